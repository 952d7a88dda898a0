"""Exact resume and exactly-once under resize, through msgpack round-trips of the state."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

import lakeloader as ll
from tests.conftest import LAYOUT_ROWS, global_batches, make_loaders, roundtrip

GLOBAL_BATCH = 48
STEPS = -(-LAYOUT_ROWS // GLOBAL_BATCH)


def two_epochs(ds: ll.LakeDataset, world_size: int, **kwargs: Any) -> list[list[list[int]]]:
    loaders = make_loaders(ds, world_size, **kwargs)
    try:
        return [list(global_batches(loaders)) for _ in range(2)]
    finally:
        for loader in loaders:
            loader.close()


@pytest.fixture(scope="module")
def uninterrupted(dataset: ll.LakeDataset) -> list[list[list[int]]]:
    return two_epochs(dataset, 1, batch_size=GLOBAL_BATCH)


def interrupt(
    ds: ll.LakeDataset, steps: int, world_size: int, **kwargs: Any
) -> tuple[dict[str, Any], list[list[int]]]:
    """Run ``steps`` global steps of epoch 0, then return (state, the batches seen)."""
    loaders = make_loaders(ds, world_size, **kwargs)
    seen = list(itertools.islice(global_batches(loaders), steps))
    states = [loader.state_dict() for loader in loaders]
    assert all(s["position"] == states[0]["position"] for s in states), "ranks disagree"
    for loader in loaders:
        loader.close()
    return roundtrip(states[0]), seen


def resume(ds: ll.LakeDataset, state: dict[str, Any], world_size: int, **kwargs: Any) -> list:
    loaders = make_loaders(ds, world_size, **kwargs)
    for loader in loaders:
        loader.load_state_dict(state)
    try:
        return [list(global_batches(loaders)) for _ in range(2)]
    finally:
        for loader in loaders:
            loader.close()


@pytest.mark.parametrize("at", [1, STEPS // 2, STEPS - 1, STEPS])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_same_topology(
    dataset: ll.LakeDataset, uninterrupted: list, at: int, num_workers: int
) -> None:
    state, seen = interrupt(dataset, at, 2, batch_size=GLOBAL_BATCH // 2, num_workers=num_workers)
    assert seen == uninterrupted[0][:at]
    rest = resume(dataset, state, 2, batch_size=GLOBAL_BATCH // 2, num_workers=num_workers)
    if at == STEPS:  # interrupted between epochs: the next iteration is epoch 1
        assert rest[0] == uninterrupted[1]
    else:
        assert rest[0] == uninterrupted[0][at:]
        assert rest[1] == uninterrupted[1]


def test_state_before_any_step_resumes_from_the_start(
    dataset: ll.LakeDataset, uninterrupted: list
) -> None:
    state, _ = interrupt(dataset, 0, 1, batch_size=GLOBAL_BATCH)
    assert resume(dataset, state, 1, batch_size=GLOBAL_BATCH) == uninterrupted


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            {"world_size": 2, "batch_size": 24, "num_workers": 0},
            {"world_size": 3, "batch_size": 16, "num_workers": 2},
        ),
        (
            {"world_size": 4, "batch_size": 12, "num_workers": 1},
            {"world_size": 1, "batch_size": 10, "num_workers": 0},
        ),
        (
            {"world_size": 1, "batch_size": 48, "num_workers": 2},
            {"world_size": 8, "batch_size": 5, "num_workers": 0},
        ),
        (
            {"world_size": 3, "batch_size": 7, "num_workers": 0},
            {"world_size": 2, "batch_size": 33, "num_workers": 1},
        ),
    ],
)
@pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.93])
def test_exactly_once_under_resize(
    dataset: ll.LakeDataset, slot_order: list[int], before: dict, after: dict, fraction: float
) -> None:
    before, after = dict(before), dict(after)
    ws0, ws1 = before.pop("world_size"), after.pop("world_size")
    steps = int(LAYOUT_ROWS * fraction) // (ws0 * before["batch_size"])
    state, seen = interrupt(dataset, steps, ws0, **before)
    rest = resume(dataset, state, ws1, **after)
    ids = [i for b in seen + rest[0] for i in b]
    assert sorted(ids) == list(range(LAYOUT_ROWS)), "every row of the epoch exactly once"
    next_epoch = [i for b in rest[1] for i in b]
    assert sorted(next_epoch) == list(range(LAYOUT_ROWS)), "and the next epoch complete"
    # The global sequence itself continues: with a global batch of one row the delivery order
    # is the slot order, and every batch before and after the resize holds exactly its slots.
    slots, position = slot_order, 0
    for batch in seen + rest[0]:
        assert sorted(batch) == sorted(slots[position : position + len(batch)])
        position += len(batch)


def test_drop_last_rows_are_counted(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=64, drop_last=True)
    ids = [i for b in loader for i in b["id"].tolist()]
    state = loader.state_dict()
    assert len(ids) == LAYOUT_ROWS - LAYOUT_ROWS % 64
    assert state["rows_dropped"] == LAYOUT_ROWS % 64
    assert state["position"] + state["rows_dropped"] == LAYOUT_ROWS
    assert len(set(ids)) == len(ids)


def test_state_is_plain_small_and_json_serialisable(dataset: ll.LakeDataset) -> None:
    state, _ = interrupt(dataset, 5, 2, batch_size=24)
    text = json.dumps(state)
    assert json.loads(text) == state
    assert state["position"] == 5 * 48 and state["epoch"] == 0
    assert state["topology"] == {"world_size": 2, "rank": 0, "num_workers": 0, "batch_size": 24}
    assert len(text) < 1000, len(text)


def test_set_epoch_keeps_a_loaded_position(dataset: ll.LakeDataset, uninterrupted: list) -> None:
    state, _ = interrupt(dataset, 3, 1, batch_size=GLOBAL_BATCH)
    loader = ll.DataLoader(dataset, batch_size=GLOBAL_BATCH)
    loader.load_state_dict(state)
    loader.set_epoch(0)  # the usual call at the top of an epoch loop must not lose the position
    assert [b["id"].tolist() for b in loader] == uninterrupted[0][3:]
    loader.set_epoch(1)
    assert [b["id"].tolist() for b in loader] == uninterrupted[1]
    loader.set_epoch(1)  # finished epoch 1: asking for it again replays it from the start
    assert [b["id"].tolist() for b in loader] == uninterrupted[1]


@pytest.mark.parametrize("persistent", [False, True])
def test_breaking_out_then_iterating_continues_the_epoch(
    dataset: ll.LakeDataset, uninterrupted: list, persistent: bool
) -> None:
    loader = ll.DataLoader(
        dataset, batch_size=GLOBAL_BATCH, num_workers=2, persistent_workers=persistent
    )
    it = iter(loader)
    first = list(itertools.islice(it, 3))
    assert [b["id"].tolist() for b in first] == uninterrupted[0][:3]
    loader.set_epoch(0)  # the usual call at the top of an epoch loop keeps the position
    assert [b["id"].tolist() for b in loader] == uninterrupted[0][3:]
    with pytest.raises(RuntimeError, match=r"ended by a newer iter\(loader\)"):
        next(it)  # the iterator a newer one replaced
    assert [b["id"].tolist() for b in loader] == uninterrupted[1], "then the next epoch"
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_peek_does_not_eat_the_epoch(dataset: ll.LakeDataset, workers: int) -> None:
    loader = ll.DataLoader(dataset, batch_size=GLOBAL_BATCH, num_workers=workers)
    peek = next(iter(loader))  # a look at one batch
    rest = [i for b in loader for i in b["id"].tolist()]
    assert sorted(peek["id"].tolist() + rest) == list(range(LAYOUT_ROWS))
    assert loader.epoch == 0
    loader.set_epoch(0, restart=True)  # the caller may still start over, explicitly
    assert sorted(i for b in loader for i in b["id"].tolist()) == list(range(LAYOUT_ROWS))
    loader.close()
