"""Array columns: a 768-dim embedding and 64-2,048 token ids, lakeloader against pyarrow.

Run it::

    python -m benchmarks.array_columns          # ~4 min; --smoke for a tiny run

The lake (written once under ``--lake``): 6 files x 20,000 rows in row groups of 5,000,
snappy; ``id`` int64, ``emb`` ``fixed_size_list<float32>[768]``, ``tokens`` ``list<int32>``
of 64 to 2,048 ids (uniform), 1.0 GB of values.

- ``pyarrow``: the reference: ``ParquetFile.iter_batches(1024)`` file after file, ``emb`` as
  its values reshaped to ``[B, 768]`` and ``tokens`` as values and offsets handed to
  ``torch.nested.nested_tensor_from_jagged`` (no copy of the values);
- ``lakeloader-wW``: ``DataLoader(LakeDataset(lake, columns=[...]), batch_size=1024,
  num_workers=W)``, shuffled, ``emb`` a ``[B, 768]`` tensor and ``tokens`` jagged;
- ``lakeloader-w2-padded``: the same with ``list_format="padded"`` (``[B, max_len]`` plus
  ``tokens_lengths``).

Every loader touches every batch alike (a sum over the embeddings' first coordinate and one
token in 4,096), so no loader is credited for work it skipped. Rows/s after the first 3
batches of a full epoch; the loaders run in turn, ``--reps`` times; each ratio is to pyarrow
in the same repetition.
"""

from __future__ import annotations

import argparse
import glob
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import machine, pinned_tree, write_results
from benchmarks._steady import child_main, ratio_table, run_reps

DIM = 768
COLUMNS = ["id", "emb", "tokens"]
BATCH = 1024


def write_lake(root: Path, files: int, rows: int, group: int) -> Path:
    """The benchmark lake (idempotent: kept if it has the expected files)."""
    if len(glob.glob(str(root / "*.parquet"))) == files:
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        lengths = rng.integers(64, 2049, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = rng.integers(0, 50_000, int(offsets[-1])).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        values = pa.array(rng.standard_normal(rows * DIM, dtype=np.float32))
        emb = pa.FixedSizeListArray.from_arrays(values, DIM)
        table = pa.table({"id": np.arange(f * rows, (f + 1) * rows), "emb": emb, "tokens": tokens})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=group)
    return root


def _touch(emb: Any, values: Any) -> float:
    return float(emb[:, 0].sum()) + float(values[::4096].sum())


def _pyarrow(args: argparse.Namespace) -> Iterable[int]:
    import torch

    # Arrow's buffers are read-only; handing them to torch without a copy is the reference.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

    for path in sorted(glob.glob(f"{args.lake}/*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=COLUMNS):
            emb_col, tok_col = batch.column("emb"), batch.column("tokens")
            flat = emb_col.values.slice(emb_col.offset * DIM, len(batch) * DIM)
            emb = torch.from_numpy(flat.to_numpy().reshape(len(batch), DIM))
            offsets = tok_col.offsets.to_numpy().astype(np.int64)
            values = torch.from_numpy(tok_col.values.to_numpy()[offsets[0] : offsets[-1]])
            tokens = torch.nested.nested_tensor_from_jagged(
                values, torch.from_numpy(offsets - offsets[0])
            )
            _touch(emb, tokens.values())
            yield len(batch)


def _lakeloader(workers: int, **kwargs: Any) -> Any:
    def run(args: argparse.Namespace) -> Iterable[int]:
        import lakeloader as ll

        ds = ll.LakeDataset(args.lake, columns=COLUMNS, seed=0, progress=False, **kwargs)
        for batch in ll.DataLoader(ds, batch_size=BATCH, num_workers=workers):
            tokens = batch["tokens"]
            _touch(batch["emb"], tokens if kwargs else tokens.values())
            yield len(batch["id"])

    return run


LOADERS = {
    "pyarrow": _pyarrow,
    "lakeloader-w0": _lakeloader(0),
    "lakeloader-w2": _lakeloader(2),
    "lakeloader-w2-padded": _lakeloader(2, list_format="padded"),
}
LABELS = {
    "pyarrow": "pyarrow iter_batches into tensors",
    "lakeloader-w0": "lakeloader, 0 workers",
    "lakeloader-w2": "lakeloader, 2 workers",
    "lakeloader-w2-padded": "lakeloader, 2 workers, padded",
}


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the loaders, write ``results/array_columns.{json,md}``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake", default="/tmp/lakeloader-bench-arrays")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny lake, one repetition")
    parser.add_argument("--src", default=None, help="HEAD (default) or worktree (--smoke)")
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(LOADERS, args, lambda n: n)
    if args.smoke:
        args.lake, args.reps = args.lake + "-smoke", 1
    files, rows, group = (2, 2_000, 500) if args.smoke else (6, 20_000, 5_000)
    write_lake(Path(args.lake), files, rows, group)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    samples = run_reps(
        "benchmarks.array_columns", list(LOADERS), args.reps, ["--lake", args.lake], cwd, 900
    )
    table, ratios = ratio_table(samples, "pyarrow", LABELS)
    after = machine()
    markdown = "\n".join(
        [
            "# Array columns (`python -m benchmarks.array_columns`)",
            "",
            f"lakeloader {src['commit']} ({src['src']}); {before['cpus']} cores; load average "
            f"{before['loadavg_1min']} before, {after['loadavg_1min']} after; {files} files x "
            f"{rows:,} rows (768-dim float32 embedding, 64-2,048 int32 tokens); batch {BATCH}; "
            f"{args.reps} repetitions in turn; ratios to pyarrow in the same repetition.",
            "",
            table,
        ]
    )
    data = {"machine": before, "after": after, "src": src, "samples": samples, "ratios": ratios}
    name = "array_columns-smoke" if args.smoke else "array_columns"
    json_path, md_path = write_results(name, data, markdown, args.out)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
