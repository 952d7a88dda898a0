"""What a new user of the ``lakeloader`` command meets: one line per error, exit status 2.

A path that holds no checkpoint is said to be missing, empty, a file or a lake; ``--verbose``
goes before or after the subcommand; usage errors exit 2 everywhere; ``clean`` refuses a
folder that is not there; a damaged checkpoint is named once; a ledger whose segments are cut
short is told from no ledger; an unverified audit exits 3; every path printed for an object
store is the URL a user passes (``s3://``), against a real S3 server; and a store that does
not answer is given up after ``--retry-seconds``.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import lakeloader as ll
from lakeloader.cli.main import main

if TYPE_CHECKING:
    from tests.stores import ObjectStore

pytest_plugins = ["tests.stores"]
pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")

ROOT_HINT = "the checkpoints' root folder, the URL given to CheckpointManager"


def _save(ds: ll.LakeDataset, url: str, steps: int = 3, **options: Any) -> None:
    """Checkpoints of steps 1..``steps`` (batch 16) under ``url``."""
    loader = ll.DataLoader(ds, batch_size=16)
    batches = iter(loader)
    with ll.CheckpointManager(url, keep=steps, **options) as ckpt:
        for step in range(1, steps + 1):
            next(batches)
            ckpt.save(step, loader)
    loader.close()


def _error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The one line a failed command wrote (nothing on stdout)."""
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"lakeloader {command}: error: "), err
    return err.strip()


