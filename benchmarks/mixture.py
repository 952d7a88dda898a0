"""A mixture of three lakes against one lake; a text mixture's batch transform at 0 and 2 workers.

Run it::

    python -m benchmarks.mixture                   # ~3 min; --smoke for a tiny run
    python -m benchmarks.mixture --workload text   # ~3 min; results/mixture-text.md

``--workload numeric`` (the default): three sources (``web``, ``code``, ``math``), each 4
files x 60,000 rows in row groups of 15,000 (``id`` int64, ``f0..f15`` float32), written once
under ``--lake``. The reference is one ``LakeDataset`` over the twelve files (``single``); the
mixture draws the three at 0.5/0.3/0.2 (``mixture``). Both with the default order settings,
batch 1,024, for ``PASSES`` passes of as many rows as the files hold each (every pass starts
anew: planning, unit stores); ``-w0`` no workers, ``-w2`` two.

``--workload text``, the pretraining path: three sources of 4 files x 20,000 rows in row
groups of 5,000, zstd (``id`` int64, ``text`` of 170 random words, about 1 KB), mixed at the
same weights, one pass of every row, batch 1,024, with a batch transform that tokenises each
text byte by byte into 1,024 int64 ids (``transforms.byte_ids``; about 65 ms of Python a
batch here): ``Mixture(..., batch_transform=tokenise)`` at 0 workers
(``mixture-text-w0``, the reference) and 2 workers (``mixture-text-w2``). Where the measured
lakeloader's ``Mixture`` takes no ``batch_transform``, ``-w0`` tokenises in the training loop
(its row says so) and ``-w2`` is not measured.

Two tables: rows/s after the first 3 batches (the steady rate), and rows over the whole run's
time (what a pass's start costs included). The loaders run in turn, ``--reps`` times, and each
ratio is to the reference (``single-w0``, ``mixture-text-w0``) of the same repetition. A
loader that asks for 2 workers is given no rate when no worker process ran (its row says "no
workers started"): the child reports the CPU its descendants used.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks._common import machine, pinned_tree
from benchmarks._steady import (
    NotMeasured,
    child_main,
    finish,
    parse,
    ratio_table,
    run_reps,
    write_lake,
)
from benchmarks.transforms import byte_ids, sentence

FLOATS = [f"f{i}" for i in range(16)]
SOURCES = {"web": 0.5, "code": 0.3, "math": 0.2}
BATCH = 1024
PASSES = 3
#: Ids per text in the text workload's batch transform (the texts are about 1 KB).
TEXT_IDS = 1024


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


def _text_table(rows: int, base: int) -> Callable[[np.random.Generator, int], pa.Table]:
    def table(rng: np.random.Generator, f: int) -> pa.Table:
        ids = np.arange(base + f * rows, base + (f + 1) * rows)
        return pa.table({"id": ids, "text": [sentence(rng, 170) for _ in range(rows)]})

    return table


def tokenise(batch: dict[str, Any]) -> dict[str, Any]:
    """The text workload's batch transform: each text to ``TEXT_IDS`` byte ids, as int64."""
    import torch

    ids = torch.tensor([byte_ids(t, TEXT_IDS) for t in batch["text"]], dtype=torch.int64)
    return {**{k: v for k, v in batch.items() if k != "text"}, "input_ids": ids}


def _text_mixture(workers: int) -> Callable[[argparse.Namespace], Iterable[Any]]:
    def run(args: argparse.Namespace) -> Iterable[Any]:
        import lakeloader as ll

        sources = {n: ll.LakeDataset(f"{args.lake}/{n}", seed=0, progress=False) for n in SOURCES}
        if "batch_transform" in inspect.signature(ll.Mixture).parameters:
            new_api: dict[str, Any] = {"batch_transform": tokenise}  # issue 30
            mix = ll.Mixture(sources, SOURCES, seed=0, **new_api)
            yield from ll.DataLoader(mix, batch_size=BATCH, num_workers=workers)
            return
        if workers:
            raise NotMeasured(
                "this lakeloader's Mixture takes no batch_transform, so no worker can run it"
            )
        args.note = (
            "tokenised in the training loop: this lakeloader's Mixture takes no batch_transform"
        )
        mix = ll.Mixture(sources, SOURCES, seed=0)
        yield from (tokenise(b) for b in ll.DataLoader(mix, batch_size=BATCH))

    return run


