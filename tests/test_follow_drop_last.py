"""Follow mode with ``drop_last=True``: an increment's short tail opens the next increment.

A folder grows by files whose row counts are no multiple of the global batch (one of them
smaller than what the tail lacks); every batch must be full and every appended row come
exactly once, on two simulated ranks, across a resume from a bare state under another world
size and batch size or from a checkpoint taken while a tail waits, and the global batches
must be those of one rank with the same global batch. A state taken at an increment's end
waits for the next increment when it is loaded.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import lakeloader as ll
from lakeloader.cli.checkpoints import open_checkpoint
from lakeloader.cli.inspect import inspect_checkpoint
from tests.conftest import make_loaders

FAST = ll.Follow(poll_interval=0.01, timeout=0.05)
ORDER: dict[str, Any] = {"seed": 4, "num_partitions": 4, "window": 8, "max_unit_rows": 10}
#: Rows of each file appended after the first (45 rows): none a multiple of 8 or 12.
GROWTH = (13, 3, 31, 22, 17)


class Lake:
    """A folder that grows by files of consecutive ids, each newer than the last."""

    def __init__(self, root: Path, first: int) -> None:
        root.mkdir()
        self.root, self.rows, self.files = root, 0, 0
        self.add(first)

    def add(self, rows: int) -> None:
        ids = np.arange(self.rows, self.rows + rows, dtype=np.int64)
        path = self.root / f"part-{self.files:04d}.parquet"
        pq.write_table(pa.table({"id": ids}), path.with_suffix(".tmp"), row_group_size=7)
        os.replace(path.with_suffix(".tmp"), path)
        stamp = 1_700_000_000 + self.files  # increasing, whatever the clock's grain
        os.utime(path, (stamp, stamp))
        self.rows, self.files = self.rows + rows, self.files + 1

    def dataset(self) -> ll.LakeDataset:
        return ll.LakeDataset(self.root, follow=FAST, **ORDER)


def _batches(loaders: list[ll.DataLoader]) -> list[list[int]]:
    """Global batches until caught up, each share checked full."""
    out = []
    for shares in zip(*(iter(loader) for loader in loaders), strict=True):
        assert [len(s["id"]) for s in shares] == [loaders[0].batch_size] * len(loaders)
        out.append([i for s in shares for i in s["id"].tolist()])
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_every_appended_row_comes_once_in_full_batches_across_a_resume(tmp_path: Path) -> None:
    lake = Lake(tmp_path / "lake", 45)
    loaders = make_loaders(lake.dataset(), 2, batch_size=4, drop_last=True)
    seen = _flat(_batches(loaders))
    assert len(seen) == 40, "5 rows of increment 0 wait for the next one"
    state = loaders[0].state_dict()
    assert (state["epoch"], state["position"], state["rows_dropped"]) == (0, 40, 0)
    lake.add(GROWTH[0])  # 5 + 13: two batches, the first across two increments
    seen += _flat(_batches(loaders))
    assert len(seen) == 56 and loaders[0].epoch == 1
    lake.add(GROWTH[1])  # 2 + 3 rows: less than a batch, they all wait
    assert _batches(loaders) == []
    lake.add(GROWTH[2])  # a batch of increments 1, 2 and 3, then increment 3's own
    batches = iter(zip(*(iter(loader) for loader in loaders), strict=True))
    seen += [i for shares in itertools.islice(batches, 2) for s in shares for i in s["id"].tolist()]
    state = json.loads(json.dumps(loaders[0].state_dict()))  # mid-way through increment 3
    for loader in loaders:
        loader.close()
    assert state["epoch"] == 3 and 0 < state["position"] < state["num_rows"]
    lake.add(GROWTH[3])
    resumed = make_loaders(lake.dataset(), 3, batch_size=4, drop_last=True)
    for loader in resumed:
        loader.load_state_dict(state)
    seen += _flat(_batches(resumed))
    lake.add(GROWTH[4])
    seen += _flat(_batches(resumed))
    waiting = len(resumed[0].dataset) - resumed[0].tracker.position
    assert len(set(seen)) == len(seen) == lake.rows - waiting, "each row once, none lost"
    assert 0 < waiting < 12 and resumed[0].state_dict()["rows_dropped"] == 0
    lake.add(12 - waiting)  # what completes the last batch
    seen += _flat(_batches(resumed))
    for loader in resumed:
        loader.close()
    assert sorted(seen) == list(range(lake.rows)), "the tail came, nothing else waits"


def test_the_batches_of_a_growing_lake_are_the_same_on_every_world_size(tmp_path: Path) -> None:
    lake = Lake(tmp_path / "lake", 45)
    groups = [
        make_loaders(lake.dataset(), 1, batch_size=12, drop_last=True),
        make_loaders(lake.dataset(), 2, batch_size=6, drop_last=True),
        make_loaders(lake.dataset(), 4, batch_size=3, drop_last=True),
    ]
    runs: list[list[list[int]]] = [[] for _ in groups]
    for rows in (0, *GROWTH):
        if rows:
            lake.add(rows)
        for run, loaders in zip(runs, groups, strict=True):
            run += _batches(loaders)
    for loaders in groups:
        for loader in loaders:
            loader.close()
    assert runs[0] == runs[1] == runs[2], "one stream, cut into the same global batches"
    assert len(runs[0]) == lake.rows // 12 and len(set(_flat(runs[0]))) == len(_flat(runs[0]))


def test_a_checkpoint_while_a_tail_waits_resumes_it_on_another_topology(tmp_path: Path) -> None:
    lake = Lake(tmp_path / "lake", 45)
    loaders = make_loaders(lake.dataset(), 2, batch_size=4, drop_last=True)
    seen = _flat(_batches(loaders))
    ll.CheckpointManager(str(tmp_path / "ckpt")).save(len(seen) // 8, loaders[0])
    for loader in loaders:
        loader.close()
    info = inspect_checkpoint(open_checkpoint(str(tmp_path / "ckpt")).checkpoint)
    assert (info["rows_to_carry"], info["rows_to_drop"]) == (5, 0), "carried, not dropped"
    lake.add(GROWTH[0])
    resumed = make_loaders(lake.dataset(), 1, batch_size=6, drop_last=True)
    ll.CheckpointManager(str(tmp_path / "ckpt")).load(resumed[0])
    assert resumed[0].state_dict()["position"] == 40, "before the 5 rows that wait"
    seen += _flat(_batches(resumed))
    resumed[0].close()
    assert sorted(seen) == list(range(58)), "5 + 1 rows, then increment 1's other 12"


def test_a_state_at_an_increments_end_waits_for_the_next_one(tmp_path: Path) -> None:
    lake = Lake(tmp_path / "lake", 45)
    loader = ll.DataLoader(lake.dataset(), batch_size=8)  # drop_last=False: the epoch ends
    assert len([i for b in loader for i in b["id"].tolist()]) == 45
    state = loader.state_dict()
    again = ll.DataLoader(lake.dataset(), batch_size=8)
    again.load_state_dict(state)
    assert list(again) == [], "caught up, not CaughtUpError"
    lake.add(GROWTH[0])
    assert sorted(i for b in again for i in b["id"].tolist()) == list(range(45, 58))


def test_a_quarantined_piece_of_a_carried_step_is_skipped_alike_on_every_topology(
    tmp_path: Path,
) -> None:
    lake = Lake(tmp_path / "lake", 45)

    def validate(table: pa.Table) -> str | None:
        return "holds id 44 or 50" if {44, 50} & set(table.column("id").to_pylist()) else None

    groups = [
        make_loaders(
            ll.LakeDataset(lake.root, follow=FAST, on_error="skip", validate=validate, **ORDER),
            world,
            batch_size=8 // world,
            drop_last=True,
        )
        for world in (1, 2)
    ]
    runs: list[list[list[int]]] = [[], []]
    for rows in (0, *GROWTH[:3]):
        if rows:
            lake.add(rows)
        for run, loaders in zip(runs, groups, strict=True):
            for shares in zip(*(iter(loader) for loader in loaders), strict=True):
                run.append(sorted(i for s in shares for i in s["id"].tolist()))
    skipped = {e for loaders in groups for loader in loaders for e in loader.quarantine}
    for loaders in groups:
        for loader in loaders:
            loader.close()
    assert runs[0] == runs[1], "the same rows left out of the same batches"
    ids = [i for b in runs[0] for i in b]
    assert len(set(ids)) == len(ids) and not {44, 50} & set(ids)
    assert len(ids) + sum(e.num_rows for e in skipped) == len(runs[0]) * 8, "slots: rows or holes"


def test_a_carried_step_is_one_step_for_fetched_ahead_quarantine_step_and_the_audit(
    tmp_path: Path,
) -> None:
    """The step that opens increment 1 with increment 0's tail: a state fetched ahead of it
    stands before it (in increment 0) and gives it again; ``quarantine_step`` of it names the
    units of both increments; it is one step of two runs for the audit ledger."""
    lake = Lake(tmp_path / "lake", 45)
    loader = ll.DataLoader(lake.dataset(), batch_size=8, drop_last=True)
    batches = iter(loader)
    head = [next(batches)["id"].tolist() for _ in range(5)]
    lake.add(GROWTH[0])
    carried = next(batches)["id"].tolist()
    runs = loader.tracker.record.last
    assert [(r.epoch, r.start, r.stop) for r in runs] == [(0, 40, 45), (1, 0, 3)]
    state = loader.state_dict(fetched_ahead=1)
    assert (state["epoch"], state["position"]) == (0, 40), "before the carried step"
    with ll.DataLoader(lake.dataset(), batch_size=8, drop_last=True) as again:
        again.load_state_dict(json.loads(json.dumps(state)))
        rest = [b["id"].tolist() for b in again]
    seen = _flat([*head, *rest])
    assert rest[0] == carried and len(seen) == len(set(seen)) == 56 and set(seen) <= set(range(58))
    earlier = loader.quarantine_step(4)  # a step of increment 0, asked in increment 1
    rows = {i // 7 for i in head[4]}
    assert {(Path(e.path).name, e.row_group) for e in earlier} == {
        ("part-0000.parquet", rg) for rg in rows
    }
    behind = {(Path(e.path).name, e.row_group) for e in loader.quarantine_step(5)}
    tail = {i // 7 for i in carried if i < 45} - rows
    assert {rg for name, rg in behind if name == "part-0000.parquet"} == tail
    assert any(name == "part-0001.parquet" for name, _ in behind)
    loader.close()


def test_a_carried_step_across_three_increments_names_the_units_of_each(tmp_path: Path) -> None:
    """Increment 1's tail, increment 2 (3 rows: less than the tail lacks) and increment 3's
    head in one step: ``quarantine_step`` of it names units of the three."""
    lake = Lake(tmp_path / "lake", 45)
    with ll.DataLoader(lake.dataset(), batch_size=8, drop_last=True) as loader:
        steps = len(list(loader))
        for rows in (13, 3):
            lake.add(rows)
            steps += len(list(loader))
        lake.add(31)
        carried = next(iter(loader))["id"].tolist()
        runs = loader.tracker.record.last
        assert [r.epoch for r in runs] == [1, 2, 3] and len(carried) == 8
        behind = {Path(e.path).name for e in loader.quarantine_step(steps)}
    assert behind == {"part-0001.parquet", "part-0002.parquet", "part-0003.parquet"}
