"""The ``lakeloader`` command: plan (table and JSON) and its errors (the demo: test_demo.py)."""

from __future__ import annotations

import json
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
