"""``examples/pretrain_packed.py`` under torchrun: packed streams through a SIGKILLed rank, a
restart of the group, and a resume on fewer ranks.

4 ranks; rank 2 SIGKILLs itself after step 7 of attempt 0; torchrun restarts the group, which
resumes from the checkpoint of step 5 and stops at step 20; then 2 ranks continue from the same
folder to step 36. From the per-rank logs, each partition's samples (rank ``r`` of ``W`` reads
partitions ``[r * 4 / W, (r + 1) * 4 / W)``, 2 samples each per step, partition-major) equal
those of an uninterrupted single-process run: every token of every row exactly once per epoch,
in order, across the kill, the restart and the resize.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import lakeloader as ll
from tests.conftest import TORCHRUN_ENV, torchrun_command

pytestmark = pytest.mark.slow  # torchrun runs: not in the quick tier

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "pretrain_packed.py"
KILL_RANK, KILL_STEP, FIRST_STOP, LAST_STOP = 2, 7, 20, 36
TIMEOUT = 240.0


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pretrain_packed", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPT.parent))
    spec.loader.exec_module(module)
    return module


def launch(work: Path, name: str, nproc: int, kill: bool) -> Path:
    """Run the example under torchrun (loopback only); SIGKILL any rank left behind."""
    logs = work / f"logs-{name}"
    steps = FIRST_STOP if kill else LAST_STOP
    cmd = torchrun_command(
        nproc, SCRIPT, "--lake", str(work / "lake"), "--ckpt", str(work / "ckpt"),
        "--log-dir", str(logs), "--steps", str(steps), "--resume", max_restarts=1,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LL_KILL_")}
    env.update(TORCHRUN_ENV)
    if kill:
        env.update(LL_KILL_RANK=str(KILL_RANK), LL_KILL_AT_STEP=str(KILL_STEP))
    out = work / f"{name}.out"
    with out.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            code = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        finally:
            for record in records(logs, "start"):
                try:
                    if SCRIPT.name.encode() in Path(f"/proc/{record['pid']}/cmdline").read_bytes():
                        os.kill(record["pid"], signal.SIGKILL)
                except OSError:
                    pass
    if code != 0:
        pytest.fail(
            f"torchrun {name} ended with {code}:\n{out.read_text(errors='replace')[-5000:]}"
        )
    return logs


def records(logs: Path, kind: str, attempt: int | None = None) -> list[dict[str, Any]]:
    out = []
    for path in sorted(logs.glob("rank*-attempt*.jsonl")):
        with path.open(encoding="utf-8") as fh:
            out += [r for r in map(json.loads, fh) if r["type"] == kind]
    return [r for r in out if attempt is None or r["attempt"] == attempt]


def partitions_of(rank: int, world: int) -> list[int]:
    per = 4 // world
    return list(range(rank * per, (rank + 1) * per))


def test_kill_restart_and_resize_deliver_every_token_once(tmp_path: Path) -> None:
    module = example()
    module.make_lake(tmp_path / "lake", 1200)
    first = launch(tmp_path, "four", 4, kill=True)
    assert [(r["rank"], r["step"]) for r in records(first, "kill")] == [(KILL_RANK, KILL_STEP)]
    resumed = {r["step"] for r in records(first, "resume", attempt=1)}
    assert resumed == {5}, "the restarted group resumed from the save of step 5"
    second = launch(tmp_path, "two", 2, kill=False)
    assert {r["step"] for r in records(second, "resume")} == {FIRST_STOP}
    assert sorted(r["step"] for r in records(second, "end")) == [LAST_STOP] * 2

    # Each partition's samples, step by step, from what was kept of each attempt.
    streams: dict[int, dict[int, list[list[int]]]] = {p: {} for p in range(4)}
    segments = [(first, 0, 4, 5), (first, 1, 4, FIRST_STOP), (second, 0, 2, LAST_STOP)]
    for logs, attempt, world, last in segments:
        for r in records(logs, "step", attempt):
            if r["step"] > last:
                continue  # replayed by the next attempt, which resumed before it
            samples = r["input_ids"]
            k = len(samples) // len(partitions_of(r["rank"], world))
            for i, p in enumerate(partitions_of(r["rank"], world)):
                streams[p][r["step"]] = samples[i * k : (i + 1) * k]

    reference = ll.DataLoader(module.dataset(tmp_path / "lake"), batch_size=8)
    expected: dict[int, list[list[int]]] = {p: [] for p in range(4)}
    for _, batch in zip(range(LAST_STOP), reference, strict=False):
        for p in range(4):
            expected[p] += batch["input_ids"][p * 2 : (p + 1) * 2].tolist()
    reference.close()
    for p in range(4):
        assert sorted(streams[p]) == list(range(1, LAST_STOP + 1)), f"partition {p}: steps"
        got = [s for step in sorted(streams[p]) for s in streams[p][step]]
        assert got == expected[p], f"partition {p}"
    tokens = np.array([t for p in range(4) for s in expected[p] for t in s])
    assert (np.bincount(tokens[tokens > 0]) <= 1).all(), "within the first epoch: each token once"
