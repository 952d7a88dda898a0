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

Both run for as many batches as the lake's tokens fill twice (``EPOCHS``; the loop reads the
files twice); tokens/s (separators and padding included) over every batch, timed from the first
one asked for (the loaders are made, and torch imported, before): a packed stream decodes the
units of an epoch's first steps before its first batch, and that is part of its rate. The
loaders run in turn, ``--reps`` times,
and each ratio is to ``numpy`` in the same repetition. A second table gives ``-w2`` against
``-w0`` of the same repetition (the gain from workers). ``lakeloader-w2`` is given no rate when
no worker process ran (its row says "no workers started"): the child reports the CPU its
descendants used.

``--world-size 1,2,3,5`` (issue 31) adds, for each world size ``W``, one rank of a run whose
global batch is fixed (``--global-batch``, 60 samples: every ``W`` given must divide it):
``lakeloader-wN-WW`` is rank 0 of ``W`` (``DataLoader(..., batch_size=60 // W, rank=0,
world_size=W, num_workers=N)``, N = 0 and 2), against ``numpy-WW``, the same numpy loop cut into
batches of ``60 // W`` samples (the tokens a batch of the rank holds). Both run for the batches
two epochs' tokens fill at that batch size, so the rank goes through ``2 W`` epochs of global
steps and delivers as many tokens as the loop. The lake's ``C=16`` partition streams: ``W`` of
1 and 2 divide it, 3 and 5 do not. Its table gives each rank's tokens/s against the loop of the
same repetition, and ``-w2`` against ``-w0``.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import machine, markdown_table, pinned_tree
from benchmarks._steady import child_main, finish, parse, ratio_table, run_reps, write_lake

SEQ, BATCH, EOS = 2048, 16, 0
#: Epochs of the lake's tokens each loader delivers (timed from the first batch asked for).
EPOCHS = 2
#: ``--global-batch``'s default: samples of a global step under ``--world-size``.
GLOBAL_BATCH = 60
#: ``--compression``: the lake's codec (the first is the default).
CODECS = ("snappy", "zstd")


def _table(rows: int) -> Callable[[np.random.Generator, int], pa.Table]:
    def table(rng: np.random.Generator, f: int) -> pa.Table:
        lengths = rng.integers(16, 1025, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
        return pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)})

    return table


def _batches(lake: str, batch: int = BATCH) -> int:
    """Batches of ``batch`` samples one epoch's tokens fill (separators included)."""
    tokens = 0
    for path in sorted(glob.glob(f"{lake}/*.parquet")):
        meta = pq.ParquetFile(path).metadata
        table = pq.read_table(path, columns=["tokens"])
        tokens += len(table.column("tokens").combine_chunks().values) + meta.num_rows
    return tokens // (SEQ * batch)


def _world(name: str) -> int | None:
    """The world size a loader's name ends with (``-W3``), None for the plain loaders."""
    head, _, tail = name.rpartition("-W")
    return int(tail) if head and tail.isdigit() else None


def _batch_of(args: argparse.Namespace) -> int:
    """Samples a batch of the child's loader: ``BATCH``, or the rank's share of the global batch."""
    world = _world(args.child or "")
    return BATCH if world is None else args.global_batch // world


def _numpy_loop(args: argparse.Namespace) -> Iterator[Any]:
    import torch  # before the clock starts, as lakeloader's is

    return _numpy_batches(args, torch)


