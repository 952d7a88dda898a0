"""What the issue-13 benchmarks share: steady-state rows/s in child processes, interleaved reps.

Each loader runs in a child process of its own (``python -m benchmarks.NAME --child LOADER``),
so that no two share a GIL, a page cache warm-up or an allocator; the parent runs every loader
once per repetition, in turn, and reports medians and, per repetition, each loader's ratio to
the reference measured in that repetition (these 2-core machines are noisy: only ratios
within a run mean much).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import emit_result, machine, markdown_table, run_child, write_results

#: Batches left out of the timing at the start (workers starting, first decodes).
WARMUP_BATCHES = 3


def steady_rate(batches: Iterable[Any], rows_of: Callable[[Any], int]) -> dict[str, Any]:
    """Rows/s over the batches after the first ``WARMUP_BATCHES``, and the whole run's rows."""
    t0 = time.perf_counter()
    rows = timed = 0
    start = None
    for i, batch in enumerate(batches):
        n = rows_of(batch)
        rows += n
        if i == WARMUP_BATCHES - 1:
            start = time.perf_counter()
        elif start is not None:
            timed += n
    end = time.perf_counter()
    seconds = end - (start if start is not None else t0)
    rate = timed / seconds if start is not None and seconds > 0 else rows / max(end - t0, 1e-9)
    return {"rows": rows, "rows_per_s": rate, "seconds": end - t0}


def child_main(loaders: dict[str, Callable[[Any], Iterable[Any]]], args: Any, rows_of: Any) -> int:
    """Run one loader in this process and hand its rate to the parent."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = steady_rate(loaders[args.child](args), rows_of)
    result["loader"] = args.child
    emit_result(result)
    return 0


def run_reps(
    module: str, names: Sequence[str], reps: int, extra: Sequence[str], cwd: Path, timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """Every loader once per repetition, in turn; what each child reported (or its failure)."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names:
            cmd = [sys.executable, "-m", module, "--child", name, *extra]
            run = run_child(cmd, timeout=timeout, cwd=cwd, pss=False)
            result = run.result or {"error": run.stderr_tail, "returncode": run.returncode}
            result["rep"] = rep
            out[name].append(result)
            rate = result.get("rows_per_s")
            said = f"{rate:,.0f} rows/s" if rate else result
            print(f"rep {rep} {name}: {said}", flush=True)
    return out


def ratio_table(
    samples: dict[str, list[dict[str, Any]]], reference: str, labels: dict[str, str]
) -> tuple[str, dict[str, Any]]:
    """A markdown table of medians and per-repetition ratios to ``reference``, and its data."""
    rows, data = [], {}
    ref = [s.get("rows_per_s") for s in samples[reference]]
    for name, runs in samples.items():
        rates = [r.get("rows_per_s") for r in runs]
        if any(r is None for r in rates):
            rows.append([labels[name], None, None, "failed: " + str(runs[0].get("error"))[-80:]])
            continue
        ratios = [r / f for r, f in zip(rates, ref, strict=True) if f]
        med = statistics.median(ratios) if ratios else None
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        rows.append([labels[name], round(statistics.median(rates)), round(med or 0, 2), spread])
        data[name] = {"rows_per_s": rates, "ratio": ratios, "median_ratio": med}
    table = markdown_table(
        ["loader", "rows/s (median)", f"x {labels[reference]} (median)", "x per rep (min-max)"],
        rows,
    )
    return table, data


def write_lake(
    root: Path, files: int, table_of: Callable[[np.random.Generator, int], pa.Table], group: int
) -> None:
    """Write ``files`` files of ``table_of(rng, f)`` in row groups of ``group`` rows, once.

    Kept as it is when ``root`` already has that many files (the lake is deterministic).
    """
    if len(list(root.glob("*.parquet"))) == files:
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        pq.write_table(table_of(rng, f), root / f"part-{f}.parquet", row_group_size=group)


def parse(description: str, lake: str, argv: list[str] | None) -> argparse.Namespace:
    """The arguments every such benchmark takes (``--smoke`` sets one repetition)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lake", default=lake, help="where the lake is written (once)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny lake, one repetition")
    parser.add_argument("--src", default=None, help="HEAD (default) or worktree (--smoke)")
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and args.child is None:
        args.lake, args.reps = args.lake + "-smoke", 1
    return args


def finish(
    name: str,
    args: argparse.Namespace,
    header: tuple[str, dict[str, Any], dict[str, Any]],
    sections: Sequence[str],
    data: dict[str, Any],
) -> int:
    """Write ``NAME(-smoke).{json,md}``: a title, the run's conditions, then ``sections``.

    Args:
        name: The script's name.
        args: Its arguments.
        header: The title, the source measured (from ``pinned_tree``) and the machine before.
        sections: Markdown after the conditions line.
        data: What goes into the JSON besides the machine and the source.
    """
    title, src, before = header
    after = machine()
    conditions = (
        f"lakeloader {src['commit']} ({src['src']}); {before['cpus']} cores; load average "
        f"{before['loadavg_1min']} before, {after['loadavg_1min']} after; {args.reps} "
        "repetitions, the loaders in turn."
    )
    markdown = "\n".join([f"# {title}", "", conditions, "", *sections])
    full = {"machine": before, "after": after, "src": src, **data}
    json_path, md_path = write_results(
        f"{name}-smoke" if args.smoke else name, full, markdown, args.out
    )
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0
