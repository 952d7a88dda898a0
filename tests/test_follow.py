"""Follow mode: a growing folder or Delta table read increment by increment, exactly once.

Files and table versions are appended while the loader runs; a training process is killed
with SIGKILL part-way and resumed on another world size; compactions and deletes of data
already delivered deliver nothing twice.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

import lakeloader as ll
from tests.conftest import (
    TORCHRUN_ENV,
    checkpointed,
    global_batches,
    make_loaders,
    torchrun_command,
    wait_dead,
)

FAST = ll.Follow(poll_interval=0.02, timeout=0.2)
ORDER: dict[str, Any] = {"seed": 2, "num_partitions": 4, "window": 16}


def _ids_while(writer: Callable[[], None], loader: Any, count: int) -> list[int]:
    """The first ``count`` ids a followed loader delivers while ``writer`` appends in a thread."""
    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    for batch in loader:
        seen += batch["id"].tolist()
        if len(seen) >= count:
            break
    thread.join()
    loader.close()
    return seen


def _append(root: Path, first: int, rows: int, name: str | None = None) -> None:
    """A new file of ids ``first ..`` written whole (renamed into place), newest mtime."""
    ids = np.arange(first, first + rows, dtype=np.int64)
    path = root / (name or f"part-{first:06d}.parquet")
    tmp = root / f".{path.name}.tmp"
    pq.write_table(pa.table({"id": ids, "x": ids * 2.0}), tmp, row_group_size=20)
    os.replace(tmp, path)
    stamp = time.time() + first * 1e-3  # distinct and increasing, whatever the clock's grain
    os.utime(path, (stamp, stamp))


def _ids(loader: ll.DataLoader) -> list[int]:
    return [i for b in loader for i in b["id"].tolist()]


def test_a_folder_is_followed_increment_by_increment(tmp_path: Path) -> None:
    _append(tmp_path, 0, 100)
    _append(tmp_path, 100, 60)
    loader = ll.DataLoader(ll.LakeDataset(tmp_path, follow=FAST, **ORDER), batch_size=16)
    with pytest.raises(TypeError, match="endless"):
        len(loader)
    assert sorted(_ids(loader)) == list(range(160)), "increment 0, then caught up"
    assert _ids(loader) == [], "nothing new"
    decoded = loader.stats()["units_decoded"]
    _append(tmp_path, 160, 50)
    assert sorted(_ids(loader)) == list(range(160, 210)), "only what was appended"
    assert loader.epoch == 1 and loader.dataset.snapshot.increment is not None
    assert loader.stats()["units_decoded"] >= decoded + 3, "increment 0's reads still count"
    loader.close()


def test_files_appended_while_the_loader_waits_are_taken_in(tmp_path: Path) -> None:
    _append(tmp_path, 0, 40)
    follow = ll.Follow(poll_interval=0.02, timeout=3)
    loader = ll.DataLoader(ll.LakeDataset(tmp_path, follow=follow, **ORDER), batch_size=8)

    def writer() -> None:
        for k in range(1, 4):
            time.sleep(0.3)
            _append(tmp_path, 40 * k, 40)

    seen = _ids_while(writer, loader, 160)
    assert sorted(seen) == list(range(160))


def test_a_sigkill_and_a_resume_on_two_ranks_deliver_every_appended_row_once(
    tmp_path: Path,
) -> None:
    lake, ckpt, log = tmp_path / "lake", tmp_path / "ckpt", tmp_path / "steps.jsonl"
    lake.mkdir()
    _append(lake, 0, 120)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.follow_child", str(lake), str(ckpt), str(log)],
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        deadline = time.monotonic() + 60
        while not log.exists() or len(log.read_text().splitlines()) < 15:
            assert time.monotonic() < deadline and child.poll() is None, "the child stalled"
            time.sleep(0.05)
        _append(lake, 120, 80)  # while it trains
        while len(log.read_text().splitlines()) < 22:
            assert time.monotonic() < deadline and child.poll() is None, "the child stalled"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        wait_dead(child.pid)
    finally:
        child.kill()
        child.wait()
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    manager = ll.CheckpointManager(str(ckpt))
    saved = manager.latest()
    assert saved is not None and saved >= 20, "a checkpoint inside the second increment"
    committed = [i for s in steps if s["step"] <= saved for i in s["ids"]]
    assert len(steps) > saved, "steps after the checkpoint were lost with the process"
    _append(lake, 200, 70)  # after the crash, before the resume
    loaders = make_loaders(
        ll.LakeDataset(
            lake, follow=ll.Follow(poll_interval=0.02, timeout=0.5), seed=1, num_partitions=4
        ),
        2,
        batch_size=4,
    )
    for loader in loaders:
        manager.load(loader)
    rest = [i for b in global_batches(loaders) for i in b]
    for loader in loaders:
        loader.close()
    assert sorted(committed + rest) == list(range(270)), "every appended row exactly once"


@pytest.fixture
def table(tmp_path: Path) -> str:
    uri = str(tmp_path / "table")
    ids = np.arange(100, dtype=np.int64)
    write_deltalake(uri, pa.table({"id": ids, "p": ids % 2}), partition_by=["p"])
    return uri


def _delta_append(uri: str, first: int, rows: int) -> None:
    ids = np.arange(first, first + rows, dtype=np.int64)
    write_deltalake(uri, pa.table({"id": ids, "p": ids % 2}), mode="append")


def test_a_delta_table_is_followed_and_compaction_delivers_nothing_twice(
    table: str, caplog: pytest.LogCaptureFixture
) -> None:
    loader = ll.DataLoader(ll.LakeDataset.from_delta(table, follow=FAST, **ORDER), batch_size=10)
    assert sorted(_ids(loader)) == list(range(100))
    _delta_append(table, 100, 30)
    _delta_append(table, 130, 30)
    assert sorted(_ids(loader)) == list(range(100, 160)), "two versions: two increments"
    assert loader.epoch == 2
    DeltaTable(table).optimize.compact()
    assert _ids(loader) == [], "a compaction appends nothing"
    _delta_append(table, 160, 20)
    DeltaTable(table).delete("id < 10")
    with caplog.at_level("WARNING", logger="lakeloader"):
        assert sorted(_ids(loader)) == list(range(160, 180)), "the delete's rewrite left out"
    assert "(DELETE) rewrites data: left out" in caplog.text
    loader.close()


def test_inspect_says_when_it_stopped_counting_the_lag(
    table: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lakeloader.cli import inspect_follow
    from lakeloader.cli.main import main as cli_main

    loader = ll.DataLoader(ll.LakeDataset.from_delta(table, follow=FAST, **ORDER), batch_size=10)
    next(iter(loader))
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(1, loader)
    loader.close()
    for k in range(3):  # three versions: three increments after the checkpoint's
        _delta_append(table, 100 + 10 * k, 10)
    monkeypatch.setattr(inspect_follow, "MAX_LAG_INCREMENTS", 2)
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "in 2+ increments appended after this one" in capsys.readouterr().out
    monkeypatch.setattr(inspect_follow, "MAX_LAG_INCREMENTS", 3)  # all of them: exact
    assert cli_main(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    lag = json.loads(capsys.readouterr().out)["lake_details"]["increment"]["lag"]
    assert lag == {"increments": 3, "files": 6, "rows": 30, "capped": False}


def test_a_rewrite_is_refused_under_on_rewrite_error(table: str) -> None:
    follow = ll.Follow(poll_interval=0.02, timeout=0.2, on_rewrite="error")
    loader = ll.DataLoader(ll.LakeDataset.from_delta(table, follow=follow), batch_size=10)
    assert len(_ids(loader)) == 100
    DeltaTable(table).delete("id < 10")
    with pytest.raises(ll.LakeChangedError, match=r"version 1 \(DELETE\) rewrites data"):
        _ids(loader)
    loader.close()


def test_a_followed_delta_table_resumes_on_another_world_size(table: str, tmp_path: Path) -> None:
    _delta_append(table, 100, 60)
    ds = ll.LakeDataset.from_delta(table, follow=FAST, **ORDER)
    seen = checkpointed(ds, 2, 4, 6, tmp_path / "ckpt")
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    _delta_append(table, 160, 40)
    loaders = make_loaders(ll.LakeDataset.from_delta(table, follow=FAST, **ORDER), 3, batch_size=4)
    for loader in loaders:
        manager.load(loader)
    rest = [i for b in global_batches(loaders) for i in b]
    for loader in loaders:
        loader.close()
    assert sorted(seen + rest) == list(range(200))


def test_inspect_shows_the_increment_and_the_lag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lakeloader.cli.main import main as cli_main

    lake = tmp_path / "lake"
    lake.mkdir()
    _append(lake, 0, 40)
    loader = ll.DataLoader(ll.LakeDataset(lake, follow=FAST, **ORDER), batch_size=8)
    assert len(_ids(loader)) == 40
    _append(lake, 40, 24)
    batches = iter(loader)
    next(batches)  # one step into increment 1
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(6, loader)
    loader.close()
    _append(lake, 64, 30)
    _append(lake, 94, 6)
    assert cli_main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "increment" in out and "1 (1 consumed before it)" in out
    assert "2 files, 36 rows in 1 increments appended after this one" in out
    assert cli_main(["inspect", str(tmp_path / "ckpt"), "--json", "--no-lag"]) == 0
    details = json.loads(capsys.readouterr().out)["lake_details"]
    assert details["increment"]["index"] == 1 and details["increment"]["lag"] is None


def test_ranks_under_torchrun_take_the_same_increments(tmp_path: Path) -> None:
    lake, logs = tmp_path / "lake", tmp_path / "logs"
    lake.mkdir()
    logs.mkdir()
    _append(lake, 0, 48)
    cmd = torchrun_command(2, Path(__file__).with_name("follow_ranks.py"), str(lake), str(logs))
    env = {**os.environ, **TORCHRUN_ENV}
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (logs / "rank1.jsonl").exists() or not (logs / "rank1.jsonl").read_text():
            assert time.monotonic() < deadline and run.poll() is None, "the ranks did not start"
            time.sleep(0.05)
        first = 48
        for k in range(1, 5):  # files land while the ranks train and wait
            time.sleep(0.4)
            _append(lake, first, 24 + 8 * k)
            first += 24 + 8 * k
        output, _ = run.communicate(timeout=120)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 0, output.decode(errors="replace")[-3000:]
    records = {
        r: [json.loads(x) for x in (logs / f"rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    }
    assert len(records[0]) == len(records[1]), "the ranks took the same steps"
    every = [i for r in (0, 1) for rec in records[r] for i in rec["ids"]]
    total = 48 + sum(24 + 8 * k for k in range(1, 5))
    assert sorted(every) == list(range(total)), "every appended row exactly once"
    epochs = [[rec["epoch"] for rec in records[r]] for r in (0, 1)]
    assert epochs[0] == epochs[1] and epochs[0][-1] >= 1, "the same increments, in step"


def test_an_iceberg_table_is_followed_snapshot_by_snapshot(tmp_path: Path) -> None:
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog(
        "default", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh"
    )
    catalog.create_namespace("ns")
    schema = pa.schema([pa.field("id", pa.int64())])
    table = catalog.create_table("ns.t", schema=schema)
    table.append(pa.table({"id": np.arange(50)}, schema))
    loader = ll.DataLoader(ll.LakeDataset.from_iceberg(table, follow=FAST, **ORDER), batch_size=8)
    assert sorted(_ids(loader)) == list(range(50))
    table = catalog.load_table("ns.t")
    table.append(pa.table({"id": np.arange(50, 80)}, schema))
    table = catalog.load_table("ns.t")
    table.append(pa.table({"id": np.arange(80, 90)}, schema))
    assert sorted(_ids(loader)) == list(range(50, 90)), "two append snapshots"
    assert loader.epoch == 2
    table = catalog.load_table("ns.t")
    table.delete("id < 5")  # copy-on-write: an overwrite of delivered rows
    table = catalog.load_table("ns.t")
    table.append(pa.table({"id": np.arange(90, 95)}, schema))
    assert sorted(_ids(loader)) == list(range(90, 95)), "the rewrite left out"
    loader.close()


def test_delta_versions_committed_while_the_loader_runs_are_taken_in(table: str) -> None:
    follow = ll.Follow(poll_interval=0.02, timeout=3)
    loader = ll.DataLoader(ll.LakeDataset.from_delta(table, follow=follow, **ORDER), batch_size=8)

    def writer() -> None:
        for k in range(3):
            time.sleep(0.3)
            _delta_append(table, 100 + 40 * k, 40)
            if k == 1:
                DeltaTable(table).optimize.compact()

    seen = _ids_while(writer, loader, 220)
    assert sorted(seen) == list(range(220)), "every committed row once, the compaction none"


def test_a_bare_state_resumes_its_increment_on_a_dataset_made_anew(tmp_path: Path) -> None:
    _append(tmp_path, 0, 60)
    loader = ll.DataLoader(ll.LakeDataset(tmp_path, follow=FAST, **ORDER), batch_size=8)
    assert len(_ids(loader)) == 60
    _append(tmp_path, 60, 48)
    batches = iter(loader)
    seen = [i for b in itertools.islice(batches, 3) for i in b["id"].tolist()]
    state = json.loads(json.dumps(loader.state_dict()))  # plain data, a few numbers more
    loader.close()
    assert state["follow_increment"][0] == 1
    _append(tmp_path, 108, 20)  # later files: the increment under way must not take them
    loaders = make_loaders(ll.LakeDataset(tmp_path, follow=FAST, **ORDER), 3, batch_size=4)
    for resumed in loaders:
        resumed.load_state_dict(state)
    rest = [i for b in global_batches(loaders) for i in b]
    for resumed in loaders:
        resumed.close()
    assert sorted(seen + rest) == list(range(60, 128)), "increment 1 finished, then increment 2"
