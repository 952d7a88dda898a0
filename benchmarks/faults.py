"""What faults cost: checkpoint overhead, a replica group's death, and the loss curve after.

Checkpoint overhead (one process, no torch.distributed)
    A 10-layer MLP (8 -> 1024 x 9 -> 4 classes, 8.4 M parameters, 34 MB; with AdamW's two
    moments 101 MB of state) trains on the demo lake (``lakeloader.cli.demo``, batch 64, 0
    workers). Each repetition runs ``--steps`` steps three times, in turn: without
    checkpoints, and with ``CheckpointManager.save(step, loader, model=, optimizer=)`` every
    ``--every`` steps, synchronous and ``async_save=True``. ``blocked`` is the time
    ``save()`` holds the loop; the share is ``blocked / (every x step time)``, and the same
    extrapolated to one checkpoint per ``--realistic-minutes`` minutes (what large runs use).
    ``wall`` is the whole run's time against the run without checkpoints (noisier: the
    machine's jitter is of the same order).

A replica group's death (torchft, ``examples/train_ft.py --demo``, ``--ft-runs`` times)
    Three replica groups of one process each on a torchft Lighthouse (gloo on CPU); group 1 is
    SIGKILLed after step 20; the time from the kill to the survivors' next committed step (no
    process restarted), the replacement's time from launch to taking part, and whether every
    row of the epoch was in exactly one committed share.

The loss curve of a fault-injected run (``examples/train_ddp.py`` under torchrun)
    A reference run on 3 ranks x 16 rows to step ``--steps-curve``; a run in which rank 1 is
    SIGKILLed after step 33 (torchrun restarts the group, which loads the checkpoint of step
    30: DCP shards, generators, loader) and stops at step 50; the same checkpoints continued on
    2 ranks x 24 rows (the same global batch) to the end. Both with DDP and with FSDP2. Steps
    1-50 are compared bit for bit, the steps after the resize by their largest relative
    deviation.

Run: ``python -m benchmarks.faults`` (about 4 minutes on two cores); ``--quick`` (about a
minute and a half) for fewer steps and one torchft run. Results go to
``benchmarks/results/faults.{json,md}``. The exit status is 1 if a fault-injected run was not
bit-identical before the resize, or a torchft run not exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import ROOT, machine, markdown_table, write_results
from lakeloader import CheckpointManager, DataLoader, LakeDataset
from lakeloader.cli.demo import CLASSES, FEATURES, write_demo_lake

TRAIN_DDP = ROOT / "examples" / "train_ddp.py"
TRAIN_FT = ROOT / "examples" / "train_ft.py"
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "RUST_LOG": "warn"}


# ----------------------------------------------------------------- checkpoint overhead
def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(len(FEATURES), 1024), torch.nn.ReLU()]
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, CLASSES))


def _train(
    lake: Path, folder: Path | None, steps: int, every: int, asynchronous: bool
) -> dict[str, Any]:
    """Train ``steps`` steps, saving every ``every`` (no saves without a folder)."""
    model = _mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(LakeDataset(lake, columns=[*FEATURES, "label"]), batch_size=64)
    ckpt = CheckpointManager(str(folder), async_save=asynchronous) if folder else None
    blocked: list[float] = []
    start = time.perf_counter()
    step = 0
    while step < steps:
        for batch in loader:
            x = torch.stack([batch[f] for f in FEATURES], 1)
            loss = torch.nn.functional.cross_entropy(model(x), batch["label"])
            optim.zero_grad()
            loss.backward()
            optim.step()
            step += 1
            if ckpt is not None and step % every == 0:
                t = time.perf_counter()
                ckpt.save(step, loader, model=model, optimizer=optim)
                blocked.append(time.perf_counter() - t)
            if step == steps:
                break
    if ckpt is not None:
        ckpt.close()
    wall = time.perf_counter() - start
    loader.close()
    return {"wall": wall, "blocked": blocked, "steps": steps}


def overhead(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    lake = work / "lake"
    write_demo_lake(lake, 60_000)
    torch.set_num_threads(2)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "sync": [], "async": []}
    for rep in range(args.reps):
        for mode in runs:
            folder = None if mode == "none" else work / f"ckpt-{mode}-{rep}"
            runs[mode].append(_train(lake, folder, args.steps, args.every, mode == "async"))
    step_time = statistics.median(r["wall"] / r["steps"] for r in runs["none"])
    rows = []
    out: dict[str, Any] = {"step_seconds": step_time, "every": args.every, "runs": runs}
    for mode in ("sync", "async"):
        blocked = [b for r in runs[mode] for b in r["blocked"][1:]]  # the first writes a manifest
        per_save = statistics.median(blocked)
        wall = [r["wall"] / n["wall"] for r, n in zip(runs[mode], runs["none"], strict=True)]
        share = per_save / (args.every * step_time)
        realistic = per_save / (args.realistic_minutes * 60)
        out[mode] = {
            "blocked_median": per_save,
            "blocked_max": max(blocked),
            "share": share,
            "share_realistic": realistic,
            "wall_ratio": wall,
        }
        rows.append(
            [
                mode,
                round(per_save * 1000, 1),
                round(max(blocked) * 1000, 1),
                f"{share:.2%}",
                f"{realistic:.4%}",
                f"{statistics.median(wall):.3f} ({min(wall):.3f}-{max(wall):.3f})",
            ]
        )
    out["table"] = markdown_table(
        [
            "save",
            "blocked ms (median)",
            "blocked ms (max)",
            f"share at 1 save / {args.every} steps",
            f"share at 1 save / {args.realistic_minutes} min",
            "wall x no checkpoints (min-max)",
        ],
        rows,
    )
    return out


# -------------------------------------------------------------------------- torchft
def ft_runs(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    lake = work / "ftlake"
    subprocess.run(
        [sys.executable, str(TRAIN_FT), "--make-lake", str(lake), "--rows", "6000"],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, **ENV}
    summaries = []
    for i in range(args.ft_runs):
        done = subprocess.run(
            [
                sys.executable,
                str(TRAIN_FT),
                "--demo",
                "--lake",
                str(lake),
                "--log-dir",
                str(work / f"ftlogs-{i}"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if done.returncode not in (0, 1):
            raise RuntimeError(
                f"train_ft --demo failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        summaries.append(json.loads(done.stdout.strip().splitlines()[-1]))
    kill = [s["kill_to_next_commit_seconds"] for s in summaries]
    join = [s["replacement_launch_to_taking_part_seconds"] for s in summaries]
    return {
        "summaries": summaries,
        "kill_to_next_commit": kill,
        "launch_to_taking_part": join,
        "exactly_once": all(s["exactly_once"] for s in summaries),
        "restarted": any(s["survivors_restarted"] for s in summaries),
    }


# ----------------------------------------------------------------------- loss curves
def _torchrun(work: Path, name: str, nproc: int, *args: str, kill: bool = False) -> list[dict]:
    logs = work / f"logs-{name}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr=127.0.0.1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={1 if kill else 0}",
        str(TRAIN_DDP),
        "--lake",
        str(work / "ddplake"),
        "--log-dir",
        str(logs),
        "--save-every",
        "10",
        *args,
    ]
    env = {**os.environ, **ENV}
    if kill:
        env.update(LL_KILL_RANK="1", LL_KILL_AT_STEP="33")
    subprocess.run(cmd, check=True, capture_output=True, env=env, timeout=900)
    out = []
    for path in sorted(logs.glob("*.jsonl")):
        attempt = int(path.stem.split("-attempt")[1])
        out += [{**json.loads(x), "attempt": attempt} for x in path.read_text().splitlines()]
    return out


def _losses(records: list[dict]) -> dict[int, float]:
    """Each step's loss (rank 0's record), the last attempt's where steps were replayed."""
    out: dict[int, tuple[int, float]] = {}
    for r in records:
        newer = r.get("step") not in out or r["attempt"] > out[r["step"]][0]
        if r["type"] == "step" and r["rank"] == 0 and newer:
            out[r["step"]] = (r["attempt"], float.fromhex(r["loss"]))
    return {s: v for s, (_, v) in sorted(out.items())}


