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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import machine, pinned_tree
from benchmarks._steady import child_main, finish, parse, ratio_table, run_reps, write_lake

DIM = 768
COLUMNS = ["id", "emb", "tokens"]
BATCH = 1024


def _table(rows: int) -> Callable[[np.random.Generator, int], pa.Table]:
    """File ``f`` of the lake: ids, embeddings, token lists of 64-2,048 ids."""

    def table(rng: np.random.Generator, f: int) -> pa.Table:
        lengths = rng.integers(64, 2049, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = rng.integers(0, 50_000, int(offsets[-1])).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
        values = pa.array(rng.standard_normal(rows * DIM, dtype=np.float32))
        emb = pa.FixedSizeListArray.from_arrays(values, DIM)
        return pa.table({"id": np.arange(f * rows, (f + 1) * rows), "emb": emb, "tokens": tokens})

    return table


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


#: Each loader: its label in the table, and what it runs.
LOADERS = {
    "pyarrow": ("pyarrow iter_batches into tensors", _pyarrow),
    "lakeloader-w0": ("lakeloader, 0 workers", _lakeloader(0)),
    "lakeloader-w2": ("lakeloader, 2 workers", _lakeloader(2)),
    "lakeloader-w2-padded": ("lakeloader, 2 workers, padded", _lakeloader(2, list_format="padded")),
}


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the loaders, write ``results/array_columns.{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-arrays", argv)
    if args.child is not None:
        return child_main({k: run for k, (_, run) in LOADERS.items()}, args, lambda n: n)
    files, rows, group = (2, 2_000, 500) if args.smoke else (6, 20_000, 5_000)
    write_lake(Path(args.lake), files, _table(rows), group)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    extra = ["--lake", args.lake]
    samples = run_reps("benchmarks.array_columns", list(LOADERS), args.reps, extra, cwd, 900)
    table, ratios = ratio_table(samples, "pyarrow", {k: v[0] for k, v in LOADERS.items()})
    lake = (
        f"{files} files x {rows:,} rows (a 768-dim float32 embedding, 64-2,048 int32 tokens), "
        f"batch {BATCH}; ratios to pyarrow in the same repetition."
    )
    title = "Array columns (`python -m benchmarks.array_columns`)"
    data = {"samples": samples, "ratios": ratios}
    return finish("array_columns", args, (title, src, before), [lake, "", table], data)


if __name__ == "__main__":
    sys.exit(main())
