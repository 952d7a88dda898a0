"""First batch of a packed 1,000-file token lake, against the time to read its footers (issue 31).

Run it::

    python -m benchmarks.packing_first_batch            # ~3 min; --smoke for a tiny run
    python -m benchmarks.packing_first_batch --profile  # + a cProfile of one first batch

The lake (written once under ``--lake``): 1,000 files x 2 row groups of 50 rows, zstd, local
disk; ``tokens`` ``list<int32>`` of 16 to 1,024 ids (2,000 units, about 52 M tokens). Each
figure comes from a fresh process (the imports are done before any clock starts; the page
cache holds the lake: it is read once before the first repetition):

- ``footers``: ``pyarrow.parquet.read_metadata`` of every file on 32 threads (what lakeloader's
  snapshot uses on a store), then once more on one thread; (a), the reference, is the faster
  of the two in each repetition (on 2 cores and a warm page cache, one thread);
- ``index``: (b) ``LakeDataset(lake, columns=["tokens"], packing=Packing("tokens", 2048,
  eos_id=0))``, which lists the lake and reads every footer; (c) the token-count index,
  ``lakeloader.pipeline.token_counts.token_counts(ds)``: *warm*, right after (b), with the
  footers in ``lakeloader.io.fetch``'s per-process footer cache, as a loader finds them, and
  *cold*, with that cache emptied first (every footer parsed again), then the epoch's
  :class:`~lakeloader.order.packing.TokenStream` from the counts (``ds.plan(0)``'s order);
- ``first-wN``: (d) from ``LakeDataset(...)`` to the first batch of ``DataLoader(ds,
  batch_size=16, num_workers=N)`` in hand (N = 0, 2), with the part spent in the loader's own
  ``token_counts`` call (it computes the index once per loader: it is inside (d)) and the part
  from ``DataLoader(...)`` to the batch.

The figures reported: (c)/(a) (cold and warm) and time to the first batch / (a), where the time
to the first batch is (b) + the loader's index + the rest of the first batch, i.e. what
``((b) + (c) + first batch)`` counts with (c) once. Medians over ``--reps`` repetitions, each
repetition running every child once, in turn.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from benchmarks._common import (
    emit_result,
    machine,
    markdown_table,
    pinned_tree,
    run_child,
    warm_page_cache,
)
from benchmarks._steady import finish, parse, write_lake
from benchmarks.packing import _table

SEQ, BATCH, EOS = 2048, 16, 0
FILES, GROUPS, GROUP_ROWS = 1_000, 2, 50
#: Threads for (a): lakeloader's snapshot reads ``min(32, files)`` footers at once.
FOOTER_THREADS = 32
CHILDREN = ("footers", "index", "first-w0", "first-w2")


def _paths(lake: str) -> list[str]:
    return sorted(str(p) for p in Path(lake).glob("*.parquet"))


def _footers(args: argparse.Namespace) -> dict[str, Any]:
    paths = _paths(args.lake)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(FOOTER_THREADS, len(paths))) as pool:
        metas = list(pool.map(pq.read_metadata, paths))
    threaded = time.perf_counter() - t0
    t0 = time.perf_counter()
    for path in paths:
        pq.read_metadata(path)
    serial = time.perf_counter() - t0
    groups = sum(m.num_row_groups for m in metas)
    return {"files": len(paths), "row_groups": groups, "a_s": threaded, "a_serial_s": serial}


def _dataset(args: argparse.Namespace) -> Any:
    import lakeloader as ll

    packing = ll.Packing("tokens", SEQ, eos_id=EOS)
    return ll.LakeDataset(args.lake, columns=["tokens"], seed=0, progress=False, packing=packing)


def _index(args: argparse.Namespace) -> dict[str, Any]:
    import lakeloader  # noqa: F401  (imported before the clocks)
    from lakeloader.io import fetch
    from lakeloader.order.packing import TokenStream
    from lakeloader.pipeline.token_counts import token_counts

    t0 = time.perf_counter()
    ds = _dataset(args)
    b = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = token_counts(ds)
    c_warm = time.perf_counter() - t0
    cache = fetch._FOOTERS._items  # the per-process footer cache (lakeloader.io.fetch)
    cached = len(cache)
    cache.clear()
    t0 = time.perf_counter()
    cold = token_counts(ds)
    c_cold = time.perf_counter() - t0
    assert np.array_equal(warm, cold)
    t0 = time.perf_counter()
    order = ds.plan(0).order
    TokenStream.of(cold[order], ds.config.num_partitions, SEQ)
    stream = time.perf_counter() - t0
    return {
        "units": len(ds.units),
        "tokens": int(cold.sum()),
        "footers_cached_after_b": cached,
        "b_s": b,
        "c_warm_s": c_warm,
        "c_cold_s": c_cold,
        "plan_and_stream_s": stream,
    }


def _first(workers: int) -> Any:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        import torch  # noqa: F401  (imported before the clocks)

        import lakeloader as ll
        import lakeloader.nodes.packing as node

        inside: list[float] = []
        counts = node.token_counts  # type: ignore[attr-defined]  # the name the node calls

        def timed(ds: Any) -> Any:
            t = time.perf_counter()
            try:
                return counts(ds)
            finally:
                inside.append(time.perf_counter() - t)

        node.token_counts = timed  # type: ignore[attr-defined]  # the loader's index, timed
        t0 = time.perf_counter()
        ds = _dataset(args)
        b = time.perf_counter() - t0
        t1 = time.perf_counter()
        loader = ll.DataLoader(ds, batch_size=BATCH, num_workers=workers)
        batch = next(iter(loader))
        d = time.perf_counter() - t1
        assert batch["input_ids"].shape == (BATCH, SEQ)
        loader.close()
        return {
            "b_s": b,
            "loader_index_s": sum(inside),
            "index_calls": len(inside),
            "after_b_s": d,
            "first_batch_s": b + d,
        }

    return run


RUNS = {"footers": _footers, "index": _index, "first-w0": _first(0), "first-w2": _first(2)}


def _child(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run = RUNS[args.child]
    if args.profile_child:  # the modules the run imports, imported before the profiler starts
        import torch  # noqa: F401

        import lakeloader.nodes.packing
        import lakeloader.pipeline.token_counts  # noqa: F401

        prof = cProfile.Profile()
        prof.enable()
        result = run(args)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).strip_dirs()
        stats.sort_stats("cumulative").print_stats(25)
        stats.sort_stats("tottime").print_stats(15)
        result["profile"] = text.getvalue()
    else:
        result = run(args)
    result["child"] = args.child
    emit_result(result)
    return 0


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", action="store_true", help="+ a cProfile of first-w0")
    parser.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    """Write the lake, run the children, write ``results/packing-first-batch.{json,md}``."""
    args = parse(__doc__.splitlines()[0], "/tmp/lakeloader-bench-first-batch", argv, _options)
    if args.child is not None:
        return _child(args)
    files, group = (20, 10) if args.smoke else (FILES, GROUP_ROWS)
    write_lake(Path(args.lake), files, _table(group * GROUPS), group, "zstd")
    lake_bytes = warm_page_cache([args.lake])
    cwd, src = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    before = machine()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CHILDREN}
    for rep in range(args.reps):
        for name in CHILDREN:
            cmd = [sys.executable, "-m", "benchmarks.packing_first_batch", "--child", name]
            run = run_child([*cmd, "--lake", args.lake], timeout=600, cwd=cwd, pss=False)
            result = run.result or {"error": run.stderr_tail, "returncode": run.returncode}
            result["rep"] = rep
            runs[name].append(result)
            print(f"rep {rep} {name}: {result}", flush=True)
    failed = {k: v for k, v in runs.items() if any("error" in r for r in v)}
    if failed:
        raise SystemExit(f"children failed: {failed}")
    per_rep: dict[str, list[float]] = {}
    for r in runs["footers"]:
        r["a_best_s"] = min(r["a_s"], r["a_serial_s"])
    for ref in ("a_best", "a"):
        a = [r[f"{ref}_s"] for r in runs["footers"]]
        for what, name, key in (
            ("c_cold", "index", "c_cold_s"),
            ("c_warm", "index", "c_warm_s"),
            ("first_w0", "first-w0", "first_batch_s"),
            ("first_w2", "first-w2", "first_batch_s"),
        ):
            per_rep[f"{what}/{ref}"] = [r[key] / f for r, f in zip(runs[name], a, strict=True)]

    def fig(name: str, key: str) -> list[Any]:
        values = [r[key] for r in runs[name]]
        return [_ms(_med(values)), f"{_ms(min(values))}-{_ms(max(values))}"]

    def ratio(key: str) -> list[Any]:
        v = per_rep[key]
        return [round(_med(v), 2), f"{min(v):.2f}-{max(v):.2f}"]

    idx = runs["index"][0]
    lines = [
        ["(a) footers: read_metadata of every file, the faster way", *fig("footers", "a_best_s")],
        ["footers on one thread", *fig("footers", "a_serial_s")],
        ["(a') footers on 32 threads", *fig("footers", "a_s")],
        ["(b) LakeDataset(lake, packing=...)", *fig("index", "b_s")],
        ["(c) token_counts(ds), cold footer cache", *fig("index", "c_cold_s")],
        ["(c) token_counts(ds), warm footer cache (after (b))", *fig("index", "c_warm_s")],
        ["ds.plan(0) + TokenStream of the counts", *fig("index", "plan_and_stream_s")],
    ]
    for w in (0, 2):
        name = f"first-w{w}"
        lines += [
            [f"{w} workers: (b) LakeDataset(...)", *fig(name, "b_s")],
            [f"{w} workers: its token_counts (inside the next line)", *fig(name, "loader_index_s")],
            [f"{w} workers: DataLoader(...) to the first batch", *fig(name, "after_b_s")],
            [f"{w} workers: LakeDataset(...) to the first batch", *fig(name, "first_batch_s")],
        ]
    ratios = [
        ["(c) cold / (a)", *ratio("c_cold/a_best")],
        ["(c) warm / (a)", *ratio("c_warm/a_best")],
        ["((b) + (c) + first batch) / (a), 0 workers", *ratio("first_w0/a_best")],
        ["((b) + (c) + first batch) / (a), 2 workers", *ratio("first_w2/a_best")],
        ["(c) cold / (a'), the footers on 32 threads", *ratio("c_cold/a")],
        ["((b) + (c) + first batch) / (a'), 0 workers", *ratio("first_w0/a")],
        ["((b) + (c) + first batch) / (a'), 2 workers", *ratio("first_w2/a")],
    ]
    sections = [
        f"{files:,} files x {GROUPS} row groups of {group} rows of 16-1,024 tokens "
        f"(zstd, local disk, {lake_bytes / 2**20:,.0f} MiB, in the page cache): "
        f"{idx['units']:,} units, {idx['tokens']:,} tokens (separators included). Samples of "
        f"{SEQ} tokens, {BATCH} a batch, C=16. Every figure from a fresh process, imports "
        "before the clocks.",
        "",
        "## Times (ms): median (min-max) over the repetitions",
        "",
        markdown_table(["what", "ms (median)", "min-max"], lines),
        "",
        "## Ratios to (a) and (a'), per repetition: median (min-max)",
        "",
        "The time to the first batch is (b) + the loader's own token_counts + the rest of the "
        "first batch, measured in one process from `LakeDataset(...)` on ((c) counted once: the "
        "loader computes it itself).",
        "",
        markdown_table(["ratio", "median", "min-max"], ratios),
    ]
    data: dict[str, Any] = {"runs": runs, "ratios": per_rep, "lake_bytes": lake_bytes}
    if args.profile:
        cmd = [sys.executable, "-m", "benchmarks.packing_first_batch", "--child", "first-w0"]
        cmd += ["--lake", args.lake, "--profile-child"]
        prof = run_child(cmd, timeout=600, cwd=cwd, pss=False).result or {}
        sections += [
            "",
            "## cProfile of one first-w0 child (LakeDataset(...) to the first batch)",
            "",
            f"First batch under the profiler: {_ms(prof.get('first_batch_s', 0))} ms.",
            "",
            "```",
            str(prof.get("profile", "(no profile)")).strip(),
            "```",
        ]
        data["profile"] = prof
    title = (
        "First batch of a packed 1,000-file token lake (`python -m benchmarks.packing_first_batch`)"
    )
    return finish("packing-first-batch", args, (title, src, before), sections, data)


if __name__ == "__main__":
    sys.exit(main())
