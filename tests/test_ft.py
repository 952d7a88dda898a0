"""Fault-tolerant training with torchft: real replica groups, a real SIGKILL, no restarts.

``examples/train_ft.py --demo`` runs a torchft Lighthouse (in its process, on loopback), three
replica groups of one process each (gloo on CPU), SIGKILLs group 1 after step 20 of the epoch,
and starts a replacement group once the survivors have committed a step on their own. The logs
are checked here from scratch: every row of the epoch is in exactly one committed share, the
survivors kept their processes and went on with two participants, and the replacement took
the position from its peers (its first step starts where theirs does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "examples" / "train_ft.py"
ROWS = 6000


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    work = tmp_path_factory.mktemp("ft")
    made = subprocess.run(
        [sys.executable, str(SCRIPT), "--make-lake", str(work / "lake"), "--rows", str(ROWS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--demo",
            "--lake",
            str(work / "lake"),
            "--log-dir",
            str(work / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "RUST_LOG": "warn"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    return summary, work / "logs"


def _env() -> dict[str, str]:
    import os

    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def test_a_group_killed_and_one_joining_leave_every_row_exactly_once(
    demo: tuple[dict[str, Any], Path],
) -> None:
    summary, logs = demo
    steps = {
        rid: [r for r in _records(logs / f"replica{rid}.jsonl") if r["type"] == "step"]
        for rid in "0123"
    }
    seen: Counter[int] = Counter()
    for rid in "0123":
        for r in steps[rid]:
            if r["committed"] and r["rank"] is not None:
                seen.update(r["ids"])
    assert sorted(seen) == list(range(ROWS)) and max(seen.values()) == 1
    # the positions of committed steps tile the epoch, one step per manager step count
    starts = {
        r["step"]: (r["position"], r["rows"]) for s in steps.values() for r in s if r["committed"]
    }
    position = 0
    for count in sorted(starts):
        assert starts[count][0] == position, f"step {count} starts at {starts[count][0]}"
        position += starts[count][1]
    assert position == ROWS
    # the kill: the survivors went on in the same processes, re-sliced for 2
    killed_at = max(r["step"] for r in steps["1"] if r["committed"])
    assert killed_at >= 20
    assert summary["survivors_restarted"] is False
    for rid in "02":
        starts_logged = [r for r in _records(logs / f"replica{rid}.jsonl") if r["type"] == "start"]
        assert len(starts_logged) == 1, "one process for the whole run"
        counts = {r["participants"] for r in steps[rid] if r["committed"]}
        assert counts == {3, 2}, counts
    # the replacement took its position from a peer and took part with 3
    first = next(r for r in steps["3"] if r["committed"])
    peers = {
        r["position"]
        for rid in "02"
        for r in steps[rid]
        if r["committed"] and r["step"] == first["step"]
    }
    assert peers == {first["position"]} and first["position"] > 0
    assert first["participants"] == 3 and first["rank"] is not None
    assert summary["exactly_once"] is True
    print(
        f"\ntorchft: group 1 SIGKILLed after step {killed_at}; the survivors' next commit "
        f"{summary['kill_to_next_commit_seconds']} s later, no restart; the replacement took "
        f"part from step {first['step']} at position {first['position']} "
        f"({summary['replacement_launch_to_taking_part_seconds']} s after its launch); "
        f"{ROWS} rows exactly once"
    )
