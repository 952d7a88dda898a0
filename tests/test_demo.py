"""``lakeloader demo``: its run passes its own audit, and a crash step past its end is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lakeloader.cli.main import main


def test_the_demo_passes_its_own_audit(tmp_path: Path) -> None:
    exe = shutil.which("lakeloader")
    assert exe, "the lakeloader console script is installed"
    demo = subprocess.run(
        [exe, "demo", "--dir", str(tmp_path), "--rows", "8000", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert demo.returncode == 0, demo.stderr
    report = json.loads(demo.stdout)
    assert report["ok"] is True and report["audit"] == "exactly once"
    assert report["killed_at_step"] >= report["checkpoint_step"] > 0
    for epoch in report["epochs"]:
        assert epoch["exactly_once"] == epoch["rows"] == 8000
        assert epoch["missing"] == epoch["duplicated"] == 0
    text = subprocess.run(
        [exe, "demo", "--dir", str(tmp_path / "again"), "--rows", "3000"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    audit_line = next(line for line in text.splitlines() if line.startswith("audit it"))
    command = audit_line.split(None, 2)[2].split("  (")[0]  # "lakeloader audit <folder>"
    assert command == f"lakeloader audit {tmp_path / 'again' / 'checkpoints'}"
    audited = subprocess.run(
        [exe, *command.split()[1:]], capture_output=True, text=True, timeout=60, check=False
    )
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert "verdict: every row exactly once" in audited.stdout
    kept = sorted((tmp_path / "checkpoints").glob("step-*"))
    assert kept and all(any((k / "weights").iterdir()) for k in kept), "model and optimizer"


def test_a_crash_step_past_the_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--dir", str(tmp_path), "--rows", "1000", "--crash-at", "500"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--crash-at 500" in err and "choose a step from 1 to 15" in err
    assert not (tmp_path / "lake").exists(), "refused before any work"
