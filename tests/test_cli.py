"""The ``lakeloader`` command: plan (table and JSON), errors, and the demo end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lakeloader.cli.main import main
from tests.conftest import LAYOUT, LAYOUT_ROWS


def test_plan_table(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(lake), "--world-size", "2", "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert f"rows               {LAYOUT_ROWS:,}" in out
    assert "global batch         32 = 2 ranks x 16" in out
    assert "file-0000.parquet" in out and "label" in out


def test_plan_json(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(lake), "--json", "--batch-size", "100", "--drop-last"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["lake"]["rows"] == LAYOUT_ROWS
    assert info["lake"]["files"] == len(LAYOUT)
    assert info["lake"]["empty_row_groups"] == 1
    assert info["epoch"]["steps"] == LAYOUT_ROWS // 100
    assert info["epoch"]["rows_dropped"] == LAYOUT_ROWS % 100
    assert info["schema"]["label"] == "int32"
    assert info["config"]["num_partitions"] == 16


def test_plan_of_a_missing_lake_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_end_to_end(tmp_path: Path) -> None:
    exe = shutil.which("lakeloader")
    assert exe, "the lakeloader console script is installed"
    result = subprocess.run(
        [exe, "demo", "--dir", str(tmp_path), "--rows", "8000", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["killed_at_step"] >= report["checkpoint_step"] > 0
    for epoch in report["epochs"]:
        assert epoch["exactly_once"] == epoch["rows"] == 8000
        assert epoch["missing"] == epoch["duplicated"] == 0
