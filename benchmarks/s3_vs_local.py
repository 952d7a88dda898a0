"""The reference workload read by lakeloader from a local lake and from the same lake in S3.

Setup: the reference lake (``benchmarks/reference_lake.py``; default 64 files x 4 row groups x
32,768 rows) in ``--lake-dir``, uploaded to a SeaweedFS ``weed mini`` started on loopback by
``tests/stores.py``'s ``s3_server`` (a temporary data folder, removed at the end). Every pass is
``DataLoader(LakeDataset(url, columns=NUMERIC_COLUMNS, seed=0, storage_options=opts),
batch_size=1024, num_workers=2)`` for one epoch, timed from the ``LakeDataset`` call (listing
and footers, "open") to the last batch ("epoch"); rows/s is over the whole pass.

Three sources, interleaved (local, S3, S3 through the counting proxy of ``tests/faultproxy.py``)
``--reps`` times, best of the repetitions for each: "s3" talks to the store directly; "s3+proxy"
goes through the proxy, whose Python hop runs in this process (so it costs CPU the loader
needs too) and whose record gives the request figures: requests by method and phase, GETs per
footer (open phase), and in the epoch the GETs that touch each row group's span (the bytes of
its selected column chunks) with their sizes, whether any selected byte was fetched more than
once, and the bytes fetched against the bytes of the selected column chunks (their compressed
sizes, from the footers).

CPU: the store's CPU seconds (``/proc/PID/stat``), this process's (the main loop, its decoding
threads and the proxy's thread) and the whole machine's busy time (``/proc/stat``) per pass
show how the 2 cores are shared.

Run: ``python benchmarks/s3_vs_local.py`` (several minutes: writes the 1.3 GB lake once),
``--smoke`` (a tiny lake, one repetition), ``--files N --rows N`` (rows per row group),
``--src HEAD`` to measure the committed lakeloader rather than the work tree. Writes
``benchmarks/results/s3_vs_local.json`` and ``.md`` (``--out`` for another folder).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # appended: a pinned lakeloader on PYTHONPATH comes first

import pyarrow.parquet as pq  # noqa: E402

import lakeloader  # noqa: E402
from benchmarks._common import machine, markdown_table, pinned_tree, write_results  # noqa: E402
from benchmarks.reference_lake import NUMERIC_COLUMNS, write_reference_lake  # noqa: E402
from tests.faultproxy import Exchange, FaultProxy  # noqa: E402
from tests.stores import ObjectStore, s3_server  # noqa: E402

PINNED_ENV = "LAKELOADER_BENCH_PINNED"
BUCKET, PREFIX = "bench", "lake"
BATCH, WORKERS = 1024, 2
TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class FileLayout:
    """Byte layout of one lake file, from its footer."""

    size: int
    footer_start: int  # first byte of the Thrift footer
    spans: list[tuple[int, int]]  # per row group: [start, end) of its selected column chunks
    chunks: list[list[tuple[int, int]]]  # per row group: the selected chunks' [start, end)
    selected_bytes: int


def _layout(path: Path, columns: list[str]) -> FileLayout:
    size = path.stat().st_size
    with path.open("rb") as fh:
        fh.seek(size - 8)
        footer_len = int.from_bytes(fh.read(4), "little")
    meta = pq.ParquetFile(path).metadata
    spans, chunks, selected = [], [], 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        mine = []
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema not in columns:
                continue
            start = col.dictionary_page_offset or col.data_page_offset
            mine.append((start, start + col.total_compressed_size))
            selected += col.total_compressed_size
        chunks.append(mine)
        spans.append((min(s for s, _ in mine), max(e for _, e in mine)))
    return FileLayout(size, size - 8 - footer_len, spans, chunks, selected)


def _range(e: Exchange, size: int) -> tuple[int, int]:
    """``[start, end)`` a GET asked for (suffix and open ranges resolved against ``size``)."""
    spec = (e.range or "").removeprefix("bytes=")
    first, _, last = spec.partition("-")
    if not spec:
        return 0, size
    if not first:
        return max(0, size - int(last)), size
    return int(first), min(size, int(last) + 1) if last else size


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


# ---------------------------------------------------------------------------- analysis
def _analyse(
    opened: list[Exchange], epoch: list[Exchange], layouts: dict[str, FileLayout]
) -> dict[str, Any]:
    """Request figures of one proxied pass (see the module docstring)."""

    def file_of(e: Exchange) -> str | None:
        name = e.path.rsplit("/", 1)[-1]
        return name if name in layouts and e.path.startswith(f"/{BUCKET}/") else None

    def kinds(exchanges: list[Exchange]) -> Counter[str]:
        out: Counter[str] = Counter()
        for e in exchanges:
            if file_of(e) is None:
                out[f"{e.method} (listing/other)"] += 1
            else:
                out[f"{e.method} (file)"] += 1
        return out

    footer_gets: Counter[str] = Counter(
        name for e in opened if e.method == "GET" and (name := file_of(e))
    )
    footer_sizes = [e.body_bytes for e in opened if e.method == "GET" and file_of(e)]
    heads_open = Counter(name for e in opened if e.method == "HEAD" and (name := file_of(e)))
    # Epoch: which row groups each GET touches, and the selected bytes it covers.
    unit_gets: dict[tuple[str, int], list[int]] = defaultdict(list)
    covered: dict[tuple[str, int], int] = Counter()
    footer_in_epoch = other_in_epoch = 0
    for e in epoch:
        name = file_of(e)
        if e.method != "GET" or name is None:
            continue
        lay = layouts[name]
        span = _range(e, lay.size)
        touched = [g for g, s in enumerate(lay.spans) if _overlap(span, s)]
        for g in touched:
            unit_gets[(name, g)].append(e.body_bytes)
            covered[(name, g)] += sum(_overlap(span, c) for c in lay.chunks[g])
        if not touched:
            if _overlap(span, (lay.footer_start, lay.size)):
                footer_in_epoch += 1
            else:
                other_in_epoch += 1
    units = [(n, g) for n, lay in layouts.items() for g in range(len(lay.spans))]
    per_unit = [len(unit_gets.get(u, [])) for u in units]
    sizes = sorted(b for u in units for b in unit_gets.get(u, []))
    refetched = [
        u for u in units if covered.get(u, 0) > sum(e - s for s, e in layouts[u[0]].chunks[u[1]])
    ]
    epoch_bytes = sum(e.body_bytes for e in epoch)
    selected = sum(lay.selected_bytes for lay in layouts.values())
    return {
        "open": {
            "requests": dict(kinds(opened)),
            "gets_per_footer": _summary(list(footer_gets.get(n, 0) for n in layouts)),
            "footer_get_bytes": _summary(footer_sizes),
            "heads_per_file": _summary(list(heads_open.get(n, 0) for n in layouts)),
            "bytes": sum(e.body_bytes for e in opened),
        },
        "epoch": {
            "requests": dict(kinds(epoch)),
            "units": len(units),
            "gets_per_unit": _summary(per_unit),
            "get_bytes_touching_units": _summary(sizes),
            "units_with_selected_bytes_fetched_twice": len(refetched),
            "gets_touching_no_unit_footer": footer_in_epoch,
            "gets_touching_no_unit_other": other_in_epoch,
            "heads": sum(1 for e in epoch if e.method == "HEAD"),
            "bytes_fetched": epoch_bytes,
            "bytes_selected_columns": selected,
            "fetched_over_selected": round(epoch_bytes / selected, 3) if selected else None,
        },
        "statuses": dict(Counter(str(e.status) for e in opened + epoch)),
    }


def _summary(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "min": ordered[0],
        "median": ordered[len(ordered) // 2],
        "max": ordered[-1],
        "mean": round(sum(values) / len(values), 2),
    }


# ------------------------------------------------------------------------------ passes
def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _machine_busy() -> int:
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(values) - values[3] - values[4]  # minus idle and iowait


def one_pass(
    url: str, options: dict[str, Any], store_pid: int, on_open: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Open the lake, call ``on_open``, read one epoch; rows, seconds and CPU."""
    store0, busy0, cpu0 = _cpu_ticks(store_pid), _machine_busy(), time.process_time()
    began = time.perf_counter()
    ds = lakeloader.LakeDataset(url, columns=NUMERIC_COLUMNS, seed=0, storage_options=options)
    opened = time.perf_counter()
    if on_open is not None:
        on_open()
    loader = lakeloader.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    rows = 0
    try:
        for batch in loader:
            rows += len(batch["id"])
    finally:
        loader.close()
    done = time.perf_counter()
    seconds = done - began
    return {
        "rows": rows,
        "seconds": round(seconds, 3),
        "open_seconds": round(opened - began, 3),
        "rows_per_s": round(rows / seconds),
        "cpu_store_s": round((_cpu_ticks(store_pid) - store0) / TICKS, 2),
        "cpu_machine_busy_s": round((_machine_busy() - busy0) / TICKS, 2),
        "cpu_this_process_s": round(time.process_time() - cpu0, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    lake = write_reference_lake(
        args.lake_dir, files=args.files, row_groups=args.row_groups, rows_per_group=args.rows
    )
    names = sorted(p.name for p in lake.glob("part-*.parquet"))
    layouts = {n: _layout(lake / n, NUMERIC_COLUMNS) for n in names}
    store_root = Path(tempfile.mkdtemp(prefix="s3-vs-local-"))
    try:
        with s3_server(store_root) as store:
            if args.pin:
                # The store on one core, this process and its loader workers on the other, for
                # local and S3 passes alike: the loader's CPU is the same in both, and what is
                # left is the cost of reading through S3 on the client side.
                os.sched_setaffinity(store.pid, {1})
                os.sched_setaffinity(0, {0})
            return _measure(args, lake, names, layouts, store)
    finally:
        shutil.rmtree(store_root, ignore_errors=True)


def _measure(
    args: argparse.Namespace,
    lake: Path,
    names: list[str],
    layouts: dict[str, FileLayout],
    store: ObjectStore,
) -> dict[str, Any]:
    fs = store.filesystem()
    fs.mkdir(BUCKET)
    began = time.perf_counter()
    fs.put([str(lake / n) for n in names], [f"{BUCKET}/{PREFIX}/{n}" for n in names])
    upload_s = time.perf_counter() - began
    url = store.url(f"{BUCKET}/{PREFIX}/")
    passes: dict[str, list[dict[str, Any]]] = {"local": [], "s3": [], "s3+proxy": []}
    requests: list[dict[str, Any]] = []
    with FaultProxy(store.endpoint, store.storage_options) as proxy:
        sources = {
            "local": (str(lake), {}),
            "s3": (url, store.storage_options),
            "s3+proxy": (url, proxy.storage_options),
        }
        for rep in range(args.reps):
            for source, (where, options) in sources.items():
                proxy.reset()
                split: list[int] = []
                mark = functools.partial(lambda out: out.append(proxy.count()), split)
                result = one_pass(where, options, store.pid, mark)
                if source == "s3+proxy":
                    exchanges = proxy.exchanges()
                    opened, epoch = exchanges[: split[0]], exchanges[split[0] :]
                    requests.append(_analyse(opened, epoch, layouts))
                passes[source].append(result)
                print(f"rep {rep} {source}: {result}", file=sys.stderr, flush=True)
    best = {s: max(p, key=lambda r: r["rows_per_s"]) for s, p in passes.items()}
    total_bytes = sum(lay.size for lay in layouts.values())
    return {
        "lake": {
            "files": len(names),
            "row_groups_per_file": args.row_groups,
            "rows_per_group": args.rows,
            "bytes": total_bytes,
            "columns": NUMERIC_COLUMNS,
            "upload_seconds": round(upload_s, 2),
        },
        "passes": passes,
        "best": best,
        "ratios": {
            "s3/local": round(best["s3"]["rows_per_s"] / best["local"]["rows_per_s"], 3),
            "s3+proxy/local": round(
                best["s3+proxy"]["rows_per_s"] / best["local"]["rows_per_s"], 3
            ),
        },
        "requests": requests[-1],
        "requests_all_reps": requests,
    }


# ------------------------------------------------------------------------------ report
def _markdown(result: dict[str, Any], note: dict[str, Any]) -> str:
    best, lake, req = result["best"], result["lake"], result["requests"]
    rows = [
        [
            source,
            b["rows_per_s"],
            round(b["rows_per_s"] / best["local"]["rows_per_s"], 3),
            b["seconds"],
            b["open_seconds"],
            b["cpu_machine_busy_s"],
            b["cpu_this_process_s"],
            b["cpu_store_s"],
        ]
        for source, b in best.items()
    ]
    table = markdown_table(
        [
            "source",
            "rows/s",
            "x local",
            "pass s",
            "open s",
            "machine busy cpu-s",
            "this process cpu-s",
            "store cpu-s",
        ],
        rows,
    )
    o, e = req["open"], req["epoch"]
    figures = markdown_table(
        ["figure", "value"],
        [
            ["open: requests", json.dumps(o["requests"], sort_keys=True)],
            ["open: GETs per footer (min/median/max)", _mmm(o["gets_per_footer"])],
            ["open: bytes per footer GET (min/median/max)", _mmm(o["footer_get_bytes"])],
            ["open: HEADs per file (min/median/max)", _mmm(o["heads_per_file"])],
            ["epoch: requests", json.dumps(e["requests"], sort_keys=True)],
            ["epoch: units (row groups)", e["units"]],
            ["epoch: GETs touching each unit (min/median/max)", _mmm(e["gets_per_unit"])],
            ["epoch: bytes of those GETs (min/median/max)", _mmm(e["get_bytes_touching_units"])],
            [
                "epoch: units with selected bytes fetched twice",
                e["units_with_selected_bytes_fetched_twice"],
            ],
            [
                "epoch: GETs touching no unit (footer / other)",
                f"{e['gets_touching_no_unit_footer']} / {e['gets_touching_no_unit_other']}",
            ],
            ["epoch: HEADs", e["heads"]],
            ["epoch: bytes fetched", e["bytes_fetched"]],
            ["epoch: bytes of the selected column chunks", e["bytes_selected_columns"]],
            ["epoch: fetched / selected", e["fetched_over_selected"]],
        ],
    )
    pinned = " (store pinned to CPU 1; this process and its workers to CPU 0)"
    pinned = pinned if result.get("pinned") else ""
    return (
        f"# lakeloader: loopback S3 (SeaweedFS) vs local\n\n"
        f"Lake: {lake['files']} files x {lake['row_groups_per_file']} row groups x "
        f"{lake['rows_per_group']:,} rows, {lake['bytes']:,} bytes; columns "
        f"{', '.join(lake['columns'])}; batch {BATCH}, {WORKERS} workers{pinned}; best of "
        f"{len(result['passes']['local'])} interleaved passes. Code: {json.dumps(note)}. "
        f"Machine: {json.dumps(result['machine'])}.\n\n{table}\n\n"
        f"Requests of the last s3+proxy pass:\n\n{figures}\n"
    )


def _mmm(s: dict[str, Any]) -> str:
    return "-" if not s.get("n") else f"{s['min']:,} / {s['median']:,} / {s['max']:,}"


def main(argv: list[str] | None = None) -> int:
    global WORKERS  # one loader configuration per run, read by one_pass and render
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny lake, one repetition")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--row-groups", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None, help="rows per row group")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--lake-dir", default=None)
    parser.add_argument("--src", default="worktree", help="'worktree' or a git revision")
    parser.add_argument("--out", default=None, help="folder for the results")
    parser.add_argument(
        "--workers", type=int, default=WORKERS, help="num_workers (2; other values add -wN)"
    )
    parser.add_argument(
        "--pin", action="store_true", help="store on CPU 1, loader on CPU 0 (adds -pinned)"
    )
    args = parser.parse_args(argv)
    if args.src != "worktree" and PINNED_ENV not in os.environ:
        folder, note = pinned_tree(args.src)
        env = {**os.environ, PINNED_ENV: json.dumps(note)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH")) if p)
        argv_ = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
        return subprocess.run(argv_, env=env, check=False).returncode
    note = json.loads(os.environ.get(PINNED_ENV, "null")) or pinned_tree("worktree")[1]
    note["lakeloader_file"] = lakeloader.__file__
    size = {"files": 4, "row_groups": 2, "rows": 4096} if args.smoke else {}
    args.files = args.files or size.get("files", 64)
    args.row_groups = args.row_groups or size.get("row_groups", 4)
    args.rows = args.rows or size.get("rows", 32_768)
    args.reps = args.reps or (1 if args.smoke else 2)
    args.lake_dir = args.lake_dir or (
        f"{tempfile.gettempdir()}/lakeloader-bench/reference-{args.files}x{args.row_groups}"
        f"x{args.rows}"
    )
    result = run(args)
    result["machine"] = machine()
    result["pinned"] = args.pin
    result["code"] = note
    WORKERS = args.workers
    name = "s3_vs_local_smoke" if args.smoke else "s3_vs_local"
    name += ("" if WORKERS == 2 else f"-w{WORKERS}") + ("-pinned" if args.pin else "")
    markdown = _markdown(result, note)
    paths = write_results(name, result, markdown, args.out or ROOT / "benchmarks" / "results")
    print(markdown)
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
