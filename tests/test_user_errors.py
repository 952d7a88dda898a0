"""What a new user trips on gets a message that names both sides and where (issue 18).

Wrong credentials against a real S3 server, nulls in an integer column, a required column that
some files lack, and the command line's argument checks, each with the names its message must
contain; and ``lakeloader clean`` sweeping the shared memory of a killed process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]


def test_wrong_and_missing_credentials_name_the_url(
    s3_store: ObjectStore, lake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = s3_store.upload(lake, "creds")
    wrong = {**s3_store.storage_options, "secret": "not-the-secret"}
    with pytest.raises(ll.StoreAccessError, match="refused access") as err:
        ll.LakeDataset(url, storage_options=wrong)
    assert url.rstrip("/").split("://")[-1] in str(err.value) and "storage_options" in str(
        err.value
    )
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    none = {k: v for k, v in s3_store.storage_options.items() if k not in ("key", "secret")}
    with pytest.raises(ll.StoreAccessError, match="NoCredentialsError"):
        ll.LakeDataset(url, storage_options=none)


def test_the_cli_reports_refused_access_in_one_line(
    s3_store: ObjectStore, lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = s3_store.upload(lake, "cli-creds")
    options = [f"--storage-option={k}={v}" for k, v in s3_store.storage_options.items()]
    options = [o if not o.startswith("--storage-option=secret=") else o + "x" for o in options]
    assert main(["plan", url, *options]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lakeloader plan: error:") and "refused access" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_nulls_in_an_integer_column_name_the_file_and_row_group(tmp_path: Path) -> None:
    ids = pa.array(np.arange(20), pa.int64())
    counts = pa.array([1] * 10 + [None] + [1] * 9, pa.int32())
    pq.write_table(pa.table({"id": ids, "n": counts}), tmp_path / "a.parquet", row_group_size=10)
    loader = ll.DataLoader(ll.LakeDataset(tmp_path, shuffle=False), batch_size=20)
    with pytest.raises(ll.NullValuesError) as err:
        next(iter(loader))
    message = str(err.value)
    assert "'n'" in message and "a.parquet, row group 1, rows [0, 10)" in message
    loader.close()


def test_a_missing_required_column_names_the_file_that_requires_it(tmp_path: Path) -> None:
    required = pa.schema([pa.field("id", pa.int64()), pa.field("y", pa.int64(), nullable=False)])
    pq.write_table(pa.table({"id": [1], "y": [2]}, schema=required), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [3]}), tmp_path / "b.parquet")
    with pytest.raises(ll.SchemaMismatchError) as err:
        ll.LakeDataset(tmp_path)
    message = str(err.value)
    assert "required (not nullable) in" in message and "a.parquet" in message
    assert "b.parquet" in message


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
        (["--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
        (["--batch-size", "x"], "argument --batch-size: expected an integer, got 'x'"),
        (["--columns", "idd"], "column 'idd' is not in the lake"),
    ],
)
def test_plan_refuses_nonsense_in_one_line(
    lake: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["plan", str(lake), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("lakeloader plan: error:") and says in err
    assert "Traceback" not in err


def test_version_and_help_with_defaults_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lakeloader {ll.__version__}"
    for command in ("plan", "inspect", "clean", "demo"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "example" in out and "(default:" in out, command


def test_clean_removes_the_shared_memory_of_dead_processes_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    left = tmp_path / f"lakeloader-{pid}-abc"
    left.mkdir()
    (left / "arena.rows").write_bytes(b"x" * 10_000)
    mine = tmp_path / f"lakeloader-{os.getpid()}-def"
    mine.mkdir()
    assert main(["clean", str(tmp_path), "--json"]) == 0
    assert str(left) in capsys.readouterr().out
    assert not left.exists() and mine.exists(), "a live process's folder stays"
    assert main(["clean", str(tmp_path)]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_the_readme_example_warns_of_nothing(lake: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", ll.CpuContentionWarning)  # on a machine of few cores
        ds = ll.LakeDataset(lake, columns=["x", "label", "id"], seed=0)
        loader = ll.DataLoader(ds, batch_size=256, num_workers=4)
        for _ in range(2):
            for batch in loader:
                assert set(batch) == {"x", "label", "id"}
                state = loader.state_dict()
        loader = ll.DataLoader(ds, batch_size=128, num_workers=2)
        loader.load_state_dict(state)
        assert sum(len(b["id"]) for b in loader) > 0
        loader.close()


def test_a_one_time_hint_when_torch_threads_and_workers_exceed_the_cores(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from lakeloader import loader_args

    loader_args._warn_cpu_contention.cache_clear()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with pytest.warns(ll.CpuContentionWarning) as record:
        for _ in range(2):
            loader = ll.DataLoader(dataset, batch_size=64, num_workers=1)
            next(iter(loader))
            loader.close()
    hints = [str(w.message) for w in record if "intra-op threads" in str(w.message)]
    assert len(hints) == 1 and "torch.set_num_threads(1)" in hints[0]
    loader_args._warn_cpu_contention.cache_clear()
