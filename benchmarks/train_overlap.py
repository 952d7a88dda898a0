"""Does the training loop wait? A loop of simulated compute fed by lakeloader, against sleep alone.

Run it::

    python -m benchmarks.train_overlap        # ~3 min; --smoke for a tiny run

The lake (written once under ``--lake``): 4 files x 100,000 rows in row groups of 25,000,
snappy; ``id`` int64 and ``f0..f15`` float32 (the transforms benchmark's numeric columns).
Each loop runs one epoch, 391 steps of batch 1,024, and "computes" ``S`` ms per step with
``time.sleep`` (an accelerator step, which leaves the CPU to the loader):

- ``sleep-S``: the loop without data, ``time.sleep(S)`` per step (the reference);
- ``wW-S``: ``for batch in DataLoader(LakeDataset(lake, columns=..., seed=0),
  batch_size=1024, num_workers=W): time.sleep(S)``.

Figures per loop, after the first 3 steps (workers starting, first decodes): rows/s, its ratio
to the sleep-only loop of the same ``S`` in the same repetition, and the microseconds each step
spent inside ``next()`` on the loader's iterator (median and mean). Every loop runs in a
child process of its own, in turn, ``--reps`` times; children run with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks._common import emit_result, machine, pinned_tree
from benchmarks._steady import WARMUP_BATCHES, finish, parse, ratio_table, run_reps, write_lake
from benchmarks.transforms import BATCH, FLOATS, _table

STEPS_MS = (0.5, 2.0)
WORKERS = (0, 2)


def _batches(args: argparse.Namespace, workers: int | None) -> Iterator[Any]:
    """``iter(loader)``, or (``workers`` None) each batch's row count, with no data."""
    if workers is None:  # the epoch's batch sizes, the last one short
        return iter([min(BATCH, args.total - s) for s in range(0, args.total, BATCH)])
    import lakeloader as ll

    ds = ll.LakeDataset(args.lake, columns=["id", *FLOATS], seed=0, progress=False)
    return iter(ll.DataLoader(ds, batch_size=BATCH, num_workers=workers))


def _rows(batch: Any) -> int:
    return batch if isinstance(batch, int) else len(batch["id"])


def _loop(args: argparse.Namespace, name: str) -> dict[str, Any]:
    kind, step_ms = name.rsplit("-", 1)
    workers = None if kind == "sleep" else int(kind.removeprefix("w"))
    pause = float(step_ms) / 1000
    batches = _batches(args, workers)
    waits: list[float] = []
    rows = timed = 0
    start = end = time.perf_counter()
    while True:
        began = time.perf_counter()
        batch = next(batches, None)
        waited = time.perf_counter() - began
        if batch is None:
            end = began
            break
        waits.append(waited)
        n = _rows(batch)
        if len(waits) == WARMUP_BATCHES + 1:
            start = began  # timed from the step after the warm-up ones
        if len(waits) > WARMUP_BATCHES:
            timed += n
        rows += n
        time.sleep(pause)
    steady = waits[WARMUP_BATCHES:] or [0.0]
    return {
        "rows": rows,
        "rows_per_s": timed / (end - start) if end > start else 0.0,
        "next_us_median": round(statistics.median(steady) * 1e6, 1),
        "next_us_mean": round(statistics.fmean(steady) * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the loops, write ``results/train_overlap.{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-transforms-numeric", argv)
    files, rows, group = (2, 3_000, 1_000) if args.smoke else (4, 100_000, 25_000)
    args.total = files * rows
    args.steps = -(-args.total // BATCH)
    if args.child is not None:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        result = _loop(args, args.child)
        result["loader"] = args.child
        emit_result(result)
        return 0
    write_lake(Path(args.lake), files, _table(rows), group)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    sections, data = [f"{files} files x {rows:,} rows; batch {BATCH}; {args.steps} steps."], {}
    for step_ms in STEPS_MS:
        names = [f"sleep-{step_ms}", *(f"w{w}-{step_ms}" for w in WORKERS)]
        labels = {names[0]: f"sleep only, {step_ms} ms a step"}
        labels.update({f"w{w}-{step_ms}": f"lakeloader, {w} workers" for w in WORKERS})
        extra = ["--lake", args.lake, *(["--smoke"] if args.smoke else [])]
        runs = run_reps("benchmarks.train_overlap", names, args.reps, extra, cwd, 600)
        table, ratios = ratio_table(runs, names[0], labels)
        waits = [
            f"- {labels[n]}: next() {_spread(runs[n], 'next_us_median')} us a step (median "
            f"per rep), {_spread(runs[n], 'next_us_mean')} us (mean)"
            for n in names[1:]
        ]
        sections += ["", f"## {step_ms} ms of compute a step", "", table, "", *waits]
        data[str(step_ms)] = {"runs": runs, "ratios": ratios}
    title = "Training-loop overlap (`python -m benchmarks.train_overlap`)"
    return finish("train_overlap", args, (title, src, before), sections, data)


def _spread(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if key in r]
    return "-" if not values else f"{min(values):g}-{max(values):g}"


if __name__ == "__main__":
    sys.exit(main())
