"""``lakeloader audit`` reports a doubled run as one span, once, in ``--json`` and text.

Not twice when both the overlap of the committed steps and the head checkpoint's position show
it, nor in pieces when several steps were delivered again (the audit's own span lists, sorted
and merged, are proven over simulated runs in tests/test_audit.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import lakeloader as ll
from lakeloader.cli.audit import LOCATED
from lakeloader.cli.main import main as cli
from tests.conftest import double_a_step, layout_dataset


def _reported_once(ckpt_dir: str, capsys: pytest.CaptureFixture[str], doubled: range) -> None:
    """``lakeloader audit`` (exit 1) names ``doubled`` once, as the epoch's one doubled span.

    In ``--json`` and in text, with its first positions located in the lake once each.
    """
    assert cli(["audit", ckpt_dir, "--json"]) == 1
    (epoch,) = json.loads(capsys.readouterr().out)["epochs"]
    assert epoch["doubled"] == [[doubled.start, doubled.stop]] and epoch["missing"] == []
    first = [f"position {p}" for p in doubled[:LOCATED]]
    assert [where.split(":")[0] for where in epoch["located"]] == first
    assert cli(["audit", ckpt_dir]) == 1
    lines = capsys.readouterr().out.splitlines()
    errors = [x for x in lines if x.startswith("ERROR epoch") or x.startswith("  position ")]
    assert errors == [
        f"ERROR epoch 0: positions [{doubled.start}, {doubled.stop}) trained on twice",
        *(f"  {where}" for where in epoch["located"]),
    ]


def test_a_step_past_the_head_doubled_is_reported_once(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 5 steps of 40 rows, a checkpoint after step 4; the ledger then says step 5 (delivered
    # after the checkpoint) was committed as well as delivered again: the overlap of the steps
    # and the head's position (160, behind the history's 200) both show [160, 200)
    ckpt_dir = str(tmp_path / "ckpt")
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=40)
    with ll.CheckpointManager(ckpt_dir) as ckpt:
        for step, _ in enumerate(loader, 1):
            if step == 4:
                ckpt.save(step, loader)
            if step == 5:
                break
    loader.close()
    assert double_a_step(tmp_path / "ckpt", 0) == (160, 200)
    _reported_once(ckpt_dir, capsys, range(160, 200))


def test_steps_delivered_again_after_a_load_state_dict_are_one_doubled_span(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a checkpoint after step 3 (position 6 at batch 2); the next attempt resumes there,
    # delivers steps 4-8 (positions [6, 16)), then load_state_dict of the step-3 state takes
    # it back and it delivers them again: five doubled steps, one span [6, 16)
    ckpt_dir = str(tmp_path / "ckpt")
    with ll.CheckpointManager(ckpt_dir) as ckpt:
        first = ll.DataLoader(layout_dataset(own_lake), batch_size=2)
        it = iter(first)
        for _ in range(3):
            next(it)
        ckpt.save(3, first)
        at_3 = first.state_dict()
        first.close()
    with ll.CheckpointManager(ckpt_dir) as ckpt:
        second = ll.DataLoader(layout_dataset(own_lake), batch_size=2)
        ckpt.load(second)
        it = iter(second)
        for _ in range(5):
            next(it)
        second.load_state_dict(at_3)
        it = iter(second)
        for _ in range(5):
            next(it)
        ckpt.save(8, second)
        second.close()
    _reported_once(ckpt_dir, capsys, range(6, 16))
