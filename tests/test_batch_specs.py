"""``batch_specs`` plans many steps at once exactly as the oracle ``batch_spec`` plans each one.

The oracle (tests/oracles.py) maps the step's slots one by one with the pure functions of
:mod:`lakeloader.order.plan`; it shares only ``batch_slots`` and ``rank_bounds`` (tested in
test_plan_properties.py) with ``batch_specs``. The shares are also checked against the virtual
rows of their slots, and ``take`` against ``inverse`` and ``row``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader.order.batches as lb
import lakeloader.order.plan as lp
from lakeloader.order.batches import BatchSpec, batch_specs
from lakeloader.order.plan import (
    EpochPlan,
    batch_slots,
    make_units,
    plan_epoch,
    rank_bounds,
    steps_in_epoch,
)
from tests.conftest import FAST, SLOW, plans
from tests.oracles import all_virtual, batch_spec, decode


def assert_same(got: BatchSpec, want: BatchSpec) -> None:
    """Field by field: equal ints, equal int64 arrays."""
    for f in dataclasses.fields(BatchSpec):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == np.int64, f.name
            assert np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def bounds(plan: EpochPlan, start: int, global_batch: int, step: int) -> tuple[int, int]:
    """Global slots of a step."""
    lo = start + step * global_batch
    return lo, min(lo + global_batch, plan.num_rows)


def check_pieces_and_rows(plan: EpochPlan, spec: BatchSpec) -> None:
    """``take == base[inverse] + row``, and ``row`` and ``inverse`` designate the same rows."""
    sizes = plan.piece_rows(spec.positions)
    base = np.cumsum(sizes) - sizes
    assert np.array_equal(spec.take, base[spec.inverse] + spec.row)
    assert np.all((spec.row >= 0) & (spec.row < sizes[spec.inverse]))
    virtual = plan.offsets[spec.positions[spec.inverse]] + spec.row
    assert np.array_equal(virtual, decode(plan, spec))


# ------------------------------------------------------------------------------- properties


@SLOW
@given(
    plan=plans(),
    global_batch=st.one_of(st.integers(1, 12), st.integers(1, 300)),
    world_size=st.one_of(st.integers(1, 4), st.integers(1, 40)),
    data=st.data(),
)
def test_batch_specs_equal_batch_spec_of_each_step(
    plan: EpochPlan, global_batch: int, world_size: int, data: st.DataObject
) -> None:
    n = plan.num_rows
    if n == 0:
        with pytest.raises(ValueError):
            batch_specs(
                plan,
                first_step=0,
                num_steps=1,
                start=0,
                global_batch=global_batch,
                world_size=world_size,
                rank=0,
            )
        assert (
            batch_specs(
                plan,
                first_step=0,
                num_steps=0,
                start=0,
                global_batch=global_batch,
                world_size=world_size,
                rank=0,
            )
            == []
        )
        return
    start = data.draw(st.integers(0, n - 1), label="start")
    total = steps_in_epoch(start, n, global_batch, drop_last=False)
    first = data.draw(st.integers(0, total - 1), label="first_step")
    num = data.draw(st.integers(0, total - first), label="num_steps")
    rank = data.draw(st.integers(0, world_size - 1), label="rank")

    specs = batch_specs(
        plan,
        first_step=first,
        num_steps=num,
        start=start,
        global_batch=global_batch,
        world_size=world_size,
        rank=rank,
    )
    assert len(specs) == num
    full = all_virtual(plan)
    for t, spec in enumerate(specs, start=first):
        lo, hi = bounds(plan, start, global_batch, t)
        assert_same(spec, batch_spec(plan, t, lo, hi, world_size, rank))
        slots = batch_slots(lo, hi, plan.num_partitions)
        a, b = rank_bounds(len(slots), world_size, rank)
        assert np.array_equal(decode(plan, spec), full[slots[a:b]])
        check_pieces_and_rows(plan, spec)


@SLOW
@given(plan=plans(), global_batch=st.integers(1, 50), world_size=st.integers(1, 6))
def test_the_shares_of_a_whole_epoch_deliver_every_row_once(
    plan: EpochPlan, global_batch: int, world_size: int
) -> None:
    """All ranks' shares, planned in one call each, are the slots in order, mapped."""
    steps = steps_in_epoch(0, plan.num_rows, global_batch, drop_last=False)
    shares = [
        batch_specs(
            plan,
            first_step=0,
            num_steps=steps,
            start=0,
            global_batch=global_batch,
            world_size=world_size,
            rank=r,
        )
        for r in range(world_size)
    ]
    full = all_virtual(plan)
    got = [decode(plan, shares[r][t]) for t in range(steps) for r in range(world_size)]
    slots = [
        batch_slots(*bounds(plan, 0, global_batch, t), plan.num_partitions) for t in range(steps)
    ]
    want = full[np.concatenate(slots)] if slots else full
    assert np.array_equal(np.concatenate(got) if got else full[:0], want)


