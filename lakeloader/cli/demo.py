"""``lakeloader demo``: generate a lake, train, crash for real, resume elsewhere, prove it.

A child process trains on 2 simulated ranks and is killed with SIGKILL part-way through the
first epoch; this process resumes from the last checkpoint on 3 ranks, trains the rest of two
epochs, and proves every row was trained on exactly once, from its step logs and the audit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lakeloader.checkpoint.manager import CheckpointManager
from lakeloader.cli.audit import run_audit
from lakeloader.cli.tables import format_pairs, record_table
from lakeloader.dataset import LakeDataset
from lakeloader.loader import DataLoader
from lakeloader.topology import Topology

FEATURES = [f"f{i}" for i in range(8)]
CLASSES = 4
EPOCHS = 2
#: Seconds the parent waits for the child to reach the crash step.
CHILD_DEADLINE = 300.0


#: How each phase runs (as rank 0 sees it; the demo simulates every rank in one process).
BEFORE = Topology(world_size=2, rank=0, num_workers=2, batch_size=64)
AFTER = Topology(world_size=3, rank=0, num_workers=1, batch_size=48)
SAVE_EVERY = 10


def write_demo_lake(root: Path, rows: int, seed: int = 0) -> int:
    """Write a hive-partitioned lake (``day=N/``) of uneven files and row groups."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(size=(len(FEATURES), CLASSES)).astype(np.float32)
    files = 16
    bounds = np.linspace(0, rows, files + 1).astype(int)
    for i in range(files):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        ids = np.arange(lo, hi, dtype=np.int64)
        x = rng.normal(size=(hi - lo, len(FEATURES))).astype(np.float32)
        table = pa.table(
            {
                "id": ids,
                **{f: x[:, j] for j, f in enumerate(FEATURES)},
                "label": (x @ weights).argmax(axis=1).astype(np.int64),
            }
        )
        folder = root / f"day={i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(
            table, folder / f"part-{i:03d}.parquet", row_group_size=int(rng.integers(700, 2500))
        )
    (root / "_SUCCESS").touch()
    return rows


def train(lake: Path, ckpt: Path, log: Path, topo: Topology) -> dict[str, Any]:
    """Train a linear classifier on simulated ranks; log row ids per step; checkpoint.

    It resumes from the newest checkpoint under ``ckpt`` if there is one, on any ``topo``.
    """
    torch.manual_seed(0)
    # Leave the cores to the loaders' workers (see README: torch's threads compete with them).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - topo.num_workers * topo.world_size))
    ds = LakeDataset(lake, columns=["id", *FEATURES, "label"], seed=0)
    loaders = [
        DataLoader(
            ds, topo.batch_size, num_workers=topo.num_workers, rank=r, world_size=topo.world_size
        )
        for r in range(topo.world_size)
    ]
    model = torch.nn.Linear(len(FEATURES), CLASSES)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step, losses = 0, []
    with CheckpointManager(str(ckpt)) as manager, log.open("ab") as out:
        if manager.latest() is not None:  # every simulated rank restores the same position
            step = manager.load(loaders[0], model=model, optimizer=optim)["step"]
            for loader in loaders[1:]:
                manager.load(loader)
        for _ in range(EPOCHS):
            for shares in zip(*loaders, strict=True):
                x = torch.cat([torch.stack([s[f] for f in FEATURES], 1) for s in shares])
                y = torch.cat([s["label"] for s in shares])
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optim.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optim.step()
                step += 1
                losses.append(loss.item())
                ids = torch.cat([s["id"] for s in shares]).tolist()
                out.write(msgpack.packb([loaders[0].epoch, step, ids]))
                out.flush()
                if step % SAVE_EVERY == 0:
                    manager.save(
                        step, loaders[0], model=model, optimizer=optim, extra={"step": step}
                    )
            if loaders[0].epoch >= EPOCHS - 1:
                break
    state_bytes = len(msgpack.packb(loaders[0].state_dict()))
    for loader in loaders:
        loader.close()
    return {"steps": step, "losses": losses, "state_bytes": state_bytes}


def _read_log(log: Path) -> list[tuple[int, int, list[int]]]:
    with log.open("rb") as fh:
        return [tuple(rec) for rec in msgpack.Unpacker(fh, raw=False)]


def _run_child(lake: Path, ckpt: Path, log: Path, crash_at: int) -> tuple[int, float]:
    """Start phase one in a child process and SIGKILL it once it passed ``crash_at``."""
    cmd = [sys.executable, "-m", "lakeloader.cli.demo", str(lake), str(ckpt), str(log)]
    errors = log.with_suffix(".stderr")
    with errors.open("wb") as err:
        child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    start = time.monotonic()
    while time.monotonic() - start < CHILD_DEADLINE:
        if child.poll() is not None:
            raise RuntimeError(
                f"the training child exited early ({child.returncode}):\n{errors.read_text()}"
            )
        if log.exists() and log.stat().st_size and _read_log(log)[-1][1] >= crash_at:
            child.send_signal(signal.SIGKILL)
            child.wait()
            return _read_log(log)[-1][1], time.monotonic() - start
        time.sleep(0.05)
    child.kill()
    raise RuntimeError(f"the training child did not reach step {crash_at} in {CHILD_DEADLINE} s")