def curves(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, str(TRAIN_DDP), "--make-lake", str(work / "ddplake"), "--rows", "8000"],
        check=True,
        capture_output=True,
    )
    out: dict[str, Any] = {}
    stop = 50
    for mode in ("ddp", "fsdp"):
        extra = ["--fsdp"] if mode == "fsdp" else []
        final = str(args.steps_curve)
        ref = _losses(
            _torchrun(
                work,
                f"{mode}-ref",
                3,
                "--ckpt",
                str(work / f"{mode}-ref"),
                "--max-steps",
                final,
                "--epochs",
                "9",
                *extra,
            )
        )
        ckpt = str(work / f"{mode}-faulted")
        faulted = _torchrun(
            work,
            f"{mode}-faulted",
            3,
            "--ckpt",
            ckpt,
            "--resume",
            "--max-steps",
            str(stop),
            "--epochs",
            "9",
            *extra,
            kill=True,
        )
        resized = _torchrun(
            work,
            f"{mode}-resized",
            2,
            "--ckpt",
            ckpt,
            "--resume",
            "--max-steps",
            final,
            "--batch-size",
            "24",
            "--epochs",
            "9",
            *extra,
        )
        before = _losses(faulted)
        after = _losses(resized)
        same = [s for s in before if before[s] == ref[s]]
        deviation = max(abs(after[s] - ref[s]) / abs(ref[s]) for s in after)
        out[mode] = {
            "reference": ref,
            "faulted": before,
            "resized": after,
            "bit_identical_steps": len(same),
            "steps_before_resize": len(before),
            "max_relative_deviation_after_resize": deviation,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--realistic-minutes", type=float, default=10.0)
    p.add_argument("--ft-runs", type=int, default=3)
    p.add_argument("--steps-curve", type=int, default=120)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.reps, args.ft_runs, args.steps_curve = 100, 50, 1, 1, 80
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {
            "overhead": overhead(args, work),
            "ft": ft_runs(args, work),
            "curves": curves(args, work),
        }
    result["machine"] = {**machine(), "loadavg_1min_before": round(before, 2)}
    result["args"] = vars(args)
    ok = result["ft"]["exactly_once"] and all(
        c["bit_identical_steps"] == c["steps_before_resize"] for c in result["curves"].values()
    )
    m = result["machine"]
    ft = result["ft"]
    md = [
        "# What faults cost (`python -m benchmarks.faults`)",
        "",
        f"lakeloader {m.get('commit', '?')}; {m['cpus']} cores; load average "
        f"{m['loadavg_1min_before']} before, {m['loadavg_1min']} after; torch {m.get('torch')}.",
        "",
        "## Checkpoint overhead (model 34 MB + AdamW, one process, local disk)",
        "",
        f"Step time without checkpoints: {result['overhead']['step_seconds'] * 1000:.1f} ms.",
        "",
        result["overhead"]["table"],
        "",
        "## A replica group's death (torchft, 3 groups, gloo on CPU)",
        "",
        markdown_table(
            [
                "run",
                "kill -> next committed step (s)",
                "replacement launch -> taking part (s)",
                "exactly once",
                "survivors restarted",
            ],
            [
                [
                    i + 1,
                    s["kill_to_next_commit_seconds"],
                    s["replacement_launch_to_taking_part_seconds"],
                    s["exactly_once"],
                    s["survivors_restarted"],
                ]
                for i, s in enumerate(ft["summaries"])
            ],
        ),
        "",
        "## Loss curve of a fault-injected run against a fault-free one",
        "",
        markdown_table(
            [
                "model",
                "steps before the resize bit-identical",
                "largest relative deviation after the resize (3 -> 2 ranks)",
            ],
            [
                [
                    mode,
                    f"{c['bit_identical_steps']} of {c['steps_before_resize']}",
                    f"{c['max_relative_deviation_after_resize']:.2e}",
                ]
                for mode, c in result["curves"].items()
            ],
        ),
    ]
    for c in result["curves"].values():
        for key in ("reference", "faulted", "resized"):
            c[key] = {str(k): v for k, v in c[key].items()}
    write_results("faults", result, "\n".join(md))
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
