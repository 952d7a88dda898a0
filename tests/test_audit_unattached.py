"""The audit of training loops that never call ``attach`` (issue: false alarms on correct runs).

A loop written from the README's snippet trains in a child process, is SIGKILLed after a
checkpoint, and is resumed at another batch size: its own step logs say every row once, and
the audit must agree (exit 0). Loops that really double or lose rows fail it (exit 1); one
whose history the ledger could not see is *unverified* (exit 3), never "NOT exactly once".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest

import lakeloader as ll
from lakeloader.cli.audit import run_audit
from lakeloader.cli.main import main as cli
from tests.conftest import LAYOUT_ROWS, ROOT, layout_dataset

EPOCHS = 2


def _child(own_lake: Path, tmp_path: Path, batch: int, *extra: str) -> list[str]:
    ckpt, log = tmp_path / "ckpt", tmp_path / "steps.msgpack"
    return [
        sys.executable,
        "-m",
        "tests.audit_child",
        str(own_lake),
        str(ckpt),
        str(log),
        str(batch),
        str(EPOCHS),
        *extra,
    ]


def _log(tmp_path: Path) -> list[list]:
    path = tmp_path / "steps.msgpack"
    if not path.exists():
        return []
    with path.open("rb") as fh:
        return list(msgpack.Unpacker(fh, raw=False))


def _crash_then_resume(own_lake: Path, tmp_path: Path, mistake: str = "") -> dict[int, Counter]:
    """Train at batch 32 until SIGKILLed past step 8; resume at batch 20 to the end.

    Returns, per epoch, how often each id was trained in the committed history by the loop's
    own logs (the steps after the checkpoint the resume started from are dropped).
    """
    env = {**os.environ, "AUDIT_CHILD_HOLD": "8"}
    child = subprocess.Popen(_child(own_lake, tmp_path, 32), cwd=ROOT, env=env)
    deadline = time.monotonic() + 120
    while not (records := _log(tmp_path)) or records[-1][1] < 8:
        assert child.poll() is None and time.monotonic() < deadline, "the child stopped early"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    killed = _log(tmp_path)
    saved = ll.CheckpointManager(str(tmp_path / "ckpt"), ledger=False).latest()
    assert (saved, len(killed)) == (6, 8), "a checkpoint, then steps after it"
    done = subprocess.run(_child(own_lake, tmp_path, 20, mistake), cwd=ROOT, timeout=120)
    assert done.returncode == 0
    records = _log(tmp_path)
    kept = [r for r in records[: len(killed)] if r[1] <= saved] + records[len(killed) :]
    counts: dict[int, Counter] = {e: Counter() for e in range(EPOCHS)}
    for epoch, _, ids in kept:
        counts[epoch].update(ids)
    return counts


def test_a_readme_loop_without_attach_passes_after_a_crash_and_a_resize(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = _crash_then_resume(own_lake, tmp_path)
    for epoch in range(EPOCHS):  # the loop's own evidence: every row once
        assert sorted(counts[epoch]) == list(range(LAYOUT_ROWS))
        assert set(counts[epoch].values()) == {1}
    assert cli(["audit", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and not info["problems"] and not info["unverified"]
    assert all(e["trained"] == LAYOUT_ROWS and e["complete"] for e in info["epochs"])
    topologies = [tuple(t) for t in info["epochs"][0]["topologies"]]
    assert topologies == [(1, 32), (1, 20)], "both attempts recorded, the first from step 1"


@pytest.mark.parametrize("mistake, found", [("double", "doubled"), ("lose", "missing")])
def test_a_loop_that_really_doubles_or_loses_rows_fails_the_audit(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mistake: str, found: str
) -> None:
    counts = _crash_then_resume(own_lake, tmp_path, mistake)
    if found == "doubled":
        assert max(counts[0].values()) == 2, "the loop's own logs show the doubled step"
    else:
        assert len(counts[0]) < LAYOUT_ROWS, "the loop's own logs show the lost rows"
    assert cli(["audit", str(tmp_path / "ckpt"), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert not info["ok"]
    assert any(e[found] for e in info["epochs"]), info["epochs"]


def test_a_history_the_ledger_did_not_see_is_unverified(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = _crash_then_resume(own_lake, tmp_path, "unrecorded")
    assert set(counts[0].values()) == {1} and len(counts[0]) == LAYOUT_ROWS
    report, _ = run_audit(str(tmp_path / "ckpt"), {})
    assert report.ok and report.verdict == "unverified", report
    assert report.epochs[0].unrecorded and report.epochs[0].unrecorded[0].start == 0
    assert any("attached late" in line for line in report.unverified), report.unverified
    assert cli(["audit", str(tmp_path / "ckpt")]) == 3
    text = capsys.readouterr().out
    assert "unverified" in text and "NOT exactly once" not in text


def test_steps_delivered_before_the_first_save_are_recorded(tmp_path: Path, own_lake: Path) -> None:
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=40)
    with ll.CheckpointManager(str(tmp_path / "ckpt")) as ckpt:
        for step, _ in enumerate(loader, 1):
            if step == 7:
                ckpt.save(step, loader)  # no attach: the ledger takes the loader's journal
    report, _ = run_audit(str(tmp_path / "ckpt"), {})
    assert report.verdict == "exactly once", report
    assert report.chain[0].steps == 7 and report.epochs[0].trained == 7 * 40
    assert report.epochs[0].uncommitted, "the steps after the save are delivered, not committed"
