"""A mixture of followed lakes: each source's stream is its increments end to end.

Appended rows arrive (no increment is replayed), a pass that reaches past what a lake holds
ends when that lake gives no more rows (the next ``iter()`` goes on once rows are appended),
and a state resumes on datasets made anew after more files were appended, under another
world size, with every row of every source once.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main as cli
from tests.conftest import global_batches, make_loaders

FAST = ll.Follow(poll_interval=0.01, timeout=0.05)
BASE = {"web": 0, "code": 1_000_000}


class Lake:
    """A folder lake that grows: file ``k`` holds ``rows`` ids after the last."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name, self.rows, self.files = root / name, name, 0, 0
        self.root.mkdir(parents=True)

    def add(self, rows: int) -> None:
        ids = [BASE[self.name] + self.rows + i for i in range(rows)]
        path = self.root / f"part-{self.files:04d}.parquet"
        pq.write_table(pa.table({"id": ids}), path.with_suffix(".tmp"), row_group_size=7)
        os.replace(path.with_suffix(".tmp"), path)
        stamp = 1_700_000_000 + self.files
        os.utime(path, (stamp, stamp))
        self.rows, self.files = self.rows + rows, self.files + 1

    def dataset(self, **kw: Any) -> ll.LakeDataset:
        return ll.LakeDataset(self.root, follow=FAST, seed=4, num_partitions=2, window=8, **kw)


class DecodedBy:
    """A ``validate`` that logs the process that decodes each unit and its first id (``pid
    id`` lines), and keeps every unit."""

    def __init__(self, log: Path) -> None:
        self.log = str(log)

    def __call__(self, table: pa.Table) -> bool:
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()} {table['id'][0].as_py()}\n")
        return True


def mixture(lakes: dict[str, Lake], **kw: Any) -> ll.Mixture:
    sources = {n: lake.dataset(**kw) for n, lake in lakes.items()}
    return ll.Mixture(sources, {"web": 0.5, "code": 0.5}, seed=3, epoch_rows=10_000)


@pytest.mark.parametrize("workers", [0, 2])
def test_appended_rows_arrive_once_across_a_resume_on_datasets_made_anew(
    tmp_path: Path, workers: int
) -> None:
    """With workers, the workers decode every increment (its decoder goes with each task)."""
    lakes = {n: Lake(tmp_path, n) for n in BASE}
    for lake in lakes.values():
        lake.add(30)
    log = tmp_path / "decoded.log"
    loaders = make_loaders(
        mixture(lakes, validate=DecodedBy(log)), 2, batch_size=4, num_workers=workers
    )
    seen = [i for b in global_batches(loaders) for i in b]
    assert 0 < len(seen) <= 60, "the pass ends when a source has no more rows"
    for lake in lakes.values():
        lake.add(25)  # increment 1 of each source
    seen += [i for b in global_batches(loaders) for i in b]  # a new iter() goes on
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["sources"]["web"].get("increment") is not None
    for loader in loaders:
        loader.close()
    for lake in lakes.values():
        lake.add(20)  # increment 2, there before the resumed datasets are made
    resumed = make_loaders(mixture(lakes), 3, batch_size=2)
    for loader in resumed:
        loader.load_state_dict(state)
    seen += [i for b in global_batches(resumed) for i in b]
    counts = resumed[0].state_dict()["counts"]
    for loader in resumed:
        loader.close()
    assert max(Counter(seen).values()) == 1, "no row twice"
    for name, base in BASE.items():
        ids = sorted(i - base for i in seen if base <= i < base + 1_000_000)
        assert len(ids) == counts[name] > 55, f"{name}: the appended increments arrived"
        whole = [n for n in (30, 55, 75) if n <= len(ids)]  # increments drawn to their end
        assert set(range(whole[-1])) <= set(ids) <= set(range(lakes[name].rows)), name
    decoded = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert {i % 1_000_000 for _, i in decoded} & set(range(30, 55)), "increment 1 decoded"
    by = {pid for pid, _ in decoded}
    assert (os.getpid() not in by and len(by) >= 2) if workers else by == {os.getpid()}


def test_a_state_taken_before_the_first_batch_resumes(tmp_path: Path) -> None:
    """The first state names each followed source's increment, as every later one does."""
    lakes = {n: Lake(tmp_path, n) for n in BASE}
    for lake in lakes.values():
        lake.add(30)
    with ll.DataLoader(mixture(lakes), batch_size=4) as first:
        state = json.loads(json.dumps(first.state_dict()))
    assert state["sources"]["web"].get("increment") is not None
    resumed = make_loaders(mixture(lakes), 2, batch_size=3)
    for loader in resumed:
        loader.load_state_dict(state)  # it raised StateMismatchError (increment None vs [...])
    fresh = make_loaders(mixture(lakes), 2, batch_size=3)
    seen, want = ([i for b in global_batches(ls) for i in b] for ls in (resumed, fresh))
    for loader in [*resumed, *fresh]:
        loader.close()
    assert seen == want and len(seen) == len(set(seen)) > 0


def test_inspect_shows_each_followed_source_s_increment_and_lag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lakes = {n: Lake(tmp_path, n) for n in BASE}
    for lake in lakes.values():
        lake.add(30)
    with ll.CheckpointManager(tmp_path / "ckpt") as ckpt, ll.DataLoader(mixture(lakes), 4) as x:
        next(iter(x))
        ckpt.save(1, x)
    lakes["web"].add(25)
    lakes["web"].add(5)
    assert cli(["inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    details = json.loads(capsys.readouterr().out)["lake_details"]
    lags = {name: d["increment"]["lag"] for name, d in details.items()}
    assert lags["web"] == {"increments": 1, "files": 2, "rows": 30, "capped": False}
    assert lags["code"] == {"increments": 0, "files": 0, "rows": 0, "capped": False}
    assert cli(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "lag of web  " in capsys.readouterr().out


def test_a_first_state_without_increments_still_loads(tmp_path: Path) -> None:
    """Before c58f634 a first state named no followed source's increment: nothing was drawn."""
    lakes = {n: Lake(tmp_path, n) for n in BASE}
    for lake in lakes.values():
        lake.add(30)
    with ll.DataLoader(mixture(lakes), batch_size=4) as first:
        state = first.state_dict()
        want = [b["id"].tolist() for b in first]
    for record in state["sources"].values():  # as that release wrote it
        record.pop("increment"), record.update(start=0, from_epoch=0)
    with ll.DataLoader(mixture(lakes), batch_size=4) as resumed:
        resumed.load_state_dict(state)
        assert [b["id"].tolist() for b in resumed] == want
