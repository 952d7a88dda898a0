"""Test oracles: slow, obvious versions of what the package computes fast.

They are built only from the pure, separately tested functions of :mod:`lakeloader.order.plan`
(one slot at a time where the package vectorises), so that the package's results can be
compared with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lakeloader.order.batches import BatchSpec
from lakeloader.order.mixture import MixDraw, PartTable, _epoch_of, epoch_first
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


# ------------------------------------------------- a mixture's parts, step by step


@dataclass(frozen=True)
class MixPart:
    """The rows of one epoch of one source in a rank's share of a global batch.

    A source's rows in a share are consecutive in its stream (its draws are counted in slot
    order), so within one of its epochs they are the positions ``[start, stop)`` of that
    epoch's order (:mod:`lakeloader.order.plan`'s slots).

    Attributes:
        source: The source (an index into the mixture's names).
        epoch: The source's epoch.
        start: First position in that epoch's order.
        stop: One past the last.
        at: Where each of these rows stands in the rank's share (slot order), position by
            position.
    """

    source: int
    epoch: int
    start: int
    stop: int
    at: np.ndarray


def rank_parts(
    draw: MixDraw, rows: Sequence[int], world_size: int, rank: int
) -> tuple[np.ndarray, list[MixPart]]:
    """A rank's share of a global batch (``draw``): each row's source, and the parts to read.

    The rank takes the slots :func:`~lakeloader.order.plan.rank_bounds` gives it, in slot order,
    so the ranks' shares laid end to end are the global batch whatever the world size.

    Args:
        draw: The global batch's slots.
        rows: Rows of one epoch of each source, in the order of the weights' names.
        world_size: Ranks sharing the batch.
        rank: This rank.

    Returns:
        The source of each row of the share, and its parts, by source then epoch.

    >>> from lakeloader.order.mixture import MixCursor, MixWeights
    >>> w = MixWeights.of({"a": 1, "b": 1})
    >>> draw, _ = MixCursor(0, {"a": 3}).take(w, seed=0, count=8)
    >>> draw.sources.tolist(), draw.offsets.tolist()
    ([1, 0, 0, 1, 0, 1, 1, 0], [0, 3, 4, 1, 5, 2, 3, 6])
    >>> sources, parts = rank_parts(draw, [4, 10], world_size=2, rank=0)
    >>> [(p.source, p.epoch, p.start, p.stop, p.at.tolist()) for p in parts]
    [(0, 0, 3, 4, [1]), (0, 1, 0, 1, [2]), (1, 0, 0, 2, [0, 3])]
    """
    ((sources, parts),) = rank_parts_many(draw, rows, 1, world_size, rank)
    return sources, parts


def _small(keys: np.ndarray, bound: int) -> np.ndarray:
    """``keys`` (all below ``bound``) in the smallest unsigned type that holds them.

    numpy sorts 8- and 16-bit keys stably by radix, in linear time.

    >>> _small(np.array([3, 1]), 300).dtype
    dtype('uint16')
    """
    for dtype in (np.uint8, np.uint16):
        if bound <= np.iinfo(dtype).max + 1:
            return keys.astype(dtype)
    return keys


def part_table(
    draw: MixDraw, rows: Sequence[int], steps: int, world_size: int, rank: int
) -> PartTable:
    """A rank's parts of ``steps`` consecutive global batches of equal size.

    The batches lie end to end in ``draw``; the work is a few array operations for all the
    steps, not a loop over them.
    """
    size = len(draw.sources) // steps
    lo, hi = rank_bounds(size, world_size, rank)
    sources = draw.sources.reshape(steps, size)[:, lo:hi]
    flat, offsets = sources.ravel(), draw.offsets.reshape(steps, size)[:, lo:hi].ravel()
    epoch = _epoch_of(rows, flat, offsets)
    position = offsets - epoch_first(rows, flat, epoch)
    width = hi - lo
    step = np.repeat(np.arange(steps, dtype=np.int64), width)
    # One key per (step, source, epoch): a stable sort groups the parts, each in slot order.
    low = int(epoch.min()) if len(epoch) else 0
    span = int(epoch.max()) - low + 1 if len(epoch) else 1
    combined = (step * len(rows) + flat) * span + (epoch - low)
    order = np.argsort(_small(combined, steps * len(rows) * span), kind="stable")
    ordered = combined[order]
    first = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    last = np.concatenate([first[1:], [len(order)]]) - 1
    head, tail = order[first], order[last]
    return PartTable(
        shares=sources,
        step=step[head],
        source=flat[head],
        epoch=epoch[head],
        start=position[head],
        stop=position[tail] + 1,
        at=order % max(width, 1),
        at_start=first,
    )


def rank_parts_many(
    draw: MixDraw, rows: Sequence[int], steps: int, world_size: int, rank: int
) -> list[tuple[np.ndarray, list[MixPart]]]:
    """:func:`rank_parts` of ``steps`` consecutive global batches of equal size, at once.

    :func:`part_table`'s parts as values.
    """
    table = part_table(draw, rows, steps, world_size, rank)
    out: list[tuple[np.ndarray, list[MixPart]]] = [(row, []) for row in table.shares]
    cuts = np.cumsum(table.stop - table.start)[:-1]
    columns = zip(
        table.step.tolist(),
        table.source.tolist(),
        table.epoch.tolist(),
        table.start.tolist(),
        table.stop.tolist(),
        np.split(table.at, cuts),
        strict=True,
    )
    for k, source, epoch, start, stop, where in columns:
        out[k][1].append(MixPart(source, epoch, start, stop, where))
    return out


# ------------------------------------------------- packed token streams, token by token

#: A sample of a packed epoch: its stream, its index in that stream, and ``[3, L]`` int64
#: rows: its tokens, each token's position in its document, and its pad mask (1: padding).
PackedSample = tuple[int, int, np.ndarray]


def packed_epoch(
    units: Sequence[Sequence[Sequence[int]] | int],
    streams: int,
    seq_len: int,
    eos_id: int | None,
    pad_id: int = 0,
) -> list[PackedSample]:
    """An epoch's samples in the epoch's order, token by token, as :mod:`lakeloader.order.packing`
    says.

    ``units`` are the epoch's units in its order, each its rows' token lists in file order (a
    row is its tokens then ``eos_id``), or a skipped unit's count of tokens: padding in their
    place (position 0). The ``T`` tokens are cut into ``streams`` contiguous streams (stream
    ``c`` holds ``[c T // C, (c + 1) T // C)``), each into samples of ``seq_len`` (its last one
    padded); the samples are dealt round robin over the streams, a stream with none left passed
    over.

    >>> [(c, k, s[0].tolist()) for c, k, s in packed_epoch([[[5, 6]], 2, [[7]]], 2, 2, 9)]
    [(0, 0, [5, 6]), (1, 0, [0, 0]), (0, 1, [9, 0]), (1, 1, [7, 9])]
    """
    tokens: list[int] = []
    positions: list[int] = []
    pads: list[int] = []
    for unit in units:
        if isinstance(unit, int):
            tokens += [pad_id] * unit
            positions += [0] * unit
            pads += [1] * unit
            continue
        for row in unit:
            doc = [*row] + ([] if eos_id is None else [eos_id])
            tokens += doc
            positions += range(len(doc))
            pads += [0] * len(doc)
    total = len(tokens)
    cut = []
    for c in range(streams):
        a, b = c * total // streams, (c + 1) * total // streams
        fill = -(b - a) % seq_len
        rows = np.array(
            [tokens[a:b] + [pad_id] * fill, positions[a:b] + [0] * fill, pads[a:b] + [1] * fill],
            dtype=np.int64,
        )
        cut.append(rows.reshape(3, -1, seq_len).transpose(1, 0, 2))
    out: list[PackedSample] = []
    for k in range(max(len(s) for s in cut)):
        out += [(c, k, s[k]) for c, s in enumerate(cut) if k < len(s)]
    return out


def packed_steps(
    epoch: Callable[[str, int], Sequence[PackedSample]],
    drawn: Sequence[str],
    counts: Mapping[str, int],
    batch: int,
) -> list[list[tuple[str, int, np.ndarray]]]:
    """Global steps of packed samples, one sample at a time.

    ``drawn`` names the source of each global slot from where the sources stood (``counts``:
    each one's samples delivered so far, its epochs one after the other; a source not in it is
    at 0); ``epoch(name, e)`` is that source's epoch ``e`` (:func:`packed_epoch`). Each step is
    the next ``batch`` slots, each slot its source's next sample, sorted by (source name,
    epoch, stream, index): a list of (source name, the sample's index in its source's stream,
    the sample).
    """
    at = dict(counts)
    steps = []
    for t in range(len(drawn) // batch):
        keyed = []
        for name in drawn[t * batch : (t + 1) * batch]:
            n = at.get(name, 0)
            at[name] = n + 1
            per_epoch = len(epoch(name, 0))
            stream, index, sample = epoch(name, n // per_epoch)[n % per_epoch]
            keyed.append(((name, n // per_epoch, stream, index), (name, n, sample)))
        steps.append([x for _, x in sorted(keyed, key=lambda kv: kv[0])])
    return steps
