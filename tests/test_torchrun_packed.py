"""``examples/pretrain_packed.py`` under torchrun: packed streams through a SIGKILLed rank, a
restart of the group, and the job continued on 3 ranks after 4.

4 ranks; rank 2 SIGKILLs itself after step 7 of attempt 0; torchrun restarts the group, which
resumes from the checkpoint of step 5 and stops at step 20; then 3 ranks (a world size that
does not divide the 4 partitions) continue from the same folder to step 36. From the per-rank
logs, each global step's samples (the ranks' batches laid end to end) equal those of an
uninterrupted single-process run: every token of every row exactly once per epoch, across the
kill, the restart and the resize.
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


def test_kill_restart_and_resize_deliver_every_token_once(tmp_path: Path) -> None:
    module = example()
    module.make_lake(tmp_path / "lake", 1200)
    first = launch(tmp_path, "four", 4, kill=True)
    assert [(r["rank"], r["step"]) for r in records(first, "kill")] == [(KILL_RANK, KILL_STEP)]
    resumed = {r["step"] for r in records(first, "resume", attempt=1)}
    assert resumed == {5}, "the restarted group resumed from the save of step 5"
    second = launch(tmp_path, "three", 3, kill=False)
    assert {r["step"] for r in records(second, "resume")} == {FIRST_STOP}
    assert sorted(r["step"] for r in records(second, "end")) == [LAST_STOP] * 3

    # Each global step's samples, from what was kept of each attempt: ranks in order.
    steps: dict[int, dict[int, list[list[int]]]] = {}
    segments = [(first, 0, 5), (first, 1, FIRST_STOP), (second, 0, LAST_STOP)]
    for logs, attempt, last in segments:
        for r in records(logs, "step", attempt):
            if r["step"] <= last:  # later ones were replayed by the next attempt
                steps.setdefault(r["step"], {})[r["rank"]] = r["input_ids"]
    assert sorted(steps) == list(range(1, LAST_STOP + 1))
    got = [s for t in sorted(steps) for rank in sorted(steps[t]) for s in steps[t][rank]]

    reference = ll.DataLoader(module.dataset(tmp_path / "lake"), batch_size=24)
    expected = [
        s
        for _, b in zip(range(LAST_STOP), reference, strict=False)
        for s in b["input_ids"].tolist()
    ]
    reference.close()
    assert got == expected
    tokens = np.array([t for s in expected for t in s])
    assert (np.bincount(tokens[tokens > 0]) <= 2).all(), (
        "within two epochs: each token twice at most"
    )
