"""Which source each global slot of a mixture comes from: a pure function of seed, weights, slot.

The sequence (a Kronecker sequence in 64-bit fixed point) is described in docs/design.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from lakeloader.order.plan import _rng, count_reached, expand_runs, rank_bounds

#: ``2**64`` divided by the golden ratio, odd: the step of the sequence in fixed point.
GOLDEN_STEP: Final = np.uint64(0x9E3779B97F4A7C15)
_ONE: Final = float(2**64)


@dataclass(frozen=True)
class MixWeights:
    """The sources of a mixture, in a fixed order, and each one's share of the slots.

    Attributes:
        names: The sources' names, sorted (the order of every per-source array).
        shares: Each source's weight divided by their sum.
    """

    names: tuple[str, ...]
    shares: tuple[float, ...]

    @classmethod
    def of(cls, weights: Mapping[str, float]) -> MixWeights:
        """Validate and normalise ``{name: weight}``.

        >>> MixWeights.of({"web": 3, "code": 1}).shares
        (0.25, 0.75)

        Raises:
            ValueError: If there is no source, or a weight is not a finite positive number.
        """
        if not weights:
            raise ValueError("a mixture needs at least one source; weights is empty")
        bad = {k: v for k, v in weights.items() if not _positive(v)}
        if bad:
            raise ValueError(
                f"mixture weights must be finite positive numbers; got {bad!r}. Give every "
                "source a weight above 0 (remove a source to stop drawing from it)"
            )
        names = tuple(sorted(weights))
        total = float(sum(weights[n] for n in names))
        return cls(names, tuple(float(weights[n]) / total for n in names))


def _positive(value: object) -> bool:
    """Whether a weight is a finite number above 0 (booleans are not weights)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value > 0


def slot_sources(weights: MixWeights, seed: int, first: int, count: int) -> np.ndarray:
    """The source (an index into ``weights.names``) of slots ``first .. first + count - 1``."""
    if first < 0 or count < 0:
        raise ValueError(f"slots must be non-negative; got first={first}, count={count}")
    index = np.arange(first, first + count, dtype=np.uint64)
    theta = _rng(seed, 0x4D4958).integers(0, 2**64, dtype=np.uint64)  # the seed's offset
    with np.errstate(over="ignore"):  # wrapping is the point: arithmetic modulo 2**64
        index *= GOLDEN_STEP  # in place: a chunk's slots are megabytes, each new array faults
        index += theta
    ends = np.cumsum(weights.shares)[:-1] * _ONE  # the sources' shares of [0, 2**64)
    return count_reached(index, np.minimum(ends, _ONE - 1).astype(np.uint64), scan_up_to=8)


@dataclass(frozen=True)
class MixCursor:
    """Where a mixture stands: slots drawn in all, and drawn from each source.

    A source's count is its position in its own stream of rows (its epochs one after the
    other).

    Attributes:
        slot: Global slots drawn so far.
        counts: ``{name: slots drawn from it}``; a source added at a resume starts at 0.
    """

    slot: int
    counts: Mapping[str, int]

    def take(self, weights: MixWeights, seed: int, count: int) -> tuple[MixDraw, MixCursor]:
        """Draw the next ``count`` slots under ``weights``; the draw and the cursor after it."""
        sources = slot_sources(weights, seed, self.slot, count)
        names = weights.names
        # Each slot's offset: its source's count so far plus its rank among that source's slots.
        base = self.counts_of(names)
        drawn = np.zeros(len(names), dtype=np.int64)
        offsets = np.empty(count, dtype=np.int64)
        for source, slots in enumerate(_by_source(sources, len(names))):
            offsets[slots] = np.arange(base[source], base[source] + len(slots), dtype=np.int64)
            drawn[source] = len(slots)
        return MixDraw(sources, offsets), self.after(count, names, base + drawn)

    def counts_of(self, names: Sequence[str]) -> np.ndarray:
        """The count of each of ``names`` (0 for a source not drawn from yet)."""
        return np.array([self.counts.get(n, 0) for n in names], dtype=np.int64)

    def after(self, slots: int, names: Sequence[str], counts: np.ndarray) -> MixCursor:
        """The cursor ``slots`` slots on, where ``names`` have reached ``counts``."""
        counts_after = dict(zip(names, counts.tolist(), strict=True))
        return MixCursor(self.slot + slots, {**self.counts, **counts_after})


@dataclass(frozen=True)
class MixDraw:
    """Consecutive global slots of a mixture: each one's source and its place in that source.

    Attributes:
        sources: Each slot's source (an index into the weights' names).
        offsets: Each slot's index in its source's stream (its epochs one after the other).
    """

    sources: np.ndarray
    offsets: np.ndarray


#: Where a source's epochs start in its stream: ``n`` rows each (a lake), or ``(e0, starts)``
#: (a followed lake): epoch ``e0 + i`` starts at offset ``starts[i]``, the last entry the end
#: of the increments known.
Spans = int | tuple[int, np.ndarray]


