"""Where every rank and worker stands, derived from a position: files, row groups, row offsets.

Pure functions of an epoch's plan, its snapshot, a position ``G`` and a topology. Work is dealt
to workers in a fixed order (:mod:`lakeloader.workers.dispatch`): step ``k`` is built by worker
``k mod W``, or the ``j``-th unit a rank decodes is decoded by worker ``j mod W``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lakeloader.lake.snapshot import Snapshot
from lakeloader.order.batches import batch_specs
from lakeloader.order.plan import (
    EpochPlan,
    batch_slots,
    piece_span,
    rank_bounds,
    slots_to_virtual,
    virtual_to_piece,
)
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology

#: Steps planned at once while looking for the units the workers decode first.
_LOOKAHEAD_CHUNK = 8


@dataclass(frozen=True)
class Location:
    """Where a row lives in the lake.

    Attributes:
        slot: Its global slot in the epoch (a mixture's source's: its position in that
            source's epoch; None for where a unit starts, which need not be a row the rank
            takes).
        file_index: Its file's index in the snapshot.
    """

    slot: int | None
    file_index: int
    file: str
    row_group: int
    row_offset: int


@dataclass(frozen=True)
class RankView:
    """What a rank takes next.

    Attributes:
        rows: Rows of its share of the next global batch.
        at: Where the first of them lives, or None when it has no share.
    """

    rank: int
    rows: int
    at: Location | None


@dataclass(frozen=True)
class SourceView:
    """Where a source of a mixture or a packed stream stands: what it gives next.

    Attributes:
        source: Its name (a packed lake's only source: ``"lake"``).
        epoch: Its epoch (a followed lake's increment).
        position: Rows (a packed source's samples) of that epoch given out.
        num_rows: Rows (samples) in that epoch.
        at: Where its next row lives (a packed source's: the first row of the unit its next
            sample begins in); None while a followed lake's next rows are not in.
    """

    source: str
    epoch: int
    position: int
    num_rows: int
    at: Location | None


@dataclass(frozen=True)
class WorkerView:
    """What a worker of a rank does first from the position.

    Attributes:
        role: ``"build"`` (it builds batches: a transform or collate_fn) or ``"decode"`` (it
            decodes units; the rank's process assembles batches).
        step_offset: For ``"build"``: which next step it builds (0 is the next one).
        rows: For ``"build"``: the rank's rows of that step; for ``"decode"``: the rows of
            the unit it decodes.
        at: For ``"build"``: where the step's first row lives; for ``"decode"``: where the
            unit starts (its first row). None when it has nothing left to do.
    """

    rank: int
    worker: int
    role: str
    step_offset: int | None
    rows: int
    at: Location | None


def rank_dict(view: RankView | WorkerView) -> dict[str, object]:
    """A rank's or a worker's view as plain types, the location's fields inline (None without)."""
    out = asdict(view)
    at = out.pop("at") or dict.fromkeys(("slot", "file_index", "file", "row_group", "row_offset"))
    return {**out, **at}


def locate(plan: EpochPlan, snapshot: Snapshot, slots: np.ndarray) -> list[Location]:
    """Where the rows of global slots live: file, row group and row offset in the row group."""
    slots = np.asarray(slots, dtype=np.int64)
    pos, row = virtual_to_piece(plan, slots_to_virtual(plan, slots))
    unit = plan.piece_unit[pos]
    files = plan.units.file_index[unit].tolist()
    groups = plan.units.row_group[unit].tolist()
    offsets = (plan.units.row_start[unit] + plan.piece_start[pos] + row).tolist()
    return [
        Location(s, f, snapshot.files[f].path, g, o)
        for s, f, g, o in zip(slots.tolist(), files, groups, offsets, strict=True)
    ]


def step_shares(
    plan: EpochPlan, snapshot: Snapshot, position: int, steps: int, topo: Topology, step: int
) -> list[RankView]:
    """Each rank's share of the ``step``-th next global batch (0: the next one).

    A rank with no share (``step`` not among the ``steps`` left, or an empty share of a short
    last batch) has no location.
    """
    start = position + step * topo.global_batch
    stop = min(start + topo.global_batch, plan.num_rows)
    slots = batch_slots(start, stop, plan.num_partitions) if step < steps else np.zeros(0, int)
    return rank_shares(plan, snapshot, slots, topo.world_size)


def rank_shares(
    plan: EpochPlan, snapshot: Snapshot, slots: np.ndarray, world_size: int
) -> list[RankView]:
    """Each rank's share of a global batch's ``slots`` (in batch order), where it begins."""
    bounds = [rank_bounds(len(slots), world_size, r) for r in range(world_size)]
    where = iter(locate(plan, snapshot, slots[[lo for lo, hi in bounds if hi > lo]]))
    return [
        RankView(r, hi - lo, next(where) if hi > lo else None) for r, (lo, hi) in enumerate(bounds)
    ]


def first_units(
    plan: EpochPlan,
    snapshot: Snapshot,
    position: int,
    steps: int,
    topo: Topology,
    rank: int,
    count: int,
    skipped: Sequence[QuarantineEntry] = (),
) -> list[int]:
    """The first ``count`` pieces a rank decodes from ``position``, in the order it does.

    The order is that of first need: step by step, each step's new pieces by position. Pieces
    that ``skipped`` (quarantined or lost units) covers are never decoded and are left out;
    ``steps``: steps left in the epoch from ``position``.
    """
    out: list[int] = []
    seen: set[int] = set()
    first = 0
    while len(out) < count and first < steps:
        n = min(_LOOKAHEAD_CHUNK, steps - first)
        specs = batch_specs(
            plan,
            first_step=first,
            num_steps=n,
            start=position,
            global_batch=topo.global_batch,
            world_size=topo.world_size,
            rank=rank,
        )
        new = dict.fromkeys(p for s in specs for p in s.positions.tolist() if p not in seen)
        seen.update(new)
        out += [p for p in new if not piece_skipped(plan, snapshot, p, skipped)]
        first += n
    return out[:count]


def piece_skipped(
    plan: EpochPlan, snapshot: Snapshot, piece: int, skipped: Sequence[QuarantineEntry]
) -> bool:
    """Whether a piece is left out: one entry covers all of it (the unit store's rule)."""
    if not skipped:
        return False
    f, rg, start, rows = piece_span(plan, piece)
    path = snapshot.files[f].path
    return any(e.covers(path, rg, start, rows) for e in skipped)


def worker_views(
    plan: EpochPlan,
    snapshot: Snapshot,
    position: int,
    topo: Topology,
    *,
    steps: int,
    workers_build: bool,
    skipped: Sequence[QuarantineEntry] = (),
) -> list[WorkerView]:
    """What each worker of each rank does first from ``position`` (see the module docstring).

    ``steps``: global steps left in the epoch from ``position``; ``workers_build``: whether
    workers build batches (else they decode units); ``skipped``: units never decoded.
    """
    if workers_build:
        by_step = [
            step_shares(plan, snapshot, position, steps, topo, k) for k in range(topo.num_workers)
        ]
        return [
            WorkerView(r, k, "build", k, by_step[k][r].rows, by_step[k][r].at)
            for r in range(topo.world_size)
            for k in range(topo.num_workers)
        ]
    out = []
    for r in range(topo.world_size):
        pieces = first_units(plan, snapshot, position, steps, topo, r, topo.num_workers, skipped)
        for k in range(topo.num_workers):
            if k >= len(pieces):
                out.append(WorkerView(r, k, "decode", None, 0, None))
                continue
            f, rg, start, rows = piece_span(plan, pieces[k])
            at = Location(None, f, snapshot.files[f].path, rg, start)
            out.append(WorkerView(r, k, "decode", None, rows, at))
    return out