#: Each workload's loaders (label, run), its reference, and how its sources are written.
WORKLOADS: dict[str, Any] = {
    "numeric": {
        "loaders": {
            "single-w0": ("one lake of the 12 files, 0 workers", _single(0)),
            "mixture-w0": ("mixture of 3 lakes, 0 workers", _mixture(0)),
            "single-w2": ("one lake of the 12 files, 2 workers", _single(2)),
            "mixture-w2": ("mixture of 3 lakes, num_workers=2", _mixture(2)),
        },
        "reference": "single-w0",
        "table": _table,
        "compression": "snappy",
        "sizes": ((2, 3_000, 1_000), (4, 60_000, 15_000)),
        "what": f"(id, 16 float32); batch {BATCH}; weights {SOURCES}; {PASSES} passes per run.",
        "title": "A mixture of three lakes against one lake",
    },
    "text": {
        "loaders": {
            "mixture-text-w0": ("text mixture, tokenised, 0 workers", _text_mixture(0)),
            "mixture-text-w2": ("text mixture, tokenised, 2 workers", _text_mixture(2)),
        },
        "reference": "mixture-text-w0",
        "table": _text_table,
        "compression": "zstd",
        "sizes": ((2, 600, 200), (4, 20_000, 5_000)),
        "what": f"(id, text of about 1 KB), zstd; batch {BATCH}; weights {SOURCES}; one pass; "
        f"batch_transform: {TEXT_IDS} byte ids a text.",
        "title": "A 3-source text mixture with a batch transform, 2 workers against 0",
    },
}
LOADERS = {k: v for w in WORKLOADS.values() for k, v in w["loaders"].items()}


def _workload(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="numeric")


def main(argv: list[str] | None = None) -> int:
    """Write the lakes, run the loaders, write ``results/mixture[-text].{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-mixture", argv, _workload)
    if args.child is not None:
        runs = {k: run for k, (_, run) in LOADERS.items()}
        return child_main(runs, args, lambda b: len(b["id"]))
    work = WORKLOADS[args.workload]
    lake = args.lake if args.workload == "numeric" else f"{args.lake}-{args.workload}"
    files, rows, group = work["sizes"][0 if args.smoke else 1]
    for k, name in enumerate(SOURCES):
        table_of = work["table"](rows, k * 10**9)
        write_lake(Path(lake) / name, files, table_of, group, work["compression"])
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    loaders, ref = work["loaders"], work["reference"]
    samples = run_reps("benchmarks.mixture", list(loaders), args.reps, ["--lake", lake], cwd, 900)
    labels = {k: v[0] for k, v in loaders.items()}
    asks = {k for k in loaders if k.endswith("-w2")}
    table, ratios = ratio_table(samples, ref, labels, asks)
    whole = {
        name: [{**r, "rows_per_s": r["rows"] / r["seconds"]} if "seconds" in r else r for r in runs]
        for name, runs in samples.items()
    }
    whole_table, whole_ratios = ratio_table(whole, ref, labels, asks)
    sections = [
        f"3 sources x {files} files x {rows:,} rows {work['what']}",
        "",
        f"## Steady rows/s, after the first 3 batches (ratio to {labels[ref]})",
        "",
        table,
        "",
        f"## Rows over the whole run's time, the passes' starts included (ratio to {labels[ref]})",
        "",
        whole_table,
    ]
    name = "mixture" if args.workload == "numeric" else f"mixture-{args.workload}"
    command = "python -m benchmarks.mixture" + (
        "" if args.workload == "numeric" else f" --workload {args.workload}"
    )
    return finish(
        name,
        args,
        (f"{work['title']} (`{command}`)", src, before),
        sections,
        {"runs": samples, "ratios": ratios, "whole_run_ratios": whole_ratios},
    )


if __name__ == "__main__":
    sys.exit(main())
