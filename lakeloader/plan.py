"""The order of an epoch: pure functions over numpy arrays (see docs/design.md).

Nothing here does I/O or depends on the number of workers; the rank and world size only
enter in :func:`rank_bounds`, which slices a global batch. Everything is cheap enough to plan
a million units in well under a second, so every process recomputes what it needs instead
of shipping plans around.

The order, in short: units (row groups or row ranges of them) are permuted with an RNG seeded
by ``(seed, epoch)`` and concatenated into a virtual row sequence of ``N`` rows. That sequence
is cut into ``C`` contiguous *partitions*; global slot ``j`` is served by partition
``j mod C`` at its position ``j // C``. Positions inside a partition are shuffled within
windows of ``window`` rows. A global batch is a slot range, ordered partition-major.
"""

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


_EMPTY = np.zeros(0, dtype=np.int64)
#: An int, or an array of them that arithmetic applies to element by element.
_IntOrArray = TypeVar("_IntOrArray", int, np.ndarray)


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
    """Cut every row group into units of at most ``max_unit_rows`` rows.

    >>> u = make_units([[5, 0], [], [3]], max_unit_rows=2)
    >>> u.file_index.tolist(), u.row_start.tolist(), u.num_rows.tolist()
    ([0, 0, 0, 2, 2], [0, 2, 4, 0, 2], [2, 2, 1, 2, 1])
    """
    if max_unit_rows < 1:
        raise ValueError(f"max_unit_rows must be >= 1, got {max_unit_rows}")
    counts = [len(rgs) for rgs in row_group_rows]
    rg_rows = np.fromiter((n for rgs in row_group_rows for n in rgs), dtype=np.int64)
    rg_file = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    rg_index = np.concatenate([np.arange(c, dtype=np.int64) for c in counts] + [_EMPTY])
    pieces = -(-rg_rows // max_unit_rows)  # ceil; 0 for empty row groups
    unit_rg = np.repeat(np.arange(len(rg_rows)), pieces)
    first_unit = np.cumsum(pieces) - pieces
    piece = np.arange(len(unit_rg)) - np.repeat(first_unit, pieces)
    row_start = piece * max_unit_rows
    num_rows = np.minimum(rg_rows[unit_rg] - row_start, max_unit_rows)
    return Units(
        file_index=rg_file[unit_rg].astype(np.int64),
        row_group=rg_index[unit_rg].astype(np.int64),
        row_start=row_start.astype(np.int64),
        num_rows=num_rows.astype(np.int64),
    )


def _rng(*key: int) -> np.random.Generator:
    """A generator seeded by a tuple of integers (negative ones wrap modulo 2**64).

    Keys are encoded as fixed-width 64-bit words behind a length prefix, so that no two
    distinct keys (``(seed, epoch)`` vs ``(seed, epoch, 0, 0)``, or a seed wider than 32 bits
    vs a later epoch) can feed the generator the same entropy.
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

    >>> partition_starts(10, 4).tolist()
    [0, 3, 6, 8, 10]
    """
    c = np.arange(num_partitions, dtype=np.int64)
    sizes = np.maximum(num_rows - c + num_partitions - 1, 0) // num_partitions
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def partition_consumed(position: int, num_partitions: int) -> np.ndarray:
    """Rows each partition has given after ``position`` global slots: ``#{j < G : j % C == c}``.

    >>> partition_consumed(10, 4).tolist()
    [3, 3, 2, 2]
    """
    c = np.arange(num_partitions, dtype=np.int64)
    return np.maximum(position - c + num_partitions - 1, 0) // num_partitions


@dataclass(frozen=True)
class EpochPlan:
    """Everything needed to map a global slot to a row of the lake in one epoch.

    The virtual sequence is made of *pieces*: the units in epoch order, with the (at most
    ``C - 1``) units that straddle a partition boundary cut in two there. A piece therefore
    lies in exactly one partition, and the cache can let go of it as soon as that partition
    is done with it, instead of holding a straddling unit until the earlier partition ends.
    Pieces are what the cache fetches and decodes: the "units of the plan".

    Attributes:
        units: The snapshot's units in path order.
        order: Unit index at each position of the epoch's unit permutation.
        piece_unit: Unit index of each piece, in virtual order.
        piece_start: First row of each piece inside its unit.
        offsets: Virtual start row of each piece, plus N at the end.
        starts: Virtual start row of each partition, plus N at the end.
        seed: Seed of the run.
        epoch: The epoch.
        shuffle: Whether windows are shuffled.
        window: Rows per window.
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

    >>> seq, first, offsets = cut_pieces(np.array([4, 4]), np.array([0, 3, 6, 8]))
    >>> seq.tolist(), first.tolist(), offsets.tolist()
    ([0, 0, 1, 1], [0, 3, 0, 2], [0, 3, 4, 6, 8])
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

    The last ``WINDOW_CACHE_PER_PARTITION * C`` permutations are kept on the plan: consecutive
    steps draw from the same windows, and drawing one costs far more than a step's lookups.
    """
    key = (partition, window)
    cached = plan.windows.get(key)
    if cached is not None:
        return cached
    perm = _draw_window(plan, partition, window)
    plan.windows[key] = perm
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


def _expand(first: np.ndarray, counts: np.ndarray, stride: int) -> np.ndarray:
    """Concatenate the runs ``first[i] + stride * k`` for ``k < counts[i]`` (one array made).

    >>> _expand(np.array([10, 0, 5]), np.array([2, 0, 3]), 2).tolist()
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


def _batch_runs(
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
    """Slots of the global batch ``[start, stop)``, partition-major (partition 0's first).

    >>> batch_slots(4, 12, 4).tolist()
    [4, 8, 5, 9, 6, 10, 7, 11]
    >>> batch_slots(5, 12, 4).tolist()
    [8, 5, 9, 6, 10, 7, 11]
    """
    first, counts = _batch_runs(np.array([start]), np.array([stop]), num_partitions)
    return _expand(first[0], counts[0], num_partitions)


def _rank_bounds(
    lengths: _IntOrArray, world_size: int, rank: int
) -> tuple[_IntOrArray, _IntOrArray]:
    """:func:`rank_bounds` of one global batch, or of several at once (an array of lengths)."""
    base, extra = divmod(lengths, world_size)
    lo = rank * base + np.minimum(rank, extra)
    return lo, lo + base + (rank < extra)


def rank_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of a global batch of ``length`` rows that ``rank`` takes.

    A full batch splits in equal blocks; a short last batch as evenly as possible (the first
    ``length % world_size`` ranks get one row more).

    >>> [rank_bounds(10, 4, r) for r in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    lo, hi = _rank_bounds(length, world_size, rank)
    return int(lo), int(hi)


def steps_in_epoch(position: int, num_rows: int, global_batch: int, drop_last: bool) -> int:
    """Global steps left from ``position`` (a short last batch counts unless dropped).

    >>> [steps_in_epoch(g, 10, 4, drop) for g, drop in [(0, False), (0, True), (10, False)]]
    [3, 2, 0]
    """
    left = max(0, num_rows - position)
    return left // global_batch if drop_last else -(-left // global_batch)


def virtual_to_piece(plan: EpochPlan, virtual: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map virtual rows to (piece position in the virtual sequence, row inside that piece)."""
    pos = np.searchsorted(plan.offsets, virtual, side="right") - 1
    return pos, virtual - plan.offsets[pos]


def release_slots(plan: EpochPlan, positions: np.ndarray) -> np.ndarray:
    """First global slot from which the pieces at ``positions`` are needed no more.

    A piece lies in one partition and is needed until the last window of that partition that
    overlaps it has been fully consumed. The cache evicts a piece once the delivered position
    reaches this.
    """
    C, W = plan.num_partitions, plan.window
    first = plan.offsets[positions]
    last = plan.offsets[positions + 1] - 1
    part = np.searchsorted(plan.starts, first, side="right") - 1
    sizes = np.diff(plan.starts)
    win_last = (last - plan.starts[part]) // W
    pos_last = np.minimum((win_last + 1) * W, sizes[part]) - 1
    return np.asarray(pos_last * C + part + 1, dtype=np.int64)


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


#: :func:`_unique_inverse` flags every possible value instead of sorting while there are at
#: most this many possible values per value (a flag costs about a hundredth of a sorted value).
_DENSE_SPAN_PER_VALUE = 16


def _unique_inverse(values: np.ndarray, span: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` by one sort, or no sort at all.

    Args:
        values: Integers to make unique.
        span: If given, every value lies in ``[0, span)``; when that range is small, the values
            are found by flagging them rather than by sorting them.

    >>> [a.tolist() for a in _unique_inverse(np.array([7, 3, 7, 5]))]
    [[3, 5, 7], [2, 0, 2, 1]]
    >>> [a.tolist() for a in _unique_inverse(np.array([7, 3, 7, 5]), span=8)]
    [[3, 5, 7], [2, 0, 2, 1]]
    """
    if span is not None and span <= _DENSE_SPAN_PER_VALUE * len(values) + 4096:
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


def batch_spec(
    plan: EpochPlan, step: int, slot_start: int, slot_stop: int, world_size: int, rank: int
) -> BatchSpec:
    """Build one rank's share of the global batch ``[slot_start, slot_stop)``.

    ``step`` only labels the result; an empty range gives an empty share. To plan several
    consecutive steps, :func:`batch_specs` gives the same at a fraction of the cost per step.
    """
    _check_share(plan, slot_start, slot_stop, world_size, rank)
    slots = batch_slots(slot_start, slot_stop, plan.num_partitions)
    lo, hi = rank_bounds(len(slots), world_size, rank)
    pos, row = virtual_to_piece(plan, slots_to_virtual(plan, slots[lo:hi]))
    positions, inverse = _unique_inverse(pos, span=plan.num_pieces)
    sizes = plan.piece_rows(positions)
    base = np.cumsum(sizes) - sizes
    return BatchSpec(step, slot_start, slot_stop, positions, base[inverse] + row, inverse, row)


def _check_share(
    plan: EpochPlan, starts: _IntOrArray, stops: _IntOrArray, world_size: int, rank: int
) -> None:
    """Raise ValueError unless ``rank`` is one of ``world_size`` and the slots in the epoch."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size: {rank}, {world_size}")
    if np.any((starts < stops) & ((starts < 0) | (stops > plan.num_rows))):
        raise ValueError(f"slots outside the epoch's {plan.num_rows}")


def batch_specs(
    plan: EpochPlan,
    first_step: int,
    num_steps: int,
    start: int,
    global_batch: int,
    world_size: int,
    rank: int,
) -> list[BatchSpec]:
    """One rank's shares of ``num_steps`` consecutive global batches, planned together.

    Step ``t`` covers the global slots ``[start + t * global_batch, start + (t + 1) *
    global_batch)``, cut at the end of the epoch. The result equals ``batch_spec`` of every
    step, at a fraction of the cost: the work is done once for all rows of all steps.

    Args:
        plan: The epoch.
        first_step: First step to plan.
        num_steps: Steps to plan.
        start: Global slot at which step 0 starts.
        global_batch: Slots per global batch.
        world_size: Ranks sharing each global batch.
        rank: The rank whose shares are planned.

    Returns:
        One :class:`BatchSpec` per step, in step order (their arrays are views of arrays
        shared by the call).

    Raises:
        ValueError: On a bad argument, or a step that has no slot of the epoch.

    >>> plan = plan_epoch(
    ...     make_units([[3, 4]], 4), seed=0, epoch=0, shuffle=False, num_partitions=2, window=2
    ... )
    >>> specs = batch_specs(plan, 1, 2, 1, 2, 1, 0)
    >>> [(s.step, s.positions.tolist(), s.take.tolist(), s.row.tolist()) for s in specs]
    [(1, [0, 2], [2, 4], [2, 1]), (2, [1, 2], [0, 3], [0, 2])]
    """
    if global_batch < 1 or num_steps < 0:
        raise ValueError(f"need global_batch >= 1, num_steps >= 0: {global_batch}, {num_steps}")
    steps = first_step + np.arange(num_steps, dtype=np.int64)
    starts = start + steps * global_batch
    stops = np.minimum(starts + global_batch, plan.num_rows)
    if np.any(starts < 0) or np.any(stops <= starts):
        raise ValueError(f"steps {first_step}..{first_step + num_steps - 1} leave the epoch")
    _check_share(plan, starts, stops, world_size, rank)
    return _batch_specs(plan, steps, starts, stops, world_size, rank)


def _batch_specs(
    plan: EpochPlan,
    steps: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    world_size: int,
    rank: int,
) -> list[BatchSpec]:
    """Shares of the global batches ``[starts[i], stops[i])``, labelled ``steps[i]``.

    Nothing is done per row but a few gathers: the rows of a run of a partition inside one
    window are a slice of that window's permutation, so runs are cut at windows into
    *segments*, every window touched is fetched once and the slice used of it turned into a
    table (the row inside its piece, and the piece), and each row picks its entry of that
    table. Pieces are made unique per step by segment if no window holds several, else by row.
    """
    step, part, pos, length, share = _share_runs(plan, starts, stops, world_size, rank)
    step, part, win, inner, length = _window_segments(plan.window, step, part, pos, length)
    pieces, table, seg_piece, table_row, table_piece = _window_tables(
        plan, step, part, win, inner, length
    )
    width = max(len(pieces), 1)
    entry = _expand(table, length, 1)  # the table entry of each row, in batch order
    if table_piece is None:  # each window holds one piece: a key (step, piece) per segment
        unique, inv = _unique_inverse(step * width + seg_piece, span=len(steps) * width)
    else:  # a key per row
        keys = np.repeat(step * width, length)
        keys += table_piece[entry]
        unique, inv = _unique_inverse(keys, span=len(steps) * width)
    key_step, key_piece = np.divmod(unique, width)
    positions = pieces[key_piece]
    per_step = np.bincount(key_step, minlength=len(steps))
    first = (np.cumsum(per_step) - per_step)[key_step]  # first key of each key's step
    offset = np.cumsum(plan.piece_rows(positions))
    offset -= plan.piece_rows(positions)  # start of each piece among all steps' pieces ...
    offset -= offset[first]  # ... and among its step's
    local = np.arange(len(unique)) - first  # index of each key's piece among its step's
    if table_piece is None:
        inverse, take = np.repeat(local[inv], length), np.repeat(offset[inv], length)
    else:
        inverse, take = local[inv], offset[inv]
    row = table_row[entry]
    take += row
    specs = []
    r0 = p0 = 0
    bounds = zip(np.cumsum(share).tolist(), np.cumsum(per_step).tolist(), strict=True)
    for t, a, b, (r1, p1) in zip(
        steps.tolist(), starts.tolist(), stops.tolist(), bounds, strict=True
    ):
        specs.append(BatchSpec(t, a, b, positions[p0:p1], take[r0:r1], inverse[r0:r1], row[r0:r1]))
        r0, p0 = r1, p1
    return specs


def _share_runs(
    plan: EpochPlan, starts: np.ndarray, stops: np.ndarray, world_size: int, rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rank's share of each global batch, as runs of consecutive positions of a partition.

    Returns:
        For each run, in batch order: its batch (index into ``starts``), partition, first
        position in the partition and length; and the rows of the rank's share of each batch.
    """
    C = plan.num_partitions
    first, counts = _batch_runs(starts, stops, C)
    at = np.cumsum(counts, axis=1) - counts  # where each run starts in its batch
    lo, hi = _rank_bounds(counts.sum(axis=1), world_size, rank)
    lo, hi = lo[:, None], hi[:, None]
    a = np.minimum(np.maximum(at, lo), hi)
    b = np.minimum(np.maximum(at + counts, lo), hi)
    keep = np.flatnonzero(b > a)
    batch, part = np.divmod(keep, C)
    pos = (first // C + a - at).ravel()[keep]
    return batch, part, pos, (b - a).ravel()[keep], (hi - lo).ravel()


def _window_segments(
    window: int, step: np.ndarray, part: np.ndarray, pos: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut runs where they cross windows: (step, partition, window, first inner, length)."""
    first = pos // window
    count = (pos + length - 1) // window - first + 1
    run = np.repeat(np.arange(len(pos)), count)
    win = _expand(first, count, 1)
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
    pieces = _expand(first, final - first + 1, 1)  # sorted, as the windows are
    fresh = np.ones(len(pieces), dtype=bool)
    fresh[1:] = pieces[1:] != pieces[:-1]
    pieces = pieces[fresh]
    # Fetched in the order of their last use: those of the last step, which the next call
    # starts with, are the last put in the plan's cache. A call may touch more windows than the
    # cache holds, but it fetches each once, and the next call needs only those of its last
    # step (one or two per partition while a batch gives a partition at most a window's rows):
    # the cache need not grow with the steps planned at once.
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
            rel = _count_reached(table_row[out], plan.offsets[f + 1 : z + 1] - plan.offsets[f])
            table_row[out] -= plan.offsets[f + rel] - plan.offsets[f]
            table_piece[out] += rel
    return pieces, at[seg_win] + inner - lo[seg_win], local[seg_win], table_row, table_piece


def _count_reached(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """How many of the sorted ``bounds`` each value reaches: ``searchsorted(side="right")``.

    >>> _count_reached(np.array([0, 5, 3, 9]), np.array([3, 6])).tolist()
    [0, 1, 1, 2]
    """
    if len(bounds) > 4:
        return np.asarray(np.searchsorted(bounds, values, side="right"), dtype=np.int64)
    count = np.zeros(len(values), dtype=np.int64)
    for bound in bounds.tolist():  # a few comparisons beat a binary search per value
        count += values >= bound
    return count
