"""Memory against the cache budget, on a lake of large row groups.

The lake: :func:`benchmarks.reference_lake.write_reference_lake` with 2 files x 2 row groups
of 1,536,000 rows (6.1 M rows, about 260 MB uncompressed per row group with ``text``, 1 GB in
all). Every run iterates a shuffled pass of ``lakeloader.DataLoader(LakeDataset(lake,
columns=ALL_COLUMNS, seed=0), batch_size=1024, num_workers=W, cache_bytes=B)`` in its own
subprocess, for W in 0, 2 and budgets B of 256 MiB, 1 GiB and the default 2 GiB, until the
pass ends or ``--seconds`` (60) of iteration have passed (the cache fills within the first
seconds, and the rows reached are in the table). Defaults of everything else
(``max_unit_rows`` 262,144, so each row group is read as 6 units; 4 decoding threads; C = 16;
window 16,384).

The parent samples the child's process tree every 0.1 s (see :mod:`benchmarks._common`):
``peak RSS`` sums the RSS of every process (pages shared between the loader and its workers
counted once per process); ``PSS+shm`` sums proportional set sizes (no double counting) and
adds the memory of the files of lakeloader's cache folder in ``/dev/shm`` (their allocated
blocks: tmpfs is memory, yet in no RSS until mapped; the mapped part is taken out of the PSS
so that it counts once), which is the loader's real footprint. ``base`` is the child's RSS
after imports and the dataset (footers) but before the pass; ``over budget`` is
``PSS+shm - base - B``, what the pass takes beyond its budget; ``cache peak`` is what
lakeloader itself counted (``loader.stats()["cache_peak_bytes"]``).

Run: ``python -m benchmarks.memory`` (about 8 minutes; writes the lake to
``/tmp/lakeloader-memory-lake`` once), ``--smoke`` for a tiny lake in seconds. Results:
``benchmarks/results/memory.json`` and ``memory.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    emit_result,
    machine,
    markdown_table,
    mib,
    pinned_tree,
    rss_bytes,
    run_child,
    warm_page_cache,
    write_results,
)
from benchmarks.reference_lake import ALL_COLUMNS, lake_info, write_reference_lake

BATCH = 1024
LAKE = {"files": 2, "row_groups": 2, "rows_per_group": 1_536_000}
SMOKE_LAKE = {"files": 2, "row_groups": 2, "rows_per_group": 20_000}
BUDGETS_MIB = [256, 1024, 2048]
SMOKE_BUDGETS_MIB = [1]
WORKERS = [0, 2]


def child(args: argparse.Namespace) -> int:
    import os

    import lakeloader

    ds = lakeloader.LakeDataset(args.lake, columns=ALL_COLUMNS, seed=0)
    loader = lakeloader.DataLoader(
        ds,
        batch_size=BATCH,
        num_workers=args.workers,
        cache_bytes=args.budget,
        cache_dir=args.shm_dir,
    )
    base = rss_bytes(os.getpid())
    rows = 0
    stats: dict[str, int] = {}
    t0 = time.perf_counter()
    for batch in loader:
        rows += len(batch["id"])
        stats = loader.stats()
        if time.perf_counter() - t0 >= args.seconds:
            break
    seconds = time.perf_counter() - t0
    emit_result({"rows": rows, "seconds": seconds, "base_rss": base, "stats": stats})
    sys.stdout.flush()
    os._exit(0)


def parent(args: argparse.Namespace) -> dict[str, Any]:
    params = SMOKE_LAKE if args.smoke else LAKE
    write_reference_lake(args.lake, **params)
    info = lake_info(args.lake)
    warm_page_cache([args.lake])
    tree, src_note = pinned_tree(args.src)
    budgets = SMOKE_BUDGETS_MIB if args.smoke else BUDGETS_MIB
    runs = []
    for workers in WORKERS:
        for budget_mib in budgets:
            budget = budget_mib * 2**20
            shm = tempfile.mkdtemp(prefix="lakeloader-bench-", dir="/dev/shm")
            cmd = [sys.executable, "-m", "benchmarks.memory", "--child", "--lake", args.lake]
            cmd += ["--workers", str(workers), "--budget", str(budget), "--shm-dir", shm]
            cmd += ["--seconds", str(args.seconds)]
            try:
                run = run_child(cmd, timeout=args.timeout, watch_dir=shm, cwd=tree)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            row: dict[str, Any] = {"workers": workers, "budget": budget, **run.peaks}
            if run.result is None:
                row["error"] = run.stderr_tail
                print(f"workers={workers} budget={budget_mib} MiB FAILED: {run.stderr_tail}")
            else:
                row.update(run.result)
                row["over_budget"] = run.peaks["peak_pss_plus_shm"] - run.result["base_rss"]
                row["over_budget"] -= budget
                print(
                    f"workers={workers} budget={budget_mib} MiB: PSS+shm "
                    f"{mib(run.peaks['peak_pss_plus_shm'])} MiB, base "
                    f"{mib(run.result['base_rss'])} MiB, over budget "
                    f"{mib(row['over_budget'])} MiB",
                    flush=True,
                )
            runs.append(row)
    ok = [r for r in runs if "over_budget" in r]
    return {
        "setup": {
            "lake": args.lake,
            "lake_info": info,
            "uncompressed_row_group_bytes": _row_group_bytes(args.lake),
            "columns": ALL_COLUMNS,
            "batch_size": BATCH,
            "seconds": args.seconds,
            "smoke": bool(args.smoke),
            "machine": machine(),
            "lakeloader_source": src_note,
        },
        "runs": runs,
        "constant_overhead": {
            str(w): max((r["over_budget"] for r in ok if r["workers"] == w), default=None)
            for w in WORKERS
        },
    }


def _row_group_bytes(lake: str) -> int:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(next(Path(lake).glob("part-*.parquet"))).metadata
    return int(meta.row_group(0).total_byte_size)


def _unaccounted(run: dict[str, Any]) -> int:
    """Peak memory the cache did not count: PSS+shm - base - the cache's own peak."""
    peak = int(run["peak_pss_plus_shm"]) - int(run["base_rss"])
    return peak - int(run["stats"].get("cache_peak_bytes", 0))