def run_demo(
    directory: str | None, *, rows: int = 60_000, steps_before_crash: int | None = None
) -> dict[str, Any]:
    """Run the whole demo and return the report (``text`` for people, the rest for machines).

    Raises:
        ValueError: If ``steps_before_crash`` is not a step of the run before the crash.
    """
    steps_per_epoch = -(-rows // (BEFORE.world_size * BEFORE.batch_size))
    last = EPOCHS * steps_per_epoch
    crash_at = steps_before_crash or int(steps_per_epoch * 0.6)
    if not 1 <= crash_at < last:
        raise ValueError(
            f"--crash-at {crash_at} is not a step the training child reaches before its end: "
            f"it trains {EPOCHS} epochs of {steps_per_epoch} steps ({last} in all) on "
            f"{rows:,} rows; choose a step from 1 to {last - 1}"
        )
    work = Path(directory or tempfile.mkdtemp(prefix="lakeloader-demo-"))
    lake, ckpt, log = work / "lake", work / "checkpoints", work / "steps.msgpack"
    shutil.rmtree(ckpt, ignore_errors=True)
    log.unlink(missing_ok=True)
    write_demo_lake(lake, rows)
    killed_at, child_seconds = _run_child(lake, ckpt, log, crash_at)
    with CheckpointManager(str(ckpt), ledger=False) as manager:
        saved_step = manager.latest() or 0
    manifest_bytes = sum(p.stat().st_size for p in (ckpt / "manifests").glob("*"))
    t0 = time.monotonic()
    resumed = train(lake, ckpt, log, AFTER)
    records = _read_log(log)
    before = [r for r in records if r[1] <= killed_at][:killed_at]
    kept = [r for r in before if r[1] <= saved_step] + records[len(before) :]
    counts = [
        Counter(i for e, _, ids in kept if e == epoch for i in ids) for epoch in range(EPOCHS)
    ]
    per_epoch = [
        {
            "epoch": epoch,
            "rows": rows,
            "delivered": sum(c.values()),
            "exactly_once": sum(1 for v in c.values() if v == 1),
            "missing": rows - len(c),
            "duplicated": sum(1 for v in c.values() if v > 1),
        }
        for epoch, c in enumerate(counts)
    ]
    audited, _ = run_audit(str(ckpt), {})
    with CheckpointManager(str(ckpt), ledger=False) as manager:
        head = manager.load_checkpoint()
    ok = all(p["exactly_once"] == rows and p["missing"] == p["duplicated"] == 0 for p in per_epoch)
    report: dict[str, Any] = {
        "ok": ok and audited.verdict == "exactly once",
        "work_dir": str(work),
        "before": BEFORE.describe(),
        "after": AFTER.describe(),
        "killed_at_step": killed_at,
        "checkpoint_step": saved_step,
        "replayed_steps": killed_at - saved_step,
        "steps_total": resumed["steps"],
        "loss_first_after_resume": resumed["losses"][0],
        "loss_last": resumed["losses"][-1],
        "state_bytes": resumed["state_bytes"],
        "checkpoint_dir": str(ckpt),
        "checkpoint_bytes": sum(f.stat().st_size for f in Path(head.path).rglob("*")),
        "manifest_bytes": manifest_bytes,
        "audit": audited.verdict,
        "phase_one_seconds": round(child_seconds, 2),
        "phase_two_seconds": round(time.monotonic() - t0, 2),
        "epochs": per_epoch,
    }
    report["text"] = _render(report)
    return report


def _render(r: dict[str, Any]) -> str:
    head = format_pairs(
        [
            ("lake", f"{r['epochs'][0]['rows']:,} rows, 16 files in day=0..3/ ({r['work_dir']})"),
            ("before the crash", r["before"]),
            (
                "crash",
                f"SIGKILL at step {r['killed_at_step']}, checkpoint of step "
                f"{r['checkpoint_step']} ({r['replayed_steps']} steps replayed)",
            ),
            ("after the resume", r["after"]),
            ("steps in all", r["steps_total"]),
            (
                "loss",
                f"{r['loss_first_after_resume']:.3f} after the resume, "
                f"{r['loss_last']:.3f} at the end",
            ),
            ("loader state", f"{r['state_bytes']} bytes (msgpack)"),
            (
                "checkpoint",
                f"{r['checkpoint_bytes']:,} bytes (loader state, model, optimizer, random "
                f"generators, context), manifest {r['manifest_bytes']:,} bytes",
            ),
            ("inspect it", f"lakeloader inspect {r['checkpoint_dir']}"),
            ("audit it", f"lakeloader audit {r['checkpoint_dir']}  ({r['audit']})"),
            ("files", f"{r['work_dir']} is kept for that; remove it with rm -r when done"),
        ]
    )
    keys = ["epoch", "rows", "delivered", "exactly_once", "missing", "duplicated"]
    table = record_table(r["epochs"], keys)
    verdict = (
        "every row of every epoch was trained on exactly once, by the step logs and the audit"
        if r["ok"]
        else f"FAILED: rows were lost or repeated (audit: {r['audit']})"
    )
    return f"{head}\n\n{table}\n\n{verdict}"


if __name__ == "__main__":  # the training child: python -m lakeloader.cli.demo LAKE CKPT LOG
    lake, ckpt, log = map(Path, sys.argv[1:4])
    train(lake, ckpt, log, BEFORE)
