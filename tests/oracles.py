"""Test oracles: slow, obvious versions of what the package computes fast.

They are built only from the pure, separately tested functions of :mod:`lakeloader.order.plan`
(one slot at a time where the package vectorises), so that the package's results can be
compared with them.
"""

from __future__ import annotations

import numpy as np

from lakeloader.order.batches import BatchSpec
from lakeloader.order.plan import (
    EpochPlan,
    batch_slots,
    rank_bounds,
    slots_to_virtual,
    virtual_to_piece,
)


def batch_spec(
    plan: EpochPlan, step: int, slot_start: int, slot_stop: int, world_size: int, rank: int
) -> BatchSpec:
    """One rank's share of the global batch ``[slot_start, slot_stop)``, slot by slot.

    The rank takes its ``rank_bounds`` slice of the batch's slots (partition-major), each slot
    is mapped to its virtual row, then to its piece and row inside the piece; the pieces are
    listed once each, sorted, and ``take`` indexes their concatenation. ``step`` only labels
    the result; an empty range gives an empty share.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size: {rank}, {world_size}")
    if slot_start < slot_stop and (slot_start < 0 or slot_stop > plan.num_rows):
        raise ValueError(f"slots outside the epoch's {plan.num_rows}")
    slots = batch_slots(slot_start, slot_stop, plan.num_partitions)
    lo, hi = rank_bounds(len(slots), world_size, rank)
    piece, row = virtual_to_piece(plan, slots_to_virtual(plan, slots[lo:hi]))
    positions, inverse = np.unique(piece, return_inverse=True)
    sizes = plan.piece_rows(positions)
    base = np.cumsum(sizes) - sizes
    return BatchSpec(
        step,
        slot_start,
        slot_stop,
        positions.astype(np.int64),
        (base[inverse] + row).astype(np.int64),
        inverse.astype(np.int64),
        row.astype(np.int64),
    )


def all_virtual(plan: EpochPlan) -> np.ndarray:
    """Virtual row of every global slot 0..N-1."""
    return slots_to_virtual(plan, np.arange(plan.num_rows, dtype=np.int64))


def decode(plan: EpochPlan, spec: BatchSpec) -> np.ndarray:
    """Virtual rows that a BatchSpec designates, independently of how it was built."""
    sizes = plan.piece_rows(spec.positions)
    ends = np.cumsum(sizes)
    assert np.all((spec.take >= 0) & (spec.take < (ends[-1] if len(ends) else 0)))
    k = np.searchsorted(ends, spec.take, side="right")
    base = ends - sizes
    # Every listed unit is really used by the rank (no unit is fetched for nothing).
    assert np.array_equal(np.unique(k), np.arange(len(spec.positions)))
    return plan.offsets[spec.positions[k]] + spec.take - base[k]


def first_need_units(
    plan: EpochPlan, position: int, global_batch: int, world_size: int, rank: int, steps: int
) -> list[tuple[int, int, int, int]]:
    """The pieces a rank decodes, in the order it first needs them: slot by slot, step by step.

    Brute force over the plan's pure functions (one step at a time, every slot mapped), as an
    independent check of the tracker's vectorised view.
    """
    order: list[int] = []
    for k in range(steps):
        start = position + k * global_batch
        stop = min(start + global_batch, plan.num_rows)
        slots = batch_slots(start, stop, plan.num_partitions)
        lo, hi = rank_bounds(len(slots), world_size, rank)
        pieces, _ = virtual_to_piece(plan, slots_to_virtual(plan, slots[lo:hi]))
        order += [p for p in sorted(set(pieces.tolist())) if p not in order]
    out = []
    for p in order:
        unit = int(plan.piece_unit[p])
        rows = int(plan.offsets[p + 1] - plan.offsets[p])
        start = int(plan.units.row_start[unit] + plan.piece_start[p])
        out.append((int(plan.units.file_index[unit]), int(plan.units.row_group[unit]), start, rows))
    return out
