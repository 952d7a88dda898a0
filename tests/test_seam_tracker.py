"""The reader-state tracker at its seams: transitions, the state it writes, the view it derives.

The per-worker view is checked against what the workers really do: each worker's pid is
recorded by the user's own code (``validate`` runs where a unit is decoded, a ``transform``
where a batch is built), so the test sees who did which piece of work.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
import lakeloader.order.plan as lp
from lakeloader.state.formats import LAKE, read
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import Delivery
from lakeloader.state.view import first_units, rank_dict
from tests.conftest import LAYOUT_ROWS, roundtrip
from tests.oracles import first_need_units

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")


def _tracker(batch: int = 4, world: int = 1, drop_last: bool = False) -> ll.ReaderStateTracker:
    return ll.ReaderStateTracker(ll.Topology(world, 0, 0, batch), drop_last=drop_last)


def test_transitions_follow_deliveries_only() -> None:
    t = _tracker()
    assert t.start_pass() == 0 and t.position == 0
    t.delivered(Delivery(4, 4, False, (), 0), 10)
    t.delivered(Delivery(8, 3, False, (QuarantineEntry("f", 0, 0, 1, "bad"),), 1), 10)
    assert (t.position, t.rows_delivered, t.rows_skipped) == (8, 7, 1)
    assert [q.path for q in t.quarantine] == ["f"]
    assert t.start_pass() == 0 and t.position == 8, "a pass left early continues its epoch"
    t.settle_tail(10)
    t.delivered(Delivery(10, 2, True, (), 0), 10)
    assert t.start_pass() == 1 and t.position == 0, "a pass after a finished one: next epoch"
    assert t.set_epoch(5) and (t.epoch, t.position) == (5, 0)
    assert not t.set_epoch(5), "set_epoch of the epoch already set keeps the position"
    assert t.start_pass() == 5


def test_drop_last_counts_the_tail() -> None:
    t = _tracker(batch=4, drop_last=True)
    t.start_pass()
    t.settle_tail(10)
    assert t.rows_dropped == 0 and t.steps_left(10) == 2
    t.delivered(Delivery(8, 4, True, (), 0), 10)
    assert t.rows_dropped == 2
    t2 = _tracker(batch=4, drop_last=True)
    t2.start_pass()
    t2.settle_tail(3)
    assert t2.rows_dropped == 3, "an epoch shorter than a global batch is all dropped"


def test_state_round_trip_and_restore(dataset: ll.LakeDataset) -> None:
    t = _tracker(batch=10, world=1)
    t.start_pass()
    t.delivered(Delivery(30, 30, False, (), 0))
    state = t.state(dataset.fingerprint, dataset.config.to_dict(), len(dataset))
    assert state.config_hash == dataset.config_hash
    again = read(roundtrip(state.to_dict()), LAKE)
    assert again == state and again.topology == ll.Topology(1, 0, 0, 10)
    fresh = _tracker(batch=7, world=3)
    fresh.restore(again)
    assert (fresh.epoch, fresh.position) == (0, 30)
    done = read({**state.to_dict(), "position": LAYOUT_ROWS}, LAKE)
    fresh.restore(done)
    assert (fresh.epoch, fresh.position) == (1, 0), "a finished epoch resumes with the next"


def test_loader_state_dict_is_the_trackers(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=32)
    try:
        it = iter(loader)
        next(it)
        next(it)
        ds = loader.dataset
        expected = loader.tracker.state(ds.fingerprint, ds.config.to_dict(), len(ds))
        state = loader.state_dict()
        requests = json.loads(state.pop("requests"))
        assert requests == {"delivered": 2, "pending": 0, "skips": [], "bad_steps": []}
        assert state == expected.to_dict()
        assert loader.tracker.position == 64
    finally:
        loader.close()


@settings(max_examples=40, deadline=None)
@given(
    rgs=st.lists(st.lists(st.integers(0, 40), max_size=4), min_size=1, max_size=5),
    c=st.integers(1, 5),
    window=st.integers(1, 30),
    world=st.integers(1, 3),
    batch=st.integers(1, 9),
    workers=st.integers(1, 4),
    seed=st.integers(0, 3),
    frac=st.floats(0, 1),
)
def test_first_units_match_a_brute_force_walk(
    rgs: list[list[int]],
    c: int,
    window: int,
    world: int,
    batch: int,
    workers: int,
    seed: int,
    frac: float,
) -> None:
    units = lp.make_units(rgs, 16)
    plan = lp.plan_epoch(units, seed=seed, epoch=0, shuffle=True, num_partitions=c, window=window)
    gb = world * batch
    position = int(frac * plan.num_rows)
    steps = lp.steps_in_epoch(position, plan.num_rows, gb, False)
    topo = ll.Topology(world, 0, workers, batch)
    snapshot = None  # no quarantine: the snapshot is not consulted
    for rank in range(world):
        got = first_units(plan, snapshot, position, steps, topo, rank, workers)  # type: ignore[arg-type]
        expected = first_need_units(plan, position, gb, world, rank, steps)[:workers]
        spans = [
            (
                int(plan.units.file_index[plan.piece_unit[p]]),
                int(plan.units.row_group[plan.piece_unit[p]]),
                int(plan.units.row_start[plan.piece_unit[p]] + plan.piece_start[p]),
                int(plan.offsets[p + 1] - plan.offsets[p]),
            )
            for p in got
        ]
        assert spans == expected


def _record(log: str, table: object) -> bool:
    """A ``validate`` that notes which process decoded which unit (its first id)."""
    ids = table.column("id")  # type: ignore[attr-defined]
    with open(log, "a") as fh:
        fh.write(f"{os.getpid()} {ids[0].as_py()}\n")
    return True


def _pid_row(row: dict[str, object]) -> dict[str, object]:
    """A ``transform`` that tags each row with the process that built its batch."""
    return {"id": row["id"], "pid": os.getpid()}


def test_decoding_workers_do_what_the_view_says(lake: Path, tmp_path: Path) -> None:
    log = tmp_path / "decodes.log"
    ds = ll.LakeDataset(
        lake,
        seed=3,
        num_partitions=4,
        window=64,
        max_unit_rows=128,
        validate=functools.partial(_record, str(log)),
    )
    loader = ll.DataLoader(ds, batch_size=40, num_workers=2, prefetch_factor=1)
    try:
        view = loader.tracker.view(ds.plan(0), ds.snapshot)
        it = iter(loader)
        ids = [next(it)["id"].tolist()]
        pids = loader._pool.pids()  # type: ignore[union-attr]
        ids += [b["id"].tolist() for b in it]
    finally:
        loader.close()
    assert sorted(i for b in ids for i in b) == list(range(LAYOUT_ROWS))
    done = [line.split() for line in log.read_text().splitlines()]
    # every unit is decoded once, the j-th (in the order of first need) by worker j mod 2
    plan = ds.plan(0)
    order = first_units(plan, ds.snapshot, 0, len(ids), loader.topology, 0, 10**6)
    first_id = {}
    base = np.cumsum([0] + [r for f in ds.snapshot.files for r in f.row_group_rows])
    rg_index = {}
    k = 0
    for fi, f in enumerate(ds.snapshot.files):
        for g in range(len(f.row_group_rows)):
            rg_index[fi, g] = k
            k += 1
    for j, p in enumerate(order):
        unit = int(plan.piece_unit[p])
        fi, g = int(plan.units.file_index[unit]), int(plan.units.row_group[unit])
        start = int(plan.units.row_start[unit] + plan.piece_start[p])
        first_id[int(base[rg_index[fi, g]]) + start] = j
    assert len(done) == len(order)
    by_worker = {pid: w for w, pid in enumerate(pids)}
    for pid, first in done:
        assert by_worker[int(pid)] == first_id[int(first)] % 2
    for w in view.workers:
        assert w.role == "decode" and w.at is not None
        j = first_id[int(base[rg_index[w.at.file_index, w.at.row_group]]) + w.at.row_offset]
        assert j == w.worker, "worker k decodes the k-th unit first"
        plain = rank_dict(w)  # what inspect --json prints for it
        assert plain["file"] == w.at.file and plain["row_offset"] == w.at.row_offset


def test_building_workers_do_what_the_view_says(dataset: ll.LakeDataset) -> None:
    ds = ll.LakeDataset(
        dataset.source, seed=7, num_partitions=4, window=64, max_unit_rows=128, transform=_pid_row
    )
    loader = ll.DataLoader(ds, batch_size=50, num_workers=3)
    try:
        view = loader.tracker.view(ds.plan(0), ds.snapshot)
        it = iter(loader)
        batches = [next(it)]
        pids = loader._pool.pids()  # type: ignore[union-attr]
        batches += list(it)
    finally:
        loader.close()
    assert [w.step_offset for w in view.workers] == [0, 1, 2]
    assert all(w.role == "build" for w in view.workers)
    for k, batch in enumerate(batches):
        assert set(batch["pid"].tolist()) == {pids[k % 3]}, f"step {k} built by worker {k % 3}"
