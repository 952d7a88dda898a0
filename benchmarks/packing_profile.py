"""Where a packed stream's time goes: cProfile of one child of ``benchmarks.packing``.

Run it (after ``python -m benchmarks.packing --compression zstd``, which writes the lake)::

    python -m benchmarks.packing_profile lakeloader-w0-W1 lakeloader-w0-W3

Each loader named (a child of :mod:`benchmarks.packing`: ``lakeloader-w0``, ``numpy``, or with
``-WN`` rank 0 of N at ``--global-batch``) is built in a fresh process on the zstd lake of
``benchmarks.packing``, from the ``git archive`` of HEAD as the benchmarks do, then its batches
(one epoch's tokens) are taken under cProfile. ``results/packing-profile.md`` gets, per loader,
its rate under the profiler and its functions by own time and by cumulative time (lakeloader's
only). A worker's time is in
no profile (cProfile follows one process): profile ``-w0`` loaders.
"""

from __future__ import annotations

import argparse
import io
import pstats
import subprocess
import sys

from benchmarks._common import emit_result, machine, pinned_tree, result_of, write_results
from benchmarks._steady import steady_rate
from benchmarks.packing import GLOBAL_BATCH, LOADERS, _limited, _world, _world_loaders


def _child(args: argparse.Namespace) -> int:
    """One loader's batches under cProfile (built before the profiler starts), its stats."""
    import cProfile

    world = _world(args.child)
    loaders = {**LOADERS, **_world_loaders([world] if world is not None else [])}
    batches = _limited(loaders[args.child][1])(args)
    prof = cProfile.Profile()
    prof.enable()
    result = steady_rate(batches, lambda b: b["input_ids"].numel())
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("lakeloader/", args.top)
    result["profile"] = text.getvalue()
    emit_result(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Profile each loader named, write ``results/packing-profile.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("loaders", nargs="*")
    parser.add_argument("--lake", default="/tmp/lakeloader-bench-packing-zstd")
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--src", default="HEAD")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return _child(args)
    cwd, src = pinned_tree(args.src)
    before = machine()
    sections, data = [], {}
    for name in args.loaders:
        cmd = [sys.executable, "-m", "benchmarks.packing_profile", "--child", name]
        cmd += ["--lake", args.lake, "--global-batch", str(args.global_batch)]
        cmd += ["--top", str(args.top)]
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=900)
        result = result_of(done.stdout) or {"error": done.stderr[-2000:]}
        report = str(result.pop("profile", "")).replace(str(cwd) + "/", "")
        rate = result.get("rows_per_s")
        said = f"{rate:,.0f} tokens/s under the profiler" if rate else str(result)[-300:]
        sections += [f"## {name}", "", said, "", "```", report.strip(), "```", ""]
        data[name] = {"result": result}
        print(f"{name}: {said}", flush=True)
    after = machine()
    conditions = (
        f"lakeloader {src['commit']} ({src['src']}); {before['cpus']} cores; load average "
        f"{before['loadavg_1min']} before, {after['loadavg_1min']} after; lake {args.lake}; "
        f"global batch {args.global_batch} for the -WN loaders. One run each: the loader is "
        "built, then its batches of one epoch's tokens are taken under cProfile (its overhead "
        "slows the Python-heavy parts most)."
    )
    title = "cProfile of packed streams (`python -m benchmarks.packing_profile`)"
    markdown = "\n".join([f"# {title}", "", conditions, "", *sections])
    full = {"machine": before, "after": after, "src": src, **data}
    write_results("packing-profile", full, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
