"""A mixture of three lakes against one lake of the same files: rows/s, same run.

Run it::

    python -m benchmarks.mixture               # ~3 min; --smoke for a tiny run

Three sources (``web``, ``code``, ``math``), each 4 files x 60,000 rows in row groups of 15,000
(``id`` int64, ``f0..f15`` float32), written once under ``--lake``. The reference is one
``LakeDataset`` over the twelve files (``single``); the mixture draws the three at 0.5/0.3/0.2
(``mixture``). Both with the default order settings, batch 1,024, for ``PASSES`` passes of as
many rows as the files hold each (every pass starts anew: planning, unit stores); ``-w0`` no
workers, ``-w2`` two (a mixture starts none: it decodes in the loader's threads either way).
Two tables: rows/s after the first 3 batches (the steady rate), and rows over the whole run's
time (what a pass's start costs included). The loaders run in turn, ``--reps`` times, and each
ratio is to ``single-w0`` of the same repetition.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks._common import machine, pinned_tree
from benchmarks._steady import child_main, finish, parse, ratio_table, run_reps, write_lake

FLOATS = [f"f{i}" for i in range(16)]
SOURCES = {"web": 0.5, "code": 0.3, "math": 0.2}
BATCH = 1024
PASSES = 3


def _table(rows: int, base: int) -> Callable[[np.random.Generator, int], pa.Table]:
    def table(rng: np.random.Generator, f: int) -> pa.Table:
        cols: dict[str, Any] = {"id": np.arange(base + f * rows, base + (f + 1) * rows)}
        for name in FLOATS:
            cols[name] = rng.random(rows).astype(np.float32)
        return pa.table(cols)

    return table


def _single(workers: int) -> Callable[[argparse.Namespace], Iterable[Any]]:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        ds = ll.LakeDataset([f"{args.lake}/{n}" for n in SOURCES], seed=0, progress=False)
        loader = ll.DataLoader(ds, batch_size=BATCH, num_workers=workers)
        for _ in range(PASSES):
            yield from loader

    return run


def _mixture(workers: int) -> Callable[[argparse.Namespace], Iterable[Any]]:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        sources = {n: ll.LakeDataset(f"{args.lake}/{n}", seed=0, progress=False) for n in SOURCES}
        loader = ll.DataLoader(
            ll.Mixture(sources, SOURCES, seed=0), batch_size=BATCH, num_workers=workers
        )
        for _ in range(PASSES):
            yield from loader

    return run


LOADERS = {
    "single-w0": ("one lake of the 12 files, 0 workers", _single(0)),
    "mixture-w0": ("mixture of 3 lakes, 0 workers", _mixture(0)),
    "single-w2": ("one lake of the 12 files, 2 workers", _single(2)),
    "mixture-w2": ("mixture of 3 lakes, num_workers=2", _mixture(2)),
}


def main(argv: list[str] | None = None) -> int:
    """Write the lakes, run the loaders, write ``results/mixture.{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-mixture", argv)
    if args.child is not None:
        runs = {k: run for k, (_, run) in LOADERS.items()}
        return child_main(runs, args, lambda b: len(b["id"]))
    files, rows, group = (2, 3_000, 1_000) if args.smoke else (4, 60_000, 15_000)
    for k, name in enumerate(SOURCES):
        write_lake(Path(args.lake) / name, files, _table(rows, k * 10**9), group)
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    samples = run_reps(
        "benchmarks.mixture", list(LOADERS), args.reps, ["--lake", args.lake], cwd, 900
    )
    labels = {k: v[0] for k, v in LOADERS.items()}
    table, ratios = ratio_table(samples, "single-w0", labels)
    whole = {
        name: [{**r, "rows_per_s": r["rows"] / r["seconds"]} if "seconds" in r else r for r in runs]
        for name, runs in samples.items()
    }
    whole_table, whole_ratios = ratio_table(whole, "single-w0", labels)
    sections = [
        f"3 sources x {files} files x {rows:,} rows (id, 16 float32); batch {BATCH}; "
        f"weights {SOURCES}; {PASSES} passes per run.",
        "",
        "## Steady rows/s, after the first 3 batches (ratio to one lake, 0 workers)",
        "",
        table,
        "",
        "## Rows over the whole run's time, the passes' starts included (ratio to one lake)",
        "",
        whole_table,
    ]
    title = "A mixture of three lakes against one lake (`python -m benchmarks.mixture`)"
    return finish(
        "mixture",
        args,
        (title, src, before),
        sections,
        {"runs": samples, "ratios": ratios, "whole_run_ratios": whole_ratios},
    )


if __name__ == "__main__":
    sys.exit(main())
