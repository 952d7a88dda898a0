"""``screen``: a step's rows renumbered around quarantined units, and the path each column takes.

Real plans and shares (``plan_epoch``, ``batch_specs``); what the store would hold for each
piece is made of the real ``UnitRef`` and ``QuarantineEntry`` types. Each piece's arena start
is ``ARENA_BASE`` plus its virtual offset, so the arena row of a batch row must be
``ARENA_BASE`` plus its virtual row, which the oracle ``decode`` gives independently.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from lakeloader.cache.decode import Held, UnitRef
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.screening import by_all, screen
from lakeloader.order.batches import BatchSpec, batch_specs
from lakeloader.order.plan import EpochPlan, make_units, plan_epoch, steps_in_epoch
from lakeloader.state.quarantine import QuarantineEntry
from tests.conftest import FAST, plans
from tests.oracles import decode

LAYOUT = RowLayout.of(pa.schema([("id", pa.int64()), ("s", pa.string()), ("x", pa.float32())]))
COLUMNS = 4  # id, x and s, and one column (say a list) that only the Arrow path carries
ARENA_BASE = 1000


def held_for(
    plan: EpochPlan,
    spec: BatchSpec,
    bad: list[bool],
    packed: tuple[str, ...] = LAYOUT.names,
    views: tuple[str, ...] = LAYOUT.views,
) -> list[Held]:
    """What the store holds for each piece of a step: a unit, or its quarantine entry."""
    out: list[Held] = []
    for position, quarantined in zip(spec.positions.tolist(), bad, strict=True):
        rows = int(plan.piece_rows(np.array([position]))[0])
        if quarantined:
            out.append(QuarantineEntry(f"f{position}", 0, 0, rows, "bad page"))
        else:
            start = ARENA_BASE + int(plan.offsets[position])
            out.append(UnitRef(start, rows, packed, pa.table({"n": [0] * rows}), views))
    return out


def small_plan() -> EpochPlan:
    units = make_units([[5, 7], [], [6, 3]], max_unit_rows=4)
    return plan_epoch(units, seed=3, epoch=1, shuffle=True, num_partitions=2, window=3)


@FAST
@given(plan=plans(), batch=st.integers(1, 30), world_size=st.integers(1, 3), data=st.data())
def test_rows_are_renumbered_around_quarantined_units(
    plan: EpochPlan, batch: int, world_size: int, data: st.DataObject
) -> None:
    steps = steps_in_epoch(0, plan.num_rows, batch, drop_last=False)
    if not steps:
        return
    step = data.draw(st.integers(0, steps - 1), label="step")
    rank = data.draw(st.integers(0, world_size - 1), label="rank")
    (spec,) = batch_specs(
        plan,
        first_step=step,
        num_steps=1,
        start=0,
        global_batch=batch,
        world_size=world_size,
        rank=rank,
    )
    n = len(spec.positions)
    bad = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="bad")
    held = held_for(plan, spec, bad)

    got = screen(spec, held, plan, LAYOUT, COLUMNS)

    virtual = decode(plan, spec)  # each batch row's virtual row, in batch order
    good = ~np.asarray(bad, dtype=bool)[spec.inverse] if n else np.zeros(0, dtype=bool)
    assert got.skipped == tuple(h for h in held if isinstance(h, QuarantineEntry))
    assert got.lost == int((~good).sum())
    assert got.refs == [h for h in held if isinstance(h, UnitRef)]
    # The packed path: each kept row's arena row, in batch order.
    assert got.rows is not None
    assert got.rows.tolist() == (ARENA_BASE + virtual[good]).tolist()
    # The Arrow path: ``take`` indexes the concatenation of the kept units, in order.
    kept = [p for p, b in zip(spec.positions.tolist(), bad, strict=True) if not b]
    concat = (
        np.concatenate(
            [plan.offsets[p] + np.arange(plan.piece_rows(np.array([p]))[0]) for p in kept]
        )
        if kept
        else np.zeros(0, dtype=np.int64)
    )
    assert concat[got.take].tolist() == virtual[good].tolist()
    assert (got.names, got.views) == (LAYOUT.names, LAYOUT.views)


def test_without_quarantine_the_spec_passes_through() -> None:
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=2, num_steps=1, start=0, global_batch=8, world_size=1, rank=0
    )
    held = held_for(plan, spec, [False] * len(spec.positions))
    got = screen(spec, held, plan, LAYOUT, COLUMNS)
    assert got.take is spec.take
    assert (got.skipped, got.lost) == ((), 0)
    assert got.rows is not None
    assert got.rows.tolist() == (ARENA_BASE + decode(plan, spec)).tolist()


def test_when_every_column_is_in_the_arena_the_arrow_path_gets_nothing() -> None:
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=0, num_steps=1, start=0, global_batch=8, world_size=2, rank=1
    )
    held = held_for(plan, spec, [False] * len(spec.positions))
    got = screen(spec, held, plan, LAYOUT, num_columns=3)  # id, x packed; s as views
    assert (got.refs, got.take.tolist()) == ([], [])
    assert got.rows is not None and len(got.rows) == spec.num_rows
    assert (got.names, got.views) == (("id", "x"), ("s",))


def test_a_column_packed_in_only_some_units_takes_the_arrow_path() -> None:
    """A unit with integer nulls in ``x`` keeps ``x`` in its table: no unit's ``x`` is packed."""
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=0, num_steps=1, start=0, global_batch=12, world_size=1, rank=0
    )
    assert len(spec.positions) >= 2
    held = held_for(plan, spec, [False] * len(spec.positions))
    first = held[0]
    assert isinstance(first, UnitRef)
    held[0] = UnitRef(first.start, first.num_rows, ("id",), first.table, first.views)
    got = screen(spec, held, plan, LAYOUT, num_columns=3)
    assert (got.names, got.views) == (("id",), ("s",))
    assert got.refs == held and got.take is spec.take  # x comes from the tables
    assert got.rows is not None


