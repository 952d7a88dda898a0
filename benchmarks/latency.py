"""Object-store latency: the same loader on a local lake and on S3 and GCS, 0 to 80 ms away.

Setup: the reference lake (``benchmarks/reference_lake.py``; here 16 files x 4 row groups x
32,768 rows by default) in ``--lake-dir``, uploaded to a SeaweedFS ``weed mini`` (S3) and a
fake-gcs-server (GCS), both started on loopback by ``tests/stores.py`` (temporary data folders,
removed at the end). Latency comes from ``benchmarks/_delay_proxy.py``: a loopback proxy, in a
process of its own, that holds every request ``D`` ms before forwarding it, so the first byte
of each response comes ``D`` ms later, as from a store in another region; "0 ms" talks to the
store directly.

Every pass is ``DataLoader(LakeDataset(url, columns=NUMERIC_COLUMNS, seed=0,
storage_options=...), batch_size=1024, num_workers=W)`` for one epoch, ``LakeDataset`` opened
first.
The open (listing, and footers: fetched once per process, so only the first repetition's open
pays for them) is timed apart; rows/s is over the epoch, from ``iter(loader)`` (worker start
included) to the last batch, what a training loop sees every epoch.
The sources (local, then each store at each latency) are interleaved within a repetition, and
the figure of each is the median over ``--reps`` repetitions; "x local" and "x 0 ms" divide by
the local pass and by the same store at 0 ms, with the same ``num_workers``, of the same run.
``requests`` and ``units`` are the loader's own counters (``loader.stats()``): ranged GETs of
the epoch (footers included, if any was fetched) and row groups decoded.

Run: ``python -m benchmarks.latency`` (about 10 minutes), ``--smoke`` (a tiny lake, one
repetition, 0 and 20 ms), ``--src HEAD`` to measure the committed lakeloader. Writes
``benchmarks/results/latency.json`` and ``.md`` (``latency-smoke`` with ``--smoke``; ``--out``
for another folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # appended: a pinned lakeloader on PYTHONPATH comes first

import lakeloader  # noqa: E402
from benchmarks._common import machine, markdown_table, pinned_tree, write_results  # noqa: E402
from benchmarks.reference_lake import NUMERIC_COLUMNS, write_reference_lake  # noqa: E402
from tests.stores import ObjectStore, gcs_server, s3_server  # noqa: E402

PINNED_ENV = "LAKELOADER_BENCH_PINNED"
BUCKET, PREFIX, BATCH = "bench", "lake", 1024


@contextmanager
def delay_proxy(upstream: str, seconds: float) -> Iterator[str]:
    """A ``benchmarks/_delay_proxy.py`` process in front of ``upstream``; yields its endpoint."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks._delay_proxy", upstream, str(seconds)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            raise RuntimeError(f"the delay proxy did not start: {line}")
        yield f"http://127.0.0.1:{line[1]}"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def timed_pass(url: str, options: dict[str, Any], workers: int) -> dict[str, Any]:
    """Open the lake, then read one epoch: rows/s over the epoch, and the loader's counters."""
    began = time.perf_counter()
    ds = lakeloader.LakeDataset(url, columns=NUMERIC_COLUMNS, seed=0, storage_options=options)
    opened = time.perf_counter()
    loader = lakeloader.DataLoader(ds, batch_size=BATCH, num_workers=workers)
    rows = 0
    try:
        for batch in loader:
            rows += len(batch["id"])
        stats = loader.stats()
    finally:
        loader.close()
    seconds = time.perf_counter() - opened
    return {
        "rows": rows,
        "epoch_seconds": round(seconds, 3),
        "open_seconds": round(opened - began, 3),
        "rows_per_s": round(rows / seconds),
        "epoch_requests": stats["requests"],
        "units": stats["units_decoded"],
    }


def _upload(store: ObjectStore, lake: Path, names: list[str]) -> str:
    fs = store.filesystem()
    fs.mkdir(BUCKET)
    fs.put([str(lake / n) for n in names], [f"{BUCKET}/{PREFIX}/{n}" for n in names])
    return store.url(f"{BUCKET}/{PREFIX}/")


def run(args: argparse.Namespace) -> dict[str, Any]:
    lake = write_reference_lake(
        args.lake_dir, files=args.files, row_groups=args.row_groups, rows_per_group=args.rows
    )
    names = sorted(p.name for p in lake.glob("part-*.parquet"))
    roots = [Path(tempfile.mkdtemp(prefix=f"latency-{s}-")) for s in args.stores]
    try:
        with ExitStack() as stack:
            sources: dict[tuple[str, int], tuple[str, dict[str, Any]]] = {}
            for store_name, root in zip(args.stores, roots, strict=True):
                server = s3_server if store_name == "s3" else gcs_server
                store = stack.enter_context(server(root))
                url = _upload(store, lake, names)
                for delay in args.delays:
                    options = dict(store.storage_options)
                    if delay:
                        proxied = delay_proxy(store.endpoint, delay / 1000)
                        options["endpoint_url"] = stack.enter_context(proxied)
                    sources[(store_name, delay)] = (url, options)
            return _measure(args, lake, sources)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)


