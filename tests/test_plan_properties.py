"""Property-based tests of the pure planning functions in :mod:`lakeloader.order.plan`.

They check the invariants of "The order of an epoch" (DESIGN.md) on random row-group layouts:
empty files, empty row groups and row groups split into several units all occur.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lakeloader.order.batches import batch_specs
from lakeloader.order.plan import (
    EpochPlan,
    Units,
    batch_slots,
    make_units,
    partition_consumed,
    partition_starts,
    plan_epoch,
    rank_bounds,
    release_slots,
    slots_to_virtual,
    steps_in_epoch,
    unit_order,
    virtual_to_piece,
)
from tests.conftest import FAST, SLOW, epochs, layouts, plans, seeds, small_layouts
from tests.oracles import all_virtual, decode

# --------------------------------------------------------------------------------- make_units


@FAST
@given(layout=layouts, max_unit_rows=st.integers(1, 40))
def test_make_units_cover_every_row_once_in_path_order(
    layout: list[list[int]], max_unit_rows: int
) -> None:
    units = make_units(layout, max_unit_rows)
    assert isinstance(units, Units)
    arrays = (units.file_index, units.row_group, units.row_start, units.num_rows)
    for a in arrays:
        assert a.dtype == np.int64
        assert a.shape == (len(units),)
    assert np.all(units.num_rows >= 1)
    assert np.all(units.num_rows <= max_unit_rows)

    # Path order: (file, row group, row start) strictly increasing.
    keys = list(zip(*(a.tolist() for a in arrays[:3]), strict=True))
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)

    # Each non-empty row group is tiled by contiguous units from row 0; empty ones get none.
    covered: dict[tuple[int, int], int] = {}
    for f, g, start, n in zip(*(a.tolist() for a in arrays), strict=True):
        assert start == covered.get((f, g), 0), "units of a row group must be contiguous"
        covered[(f, g)] = start + n
    expected = {(f, g): n for f, rgs in enumerate(layout) for g, n in enumerate(rgs) if n > 0}
    assert covered == expected
    assert int(units.num_rows.sum()) == sum(map(sum, layout))
    # Only the last unit of a row group may be short.
    assert len(units) == sum(-(-n // max_unit_rows) for n in expected.values())


def test_make_units_edge_cases() -> None:
    assert len(make_units([], 3)) == 0
    assert len(make_units([[], [0, 0], []], 3)) == 0
    assert make_units([[0, 7]], 7).row_group.tolist() == [1]
    with pytest.raises(ValueError):
        make_units([[1]], 0)


# ------------------------------------------------------------------ partitions and positions


@FAST
@given(n=st.integers(0, 2000), c=st.integers(1, 64))
def test_partition_starts(n: int, c: int) -> None:
    starts = partition_starts(n, c)
    assert starts.dtype == np.int64
    assert len(starts) == c + 1
    assert starts[0] == 0 and starts[-1] == n
    sizes = np.diff(starts)
    assert sizes.sum() == n
    assert sizes.max() - sizes.min() <= 1
    assert np.all(sizes[:-1] >= sizes[1:])
    assert sizes.tolist() == [-(-(n - k) // c) if n > k else 0 for k in range(c)]
    # Partition k holds exactly the slots j < N with j % C == k.
    assert sizes.tolist() == [len(range(k, n, c)) for k in range(c)]
    assert np.array_equal(partition_consumed(n, c), sizes)


@FAST
@given(g=st.integers(0, 2000), c=st.integers(1, 64))
def test_partition_consumed(g: int, c: int) -> None:
    consumed = partition_consumed(g, c)
    assert len(consumed) == c
    assert consumed.sum() == g
    brute = np.bincount(np.arange(g) % c, minlength=c)
    assert consumed.tolist() == brute.tolist()
    assert consumed.max() - consumed.min() <= 1
    assert np.all(consumed[:-1] >= consumed[1:])


# -------------------------------------------------------------------------------- unit_order


@FAST
@given(n=st.integers(0, 2000), seed=seeds, epoch=epochs)
def test_unit_order(n: int, seed: int, epoch: int) -> None:
    order = unit_order(n, seed, epoch, True)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(order, unit_order(n, seed, epoch, True))
    assert np.array_equal(unit_order(n, seed, epoch, False), np.arange(n))
    if n >= 20:  # 20! orders: two epochs giving the same one is not a coincidence
        others = [unit_order(n, seed, e, True) for e in (epoch + 1, epoch + 2)]
        assert not all(np.array_equal(order, o) for o in others)


# -------------------------------------------------------------------------- slots_to_virtual


@FAST
@given(plan=plans())
def test_slots_to_virtual_is_a_windowed_bijection(plan: EpochPlan) -> None:
    n, c, w = plan.num_rows, plan.num_partitions, plan.window
    slots = np.arange(n, dtype=np.int64)
    virtual = all_virtual(plan)
    assert np.array_equal(np.sort(virtual), slots)
    part, pos = slots % c, slots // c
    lo = plan.starts[part]
    hi = plan.starts[part + 1]
    assert np.all((lo <= virtual) & (virtual < hi)), "slot left its partition"
    win_lo = lo + (pos // w) * w
    win_hi = np.minimum(win_lo + w, hi)
    assert np.all((win_lo <= virtual) & (virtual < win_hi)), "slot left its window"
    if not plan.shuffle:
        assert np.array_equal(virtual, lo + pos)
    # Deterministic.
    assert np.array_equal(virtual, all_virtual(plan))


@FAST
@given(plan=plans(), data=st.data())
def test_slots_to_virtual_is_pointwise(plan: EpochPlan, data: st.DataObject) -> None:
    """Any subset of slots, in any order, maps as it does within the full range."""
    if plan.num_rows == 0:
        assert slots_to_virtual(plan, np.zeros(0, dtype=np.int64)).size == 0
        return
    full = all_virtual(plan)
    picked = data.draw(st.lists(st.integers(0, plan.num_rows - 1), max_size=50))
    slots = np.array(picked, dtype=np.int64)
    assert np.array_equal(slots_to_virtual(plan, slots), full[slots])


@FAST
@given(layout=layouts, max_unit_rows=st.integers(1, 40), seed=seeds, epoch=epochs)
def test_slots_to_virtual_identity_without_shuffle_or_partitions(
    layout: list[list[int]], max_unit_rows: int, seed: int, epoch: int
) -> None:
    units = make_units(layout, max_unit_rows)
    plan = plan_epoch(units, seed=seed, epoch=epoch, shuffle=False, num_partitions=1, window=7)
    assert np.array_equal(all_virtual(plan), np.arange(plan.num_rows))
    # With one partition and one window covering everything, only the unit order shuffles.
    shuffled = plan_epoch(
        units, seed=seed, epoch=epoch, shuffle=True, num_partitions=1, window=10**6
    )
    assert np.array_equal(np.sort(all_virtual(shuffled)), np.arange(plan.num_rows))


# ------------------------------------------------------------------------------- batch_slots


@FAST
@given(start=st.integers(0, 2000), length=st.integers(0, 100), c=st.integers(1, 20))
def test_batch_slots_are_partition_major(start: int, length: int, c: int) -> None:
    slots = batch_slots(start, start + length, c)
    assert np.array_equal(np.sort(slots), np.arange(start, start + length))
    key = (slots % c) * (start + length + 1) + slots  # partition first, then slot
    assert np.all(np.diff(key) > 0)


# ------------------------------------------------------------------------------- rank_bounds


@FAST
@given(length=st.integers(0, 200), world_size=st.integers(1, 16))
def test_rank_bounds_tile_the_batch(length: int, world_size: int) -> None:
    bounds = [rank_bounds(length, world_size, r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    for (_, hi), (lo, _) in itertools.pairwise(bounds):
        assert hi == lo
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@FAST
@given(
    position=st.integers(0, 2100),
    n=st.integers(0, 2000),
    batch=st.integers(1, 64),
    drop_last=st.booleans(),
)
def test_steps_in_epoch(position: int, n: int, batch: int, drop_last: bool) -> None:
    sizes = [min(batch, n - s) for s in range(position, n, batch)]
    expected = sum(1 for k in sizes if k == batch or not drop_last)
    assert steps_in_epoch(position, n, batch, drop_last) == expected


# --------------------------------------------------------------------------------- batches


@SLOW
@given(
    plan=plans(small_layouts),
    world_size=st.integers(1, 8),
    batch=st.integers(1, 10),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_batches_deliver_each_row_once_for_any_topology(
    plan: EpochPlan, world_size: int, batch: int, drop_last: bool, data: st.DataObject
) -> None:
    n = plan.num_rows
    g = data.draw(st.integers(0, n), label="start position G")
    full = all_virtual(plan)
    steps = steps_in_epoch(g, n, batch, drop_last)
    delivered: list[np.ndarray] = []
    for step in range(steps):
        start = g + step * batch
        stop = min(start + batch, n)
        assert stop > start
        if drop_last:
            assert stop - start == batch
        slots = batch_slots(start, stop, plan.num_partitions)
        assert np.array_equal(np.sort(slots), np.arange(start, stop))
        expected = full[slots]

        # One rank with the whole batch.
        (whole,) = batch_specs(
            plan, first_step=step, num_steps=1, start=g, global_batch=batch, world_size=1, rank=0
        )
        assert (whole.step, whole.slot_start, whole.slot_stop) == (step, start, stop)
        assert whole.num_rows == stop - start
        assert np.array_equal(decode(plan, whole), expected)

        # The rank shares, in rank order, rebuild exactly that batch.
        shares = []
        for rank in range(world_size):
            (spec,) = batch_specs(
                plan,
                first_step=step,
                num_steps=1,
                start=g,
                global_batch=batch,
                world_size=world_size,
                rank=rank,
            )
            assert np.all(np.diff(spec.positions) > 0)
            lo, hi = rank_bounds(stop - start, world_size, rank)
            assert spec.num_rows == hi - lo
            rows = decode(plan, spec)
            assert np.array_equal(rows, expected[lo:hi])
            shares.append(rows)
        assert np.array_equal(np.concatenate(shares), expected)
        delivered.append(expected)

    got = np.concatenate(delivered) if delivered else np.zeros(0, dtype=np.int64)
    assert len(np.unique(got)) == len(got), "a row was delivered twice"
    end = g + steps * batch if drop_last else n
    assert np.array_equal(np.sort(got), np.sort(full[g:end]))
    dropped = n - g - len(got)
    assert dropped == ((n - g) % batch if drop_last else 0)
    if g == 0 and not drop_last:
        assert np.array_equal(np.sort(got), np.arange(n))


# ------------------------------------------------------------------------------ release_slots


def last_use(plan: EpochPlan) -> np.ndarray:
    """Last global slot that maps into the piece at each position (-1 if none)."""
    pos, _ = virtual_to_piece(plan, all_virtual(plan))
    last = np.full(plan.num_pieces, -1, dtype=np.int64)
    np.maximum.at(last, pos, np.arange(plan.num_rows, dtype=np.int64))
    return last


@FAST
@given(plan=plans())
def test_release_after_last_use(plan: EpochPlan) -> None:
    positions = np.arange(plan.num_pieces, dtype=np.int64)
    release = release_slots(plan, positions)
    assert release.shape == positions.shape
    last = last_use(plan)
    assert np.all(last >= 0), "every unit is used in the epoch"
    assert np.all(release > last), "a unit would be released before its last use"
    assert np.all(release <= plan.num_rows)
    # Any subset of positions, in any order, gives the same answer.
    rev = positions[::-1].copy()
    assert np.array_equal(release_slots(plan, rev), release[::-1])


@FAST
@given(plan=plans())
def test_release_matches_last_overlapping_window(plan: EpochPlan) -> None:
    """The documented rule: released once every window that overlaps the unit is consumed."""
    c_count, w = plan.num_partitions, plan.window
    sizes = np.diff(plan.starts)
    expected = np.zeros(plan.num_pieces, dtype=np.int64)
    for c in range(c_count):
        for win in range(-(-int(sizes[c]) // w)):
            v_lo = int(plan.starts[c]) + win * w
            v_hi = min(v_lo + w, int(plan.starts[c + 1]))
            last_slot = (v_hi - int(plan.starts[c]) - 1) * c_count + c
            overlapping = (plan.offsets[:-1] < v_hi) & (plan.offsets[1:] > v_lo)
            expected[overlapping] = np.maximum(expected[overlapping], last_slot + 1)
    positions = np.arange(plan.num_pieces, dtype=np.int64)
    assert np.array_equal(release_slots(plan, positions), expected)


@FAST
@given(plan=plans())
def test_pieces_cut_units_only_at_partition_boundaries(plan: EpochPlan) -> None:
    part_of_first = np.searchsorted(plan.starts, plan.offsets[:-1], side="right") - 1
    part_of_last = np.searchsorted(plan.starts, plan.offsets[1:] - 1, side="right") - 1
    assert np.array_equal(part_of_first, part_of_last), "a piece spans two partitions"
    assert plan.num_pieces <= len(plan.units) + plan.num_partitions - 1
    # Pieces of a unit tile it, in order, and follow the unit order of the epoch.
    rows = plan.piece_rows(np.arange(plan.num_pieces))
    for unit in range(len(plan.units)):
        mine = np.nonzero(plan.piece_unit == unit)[0]
        starts = plan.piece_start[mine]
        assert starts[0] == 0 and np.all(np.diff(mine) == 1)
        assert np.array_equal(starts[1:], np.cumsum(rows[mine])[:-1])
        assert rows[mine].sum() == plan.units.num_rows[unit]
    assert np.array_equal(plan.piece_unit[plan.piece_start == 0], plan.order)


@SLOW
@given(plan=plans(small_layouts), batch=st.integers(1, 10), world_size=st.integers(1, 4))
def test_units_needed_by_a_step_are_not_released_yet(
    plan: EpochPlan, batch: int, world_size: int
) -> None:
    full = all_virtual(plan)
    for step in range(steps_in_epoch(0, plan.num_rows, batch, False)):
        start, stop = step * batch, min((step + 1) * batch, plan.num_rows)
        slots = batch_slots(start, stop, plan.num_partitions)
        for rank in range(world_size):
            (spec,) = batch_specs(
                plan,
                first_step=step,
                num_steps=1,
                start=0,
                global_batch=batch,
                world_size=world_size,
                rank=rank,
            )
            lo, hi = rank_bounds(len(slots), world_size, rank)
            pos, _ = virtual_to_piece(plan, full[slots[lo:hi]])
            release = release_slots(plan, spec.positions)
            for p, r in zip(spec.positions.tolist(), release.tolist(), strict=True):
                assert r > slots[lo:hi][pos == p].max()
                assert r > start  # still held when the step is built


# ------------------------------------------------------------------------ RNG stream separation


def test_unit_order_and_first_window_use_different_streams() -> None:
    units = make_units([[1] * 64], 1)
    plan = plan_epoch(units, seed=3, epoch=0, shuffle=True, num_partitions=1, window=64)
    assert not np.array_equal(plan.order, slots_to_virtual(plan, np.arange(64)))


def test_large_seeds_do_not_alias_other_epochs() -> None:
    assert not np.array_equal(unit_order(100, 2**32, 0, True), unit_order(100, 0, 1, True))
