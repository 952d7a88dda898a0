"""Where the CPU of a pass goes: the training loop's thread, the loader's process, its workers.

On two cores the loaders compete for CPU, so rows/s alone does not say what to make cheaper.
This measures, per batch of 1,024 rows of the reference lake's numeric columns (shuffled, as
torch tensors; one full pass after the first batch, page cache warm):

- ``wall``: wall time per batch;
- ``main thread``: CPU of the thread that iterates (``time.thread_time``): for lakeloader the
  planning, the gather out of the arena and the tensors; it bounds the rate on any machine;
- ``process``: CPU of the whole loading process (every thread: pyarrow's, the decoding
  threads without workers, the thread that talks to the workers);
- ``workers``: CPU of the worker processes (``RUSAGE_CHILDREN`` once they have exited);
- the physical reference, ``pyarrow.dataset`` ``to_batches`` over the same columns with all
  threads, each column to a tensor, in path order, measured the same way in the same run;
  ``x pyarrow`` is rows/s over its rows/s.

Each configuration runs in a fresh process; repetitions interleave, and the best wall time
of ``--reps`` is reported with the CPU figures of that repetition.

Run: ``python -m benchmarks.cpu_split`` (about 1 minute; writes the reference lake to
``/tmp/lakeloader-reference-lake`` if it is not there), ``--smoke`` for a tiny lake.
Results: ``benchmarks/results/cpu_split.{json,md}``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    emit_result,
    machine,
    markdown_table,
    pinned_tree,
    result_of,
    warm_page_cache,
    write_results,
)
from benchmarks.reference_lake import write_reference_lake

BATCH = 1024
COLUMNS = ["id", "label"] + [f"f{i}" for i in range(16)]
LOADERS = ("pyarrow-dataset", "lakeloader-w0", "lakeloader-w2")
DEFAULT_LAKE = "/tmp/lakeloader-reference-lake"
SMOKE_LAKE = "/tmp/lakeloader-cpu-split-smoke-lake"


def _batches(name: str, lake: str) -> tuple[Any, Any]:
    """An iterator of batches and the object to close afterwards."""
    if name == "pyarrow-dataset":
        import pyarrow.dataset as pds
        import torch

        files = sorted(str(p) for p in Path(lake).glob("*.parquet"))
        batches = pds.dataset(files).to_batches(columns=COLUMNS, batch_size=BATCH)
        return (
            (
                {c: torch.from_numpy(b.column(c).to_numpy(zero_copy_only=False)) for c in COLUMNS}
                for b in batches
            ),
            None,
        )
    import lakeloader

    workers = int(name.rsplit("-w", 1)[1])
    ds = lakeloader.LakeDataset(lake, columns=COLUMNS, seed=0, progress=False)
    loader = lakeloader.DataLoader(ds, batch_size=BATCH, num_workers=workers)
    return iter(loader), loader


def child(name: str, lake: str) -> None:
    """One pass; emits the timings (see the module docstring)."""
    it, closer = _batches(name, lake)
    batches = 1
    next(it)
    wall0, main0, proc0 = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in it:
        batches += 1
    wall, main = time.perf_counter() - wall0, time.thread_time() - main0
    process = time.process_time() - proc0
    if closer is not None:
        closer.close()
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    emit_result(
        {
            "batches": batches,
            "wall_s": wall,
            "main_thread_cpu_s": main,
            "process_cpu_s": process,
            "workers_cpu_s": kids.ru_utime + kids.ru_stime,
        }
    )


def _run(src: Path, name: str, lake: str) -> dict[str, Any]:
    """One configuration in a fresh process (no memory sampling: it would cost CPU here)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.cpu_split", "--child", name, "--lake", lake],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    result = result_of(out)
    if result is None:
        raise RuntimeError(f"{name} handed over no result:\n{out[-2000:]}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lake", help=f"the lake (default {DEFAULT_LAKE}; smoke: {SMOKE_LAKE})")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny lake, one repetition")
    parser.add_argument("--src", default=None, help="git revision (HEAD; smoke: worktree)")
    parser.add_argument("--out", default=None, help="results folder")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.lake)
        return 0
    lake = args.lake or (SMOKE_LAKE if args.smoke else DEFAULT_LAKE)
    if args.smoke:
        write_reference_lake(lake, files=4, row_groups=2, rows_per_group=2048)
        args.reps = 1
    elif not Path(lake, "_reference_lake.json").exists():
        write_reference_lake(lake)
    warm_page_cache([lake])
    src, measured = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    best: dict[str, dict[str, Any]] = {}
    for rep in range(args.reps):
        for name in LOADERS if rep % 2 == 0 else reversed(LOADERS):
            r = _run(src, name, lake)
            print(f"[rep {rep}] {name}: {r['batches'] * BATCH / r['wall_s']:,.0f} rows/s")
            if name not in best or r["wall_s"] < best[name]["wall_s"]:
                best[name] = r
    rate = {n: r["batches"] * BATCH / r["wall_s"] for n, r in best.items()}
    rows = []
    for name in LOADERS:
        r = best[name]
        per = 1e6 / r["batches"]
        rows.append(
            [
                name,
                round(rate[name]),
                round(rate[name] / rate["pyarrow-dataset"], 3),
                round(r["wall_s"] * per),
                round(r["main_thread_cpu_s"] * per),
                round(r["process_cpu_s"] * per),
                round(r["workers_cpu_s"] * per),
                round((r["process_cpu_s"] + r["workers_cpu_s"]) * per),
            ]
        )
    table = markdown_table(
        [
            "loader",
            "rows/s",
            "x pyarrow",
            "wall µs/batch",
            "main thread CPU µs/batch",
            "process CPU µs/batch",
            "workers CPU µs/batch",
            "total CPU µs/batch",
        ],
        rows,
    )
    info = machine()
    markdown = (
        "# CPU per batch: the training loop's thread, the loader's process, its workers\n\n"
        f"Lake: `{lake}`, numeric columns, batch {BATCH:,}, shuffled (lakeloader), warm page "
        f"cache; best of {args.reps} interleaved repetitions. Machine: {info}. "
        f"lakeloader measured: {measured}.\n\n{table}\n"
    )
    data = {"machine": info, "measured": measured, "lake": lake, "best": best}
    name = "cpu_split-smoke" if args.smoke else "cpu_split"
    paths = write_results(name, data, markdown, args.out)
    print(markdown)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