def _measure(
    args: argparse.Namespace,
    lake: Path,
    sources: dict[tuple[str, int], tuple[str, dict[str, Any]]],
) -> dict[str, Any]:
    passes: dict[str, list[dict[str, Any]]] = {}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        for workers in args.workers:
            runs = [("local", 0, str(lake), {})]
            runs += [(s, d, url, opts) for (s, d), (url, opts) in sources.items()]
            for store, delay, url, options in runs:
                key = f"{store}|{delay}|{workers}"
                result = timed_pass(url, options, workers)
                passes.setdefault(key, []).append(result)
                print(f"rep {rep} {key}: {result}", file=sys.stderr, flush=True)
    rows = []
    for key, results in passes.items():
        store, delay, workers = key.split("|")
        rate = statistics.median(r["rows_per_s"] for r in results)
        local = statistics.median(r["rows_per_s"] for r in passes[f"local|0|{workers}"])
        base = passes.get(f"{store}|0|{workers}", results)
        zero = statistics.median(r["rows_per_s"] for r in base)
        last = results[-1]
        rows.append(
            {
                "store": store,
                "delay_ms": int(delay),
                "workers": int(workers),
                "rows_per_s": round(rate),
                "x_local": round(rate / local, 3),
                "x_0ms": round(rate / zero, 3),
                "x_local_per_rep": [
                    round(r["rows_per_s"] / q["rows_per_s"], 3)
                    for r, q in zip(results, passes[f"local|0|{workers}"], strict=True)
                ],
                "epoch_requests": last["epoch_requests"],
                "units": last["units"],
                "open_seconds_first_rep": results[0]["open_seconds"],
            }
        )
    return {
        "lake": {
            "files": args.files,
            "row_groups_per_file": args.row_groups,
            "rows_per_group": args.rows,
            "columns": NUMERIC_COLUMNS,
        },
        "loadavg_before": round(load_before, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        "passes": passes,
        "table": rows,
    }


def _order(row: dict[str, Any]) -> tuple[int, str, int]:
    return row["workers"], row["store"], row["delay_ms"]


def _markdown(result: dict[str, Any], note: dict[str, Any]) -> str:
    lake = result["lake"]
    table = markdown_table(
        [
            "store",
            "first-byte delay ms",
            "num_workers",
            "rows/s (median)",
            "x local",
            "x same store at 0 ms",
            "x local per rep",
            "epoch requests",
            "units",
            "open s (rep 0)",
        ],
        [
            [
                r["store"],
                r["delay_ms"],
                r["workers"],
                r["rows_per_s"],
                r["x_local"],
                r["x_0ms"],
                " ".join(str(x) for x in r["x_local_per_rep"]),
                r["epoch_requests"],
                r["units"],
                r["open_seconds_first_rep"],
            ]
            for r in sorted(result["table"], key=_order)
        ],
    )
    return (
        "# lakeloader: object-store latency (loopback S3 and GCS, delayed by a proxy)\n\n"
        f"Lake: {lake['files']} files x {lake['row_groups_per_file']} row groups x "
        f"{lake['rows_per_group']:,} rows; columns {', '.join(lake['columns'])}; batch {BATCH}; "
        f"median of {len(next(iter(result['passes'].values())))} interleaved repetitions. "
        f"Load average {result['loadavg_before']} before, {result['loadavg_after']} after. "
        f"Code: {json.dumps(note)}. Machine: {json.dumps(result['machine'])}.\n\n{table}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny lake, one repetition")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--row-groups", type=int, default=4)
    parser.add_argument("--rows", type=int, default=None, help="rows per row group")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--delays", type=int, nargs="+", default=None, help="ms (0: direct)")
    parser.add_argument("--stores", nargs="+", default=["s3", "gcs"], choices=["s3", "gcs"])
    parser.add_argument("--lake-dir", default=None)
    parser.add_argument("--src", default="worktree", help="'worktree' or a git revision")
    parser.add_argument("--out", default=None, help="folder for the results")
    args = parser.parse_args(argv)
    if args.src != "worktree" and PINNED_ENV not in os.environ:
        folder, note = pinned_tree(args.src)
        env = {**os.environ, PINNED_ENV: json.dumps(note)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
        argv_ = [sys.executable, "-m", "benchmarks.latency", *(argv or sys.argv[1:])]
        if args.out is None:  # results go to this repository, not the pinned copy
            argv_ += ["--out", str(ROOT / "benchmarks" / "results")]
        return subprocess.run(argv_, env=env, cwd=folder, check=False).returncode
    note = json.loads(os.environ.get(PINNED_ENV, "null")) or pinned_tree("worktree")[1]
    args.files = args.files or (2 if args.smoke else 16)
    args.rows = args.rows or (4096 if args.smoke else 32_768)
    args.reps = args.reps or (1 if args.smoke else 2)
    args.delays = args.delays or ([0, 20] if args.smoke else [0, 20, 80])
    if args.smoke:
        args.workers = [0, 2]
    made = args.lake_dir is None
    args.lake_dir = args.lake_dir or tempfile.mkdtemp(prefix="latency-lake-")
    try:
        result = run(args)
    finally:
        if made:
            shutil.rmtree(args.lake_dir, ignore_errors=True)
    result["machine"] = machine()
    name = "latency-smoke" if args.smoke else "latency"
    out = write_results(name, result, _markdown(result, note), args.out)
    print(f"wrote {out[0]} and {out[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