def _epoch_of(rows: Sequence[Spans], sources: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The epoch of each offset of its source's stream.

    >>> _epoch_of([4, (2, np.array([10, 13, 13, 20]))], np.array([0, 1, 1]), np.array([9, 12, 13]))
    array([2, 2, 4])
    """
    out = np.empty(len(offsets), dtype=np.int64)
    for source in np.unique(sources).tolist():
        mine, spans = sources == source, rows[source]
        if isinstance(spans, tuple):
            e0, starts = spans
            out[mine] = e0 + np.searchsorted(starts, offsets[mine], side="right") - 1
        else:
            out[mine] = offsets[mine] // spans
    return out


def epoch_first(rows: Sequence[Spans], sources: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    """The first offset of each epoch of its source's stream (its end, one past the last)."""
    out = np.empty(len(epochs), dtype=np.int64)
    for source in np.unique(sources).tolist():
        mine, spans = sources == source, rows[source]
        if isinstance(spans, tuple):
            e0, starts = spans
            out[mine] = starts[np.minimum(epochs[mine] - e0, len(starts) - 1)]
        else:
            out[mine] = epochs[mine] * spans
    return out


def _by_source(sources: np.ndarray, count: int) -> list[np.ndarray]:
    """Where each of ``count`` sources stands in ``sources`` (flattened), in order: no sort.

    >>> [a.tolist() for a in _by_source(np.array([[1, 0], [0, 2]]), 3)]
    [[1, 2], [0], [3]]
    """
    flat = sources.ravel()
    return [np.flatnonzero(flat == source) for source in range(count)]


@dataclass(frozen=True)
class PartTable:
    """The parts of a rank's shares of consecutive global batches, as arrays.

    One entry per part, ordered by step, source, epoch.

    Attributes:
        shares: The source of each row of each share, ``(steps, rows of a share)``.
        step: Each part's step (index among the steps planned).
        source: Its source (an index into the names).
        epoch: Its source's epoch.
        start: Its first position in its source's epoch's order (``stop``: one past its last).
        at: Where each row stands in its share, laid out by source (each source's rows of
            every step in slot order, the sources one after the other), so that no sort
            makes it: a part's rows are ``at[at_start : at_start + stop - start]``.
        at_start: Where each part's rows begin in ``at``.
    """

    shares: np.ndarray
    step: np.ndarray
    source: np.ndarray
    epoch: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    at: np.ndarray
    at_start: np.ndarray


def draw_parts(
    cursor: MixCursor,
    weights: MixWeights,
    seed: int,
    steps: int,
    size: int,
    rows: Sequence[Spans],
    world_size: int,
    rank: int,
) -> tuple[PartTable, MixCursor, np.ndarray]:
    """Draw ``steps`` global batches of ``size`` slots and cut a rank's shares into parts.

    A part's range comes from its source's count before it, its rows (in slot order) from
    where its source's slots stand in the shares (:attr:`PartTable.at`). ``rows`` says where
    each source's epochs start in its stream (:data:`Spans`; a followed lake's must reach past
    the draws).

    Returns:
        The parts; the cursor after the batches; and, after each step, each source's count
        (``(steps, sources)``, in the order of ``weights.names``).
    """
    names, S = weights.names, len(weights.names)
    drawn = slot_sources(weights, seed, cursor.slot, steps * size).reshape(steps, size)
    lo, hi = rank_bounds(size, world_size, rank)
    width = hi - lo
    step_of = np.arange(steps, dtype=np.int64)[:, None] * S
    share = drawn[:, lo:hi]
    keyed = (step_of + share).ravel()  # each row of the shares' (step, source)
    mine = np.bincount(keyed, minlength=steps * S).reshape(steps, S)
    if width == size:  # one rank: its shares are the batches
        full, ahead = mine, np.zeros_like(mine)
    else:
        full = np.bincount((step_of + drawn).ravel(), minlength=steps * S).reshape(steps, S)
        before = (step_of + drawn[:, :lo]).ravel()
        ahead = np.bincount(before, minlength=steps * S).reshape(steps, S)
    after_step = cursor.counts_of(names) + np.cumsum(full, axis=0)
    first = after_step - full + ahead  # each (step, source)'s first offset in the share
    k, s = np.nonzero(mine)  # (step, source) pairs with rows, step-major as the sort below
    start, count = first[k, s], mine[k, s]
    empty = [names[i] for i in sorted(set(s.tolist())) if rows[i] == 0]
    if empty:
        raise ValueError(f"mixture source(s) {empty} have no rows")
    e0, e1 = _epoch_of(rows, s, start), _epoch_of(rows, s, start + count - 1)
    runs = e1 - e0 + 1  # epochs each (step, source) spans: one, or more at an epoch's end
    part = np.repeat(np.arange(len(k)), runs)
    epoch = expand_runs(e0, runs, 1)
    base, end = epoch_first(rows, s[part], epoch), epoch_first(rows, s[part], epoch + 1)
    lo_off = np.maximum(start[part], base)
    hi_off = np.minimum((start + count)[part], end)
    kept = hi_off > lo_off  # a followed lake's empty increments hold no part
    # ``at`` by source, then step: where each (step, source)'s rows begin in it
    per_source = mine.sum(axis=0)
    block = np.cumsum(mine, axis=0) - mine + (np.cumsum(per_source) - per_source)
    at = np.concatenate(_by_source(share, S))  # flat: step * width + place in the share
    at -= np.repeat(np.tile(np.arange(steps, dtype=np.int64) * width, S), mine.T.ravel())
    table = PartTable(
        shares=share,
        step=k[part][kept],
        source=s[part][kept],
        epoch=epoch[kept],
        start=(lo_off - base)[kept],
        stop=(hi_off - base)[kept],
        at=at,
        at_start=(block[k, s][part] + lo_off - start[part])[kept],
    )
    return table, cursor.after(steps * size, names, after_step[-1]), after_step