def _numpy_batches(args: argparse.Namespace, torch: Any) -> Iterator[Any]:
    per_batch = _batch_of(args)
    carry = np.zeros(0, np.int64)
    carry_pos = np.zeros(0, np.int64)
    paths = sorted(glob.glob(f"{args.lake}/*.parquet"))
    for path in paths * EPOCHS:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["tokens"]):
            col = batch.column(0)
            offsets = col.offsets.to_numpy()
            values = col.values.to_numpy().astype(np.int64)
            stream = np.insert(values, offsets[1:] - offsets[0], EOS)
            lengths = np.diff(offsets) + 1
            starts = np.cumsum(lengths) - lengths
            pos = np.arange(len(stream)) - np.repeat(starts, lengths)
            carry, carry_pos = np.concatenate([carry, stream]), np.concatenate([carry_pos, pos])
            whole = len(carry) // (SEQ * per_batch) * SEQ * per_batch
            for a in range(0, whole, SEQ * per_batch):
                ids = torch.from_numpy(carry[a : a + SEQ * per_batch].reshape(per_batch, SEQ))
                positions = torch.from_numpy(
                    carry_pos[a : a + SEQ * per_batch].reshape(per_batch, SEQ)
                )
                yield {"input_ids": ids, "position_ids": positions}
            carry, carry_pos = carry[whole:], carry_pos[whole:]


def _lakeloader(workers: int) -> Callable[[argparse.Namespace], Iterable[Any]]:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        packing = ll.Packing("tokens", SEQ, eos_id=EOS)
        ds = ll.LakeDataset(args.lake, columns=["tokens"], seed=0, progress=False, packing=packing)
        world = _world(args.child or "")
        if world is None:
            return ll.DataLoader(ds, batch_size=BATCH, num_workers=workers)
        return ll.DataLoader(
            ds, batch_size=_batch_of(args), num_workers=workers, rank=0, world_size=world
        )

    return run


LOADERS = {
    "numpy": ("numpy packing loop (file order)", _numpy_loop),
    "lakeloader-w0": ("lakeloader Packing, 0 workers", _lakeloader(0)),
    "lakeloader-w2": ("lakeloader Packing, num_workers=2", _lakeloader(2)),
}


def _world_loaders(worlds: list[int]) -> dict[str, tuple[str, Any]]:
    """The loaders ``--world-size`` adds: per ``W``, the loop and rank 0 at 0 and 2 workers."""
    out: dict[str, tuple[str, Any]] = {}
    for w in worlds:
        out[f"numpy-W{w}"] = (f"W={w}: numpy packing loop", _numpy_loop)
        out[f"lakeloader-w0-W{w}"] = (f"W={w}: lakeloader rank 0, 0 workers", _lakeloader(0))
        out[f"lakeloader-w2-W{w}"] = (f"W={w}: lakeloader rank 0, num_workers=2", _lakeloader(2))
    return out


def _limited(run: Callable[[argparse.Namespace], Iterable[Any]]) -> Any:
    def limited(args: argparse.Namespace) -> Iterable[Any]:
        batches = EPOCHS * _batches(args.lake, _batch_of(args))  # the packed stream is endless
        return itertools.islice(run(args), batches)

    return limited