def render(r: dict[str, Any]) -> str:
    s = r["setup"]
    p = s["lake_info"]["params"]
    ok = [x for x in r["runs"] if "stats" in x]
    table = markdown_table(
        [
            "workers",
            "budget MiB",
            "rows",
            "seconds",
            "base MiB",
            "peak RSS tree MiB",
            "PSS+shm MiB",
            "shm files MiB",
            "over budget MiB",
            "cache peak MiB",
            "not in cache MiB",
        ],
        [
            [
                x["workers"],
                mib(x["budget"]),
                x.get("rows", "failed"),
                round(x["seconds"], 1) if "seconds" in x else None,
                mib(x["base_rss"]) if "base_rss" in x else None,
                mib(x["peak_rss_tree"]),
                mib(x["peak_pss_plus_shm"]),
                mib(x["peak_shm_files"]),
                mib(x["over_budget"]) if "over_budget" in x else None,
                mib(x["stats"].get("cache_peak_bytes", 0)) if "stats" in x else None,
                mib(_unaccounted(x)) if "stats" in x else None,
            ]
            for x in r["runs"]
        ],
    )
    unaccounted = ", ".join(
        f"{w} workers: {mib(max(_unaccounted(x) for x in ok if x['workers'] == int(w)))} MiB"
        for w in r["constant_overhead"]
        if any(x["workers"] == int(w) for x in ok)
    )
    const = ", ".join(
        f"{w} workers: {mib(v) if v is not None else '-'} MiB"
        for w, v in r["constant_overhead"].items()
    )
    return "\n".join(
        [
            "# Memory against the cache budget (large row groups)",
            "",
            f"Lake: {s['lake_info']['rows']:,} rows, {p['files']} files x {p['row_groups']} row "
            f"groups x {p['rows_per_group']:,} rows, "
            f"{s['uncompressed_row_group_bytes'] / 2**20:.0f} MiB uncompressed per row group, "
            f"{s['lake_info']['bytes_on_disk'] / 1e9:.2f} GB on disk. All columns (with text), "
            f"batch {s['batch_size']}, a shuffled pass per run until its end or "
            f"{s['seconds']:g} s, page cache warm.",
            "",
            table,
            "",
            f"Largest overhead beyond the budget (PSS+shm - base - budget): {const}. Largest "
            f"memory the cache did not count (PSS+shm - base - cache peak): {unaccounted}.",
            "",
            f"Machine: {s['machine']}. lakeloader measured: {s['lakeloader_source']}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lake", help="the lake's folder")
    parser.add_argument("--smoke", action="store_true", help="tiny lake, seconds")
    parser.add_argument("--out", help="results folder (default benchmarks/results)")
    parser.add_argument("--name", help="results file name (default memory; smoke: memory-smoke)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="cap per run")
    parser.add_argument("--src", help="git revision to measure (HEAD; smoke: worktree)")
    parser.add_argument("--render", help="re-render the .md of this JSON; no run")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shm-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    default_lake = "/tmp/lakeloader-memory-lake" + ("-smoke" if args.smoke else "")
    args.lake = args.lake or default_lake
    args.src = args.src or ("worktree" if args.smoke else "HEAD")
    report = json.loads(Path(args.render).read_text()) if args.render else parent(args)
    name = args.name or ("memory-smoke" if args.smoke else "memory")
    json_path, md_path = write_results(name, report, render(report), args.out)
    print(render(report))
    print(f"wrote {json_path} and {md_path}")
    return 0 if all("over_budget" in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
