"""Measure what a checkpoint costs the training loop: ``CheckpointManager.save`` at the barrier.

Setup: the demo lake (``lakeloader.cli.demo.write_demo_lake``, 60,000 rows, 16 files in
``day=0..3/``) in a temporary folder, a ``LakeDataset`` over the demo's columns, and a
``DataLoader`` in the demo's pre-crash topology (rank 0 of 2 ranks x 64 rows, 2 workers)
advanced a few steps and left mid-epoch with its iterator open, as in a training loop.

Save latency
    For each ``extra`` (none; a small MLP's ``state_dict`` as ``torch.save`` bytes, ~100 KB;
    a bigger one, ~10 MB) and each mode (``async_save=False`` / ``True``), one
    ``CheckpointManager`` under its own folder below ``--tmp`` (``/tmp``: a local disk here)
    saves ``--reps`` times at increasing steps (``keep=3``, so pruning runs as in a real run).
    The modes alternate within each repetition so that both see the same machine. ``blocked``
    is the time ``save()`` takes to return, i.e. the time the training loop is held at the
    barrier; for async, ``write`` is the time from the ``save()`` call until ``wait()``
    returns (capture, then the write itself in the background thread). The first save of
    every manager, which also writes the manifest, is reported apart and left out of the
    statistics. ``async/sync`` is the ratio of the blocked medians measured in this run.

Sizes
    The loader state as msgpack (``len(msgpack.packb(loader.state_dict()))``), the
    ``state.msgpack`` of a checkpoint for each ``extra``, the manifest under ``manifests/`` and
    the ``COMMIT`` marker, all in bytes.

Load
    ``CheckpointManager.load(fresh_loader)`` of the newest checkpoint into a new ``DataLoader``
    (created outside the timer), for each ``extra``; the restored position and extra are
    checked against what was saved.

torch.distributed is not initialised here, so the all-gather that compares positions across
ranks is skipped; the library does not fsync, so ``write`` is the time to hand the bytes to the
page cache, not to make them durable.

Run: ``python benchmarks/checkpoint_latency.py`` (about 6 s on two cores, most of it imports
and writing the lake), ``--quick`` (about 4 s: 5 saves, 3 loads), ``--json`` for one JSON
document with every sample. The manifest's size depends on the length of the temporary path,
which it records. The exit status is 1 if a load did not restore the saved position and extra.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from lakeloader import CheckpointManager, DataLoader, LakeDataset
from lakeloader.checkpoint.layout import COMMIT_FILE, MANIFEST_DIR, STATE_FILE, step_dir_name
from lakeloader.cli.demo import BEFORE, FEATURES, write_demo_lake
from lakeloader.cli.tables import format_pairs, format_table, to_json
from lakeloader.units import human_bytes

COLUMNS = ["id", *FEATURES, "label"]
MODES = ("sync", "async")


@dataclass(frozen=True)
class Extra:
    """A caller's ``extra``: None, or a model's ``state_dict`` as ``torch.save`` bytes."""

    name: str
    hidden: int  # width of the MLP's two hidden layers; 0 means no extra at all

    def build(self) -> bytes | None:
        if not self.hidden:
            return None
        torch.manual_seed(0)
        h = self.hidden
        model = torch.nn.Sequential(
            torch.nn.Linear(len(FEATURES), h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, h),
            torch.nn.ReLU(),
            torch.nn.Linear(h, 4),
        )
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        return buf.getvalue()


# Widths chosen for ~100 KB and ~10 MB of float32 parameters.
EXTRAS = (Extra("none", 0), Extra("~100 KB", 160), Extra("~10 MB", 1_600))


def _ms(ns: int) -> float:
    return ns / 1e6


def _summary(samples_ms: list[float]) -> dict[str, float]:
    return {
        "median_ms": float(statistics.median(samples_ms)),
        "p90_ms": float(np.percentile(samples_ms, 90)),
        "min_ms": float(min(samples_ms)),
        "max_ms": float(max(samples_ms)),
    }


def _timed(fn: Callable[[], Any]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def _fs_type(path: Path) -> str:
    """The filesystem type of ``path`` from /proc/mounts (longest mount prefix), or '?'."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    real = os.path.realpath(path)
    best = max(
        (m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
        key=lambda m: len(m[0]),
        default=None,
    )
    return f"{best[1]} (mounted at {best[0]})" if best else "?"


def _make_loader(ds: LakeDataset, num_workers: int) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=BEFORE.batch_size,
        num_workers=num_workers,
        rank=0,
        world_size=BEFORE.world_size,
    )