def _codec(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compression", choices=CODECS, default=CODECS[0], help="the lake's")
    parser.add_argument(
        "--world-size",
        default="",
        help="comma-separated world sizes: rank 0 of each at a fixed global batch (issue 31)",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=GLOBAL_BATCH,
        help="samples of a global step under --world-size (each W must divide it)",
    )


def _median_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _world_table(
    samples: dict[str, list[dict[str, Any]]], worlds: list[int], global_batch: int
) -> tuple[str, dict[str, Any]]:
    """Per world size: tokens/s of the loop and of rank 0 (0, 2 workers), ratios per rep."""
    rows: list[list[Any]] = []
    data: dict[str, Any] = {}
    for w in worlds:
        ref, w0, w2 = (samples[f"{k}-W{w}"] for k in ("numpy", "lakeloader-w0", "lakeloader-w2"))
        failed = [r for runs in (ref, w0, w2) for r in runs if not r.get("rows_per_s")]
        if failed:  # no rate, or 0: no batch after the warm-up ones (a --smoke lake)
            why = "failed: " + str(failed[0])[-80:]
            rows.append([w, global_batch // w, "yes" if 16 % w == 0 else "no", why, *[None] * 5])
            continue
        rate: dict[str, list[float]] = {
            k: [float(r["rows_per_s"]) for r in runs]
            for k, runs in (("numpy", ref), ("w0", w0), ("w2", w2))
        }
        r0 = [a / b for a, b in zip(rate["w0"], rate["numpy"], strict=True)]
        r2 = [a / b for a, b in zip(rate["w2"], rate["numpy"], strict=True)]
        r20 = [a / b for a, b in zip(rate["w2"], rate["w0"], strict=True)]
        no_workers = any(r.get("worker_cpu_s") == 0 for r in w2)
        rows.append(
            [
                w,
                global_batch // w,
                "yes" if 16 % w == 0 else "no",
                round(statistics.median(rate["numpy"])),
                round(statistics.median(rate["w0"])),
                _median_range(r0),
                "no workers started" if no_workers else round(statistics.median(rate["w2"])),
                "-" if no_workers else _median_range(r2),
                "-" if no_workers else _median_range(r20),
            ]
        )
        data[str(w)] = {
            "batch_size": global_batch // w,
            "rows_per_s": rate,
            "w0_over_numpy": r0,
            "w2_over_numpy": r2,
            "w2_over_w0": r20,
            "w2_workers_ran": not no_workers,
        }
    table = markdown_table(
        [
            "W",
            "rank batch",
            "W divides C=16",
            "numpy loop tokens/s",
            "rank 0, 0 workers tokens/s",
            "x numpy, median (min-max)",
            "rank 0, 2 workers tokens/s",
            "x numpy, median (min-max) ",
            "2 workers x 0 workers",
        ],
        rows,
    )
    return table, data


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the loaders, write ``results/packing[-zstd].{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-packing", argv, _codec)
    worlds = [int(w) for w in args.world_size.split(",") if w.strip()]
    if args.child is not None:
        world = _world(args.child)
        loaders = {**LOADERS, **_world_loaders([world] if world is not None else [])}
        runs = {k: _limited(run) for k, (_, run) in loaders.items()}
        return child_main(runs, args, lambda b: b["input_ids"].numel(), warmup=0)
    for w in worlds:
        if w < 1 or args.global_batch % w:
            raise SystemExit(f"--world-size {w} does not divide --global-batch {args.global_batch}")
    codec = "" if args.compression == CODECS[0] else f"-{args.compression}"
    lake = args.lake + codec
    files, rows, group = (2, 400, 100) if args.smoke else (4, 20_000, 5_000)
    write_lake(Path(lake), files, _table(rows), group, args.compression)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    every = {**LOADERS, **_world_loaders(worlds)}
    extra = ["--lake", lake, "--global-batch", str(args.global_batch)]
    all_samples = run_reps("benchmarks.packing", list(every), args.reps, extra, cwd, 900)
    samples = {k: all_samples[k] for k in LOADERS}
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
    data: dict[str, Any] = {"runs": samples, "ratios": ratios, "workers_ratios": workers_ratios}
    option = f" --compression {args.compression}" if codec else ""
    if worlds:
        option += f" --world-size {args.world_size} --global-batch {args.global_batch}"
        world_table, world_data = _world_table(all_samples, worlds, args.global_batch)
        sections += [
            "",
            f"## One rank of W, global batch {args.global_batch} (issue 31)",
            "",
            f"Rank 0 of W (`batch_size={args.global_batch}` // W, `rank=0, world_size=W`) "
            "against the numpy loop cut into batches of as many samples, each for the batches "
            f"{EPOCHS} epochs' tokens fill (the rank goes through {EPOCHS} W epochs of global "
            "steps), timed from the first batch asked for. "
            "Ratios are per repetition (the loop of the same repetition): median (min-max).",
            "",
            world_table,
        ]
        data["world_runs"] = {k: v for k, v in all_samples.items() if k not in LOADERS}
        data["world_sizes"] = world_data
        data["global_batch"] = args.global_batch
    title = (
        "Packed token streams against a numpy packing loop "
        f"(`python -m benchmarks.packing{option}`)"
    )
    return finish(f"packing{codec}", args, (title, src, before), sections, data)


if __name__ == "__main__":
    sys.exit(main())
