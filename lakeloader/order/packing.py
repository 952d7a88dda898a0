"""Packed token streams: which tokens make each sample, under any world size and batch (pure).

The streams and their samples are described in docs/design.md (Packed streams).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from lakeloader.order.plan import EpochPlan, Units, expand_runs, plan_epoch, rank_bounds

#: Rows of a packed plan's windows: they are not shuffled, so any size orders alike; this one
#: keeps a unit's rows in few windows and the identity permutation of one small.
PACKED_WINDOW = 65_536


def packed_plan(units: Units, seed: int, epoch: int, shuffle: bool) -> EpochPlan:
    """A packed lake's plan of an epoch: one partition, its units permuted (when shuffling).

    >>> from lakeloader.order.plan import make_units
    >>> p = packed_plan(make_units([[3, 2]], 8), seed=0, epoch=0, shuffle=True)
    >>> p.num_partitions, p.shuffle, sorted(p.order.tolist())
    (1, False, [0, 1])
    """
    plan = plan_epoch(
        units, seed=seed, epoch=epoch, shuffle=shuffle, num_partitions=1, window=PACKED_WINDOW
    )
    return replace(plan, shuffle=False)


@dataclass(frozen=True)
class TokenStream:
    """One epoch of a packed source: where its units' tokens end, and its streams' bounds.

    Attributes:
        ends: Token end of each unit, in the epoch's unit order (its counts summed up).
        bounds: First token of each stream, plus ``T``.
        seq_len: Tokens per sample (``L``).
    """

    ends: np.ndarray
    bounds: np.ndarray
    seq_len: int

    @classmethod
    def of(cls, counts: np.ndarray, streams: int, seq_len: int) -> TokenStream:
        """The stream of units of these token counts (in the epoch's order)."""
        ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        total = int(ends[-1]) if len(ends) else 0
        bounds = np.arange(streams + 1, dtype=np.int64) * total // streams
        return cls(ends, bounds, seq_len)

    @property
    def sizes(self) -> np.ndarray:
        """Samples in each stream (its last one padded when the tokens do not fill it)."""
        return np.asarray(-(-np.diff(self.bounds) // self.seq_len), dtype=np.int64)

    @property
    def num_samples(self) -> int:
        """Samples in the epoch."""
        return int(self.sizes.sum())

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stream of each of the epoch's ``samples``, and its index in that stream."""
        sizes = self.sizes
        C, fewest = len(sizes), int(sizes.min())
        longer = np.flatnonzero(sizes > fewest)  # each has one more: sizes differ by <= 1
        j = np.asarray(samples, dtype=np.int64)
        early = j < fewest * C
        late = longer[np.clip(j - fewest * C, 0, max(len(longer) - 1, 0))] if len(longer) else 0
        stream = np.where(early, j % C, late)
        return stream.astype(np.int64), np.where(early, j // C, fewest).astype(np.int64)

    def spans(self, stream: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The token range ``[start, stop)`` of samples (shorter than ``L``: padded)."""
        start = self.bounds[stream] + index * self.seq_len
        return start, np.minimum(start + self.seq_len, self.bounds[stream + 1])

    def sample_units(self, start: int, stop: int) -> np.ndarray:
        """The positions of the units that the epoch's samples ``[start, stop)`` take tokens of.

        >>> TokenStream.of(np.array([5, 4, 6]), streams=2, seq_len=4).sample_units(1, 2).tolist()
        [1, 2]
        """
        return self.units(*self.spans(*self.locate(np.arange(start, stop, dtype=np.int64))))

    def units(self, start: int | np.ndarray, stop: int | np.ndarray) -> np.ndarray:
        """The positions of the units that tokens ``[start, stop)`` lie in (sorted, each once).

        ``start`` and ``stop`` may be arrays of ranges, all non-empty.
        """
        first = np.searchsorted(self.ends, np.atleast_1d(start), side="right")
        last = np.searchsorted(self.ends, np.atleast_1d(stop) - 1, side="right")
        return np.unique(expand_runs(first, last - first + 1, 1))


@dataclass(frozen=True)
class Share:
    """A rank's samples of a step, in batch order.

    Attributes:
        source: Each sample's source (an index).
        offset: Its index in its source's endless stream of samples (its seed's key).
        epoch: Its source's epoch.
        start: Its first token in that epoch's stream.
        stop: Its end (``stop - start < L``: the rest is padding).
    """

    source: np.ndarray
    offset: np.ndarray
    epoch: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    def __len__(self) -> int:
        return len(self.source)


def source_epochs(sources: np.ndarray, epochs: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
    """The indices of the samples of each (source, epoch) pair, pairs in sorted order."""
    keys = np.asarray(sources, dtype=np.int64) * (1 << 32) + epochs
    return {divmod(k, 1 << 32): np.flatnonzero(keys == k) for k in np.unique(keys).tolist()}


def step_shares(
    sources: np.ndarray,
    offsets: np.ndarray,
    epochs: np.ndarray,
    places: np.ndarray,
    stream_of: dict[tuple[int, int], TokenStream],
    global_batch: int,
    world_size: int,
    rank: int,
) -> list[Share]:
    """A rank's samples of consecutive global steps.

    Each step's samples are sorted by source, epoch, stream and sample, so that a share reads
    few units, and the rank takes its :func:`~lakeloader.order.plan.rank_bounds` slice. Each
    sample drawn (``global_batch`` a step) has its source, its index in that source's endless
    stream (``offsets``), its epoch of the source and its index among that epoch's samples
    (``places``); ``stream_of`` holds the stream of each ``(source, epoch)`` the steps reach.

    >>> s = TokenStream.of(np.array([8, 8]), streams=2, seq_len=4)
    >>> (share,) = step_shares(*[np.zeros(4, int), np.arange(4)] * 2, {(0, 0): s}, 4, 2, 1)
    >>> share.start.tolist(), share.stop.tolist()
    ([8, 12], [12, 16])
    """
    stream, index, start, stop = (np.empty(len(sources), dtype=np.int64) for _ in range(4))
    for key, mine in source_epochs(sources, epochs).items():
        tokens = stream_of[key]
        stream[mine], index[mine] = tokens.locate(places[mine])
        start[mine], stop[mine] = tokens.spans(stream[mine], index[mine])
    step = np.arange(len(sources), dtype=np.int64) // global_batch
    order = np.lexsort((index, stream, epochs, sources, step))  # each step's block stays its own
    a, b = rank_bounds(global_batch, world_size, rank)
    picks = [order[first + a : first + b] for first in range(0, len(order), global_batch)]
    return [Share(sources[i], offsets[i], epochs[i], start[i], stop[i]) for i in picks]


def separated(
    values: np.ndarray, offsets: np.ndarray, eos_id: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows laid end to end with ``eos_id`` after each row; each token's position in its row.

    Tokens keep a 4-byte integer type when the ids and ``eos_id`` fit one (else 8 bytes), and
    positions are 4-byte too (while there are fewer than ``2**31`` tokens).

    >>> t, p = separated(np.array([1, 2, 3]), np.array([0, 2, 2, 3]), 9)
    >>> t.tolist(), p.tolist()
    ([1, 2, 9, 9, 3, 9], [0, 1, 2, 0, 0, 1])
    """
    values = values[offsets[0] : offsets[-1]]
    small = values.dtype.itemsize <= 4 and values.dtype != np.uint32
    fits = eos_id is None or -(2**31) <= eos_id < 2**31
    values = values.astype(np.int32 if small and fits else np.int64, copy=False)
    lengths = np.diff(offsets)
    out = values
    if eos_id is not None:  # one separator after each row's last token
        out = np.insert(values, offsets[1:] - offsets[0], eos_id)
        lengths = lengths + 1
    lengths = lengths[lengths > 0]
    positions = np.ones(len(out), dtype=np.int32 if len(out) < 2**31 else np.int64)
    if len(out):  # each row's first token restarts the count: a running sum of ones
        positions[0] = 0
        positions[np.cumsum(lengths[:-1])] = 1 - lengths[:-1]
        np.cumsum(positions, out=positions)
    return out, positions