def _save_once(
    mgr: CheckpointManager, step: int, loader: DataLoader, extra: Any
) -> tuple[int, int]:
    """One save: (ns blocked in save(), ns from the call until wait() returns)."""
    t0 = time.perf_counter_ns()
    mgr.save(step, loader, extra=extra)
    t1 = time.perf_counter_ns()
    mgr.wait()
    t2 = time.perf_counter_ns()
    return t1 - t0, t2 - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    reps = args.reps if args.reps is not None else (5 if args.quick else 30)
    load_reps = max(3, reps // 2) if args.quick else reps
    work = Path(tempfile.mkdtemp(prefix="lakeloader-ckpt-bench-", dir=args.tmp))
    try:
        return _run(args, work, reps, load_reps)
    finally:
        if not args.keep_files:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, reps: int, load_reps: int) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    lake = Path(args.lake) if args.lake else work / "lake"
    t0 = time.perf_counter()
    if not args.lake:
        write_demo_lake(lake, rows=args.rows)
    lake_seconds = time.perf_counter() - t0
    ds = LakeDataset(lake, columns=args.columns.split(",") if args.columns else COLUMNS, seed=0)

    loader = _make_loader(ds, args.num_workers)
    batches = iter(loader)
    for _ in range(args.steps):
        next(batches)
    state = loader.state_dict()
    base_step = args.steps  # the label of a checkpoint; the loader does not move any more

    blobs = {e.name: e.build() for e in EXTRAS}
    managers = {
        (e.name, mode): CheckpointManager(
            str(work / "ckpt" / f"{e.hidden}-{mode}"), async_save=mode == "async"
        )
        for e in EXTRAS
        for mode in MODES
    }

    def payload(name: str, step: int) -> Any:
        blob = blobs[name]
        return None if blob is None else {"model": blob, "step": step}

    first: dict[str, dict[str, float]] = {e.name: {} for e in EXTRAS}
    for e in EXTRAS:
        for mode in MODES:
            blocked, total = _save_once(
                managers[e.name, mode], base_step, loader, payload(e.name, base_step)
            )
            first[e.name][f"{mode}_blocked_ms"] = _ms(blocked)
            first[e.name][f"{mode}_write_ms"] = _ms(total)

    blocked_ms: dict[tuple[str, str], list[float]] = {k: [] for k in managers}
    write_ms: dict[tuple[str, str], list[float]] = {k: [] for k in managers}
    t0 = time.perf_counter()
    for rep in range(reps):
        step = base_step + 1 + rep
        for e in EXTRAS:
            extra = payload(e.name, step)
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                blocked, total = _save_once(managers[e.name, mode], step, loader, extra)
                blocked_ms[e.name, mode].append(_ms(blocked))
                write_ms[e.name, mode].append(_ms(total))
    save_seconds = time.perf_counter() - t0
    last_step = base_step + reps

    # Sizes, from the newest checkpoint of each sync manager (the async ones write the same).
    sizes: dict[str, int] = {"loader_state_msgpack": len(msgpack.packb(state))}
    for e in EXTRAS:
        blob = blobs[e.name]
        sizes[f"extra_torch_save[{e.name}]"] = 0 if blob is None else len(blob)
        folder = Path(managers[e.name, "sync"].root) / step_dir_name(last_step)
        sizes[f"state_msgpack[{e.name}]"] = (folder / STATE_FILE).stat().st_size
    root = Path(managers[EXTRAS[0].name, "sync"].root)
    (manifest,) = (root / MANIFEST_DIR).iterdir()
    sizes["manifest"] = manifest.stat().st_size
    sizes["commit"] = (root / step_dir_name(last_step) / COMMIT_FILE).stat().st_size

    # load() into a fresh loader, per extra; check what comes back.
    load_ms: dict[str, list[float]] = {}
    checks: list[str] = []
    for e in EXTRAS:
        mgr = managers[e.name, "sync"]
        samples = []
        for _ in range(load_reps):
            fresh = _make_loader(ds, args.num_workers)
            got: list[Any] = []
            samples.append(_ms(_timed(lambda m=mgr, f=fresh, g=got: g.append(m.load(f)))))
            restored = fresh.state_dict()
            if (restored["epoch"], restored["position"]) != (state["epoch"], state["position"]):
                checks.append(
                    f"{e.name}: restored epoch/position {restored['epoch']}/"
                    f"{restored['position']}, saved {state['epoch']}/{state['position']}"
                )
            if got[0] != payload(e.name, last_step):
                checks.append(f"{e.name}: the extra did not round-trip")
            fresh.close()
        load_ms[e.name] = samples

    for mgr in managers.values():
        mgr.close()
    loader.close()

    saves = []
    for e in EXTRAS:
        sync = _summary(blocked_ms[e.name, "sync"])
        asyn = _summary(blocked_ms[e.name, "async"])
        saves.append(
            {
                "extra": e.name,
                "extra_bytes": sizes[f"extra_torch_save[{e.name}]"],
                "state_msgpack_bytes": sizes[f"state_msgpack[{e.name}]"],
                "sync_blocked": sync,
                "async_blocked": asyn,
                "async_write": _summary(write_ms[e.name, "async"]),
                "async_over_sync_blocked": asyn["median_ms"] / sync["median_ms"],
                "first_save": first[e.name],
                "samples_ms": {
                    "sync_blocked": blocked_ms[e.name, "sync"],
                    "async_blocked": blocked_ms[e.name, "async"],
                    "async_write": write_ms[e.name, "async"],
                },
            }
        )
    report: dict[str, Any] = {
        "setup": {
            "rows": len(ds),
            "lake": str(args.lake) if args.lake else "demo lake",
            "columns": list(ds.config.columns),
            "lake_files": sum(1 for _ in lake.rglob("*.parquet")),
            "lake_seconds": round(lake_seconds, 2),
            "loader": {
                "rank": 0,
                "world_size": BEFORE.world_size,
                "batch_size": BEFORE.batch_size,
                "num_workers": args.num_workers,
                "steps_advanced": args.steps,
                "epoch": state["epoch"],
                "position": state["position"],
            },
            "checkpoint_dir": str(work / "ckpt"),
            "filesystem": _fs_type(work),
            "reps": reps,
            "load_reps": load_reps,
            "save_loop_seconds": round(save_seconds, 2),
            "quick": bool(args.quick),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "msgpack": ".".join(map(str, msgpack.version)),
            "cpus": os.cpu_count(),
            "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "saves": saves,
        "sizes": sizes,
        "load": [{"extra": e.name, **_summary(load_ms[e.name])} for e in EXTRAS],
        "load_samples_ms": load_ms,
        "checks": checks or ["ok"],
    }
    return report


def render(r: dict[str, Any]) -> str:
    s = r["setup"]
    lo = s["loader"]
    head = format_pairs(
        [
            ("lake", f"{s['rows']:,} rows, {s['lake_files']} files ({s['lake']}), {s['columns']}"),
            (
                "loader",
                f"rank 0 of {lo['world_size']} x {lo['batch_size']} rows, "
                f"{lo['num_workers']} workers, {lo['steps_advanced']} steps in "
                f"(epoch {lo['epoch']}, position {lo['position']:,}), iterator open",
            ),
            ("checkpoints", f"{s['checkpoint_dir']} on {s['filesystem']}, keep=3, no fsync"),
            (
                "repetitions",
                f"{s['reps']} saves per extra and mode (after 1 untimed first save), "
                f"{s['load_reps']} loads",
            ),
            (
                "machine",
                f"{s['cpus']} CPUs, Python {s['python']}, torch {s['torch']}, "
                f"msgpack {s['msgpack']}, 1-min load average "
                f"{s['loadavg_1min'][0]} before, {s['loadavg_1min'][1]} after",
            ),
        ]
    )
    save_table = format_table(
        [
            "extra",
            "state.msgpack",
            "sync med",
            "sync p90",
            "async med",
            "async p90",
            "async/sync",
            "async write med",
            "async write p90",
        ],
        [
            [
                x["extra"],
                human_bytes(x["state_msgpack_bytes"]),
                round(x["sync_blocked"]["median_ms"], 3),
                round(x["sync_blocked"]["p90_ms"], 3),
                round(x["async_blocked"]["median_ms"], 3),
                round(x["async_blocked"]["p90_ms"], 3),
                round(x["async_over_sync_blocked"], 3),
                round(x["async_write"]["median_ms"], 3),
                round(x["async_write"]["p90_ms"], 3),
            ]
            for x in r["saves"]
        ],
    )
    first_table = format_table(
        ["extra", "sync", "async blocked", "async write"],
        [
            [
                x["extra"],
                round(x["first_save"]["sync_blocked_ms"], 3),
                round(x["first_save"]["async_blocked_ms"], 3),
                round(x["first_save"]["async_write_ms"], 3),
            ]
            for x in r["saves"]
        ],
    )
    size_rows = [
        ("loader state, msgpack.packb(loader.state_dict())", r["sizes"]["loader_state_msgpack"])
    ]
    for x in r["saves"]:
        if x["extra_bytes"]:
            size_rows.append((f"extra, torch.save bytes ({x['extra']})", x["extra_bytes"]))
    for x in r["saves"]:
        size_rows.append((f"step-*/state.msgpack, extra {x['extra']}", x["state_msgpack_bytes"]))
    size_rows += [
        (f"{MANIFEST_DIR}/<fingerprint>.msgpack", r["sizes"]["manifest"]),
        ("step-*/COMMIT", r["sizes"]["commit"]),
    ]
    size_table = format_table(["file", "bytes"], [list(row) for row in size_rows])
    load_table = format_table(
        ["extra", "load med", "load p90"],
        [[x["extra"], round(x["median_ms"], 3), round(x["p90_ms"], 3)] for x in r["load"]],
    )
    return "\n\n".join(
        [
            head,
            "save(): time the training loop is blocked, ms (async write: save() call until "
            "wait() returns)",
            save_table,
            "first save of each manager (also writes the manifest; not in the figures above), ms",
            first_table,
            "sizes",
            size_table,
            "CheckpointManager.load(fresh_loader), newest checkpoint, ms",
            load_table,
            "checks  " + "; ".join(r["checks"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds: fewer repetitions")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--reps", type=int, help="timed saves per extra and mode (30; quick 5)")
    parser.add_argument("--rows", type=int, default=60_000, help="rows of the demo lake")
    parser.add_argument("--steps", type=int, default=5, help="steps to advance the loader")
    parser.add_argument(
        "--num-workers", type=int, default=BEFORE.num_workers, help="loader workers (demo: 2)"
    )
    parser.add_argument("--tmp", default="/tmp", help="parent of the work folder (/tmp)")
    parser.add_argument(
        "--lake", help="an existing lake instead of the demo's (e.g. the reference lake)"
    )
    parser.add_argument("--columns", help="comma-separated columns to read from --lake")
    parser.add_argument("--keep-files", action="store_true", help="leave the work folder")
    args = parser.parse_args(argv)
    report = run(args)
    print(to_json(report) if args.json else render(report))
    return 0 if report["checks"] == ["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
