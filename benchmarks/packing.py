"""Packed token streams: lakeloader's packing against a numpy packing loop, tokens/s.

Run it::

    python -m benchmarks.packing                     # ~3 min; --smoke for a tiny run
    python -m benchmarks.packing --compression zstd  # results/packing-zstd.md

The lake (written once under ``--lake``, or ``--lake`` + ``-zstd``): 4 files x 20,000 rows in
row groups of 5,000, snappy (``--compression``: or zstd); ``tokens`` ``list<int32>`` of 16 to
1,024 ids (uniform), about 42 M tokens.

- ``numpy``: the reference: ``ParquetFile.iter_batches(1024)`` file after file (no shuffle),
  each batch's token values with a separator after each row (``np.insert``), carried over
  between batches, cut into samples of 2,048 with position ids (``arange`` minus each
  document's start), 16 samples a batch as tensors;
- ``lakeloader-wW``: ``DataLoader(LakeDataset(lake, columns=["tokens"],
  packing=Packing("tokens", 2048, eos_id=0)), batch_size=16, num_workers=W)``: shuffled, C=16
  partition streams, ``input_ids``, ``position_ids`` and ``pad_mask``.

Both run for as many batches as the lake's tokens fill (one epoch); tokens/s (separators
and padding included) after the first 3 batches; the loaders run in turn, ``--reps`` times,
and each ratio is to ``numpy`` in the same repetition. A second table gives ``-w2`` against
``-w0`` of the same repetition (the gain from workers). ``lakeloader-w2`` is given no rate when
no worker process ran (its row says "no workers started"): the child reports the CPU its
descendants used.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import machine, pinned_tree
from benchmarks._steady import child_main, finish, parse, ratio_table, run_reps, write_lake

SEQ, BATCH, EOS = 2048, 16, 0
#: ``--compression``: the lake's codec (the first is the default).
CODECS = ("snappy", "zstd")


def _table(rows: int) -> Callable[[np.random.Generator, int], pa.Table]:
    def table(rng: np.random.Generator, f: int) -> pa.Table:
        lengths = rng.integers(16, 1025, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
        return pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})

    return table


def _batches(lake: str) -> int:
    """Batches one epoch's tokens fill (separators included)."""
    tokens = 0
    for path in sorted(glob.glob(f"{lake}/*.parquet")):
        meta = pq.ParquetFile(path).metadata
        table = pq.read_table(path, columns=["tokens"])
        tokens += len(table.column("tokens").combine_chunks().values) + meta.num_rows
    return tokens // (SEQ * BATCH)


def _numpy_loop(args: argparse.Namespace) -> Iterator[Any]:
    import torch

    carry = np.zeros(0, np.int64)
    carry_pos = np.zeros(0, np.int64)
    for path in sorted(glob.glob(f"{args.lake}/*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["tokens"]):
            col = batch.column(0)
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy().astype(np.int64)
            stream = np.insert(values, offsets[1:] - offsets[0], EOS)
            lengths = np.diff(offsets) + 1
            starts = np.cumsum(lengths) - lengths
            pos = np.arange(len(stream)) - np.repeat(starts, lengths)
            carry, carry_pos = np.concatenate([carry, stream]), np.concatenate([carry_pos, pos])
            whole = len(carry) // (SEQ * BATCH) * SEQ * BATCH
            for a in range(0, whole, SEQ * BATCH):
                ids = torch.from_numpy(carry[a : a + SEQ * BATCH].reshape(BATCH, SEQ))
                positions = torch.from_numpy(carry_pos[a : a + SEQ * BATCH].reshape(BATCH, SEQ))
                yield {"input_ids": ids, "position_ids": positions}
            carry, carry_pos = carry[whole:], carry_pos[whole:]


def _lakeloader(workers: int) -> Callable[[argparse.Namespace], Iterable[Any]]:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        packing = ll.Packing("tokens", SEQ, eos_id=EOS)
        ds = ll.LakeDataset(args.lake, columns=["tokens"], seed=0, progress=False, packing=packing)
        return ll.DataLoader(ds, batch_size=BATCH, num_workers=workers)

    return run


LOADERS = {
    "numpy": ("numpy packing loop (file order)", _numpy_loop),
    "lakeloader-w0": ("lakeloader Packing, 0 workers", _lakeloader(0)),
    "lakeloader-w2": ("lakeloader Packing, num_workers=2", _lakeloader(2)),
}


def _limited(run: Callable[[argparse.Namespace], Iterable[Any]]) -> Any:
    def limited(args: argparse.Namespace) -> Iterable[Any]:
        return itertools.islice(run(args), _batches(args.lake))  # the packed stream is endless

    return limited


def _codec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compression", choices=CODECS, default=CODECS[0], help="the lake's")


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the loaders, write ``results/packing[-zstd].{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-packing", argv, _codec)
    if args.child is not None:
        runs = {k: _limited(run) for k, (_, run) in LOADERS.items()}
        return child_main(runs, args, lambda b: b["input_ids"].numel())
    codec = "" if args.compression == CODECS[0] else f"-{args.compression}"
    lake = args.lake + codec
    files, rows, group = (2, 400, 100) if args.smoke else (4, 20_000, 5_000)
    write_lake(Path(lake), files, _table(rows), group, args.compression)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    samples = run_reps("benchmarks.packing", list(LOADERS), args.reps, ["--lake", lake], cwd, 900)
    labels = {k: v[0] for k, v in LOADERS.items()}
    table, ratios = ratio_table(samples, "numpy", labels, {"lakeloader-w2"})
    lakeloader = {k: v for k, v in samples.items() if k != "numpy"}
    workers, workers_ratios = ratio_table(lakeloader, "lakeloader-w0", labels, {"lakeloader-w2"})
    sections = [
        f"{files} files x {rows:,} rows of 16-1,024 tokens, {args.compression}; samples of "
        f"{SEQ} tokens, {BATCH} a batch. The rate column counts tokens (separators and padding "
        "included), not rows.",
        "",
        "## Tokens/s (ratio to the numpy packing loop)",
        "",
        table,
        "",
        "## Workers: 2 against 0 (ratio to lakeloader Packing, 0 workers)",
        "",
        workers,
    ]
    option = f" --compression {args.compression}" if codec else ""
    title = (
        "Packed token streams against a numpy packing loop "
        f"(`python -m benchmarks.packing{option}`)"
    )
    data = {"runs": samples, "ratios": ratios, "workers_ratios": workers_ratios}
    return finish(f"packing{codec}", args, (title, src, before), sections, data)


if __name__ == "__main__":
    sys.exit(main())