def test_views_missing_in_one_unit_leave_strings_to_the_arrow_path() -> None:
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=1, num_steps=1, start=0, global_batch=12, world_size=1, rank=0
    )
    held = held_for(plan, spec, [False] * len(spec.positions))
    first = held[-1]
    assert isinstance(first, UnitRef)
    held[-1] = UnitRef(first.start, first.num_rows, first.packed, first.table, ())
    got = screen(spec, held, plan, LAYOUT, num_columns=3)
    assert (got.names, got.views) == (("id", "x"), ())
    assert got.refs == held


def test_units_with_nothing_packed_take_the_arrow_path_only() -> None:
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=0, num_steps=1, start=0, global_batch=12, world_size=1, rank=0
    )
    held = held_for(plan, spec, [False] * len(spec.positions), packed=(), views=())
    got = screen(spec, held, plan, LAYOUT, num_columns=3)
    assert (got.names, got.views, got.rows) == ((), (), None)
    assert got.take is spec.take
    without_arena = screen(spec, held, plan, None, num_columns=3)
    assert (without_arena.names, without_arena.rows) == ((), None)


def test_a_step_whose_units_are_all_quarantined_delivers_no_row() -> None:
    plan = small_plan()
    (spec,) = batch_specs(
        plan, first_step=0, num_steps=1, start=0, global_batch=8, world_size=1, rank=0
    )
    held = held_for(plan, spec, [True] * len(spec.positions))
    got = screen(spec, held, plan, LAYOUT, COLUMNS)
    assert (got.refs, got.take.tolist(), got.lost) == ([], [], spec.num_rows)
    assert len(got.skipped) == len(spec.positions)
    assert got.rows is not None and got.rows.tolist() == []


def test_by_all_keeps_the_layout_order_of_the_common_columns() -> None:
    full = ("a", "b", "c")
    refs = [UnitRef(0, 1, ("c", "a"), None), UnitRef(1, 1, ("a", "b", "c"), None)]
    assert by_all(refs, full, "packed") == ("a", "c")
    same = [UnitRef(0, 1, full, None), UnitRef(1, 1, full, None)]
    assert by_all(same, full, "packed") is full
    copies = [UnitRef(0, 1, tuple(full), None), UnitRef(1, 1, ("a", "b", "c"), None)]
    assert by_all(copies, full, "packed") is full  # units decoded elsewhere hold equal copies
