"""What the issue-13 benchmarks share: steady-state rows/s in child processes, interleaved reps.

Each loader runs in a child process of its own (``python -m benchmarks.NAME --child LOADER``),
so that no two share a GIL, a page cache warm-up or an allocator; the parent runs every loader
once per repetition, in turn, and reports medians and, per repetition, each loader's ratio to
the reference measured in that repetition (these 2-core machines are noisy: only ratios
within a run mean much).

A loader that asks for workers is only credited with a rate if worker processes ran: each child
reports the CPU its descendants used (``worker_cpu_s``), and :func:`ratio_table` prints "no
workers started" for a loader named in ``workers=`` whose children used none. A loader whose
measurement cannot run on the lakeloader measured raises :class:`NotMeasured`, and its row
says why instead of a rate.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks._common import (
    emit_result,
    machine,
    markdown_table,
    run_child,
    tree_pids,
    write_results,
)

#: Batches left out of the timing at the start (workers starting, first decodes).
WARMUP_BATCHES = 3


class NotMeasured(Exception):  # noqa: N818 (not an error: a row that says why it has no rate)
    """Raised by a loader's run when the lakeloader measured cannot run it; the reason."""


def worker_cpu_seconds() -> float:
    """CPU seconds used so far by this process's descendants, the exited and the live.

    The exited ones are those waited for (a pool's workers once it is shut down); the live ones
    are read from ``/proc`` (a pool still running).
    """
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = used.ru_utime + used.ru_stime
    for pid in tree_pids(os.getpid())[1:]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def steady_rate(
    batches: Iterable[Any], rows_of: Callable[[Any], int], warmup: int = WARMUP_BATCHES
) -> dict[str, Any]:
    """Rows/s over the batches after the first ``warmup``, and the whole run's rows.

    ``warmup=0``: over every batch, from the first one asked for.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    rows = timed = 0
    start = t0 if warmup == 0 else None
    for i, batch in enumerate(batches):
        n = rows_of(batch)
        rows += n
        if i == warmup - 1:
            start = time.perf_counter()
        elif start is not None:
            timed += n
    end = time.perf_counter()
    seconds = end - (start if start is not None else t0)
    rate = timed / seconds if start is not None and seconds > 0 else rows / max(end - t0, 1e-9)
    cpu = time.process_time() - c0  # this process's threads, from the first batch asked for
    return {"rows": rows, "rows_per_s": rate, "seconds": end - t0, "cpu_s": cpu}


def child_main(
    loaders: dict[str, Callable[[Any], Iterable[Any]]],
    args: Any,
    rows_of: Any,
    warmup: int = WARMUP_BATCHES,
) -> int:
    """Run one loader in this process and hand its rate to the parent.

    With it go the CPU seconds of this process's descendants (its workers, if any ran), and
    ``args.note`` if the run set one (how it measured something other than its label says).
    ``warmup``: batches left out of the rate (see :func:`steady_rate`).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        result = steady_rate(loaders[args.child](args), rows_of, warmup)
    except NotMeasured as why:
        result = {"not_measured": str(why)}
    result["loader"] = args.child
    result["worker_cpu_s"] = round(worker_cpu_seconds(), 3)
    if getattr(args, "note", None):
        result["note"] = args.note
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


def _unmeasured(runs: list[dict[str, Any]], needs_workers: bool) -> str | None:
    """Why a loader's row has no rate though it ran, if it has none."""
    for run in runs:
        if "not_measured" in run:
            return f"not measured: {run['not_measured']}"
        if needs_workers and run.get("worker_cpu_s") == 0:
            return f"no workers started (rep {run.get('rep')}: no child process used CPU)"
    return None


def ratio_table(
    samples: dict[str, list[dict[str, Any]]],
    reference: str,
    labels: dict[str, str],
    workers: Collection[str] = (),
) -> tuple[str, dict[str, Any]]:
    """A markdown table of medians and per-repetition ratios to ``reference``, and its data.

    A loader in ``workers`` whose worker processes did not run, and one that raised
    :class:`NotMeasured`, get a row that says so instead of a rate. A run's ``note`` is added to
    its loader's label. ``cores``: the CPU seconds the run's process (its threads) used from its
    first batch asked for, plus all its worker processes used (their start too), over the run's
    seconds: how much of the machine it took.
    """
    rows: list[list[Any]] = []
    data = {}
    ref = [s.get("rows_per_s") for s in samples[reference]]
    for name, runs in samples.items():
        note = next((r["note"] for r in runs if r.get("note")), None)
        label = f"{labels[name]} ({note})" if note else labels[name]
        why = _unmeasured(runs, name in workers)
        if why is not None:
            rows.append([label, None, None, why, None])
            continue
        if any(r.get("rows_per_s") is None for r in runs):
            rows.append([label, None, None, "failed: " + str(runs[0].get("error"))[-80:], None])
            continue
        rates: list[float] = [r["rows_per_s"] for r in runs]
        ratios = [r / f for r, f in zip(rates, ref, strict=True) if f]
        med = statistics.median(ratios) if ratios else None
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        cores = [
            (r.get("cpu_s", 0.0) + r.get("worker_cpu_s", 0.0)) / r["seconds"]
            for r in runs
            if r.get("seconds")
        ]
        row = [label, round(statistics.median(rates)), round(med or 0, 2), spread]
        rows.append([*row, round(statistics.median(cores), 2) if cores else None])
        data[name] = {"rows_per_s": rates, "ratio": ratios, "median_ratio": med, "cores": cores}
    head = ["loader", "rows/s (median)", f"x {labels[reference]} (median)", "x per rep (min-max)"]
    table = markdown_table([*head, "cores (median)"], rows)
    return table, data


def write_lake(
    root: Path,
    files: int,
    table_of: Callable[[np.random.Generator, int], pa.Table],
    group: int,
    compression: str = "snappy",
) -> None:
    """Write ``files`` files of ``table_of(rng, f)`` in row groups of ``group`` rows, once.

    Kept as it is when ``root`` already has that many files (the lake is deterministic; give
    a lake of another ``compression`` a folder of its own).
    """
    if len(list(root.glob("*.parquet"))) == files:
        return
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        path = root / f"part-{f}.parquet"
        pq.write_table(table_of(rng, f), path, row_group_size=group, compression=compression)


def parse(
    description: str,
    lake: str,
    argv: list[str] | None,
    more: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The arguments every such benchmark takes (``--smoke`` sets one repetition).

    ``more`` adds a script's own arguments to the parser.
    """
    parser = argparse.ArgumentParser(description=description)
    if more is not None:
        more(parser)
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
