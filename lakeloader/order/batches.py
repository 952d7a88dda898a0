"""One rank's share of global batches: which pieces, and which of their rows in what order.

The shares of many consecutive steps are planned at once, vectorised across steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from lakeloader.order.plan import (
    EpochPlan,
    batch_runs,
    batch_slots,
    count_reached,
    expand_runs,
    rank_bounds,
    rank_bounds_many,
    window_permutation,
)


@dataclass(frozen=True)
class BatchSpec:
    """What one rank needs for one step: which pieces, and which of their rows in what order.

    Attributes:
        step: Step index in the epoch (0-based, counted from the epoch's start position).
        slot_start: First global slot of the global batch.
        slot_stop: One past the last global slot of the global batch.
        positions: Sorted unique positions of the pieces needed.
        take: Row indices into the concatenation of those pieces, in batch order.
        inverse: For each row, in batch order, the index into ``positions`` of its piece.
        row: For each row, in batch order, the row inside its piece. With ``base`` the start
            of each piece in the concatenation, ``take == base[inverse] + row``.
    """

    step: int
    slot_start: int
    slot_stop: int
    positions: np.ndarray
    take: np.ndarray
    inverse: np.ndarray
    row: np.ndarray

    @property
    def num_rows(self) -> int:
        """Rows this rank gets in this step."""
        return len(self.take)


def share_slots(spec: BatchSpec, num_partitions: int, world_size: int, rank: int) -> np.ndarray:
    """The global slot of each row of a rank's share, in batch order.

    A slot is where a row stands in the epoch's order, whatever the topology.

    >>> from lakeloader.order.plan import make_units, plan_epoch
    >>> plan = plan_epoch(make_units([[8]], 8), seed=0, epoch=0, shuffle=False,
    ...                   num_partitions=2, window=4)
    >>> (spec,) = batch_specs(plan, first_step=0, num_steps=1, start=2, global_batch=4,
    ...                       world_size=2, rank=1)
    >>> share_slots(spec, 2, 2, 1).tolist()
    [3, 5]
    """
    slots = batch_slots(spec.slot_start, spec.slot_stop, num_partitions)
    lo, hi = rank_bounds(len(slots), world_size, rank)
    return slots[lo:hi]


#: :func:`_unique_inverse` flags every possible value instead of sorting while there are at
#: most this many possible values per value (flagging is far cheaper per value than sorting).
_DENSE_SPAN_PER_VALUE = 16


def _unique_inverse(values: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` by one sort, or no sort at all.

    Every value lies in ``[0, span)``; when that range is small, the values are found by
    flagging them rather than by sorting them.
    """
    if span <= _DENSE_SPAN_PER_VALUE * len(values) + 4096:
        seen = np.zeros(span, dtype=bool)
        seen[values] = True
        return np.flatnonzero(seen), (np.cumsum(seen, dtype=np.int64) - 1)[values]
    if not len(values):
        return values.astype(np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    first = np.concatenate([[True], ordered[1:] != ordered[:-1]])
    inverse = np.empty(len(values), dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


#: Runs of consecutive positions of a partition: (step index, partition, first position, length).
Runs: TypeAlias = "tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]"


def batch_specs(
    plan: EpochPlan,
    *,
    first_step: int,
    num_steps: int,
    start: int,
    global_batch: int,
    world_size: int,
    rank: int,
) -> list[BatchSpec]:
    """One rank's shares of ``num_steps`` global batches from ``first_step`` on, planned together.

    Step ``t`` covers the global slots ``[start + t * global_batch, start + (t + 1) *
    global_batch)``, cut at the end of the epoch. Each share is the rank's slice
    (:func:`~lakeloader.order.plan.rank_bounds`) of the step's slots in partition-major order
    (:func:`~lakeloader.order.plan.batch_slots`), mapped to pieces and rows.

    Returns:
        One :class:`BatchSpec` per step, in step order (their arrays are views of arrays
        shared by the call).

    Raises:
        ValueError: On a bad argument, or a step that has no slot of the epoch.
    """
    if global_batch < 1 or num_steps < 0:
        raise ValueError(f"need global_batch >= 1, num_steps >= 0: {global_batch}, {num_steps}")
    steps = first_step + np.arange(num_steps, dtype=np.int64)
    starts = start + steps * global_batch
    stops = np.minimum(starts + global_batch, plan.num_rows)
    if np.any(starts < 0) or np.any(stops <= starts):
        raise ValueError(f"steps {first_step}..{first_step + num_steps - 1} leave the epoch")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size: {rank}, {world_size}")
    return _run_specs(plan, steps, starts, stops, world_size, rank)


def range_specs(
    plan: EpochPlan, steps: np.ndarray, starts: np.ndarray, stops: np.ndarray
) -> list[BatchSpec]:
    """Specs of the slot ranges ``[starts[i], stops[i])`` of one epoch, labelled ``steps[i]``.

    For ranges of any length (a mixture's part of a rank's share, a packed plan's unit); each
    spec's rows come in the partition-major order of its range.

    >>> from lakeloader.order.plan import make_units, plan_epoch
    >>> plan = plan_epoch(make_units([[6]], 6), seed=0, epoch=0, shuffle=False,
    ...                   num_partitions=2, window=3)
    >>> [s.take.tolist() for s in range_specs(plan, np.array([0, 1]), np.array([0, 3]),
    ...                                        np.array([3, 6]))]
    [[0, 1, 3], [2, 4, 5]]

    Raises:
        ValueError: If a range is empty or leaves the epoch.
    """
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if np.any(starts < 0) or np.any(stops <= starts) or np.any(stops > plan.num_rows):
        raise ValueError(f"slot ranges must be non-empty and within {plan.num_rows} rows")
    return _run_specs(plan, np.asarray(steps, dtype=np.int64), starts, stops, 1, 0)


def _run_specs(
    plan: EpochPlan,
    steps: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    world_size: int,
    rank: int,
) -> list[BatchSpec]:
    """Specs of the rank's shares of the global batches ``[starts[i], stops[i])``."""
    runs, share = _share_runs(plan, starts, stops, world_size, rank)
    positions, per_step, key_step, piece, row = _run_core(plan, len(steps), runs)
    first = (np.cumsum(per_step) - per_step)[key_step]  # first key of each key's step
    offset = np.cumsum(plan.piece_rows(positions))
    offset -= plan.piece_rows(positions)  # start of each piece among all steps' pieces ...
    offset -= offset[first]  # ... and among its step's
    local = np.arange(len(positions)) - first  # index of each piece among its step's
    inverse, take = local[piece], offset[piece] + row
    specs = []
    r0 = p0 = 0
    bounds = zip(np.cumsum(share).tolist(), np.cumsum(per_step).tolist(), strict=True)
    for t, a, b, (r1, p1) in zip(
        steps.tolist(), starts.tolist(), stops.tolist(), bounds, strict=True
    ):
        specs.append(BatchSpec(t, a, b, positions[p0:p1], take[r0:r1], inverse[r0:r1], row[r0:r1]))
        r0, p0 = r1, p1
    return specs


def _run_core(
    plan: EpochPlan, num_steps: int, runs: Runs
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of steps made of runs, and each row's piece and row inside it.

    Nothing is done per row but a few gathers: runs are cut at windows into segments, each
    window touched is fetched once and the slice used of it tabulated, and each row picks its
    entry of that table.

    Returns:
        The pieces of each step, step after step (unique per step, sorted); how many each
        step has; each piece's step; for each row (steps end to end, in batch order) the
        index of its piece among all of them; and its row inside that piece.
    """
    step, part, win, inner, length = _window_segments(plan.window, *runs)
    pieces, table, seg_piece, table_row, table_piece = _window_tables(
        plan, step, part, win, inner, length
    )
    width = max(len(pieces), 1)
    entry = expand_runs(table, length, 1)  # the table entry of each row, in batch order
    if table_piece is None:  # each window holds one piece: a key (step, piece) per segment
        unique, inv = _unique_inverse(step * width + seg_piece, span=num_steps * width)
        inv = np.repeat(inv, length)
    else:  # a key per row
        keys = np.repeat(step * width, length)
        keys += table_piece[entry]
        unique, inv = _unique_inverse(keys, span=num_steps * width)
    key_step, key_piece = np.divmod(unique, width)
    per_step = np.bincount(key_step, minlength=num_steps)
    return pieces[key_piece], per_step, key_step, inv, table_row[entry]


def range_rows(
    plan: EpochPlan, starts: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`range_specs` as flat arrays, for many ranges without a spec each.

    Returns:
        The pieces of each range, range after range (unique per range); how many each range
        has; and for each row (ranges end to end, each partition-major) the index of its piece
        among all of them, and its row inside that piece.

    >>> from lakeloader.order.plan import make_units, plan_epoch
    >>> plan = plan_epoch(make_units([[6]], 6), seed=0, epoch=0, shuffle=False,
    ...                   num_partitions=2, window=3)
    >>> [a.tolist() for a in range_rows(plan, np.array([0, 3]), np.array([3, 6]))]
    [[0, 1, 0, 1], [2, 2], [0, 0, 1, 2, 3, 3], [0, 1, 0, 2, 1, 2]]
    """
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    runs, _ = _share_runs(plan, starts, stops, 1, 0)
    positions, per_range, _, piece, row = _run_core(plan, len(starts), runs)
    return positions, per_range, piece, row


def _share_runs(
    plan: EpochPlan, starts: np.ndarray, stops: np.ndarray, world_size: int, rank: int
) -> tuple[Runs, np.ndarray]:
    """The rank's share of each global batch ``[starts[i], stops[i])``, as runs in batch order.

    Returns:
        The runs (their step being the batch's index), and the rows of each share.
    """
    C = plan.num_partitions
    first, counts = batch_runs(starts, stops, C)
    at = np.cumsum(counts, axis=1) - counts  # where each run starts in its batch
    lo, hi = rank_bounds_many(counts.sum(axis=1), world_size, rank)
    lo, hi = lo[:, None], hi[:, None]
    a = np.minimum(np.maximum(at, lo), hi)
    b = np.minimum(np.maximum(at + counts, lo), hi)
    keep = np.flatnonzero(b > a)
    batch, part = np.divmod(keep, C)
    pos = (first // C + a - at).ravel()[keep]
    return (batch, part, pos, (b - a).ravel()[keep]), (hi - lo).ravel()


def _window_segments(
    window: int, step: np.ndarray, part: np.ndarray, pos: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs where they cross windows: (step, partition, window, first inner, length)."""
    first = pos // window
    count = (pos + length - 1) // window - first + 1
    run = np.repeat(np.arange(len(pos)), count)
    win = expand_runs(first, count, 1)
    lo = np.maximum(pos[run], win * window)
    hi = np.minimum((pos + length)[run], win * window + window)
    return step[run], part[run], win, lo - win * window, hi - lo


def _window_tables(
    plan: EpochPlan,
    step: np.ndarray,
    part: np.ndarray,
    win: np.ndarray,
    inner: np.ndarray,
    length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Fetch every window that the segments touch, once, and tabulate the rows they use.

    Returns:
        The pieces that the windows overlap (sorted); for each segment, the index in the
        tables of its first row and the index in the pieces of its window's first piece; and
        the tables: for each row, the row inside its piece and, unless every window lies in
        one piece, the index of its piece in the pieces.
    """
    W = plan.window
    sizes = np.diff(plan.starts)
    per_part = int(sizes[0]) // W + 1  # more than the windows of the largest partition
    # The windows touched, sorted: in virtual order.
    keys, seg_win = _unique_inverse(part * per_part + win, span=len(sizes) * per_part)
    w_part, w_win = np.divmod(keys, per_part)
    lo = np.full(len(keys), W, dtype=np.int64)
    hi = np.zeros(len(keys), dtype=np.int64)
    last = np.zeros(len(keys), dtype=np.int64)
    np.minimum.at(lo, seg_win, inner)
    np.maximum.at(hi, seg_win, inner + length)
    np.maximum.at(last, seg_win, step)
    virtual = plan.starts[w_part] + w_win * W
    size = np.minimum(W, sizes[w_part] - w_win * W)
    first = np.searchsorted(plan.offsets, virtual, side="right") - 1
    final = np.searchsorted(plan.offsets, virtual + size - 1, side="right") - 1
    pieces = expand_runs(first, final - first + 1, 1)  # sorted, as the windows are
    fresh = np.ones(len(pieces), dtype=bool)
    fresh[1:] = pieces[1:] != pieces[:-1]
    pieces = pieces[fresh]
    # Fetched in the order of their last use: the last step's windows, which the next call
    # starts with, are the last put in the plan's cache (so it need not grow with the steps).
    order = np.lexsort((keys, last))
    used = (hi - lo)[order]
    at = np.empty(len(keys), dtype=np.int64)
    at[order] = np.cumsum(used) - used
    table_row = np.empty(int(used.sum()), dtype=np.int64)
    table_piece = np.empty(len(table_row), dtype=np.int64) if np.any(final > first) else None
    local = np.searchsorted(pieces, first)
    columns = (w_part, w_win, lo, hi, at, virtual, first, final, local)
    for p, w, a, b, t, v, f, z, k in zip(*(c[order].tolist() for c in columns), strict=True):
        perm = window_permutation(plan, p, w)[a:b]
        out = slice(t, t + b - a)
        np.add(perm, v - plan.offsets[f], out=table_row[out])  # the row inside the first piece
        if table_piece is None:
            continue
        table_piece[out] = k
        if z > f:  # the window overlaps several pieces: find each row's
            rel = count_reached(table_row[out], plan.offsets[f + 1 : z + 1] - plan.offsets[f])
            table_row[out] -= plan.offsets[f + rel] - plan.offsets[f]
            table_piece[out] += rel
    return pieces, at[seg_win] + inner - lo[seg_win], local[seg_win], table_row, table_piece