def _console(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it (its own logging and warnings)."""
    exe = shutil.which("lakeloader")
    assert exe, "the lakeloader console script is installed"
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.parametrize("command", ["inspect", "audit"])
def test_a_path_without_checkpoints_is_named_for_what_it_is(
    lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "empty").mkdir()
    parquet = next(lake.glob("*.parquet"))
    says = {
        tmp_path / "missing": f"no such folder: {tmp_path / 'missing'}; give {ROOT_HINT}",
        tmp_path / "empty": f"{tmp_path / 'empty'} is empty: no checkpoint was saved here",
        lake: f"{lake} is a lake (Parquet files), not a checkpoint folder: `lakeloader plan "
        f"{lake}` describes it",
        parquet: f"{parquet} is a file, not a folder: give {ROOT_HINT}",
    }
    for path, message in says.items():
        assert main([command, str(path)]) == 2, path
        assert message in _error(capsys, command)


def test_a_file_in_a_step_folder_names_the_root(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(dataset, str(tmp_path / "ckpt"), steps=1)
    commit = tmp_path / "ckpt" / "step-000000000001" / "COMMIT"
    assert main(["inspect", str(commit)]) == 2
    assert _error(capsys, "inspect").endswith(f"folders), here {tmp_path / 'ckpt'}")
    assert main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0


def test_verbose_goes_before_or_after_the_subcommand(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lakeloader.cli.parser import build_parser

    parser = build_parser()
    assert parser.parse_args(["inspect", "x", "--verbose"]).verbose is True
    assert parser.parse_args(["-v", "audit", "x"]).verbose is True
    assert parser.parse_args(["clean"]).verbose is False
    _save(dataset, str(tmp_path), steps=1)
    assert main(["inspect", str(tmp_path), "--verbose", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["plan", "L", "--storage-option", "x"], "--storage-option: expected KEY=VALUE, got 'x'"),
        (["inspect", "C", "--storage-option=k"], "--storage-option: expected KEY=VALUE, got 'k'"),
        (["audit", "C", "--retry-seconds", "-1"], "--retry-seconds: must be >= 0, got -1"),
        (["inspect", "C", "--step", "x"], "--step: expected an integer, got 'x'"),
        (["clean", "--nope"], "unrecognized arguments: --nope (see lakeloader clean --help)"),
        (["audit"], "the following arguments are required: checkpoint"),
    ],
)
def test_usage_errors_exit_2_in_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(args) == 2
    assert says in _error(capsys, args[0])


def test_clean_refuses_a_folder_that_is_not_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["clean", str(tmp_path / "nope")]) == 2
    assert f"no such folder: {tmp_path / 'nope'} (clean sweeps local folders" in _error(
        capsys, "clean"
    )
    (tmp_path / "f").write_text("")
    assert main(["clean", str(tmp_path), str(tmp_path / "f")]) == 2
    assert f"{tmp_path / 'f'} is a file" in _error(capsys, "clean")


def test_each_damaged_checkpoint_is_named_once(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    _save(dataset, str(tmp_path))
    states = [tmp_path / f"step-{s:012d}" / "state.msgpack" for s in (3, 2, 1)]
    states[0].write_bytes(states[0].read_bytes()[:10])
    for command in ("inspect", "audit"):
        ran = _console(command, str(tmp_path), "--json")
        assert ran.returncode == 0, ran.stderr
        prefix = f"lakeloader {command}: warning: damaged checkpoint passed over: "
        lines = ran.stderr.splitlines()
        assert len(lines) == 1, ran.stderr
        assert lines[0].startswith(f"{prefix}{states[0].parent}: state.msgpack is 10 bytes")
        info = json.loads(ran.stdout)
        assert info["skipped_damaged"] == [lines[0].removeprefix(prefix)]
        assert info.get("path", info.get("checkpoint")) == str(states[1].parent)
    for state in states[1:]:
        state.write_bytes(state.read_bytes()[:10])
    ran = _console("inspect", str(tmp_path))
    assert ran.returncode == 2 and len(ran.stderr.splitlines()) == 1, ran.stderr
    assert ran.stderr.startswith(
        f"lakeloader inspect: error: no usable checkpoint under {tmp_path}"
    )
    assert all(ran.stderr.count(str(s.parent)) == 1 for s in states), ran.stderr


def test_a_ledger_cut_short_is_told_from_no_ledger(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(dataset, str(tmp_path / "none"), steps=1, ledger=False)
    assert main(["audit", str(tmp_path / "none")]) == 2
    assert "no audit ledger under" in _error(capsys, "audit")
    _save(dataset, str(tmp_path / "cut"), steps=1)
    segments = sorted((tmp_path / "cut" / "ledger").rglob("*.jsonl"))
    assert segments
    for segment in segments:
        segment.write_bytes(segment.read_bytes().split(b"\n")[0][:-5])  # the first line, cut
    assert main(["audit", str(tmp_path / "cut")]) == 2
    err = _error(capsys, "audit")
    assert "holds no complete entry" in err and "no audit ledger" not in err
    assert all(f"{s}: its last line is incomplete" in err for s in segments), err
    for segment in segments:
        segment.write_bytes(b"")
    assert main(["audit", str(tmp_path / "cut")]) == 2
    err = _error(capsys, "audit")
    assert "are empty" in err and all(str(s) in err for s in segments), err


def test_an_unverified_audit_exits_3_and_says_why(
    dataset: ll.LakeDataset, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = ll.DataLoader(dataset, batch_size=16)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    state = first.state_dict()
    first.close()
    late = ll.DataLoader(dataset, batch_size=16)
    late.load_state_dict(state)  # not CheckpointManager.load: the ledger sees steps 4 and 5 only
    batches = iter(late)
    for _ in range(2):
        next(batches)
    with ll.CheckpointManager(str(tmp_path)) as ckpt:
        ckpt.save(5, late)
    late.close()
    assert main(["audit", str(tmp_path), "--json"]) == 3
    info = json.loads(capsys.readouterr().out)
    assert info["verdict"] == "unverified" and info["ok"]
    assert len(info["unverified"]) == 1 and "attached late" in info["unverified"][0]
    assert main(["audit", str(tmp_path)]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert f"UNVERIFIED {info['unverified'][0]}" in lines
    assert lines[-1].startswith("verdict: unverified: ")
    assert not any("NOT exactly once" in line for line in lines)


def test_printed_paths_are_the_urls_a_user_passes(
    s3_store: ObjectStore, lake: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket, lake_url = s3_store.upload(lake, "cli-urls")
    lake_url = lake_url.rstrip("/")
    options = [f"--storage-option={k}={v}" for k, v in s3_store.storage_options.items()]
    ckpt = s3_store.url(f"{bucket}/ckpt")
    ds = ll.LakeDataset(lake_url, storage_options=s3_store.storage_options)
    _save(ds, ckpt, steps=2, storage_options=s3_store.storage_options)
    assert main(["audit", ckpt, *options, "--json"]) == 0
    audited = json.loads(capsys.readouterr().out)["checkpoint"]
    assert audited == f"{ckpt}/step-000000000002"
    assert main(["inspect", audited, *options, "--json"]) == 0  # copied from audit
    info = json.loads(capsys.readouterr().out)
    assert info["path"] == audited and info["step"] == 2
    assert all(r["file"].startswith(lake_url) for r in info["ranks"])
    assert main(["inspect", ckpt, *options]) == 0
    assert f"checkpoint       {audited}\n" in capsys.readouterr().out
    assert main(["plan", lake_url, *options, "--json"]) == 0
    assert all(f["path"].startswith(lake_url) for f in json.loads(capsys.readouterr().out)["files"])
    assert main(["plan", f"{lake_url}-gone", *options]) == 2
    said = _error(capsys, "plan")
    assert f"{lake_url}-gone" in said and f" {bucket}/" not in said, said
    assert main(["inspect", f"{ckpt}/nothing", *options]) == 2
    assert f"no such folder: {ckpt}/nothing;" in _error(capsys, "inspect")
    assert main(["inspect", lake_url, *options]) == 2
    said = _error(capsys, "inspect")
    assert (
        f"is a lake (Parquet files), not a checkpoint folder: `lakeloader plan {lake_url}`" in said
    )


def test_a_store_that_does_not_answer_is_given_up_after_retry_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    url = "s3://nowhere/ckpt"
    options = [f"--storage-option=endpoint_url=http://127.0.0.1:{port}"]
    options += ["--storage-option=key=k", "--storage-option=secret=s"]
    started = time.monotonic()
    ran = _console("inspect", url, *options, "--retry-seconds", "1", timeout=60)
    elapsed = time.monotonic() - started
    assert ran.returncode == 2 and ran.stdout == ""
    assert len(ran.stderr.splitlines()) == 1, ran.stderr
    assert ran.stderr.startswith(f"lakeloader inspect: error: {url}: the store kept failing")
    assert "retry deadline 1 s" in ran.stderr and "--retry-seconds" in ran.stderr
    assert elapsed < 30, f"{elapsed:.1f} s: the default deadline is 30 s, botocore's own ~5 s"