@FAST
@given(values=st.lists(st.integers(0, 300), max_size=60), extra=st.integers(0, 10_000))
def test_unique_inverse_by_flags_or_by_sorting(values: list[int], extra: int) -> None:
    array = np.array(values, dtype=np.int64)
    want_unique, want_inverse = np.unique(array, return_inverse=True)
    for span in (2**40, 301 + extra):  # sorted, flagged
        unique, inverse = lb._unique_inverse(array, span)
        assert np.array_equal(unique, want_unique)
        assert np.array_equal(inverse, want_inverse)


# ----------------------------------------------------------------------------------- cases


def small_plan(shuffle: bool = True) -> EpochPlan:
    """N = 47 rows in uneven units, three partitions, windows of four rows."""
    units = make_units([[5, 0, 9], [13], [], [20]], max_unit_rows=6)
    return plan_epoch(units, seed=7, epoch=2, shuffle=shuffle, num_partitions=3, window=4)


@pytest.mark.parametrize("shuffle", [True, False])
def test_short_last_batch(shuffle: bool) -> None:
    plan = small_plan(shuffle)
    assert plan.num_rows == 47
    specs = batch_specs(
        plan, first_step=0, num_steps=5, start=2, global_batch=10, world_size=1, rank=0
    )  # the fifth step holds slots 42..46
    assert [(s.slot_start, s.slot_stop, s.num_rows) for s in specs][-2:] == [
        (32, 42, 10),
        (42, 47, 5),
    ]
    for t, spec in enumerate(specs):
        assert_same(spec, batch_spec(plan, t, *bounds(plan, 2, 10, t), 1, 0))
    for rank in range(3):  # 5 rows over 3 ranks: 2, 2, 1
        (last,) = batch_specs(
            plan, first_step=4, num_steps=1, start=2, global_batch=10, world_size=3, rank=rank
        )
        assert last.num_rows == (2 if rank < 2 else 1)
        assert_same(last, batch_spec(plan, 4, 42, 47, 3, rank))


def test_world_size_larger_than_a_batch() -> None:
    plan = small_plan()
    for rank in range(7):
        specs = batch_specs(
            plan, first_step=0, num_steps=10, start=0, global_batch=5, world_size=7, rank=rank
        )
        for t, spec in enumerate(specs):
            assert_same(spec, batch_spec(plan, t, *bounds(plan, 0, 5, t), 7, rank))
            check_pieces_and_rows(plan, spec)
        sizes = [s.num_rows for s in specs]
        assert sizes == [1 if rank < 5 else 0] * 9 + [1 if rank < 2 else 0]
    empty = batch_specs(
        plan, first_step=0, num_steps=1, start=0, global_batch=5, world_size=7, rank=6
    )[0]
    for a in (empty.positions, empty.take, empty.inverse, empty.row):
        assert a.dtype == np.int64 and a.shape == (0,)


@pytest.mark.parametrize(
    "args",
    [
        (0, 6, 0, 10, 1, 0),  # step 5 would start at slot 50 > 47
        (5, 1, 0, 10, 1, 0),
        (-1, 1, 0, 10, 1, 0),
        (0, -1, 0, 10, 1, 0),
        (0, 1, 0, 0, 1, 0),
        (0, 1, 0, 10, 2, 2),
        (0, 1, 0, 10, 0, 0),
    ],
)
def test_bad_requests_raise(args: tuple[int, int, int, int, int, int]) -> None:
    with pytest.raises(ValueError):
        names = ("first_step", "num_steps", "start", "global_batch", "world_size", "rank")
        batch_specs(small_plan(), **dict(zip(names, args, strict=True)))


def test_each_window_is_drawn_once_across_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls touching more windows than the cache holds neither thrash nor re-draw."""
    units = make_units([[37] * 20], max_unit_rows=37)  # N = 740
    plan, oracle = (
        plan_epoch(units, seed=1, epoch=0, shuffle=True, num_partitions=4, window=8) for _ in "ab"
    )
    drawn: list[tuple[int, int]] = []
    draw = lp._draw_window

    def counting(drawing: EpochPlan, partition: int, window: int) -> np.ndarray:
        if drawing is plan:
            drawn.append((partition, window))
        return draw(drawing, partition, window)

    monkeypatch.setattr(lp, "_draw_window", counting)
    total = steps_in_epoch(3, plan.num_rows, 12, drop_last=False)
    first = 0
    for num in [1, 7, 30, 2, 1, 9] * 10:  # 30 steps: 360 slots, 11 windows per partition
        num = min(num, total - first)
        for spec in batch_specs(
            plan, first_step=first, num_steps=num, start=3, global_batch=12, world_size=1, rank=0
        ):
            lo, hi = bounds(plan, 3, 12, spec.step)
            assert_same(spec, batch_spec(oracle, spec.step, lo, hi, 1, 0))
        first += num
        assert len(plan.windows) <= lp.WINDOW_CACHE_PER_PARTITION * plan.num_partitions
    assert first == total
    assert len(drawn) == len(set(drawn))
