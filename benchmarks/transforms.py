"""Per-row transforms and batch transforms: lakeloader against a plain loop and torch's own.

Run it::

    python -m benchmarks.transforms            # ~6 min; --smoke for a tiny run

The lake (written once under ``--lake``): 4 files x 100,000 rows in row groups of 25,000,
snappy; ``id`` int64, ``text`` (15 words, about 90 bytes) and ``f0..f15`` float32.

Table 1, a per-row transform as a new user writes it (the text's bytes to a fixed int64
tensor of 32, the 16 floats stacked), batch 1,024, every loader in its own process:

- ``floor``: a plain single-process loop: ``ParquetFile.iter_batches(1024)``, ``to_pylist()``,
  the transform per row, ``default_collate`` (file order: no shuffle);
- ``lakeloader-w0`` / ``-w2``: ``DataLoader(LakeDataset(lake, transform=f), batch_size=1024,
  num_workers=W)``;
- ``torch-map-w2``: torch's ``DataLoader`` over a map-style dataset of the same rows (the
  columns held as Python lists, a row dict per ``__getitem__``), ``shuffle=True``, 2 workers.

Table 2, a vectorised batch transform (stack ``f0..f15`` to ``[B, 16]``, standardise, a
``16 x 256`` projection and ``tanh``), applied either in the training loop to the default
batch (``loop-wW``) or as ``LakeDataset(batch_transform=f)`` (``batch-wW``).

Rows/s are counted after the first 3 batches of a full epoch; each table's loaders run in
turn, ``--reps`` times, and each ratio is to the reference of the same repetition. Children run
with ``OMP_NUM_THREADS=1`` (torch's intra-op threads would compete with the workers).
"""

from __future__ import annotations

import argparse
import glob
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import machine, pinned_tree
from benchmarks._steady import child_main, finish, parse, ratio_table, run_reps, write_lake

FLOATS = [f"f{i}" for i in range(16)]
COLUMNS = ["id", "text", *FLOATS]
WORDS = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"])
BATCH = 1024


def _table(rows: int) -> Callable[[np.random.Generator, int], pa.Table]:
    """File ``f`` of the lake: ids, 15 random words, 16 floats."""

    def table(rng: np.random.Generator, f: int) -> pa.Table:
        cols: dict[str, Any] = {"id": np.arange(f * rows, (f + 1) * rows)}
        cols["text"] = [sentence(rng, 15) for _ in range(rows)]
        for name in FLOATS:
            cols[name] = rng.random(rows).astype(np.float32)
        return pa.table(cols)

    return table


def sentence(rng: np.random.Generator, words: int) -> str:
    """``words`` random words of :data:`WORDS`, space-separated."""
    return " ".join(WORDS[rng.integers(0, len(WORDS), words)])


def byte_ids(text: str, length: int) -> list[int]:
    """A byte-level tokeniser: the text's UTF-8 bytes as ids, cut or padded with 0 to ``length``."""
    return list(text.encode()[:length].ljust(length, b"\0"))


def transform(row: dict[str, Any]) -> dict[str, Any]:
    """The per-row transform of table 1."""
    import torch

    return {
        "id": row["id"],
        "tokens": torch.tensor(byte_ids(row["text"], 32), dtype=torch.int64),
        "x": torch.tensor([row[f] for f in FLOATS], dtype=torch.float32),
    }


def batch_fn(batch: dict[str, Any]) -> dict[str, Any]:
    """The vectorised batch transform of table 2."""
    import torch

    x = torch.stack([batch[f] for f in FLOATS], dim=1)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    weight = torch.linspace(-1, 1, 16 * 256).reshape(16, 256)
    return {"id": batch["id"], "x": torch.tanh(x @ weight)}


def _floor(args: argparse.Namespace) -> Iterable[Any]:
    import torch
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    for path in sorted(glob.glob(f"{args.lake}/*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH, columns=COLUMNS):
            yield default_collate([transform(row) for row in batch.to_pylist()])


class _MapRows:
    """Torch's map-style dataset of the lake's rows (columns as Python lists)."""

    def __init__(self, lake: str) -> None:
        table = pq.read_table(lake, columns=COLUMNS)
        self.names = table.column_names
        self.columns = [c.to_pylist() for c in table.columns]

    def __len__(self) -> int:
        return len(self.columns[0])

    def __getitem__(self, i: int) -> Any:
        return transform({n: c[i] for n, c in zip(self.names, self.columns, strict=True)})


def _torch_map(args: argparse.Namespace) -> Iterable[Any]:
    import torch

    data: Any = _MapRows(args.lake)  # map-style by duck typing, as torch takes it
    yield from torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, num_workers=2)


def _lakeloader(workers: int, **kwargs: Any) -> Any:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        columns = COLUMNS if "transform" in kwargs else ["id", *FLOATS]
        ds = ll.LakeDataset(args.lake, columns=columns, seed=0, progress=False, **kwargs)
        yield from ll.DataLoader(ds, batch_size=BATCH, num_workers=workers)

    return run


def _in_loop(workers: int) -> Any:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        return (batch_fn(b) for b in _lakeloader(workers)(args))

    return run


#: Table 1's loaders: each one's label, and what it runs.
ROW_LOADERS = {
    "floor": ("plain loop (floor)", _floor),
    "lakeloader-w0": ("lakeloader, 0 workers", _lakeloader(0, transform=transform)),
    "lakeloader-w2": ("lakeloader, 2 workers", _lakeloader(2, transform=transform)),
    "torch-map-w2": ("torch DataLoader, map-style, 2 workers", _torch_map),
}
#: Table 2's.
BATCH_LOADERS = {
    "loop-w0": ("function in the loop, 0 workers", _in_loop(0)),
    "batch-w0": ("batch_transform, 0 workers", _lakeloader(0, batch_transform=batch_fn)),
    "loop-w2": ("function in the loop, 2 workers", _in_loop(2)),
    "batch-w2": ("batch_transform, 2 workers", _lakeloader(2, batch_transform=batch_fn)),
}
ALL = {**ROW_LOADERS, **BATCH_LOADERS}


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the tables, write ``results/transforms.{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-transforms", argv)
    if args.child is not None:
        return child_main({k: run for k, (_, run) in ALL.items()}, args, lambda b: len(b["id"]))
    files, rows, group = (2, 3_000, 1_000) if args.smoke else (4, 100_000, 25_000)
    write_lake(Path(args.lake), files, _table(rows), group)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    extra = ["--lake", args.lake]
    row = run_reps("benchmarks.transforms", list(ROW_LOADERS), args.reps, extra, cwd, 900)
    batch = run_reps("benchmarks.transforms", list(BATCH_LOADERS), args.reps, extra, cwd, 900)
    labels = {k: label for k, (label, _) in ALL.items()}
    row_table, row_data = ratio_table(row, "floor", labels)
    batch_table, batch_data = ratio_table(batch, "loop-w2", labels)
    sections = [
        f"{files} files x {rows:,} rows; batch {BATCH}.",
        "",
        "## A per-row transform (ratio to the plain single-process loop)",
        "",
        row_table,
        "",
        "## A vectorised batch transform (ratio to the function in the loop, 2 workers)",
        "",
        batch_table,
    ]
    title = "Per-row and batch transforms (`python -m benchmarks.transforms`)"
    data = {"rows": row, "batches": batch, "row_ratios": row_data, "batch_ratios": batch_data}
    return finish("transforms", args, (title, src, before), sections, data)


if __name__ == "__main__":
    sys.exit(main())
