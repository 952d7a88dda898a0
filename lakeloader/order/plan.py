"""The order of an epoch: pure functions over numpy arrays, no I/O (see docs/design.md)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

#: Canonical partitions used when shuffling and the caller does not choose (see docs/design.md).
DEFAULT_NUM_PARTITIONS = 16
#: Rows shuffled together inside a partition (see docs/design.md for the measurements).
DEFAULT_WINDOW = 16_384
#: Row groups with more rows than this are split into row ranges of at most this many rows.
DEFAULT_MAX_UNIT_ROWS = 262_144
#: Window permutations kept per partition (a step touches one or two per partition).
WINDOW_CACHE_PER_PARTITION = 4

#: An int, or an array of them that arithmetic applies to element by element.
IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


@dataclass(frozen=True)
class Units:
    """The units of a snapshot, in path order: parallel arrays, one entry per unit.

    Attributes:
        file_index: Index of the unit's file in the snapshot.
        row_group: Row group index inside that file.
        row_start: First row of the unit inside the row group.
        num_rows: Rows in the unit (always > 0: empty row groups give no unit).
    """

    file_index: np.ndarray
    row_group: np.ndarray
    row_start: np.ndarray
    num_rows: np.ndarray

    def __len__(self) -> int:
        return len(self.num_rows)


def make_units(row_group_rows: Sequence[Sequence[int]], max_unit_rows: int) -> Units:
    """Cut every row group into units of at most ``max_unit_rows`` rows."""
    if max_unit_rows < 1:
        raise ValueError(f"max_unit_rows must be >= 1, got {max_unit_rows}")
    counts = [len(rgs) for rgs in row_group_rows]
    rg_rows = np.fromiter((n for rgs in row_group_rows for n in rgs), dtype=np.int64)
    rg_file = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    rg_index = expand_runs(np.zeros(len(counts), np.int64), np.array(counts, np.int64), 1)
    pieces = -(-rg_rows // max_unit_rows)  # ceil; 0 for empty row groups
    unit_rg = np.repeat(np.arange(len(rg_rows)), pieces)
    row_start = expand_runs(np.zeros(len(rg_rows), np.int64), pieces, max_unit_rows)
    num_rows = np.minimum(rg_rows[unit_rg] - row_start, max_unit_rows)
    return Units(
        file_index=rg_file[unit_rg].astype(np.int64),
        row_group=rg_index[unit_rg].astype(np.int64),
        row_start=row_start.astype(np.int64),
        num_rows=num_rows.astype(np.int64),
    )


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded by a tuple of integers (negative ones wrap modulo 2**64).

    Keys are 64-bit words behind a length prefix: no two distinct keys seed alike.
    """
    words = np.array([len(key), *[k % 2**64 for k in key]], dtype=np.uint64).view(np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


def unit_order(num_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order of the units in an epoch's virtual sequence: a permutation, or path order."""
    if not shuffle:
        return np.arange(num_units, dtype=np.int64)
    return np.asarray(_rng(seed, epoch).permutation(num_units), dtype=np.int64)


def partition_starts(num_rows: int, num_partitions: int) -> np.ndarray:
    """Virtual-row start of each partition, plus ``num_rows`` at the end.

    Partition ``c`` holds ``ceil((N - c) / C)`` rows, so sizes differ by at most one.
    """
    sizes = partition_consumed(num_rows, num_partitions)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def partition_consumed(position: int, num_partitions: int) -> np.ndarray:
    """Rows each partition has given after ``position`` global slots: ``#{j < G : j % C == c}``."""
    c = np.arange(num_partitions, dtype=np.int64)
    return np.maximum(position - c + num_partitions - 1, 0) // num_partitions


@dataclass(frozen=True)
class EpochPlan:
    """Everything needed to map a global slot to a row of the lake in one epoch.

    The virtual sequence is made of *pieces*, what the cache decodes: the units in epoch order,
    those that straddle a partition boundary cut in two there (a piece lies in one partition).

    Attributes:
        units: The snapshot's units in path order.
        order: Unit index at each position of the epoch's unit permutation.
        piece_unit: Unit index of each piece, in virtual order.
        piece_start: First row of each piece inside its unit.
        offsets: Virtual start row of each piece, plus N at the end.
        starts: Virtual start row of each partition, plus N at the end.
    """

    units: Units
    order: np.ndarray
    piece_unit: np.ndarray
    piece_start: np.ndarray
    offsets: np.ndarray
    starts: np.ndarray
    seed: int
    epoch: int
    shuffle: bool
    window: int
    #: Window permutations drawn so far (a step reuses its windows for window/batch steps).
    windows: OrderedDict[tuple[int, int], np.ndarray] = field(
        default_factory=OrderedDict, compare=False, repr=False
    )

    @property
    def num_rows(self) -> int:
        """Rows in the epoch (N)."""
        return int(self.offsets[-1])

    @property
    def num_partitions(self) -> int:
        """Canonical partitions (C)."""
        return len(self.starts) - 1

    @property
    def num_pieces(self) -> int:
        """Pieces in the epoch: what a rank that reads everything decodes once each."""
        return len(self.piece_unit)

    def piece_rows(self, positions: np.ndarray) -> np.ndarray:
        """Rows of the pieces at these positions."""
        return np.asarray(self.offsets[positions + 1] - self.offsets[positions], dtype=np.int64)


def cut_pieces(
    unit_rows: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut a sequence of units at partition boundaries.

    Args:
        unit_rows: Rows of each unit, in sequence order (all > 0).
        starts: Partition starts plus N, from :func:`partition_starts`.

    Returns:
        For each piece: its index in the unit sequence, its first row inside that unit, and
        the virtual start offsets (plus N at the end).
    """
    unit_offsets = np.concatenate([[0], np.cumsum(unit_rows)]).astype(np.int64)
    total = int(unit_offsets[-1])
    cuts = np.sort(np.concatenate([unit_offsets[:-1], starts[1:-1]]))  # np.unique is slower
    keep = cuts < total
    keep[1:] &= np.diff(cuts) != 0
    cuts = cuts[keep]
    seq = np.searchsorted(unit_offsets, cuts, side="right") - 1
    offsets = np.concatenate([cuts, [total]]).astype(np.int64)
    return seq.astype(np.int64), (cuts - unit_offsets[seq]).astype(np.int64), offsets


def plan_epoch(
    units: Units, *, seed: int, epoch: int, shuffle: bool, num_partitions: int, window: int
) -> EpochPlan:
    """Plan one epoch (O(units); no per-row work)."""
    if num_partitions < 1 or window < 1:
        raise ValueError(f"num_partitions and window must be >= 1: {num_partitions}, {window}")
    order = unit_order(len(units), seed, epoch, shuffle)
    starts = partition_starts(int(units.num_rows.sum()), num_partitions)
    seq, first, offsets = cut_pieces(units.num_rows[order], starts)
    return EpochPlan(units, order, order[seq], first, offsets, starts, seed, epoch, shuffle, window)


def window_permutation(plan: EpochPlan, partition: int, window: int) -> np.ndarray:
    """Permutation of the positions of one window (identity when not shuffling).

    The last ``WINDOW_CACHE_PER_PARTITION * C`` permutations are kept on the plan.
    """
    key = (partition, window)
    perm = plan.windows.get(key)
    if perm is None:
        perm = plan.windows[key] = _draw_window(plan, partition, window)
        while len(plan.windows) > WINDOW_CACHE_PER_PARTITION * plan.num_partitions:
            plan.windows.popitem(last=False)
    return perm


def _draw_window(plan: EpochPlan, partition: int, window: int) -> np.ndarray:
    size = int(plan.starts[partition + 1] - plan.starts[partition])
    length = max(0, min(plan.window, size - window * plan.window))
    if not plan.shuffle:
        return np.arange(length, dtype=np.int64)
    perm = _rng(plan.seed, plan.epoch, partition, window).permutation(length)
    return np.asarray(perm, dtype=np.int64)


def slots_to_virtual(plan: EpochPlan, slots: np.ndarray) -> np.ndarray:
    """Map global slots to virtual rows (vectorised, one RNG per window touched)."""
    C, W = plan.num_partitions, plan.window
    part, pos = slots % C, slots // C
    win, inner = pos // W, pos % W
    out = plan.starts[part] + win * W
    if plan.shuffle and len(slots):
        keys = part * (int(plan.num_rows) // W + 2) + win
        # A batch's slots come grouped by partition and window already; sort only if not.
        order = None if (np.diff(keys) >= 0).all() else np.argsort(keys, kind="stable")
        grouped = keys if order is None else keys[order]
        cuts = (np.flatnonzero(np.diff(grouped)) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(keys)], strict=True):
            idx = slice(a, b) if order is None else order[a:b]
            first = a if order is None else int(order[a])
            perm = window_permutation(plan, int(part[first]), int(win[first]))
            out[idx] += perm[inner[idx]]
    else:
        out += inner
    return np.asarray(out, dtype=np.int64)


def expand_runs(first: np.ndarray, counts: np.ndarray, stride: int) -> np.ndarray:
    """Concatenate the runs ``first[i] + stride * k`` for ``k < counts[i]`` (one array made).

    >>> expand_runs(np.array([10, 0, 5]), np.array([2, 0, 3]), 2).tolist()
    [10, 12, 5, 7, 9]
    """
    used = counts > 0
    first, counts = first[used], counts[used]
    out = np.full(int(counts.sum()), stride, dtype=np.int64)
    if len(out):  # steps: ``stride`` inside a run, from the last of a run to the next's first
        jumps = first.astype(np.int64)
        jumps[1:] -= first[:-1] + stride * (counts[:-1] - 1)
        out[np.cumsum(counts) - counts] = jumps
        np.cumsum(out, out=out)
    return out


def count_reached(values: np.ndarray, bounds: np.ndarray, scan_up_to: int = 4) -> np.ndarray:
    """How many of the sorted ``bounds`` each value reaches: ``searchsorted(side="right")``.

    Up to ``scan_up_to`` bounds, a comparison per bound beats a binary search per value.

    >>> count_reached(np.array([0, 5, 3, 9]), np.array([3, 6])).tolist()
    [0, 1, 1, 2]
    """
    if len(bounds) > scan_up_to:
        return np.asarray(np.searchsorted(bounds, values, side="right"), dtype=np.int64)
    count = np.zeros(len(values), dtype=np.int64)
    for bound in bounds:  # numpy scalars: a uint64 bound is compared as one
        count += values >= bound
    return count


def batch_runs(
    starts: np.ndarray, stops: np.ndarray, num_partitions: int
) -> tuple[np.ndarray, np.ndarray]:
    """First slot and number of slots of each partition in each global batch ``[start, stop)``.

    Both arrays have shape ``(len(starts), C)``; a global batch is these runs, row by row.
    """
    C = num_partitions
    part = np.arange(C, dtype=np.int64)
    first = starts[:, None] + (part - starts[:, None]) % C
    return first, np.maximum(0, (stops[:, None] - first + C - 1) // C)


def batch_slots(start: int, stop: int, num_partitions: int) -> np.ndarray:
    """Slots of the global batch ``[start, stop)``, partition-major (partition 0's first)."""
    first, counts = batch_runs(np.array([start]), np.array([stop]), num_partitions)
    return expand_runs(first[0], counts[0], num_partitions)


def rank_bounds_many(
    lengths: IntOrArray, world_size: int, rank: int
) -> tuple[IntOrArray, IntOrArray]:
    """:func:`rank_bounds` of one global batch, or of several at once (an array of lengths)."""
    base, extra = divmod(lengths, world_size)
    lo = rank * base + np.minimum(rank, extra)
    return lo, lo + base + (rank < extra)


def rank_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of a global batch of ``length`` rows that ``rank`` takes.

    A full batch splits in equal blocks; a short last batch as evenly as possible (the first
    ``length % world_size`` ranks get one row more).
    """
    lo, hi = rank_bounds_many(length, world_size, rank)
    return int(lo), int(hi)


def steps_in_epoch(position: int, num_rows: int, global_batch: int, drop_last: bool) -> int:
    """Global steps left from ``position`` (a short last batch counts unless dropped)."""
    left = max(0, num_rows - position)
    return left // global_batch if drop_last else -(-left // global_batch)


def virtual_to_piece(plan: EpochPlan, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map virtual rows to (piece position in the virtual sequence, row inside that piece)."""
    pos = np.searchsorted(plan.offsets, virtual, side="right") - 1
    return pos, virtual - plan.offsets[pos]


def slot_units(plan: EpochPlan, start: int, stop: int) -> np.ndarray:
    """The units (indices into ``plan.units``) that global slots ``[start, stop)`` read, sorted.

    >>> plan = plan_epoch(make_units([[4, 4], [4]], 4), seed=0, epoch=0, num_partitions=1,
    ...                   window=4, shuffle=False)
    >>> slot_units(plan, 3, 9).tolist()
    [0, 1, 2]
    """
    slots = np.arange(start, stop, dtype=np.int64)
    pos, _ = virtual_to_piece(plan, slots_to_virtual(plan, slots))
    return np.unique(plan.piece_unit[pos])


def release_slots(plan: EpochPlan, positions: np.ndarray) -> np.ndarray:
    """First global slot from which the pieces at ``positions`` are needed no more.

    A piece is needed until the last window of its partition that overlaps it is consumed.
    """
    C, W = plan.num_partitions, plan.window
    first = plan.offsets[positions]
    last = plan.offsets[positions + 1] - 1
    part = np.searchsorted(plan.starts, first, side="right") - 1
    sizes = np.diff(plan.starts)
    win_last = (last - plan.starts[part]) // W
    pos_last = np.minimum((win_last + 1) * W, sizes[part]) - 1
    return np.asarray(pos_last * C + part + 1, dtype=np.int64)


def piece_span(plan: EpochPlan, piece: int) -> tuple[int, int, int, int]:
    """(file index, row group, first row in the row group, rows) of a piece."""
    unit = int(plan.piece_unit[piece])
    rows = int(plan.offsets[piece + 1] - plan.offsets[piece])
    start = int(plan.units.row_start[unit]) + int(plan.piece_start[piece])
    return int(plan.units.file_index[unit]), int(plan.units.row_group[unit]), start, rows
