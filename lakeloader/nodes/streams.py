"""A source's stream: its epochs end to end, a followed lake's increments.

A mixture counts the rows (a packed source: the samples) it has drawn from each source; offset
``j`` of a source's stream is a row of one of its epochs. A followed lake's epochs are its
increments, and a lake that grew since a checkpoint runs its saved epoch on the pinned snapshot:
their epochs are known one by one, each of its own size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.mixture import Mixture
from lakeloader.order.mixture import MixCursor, Spans
from lakeloader.recovery.coordinator import on_increment
from lakeloader.state.journal import DeliveredRun, epoch_runs
from lakeloader.state.mixture_state import MixtureState, SourceRecord, WeightChange
from lakeloader.topology import Topology


class SourceStream:
    """One source's rows, epoch after epoch (see the module docstring).

    Args:
        dataset: The source: a lake (epoch ``k`` runs on ``dataset.for_epoch(k)``), or a
            followed lake's increment the stream is known from.
        start: The stream's offset of the first row of that epoch (or increment).
        size: The offsets an epoch's dataset holds (its rows: ``len``).
        epoch: The epoch that starts at ``start`` (a followed lake's increment gives its own
            number).
    """

    def __init__(
        self,
        dataset: LakeDataset,
        start: int = 0,
        size: Callable[[LakeDataset], int] = len,
        epoch: int = 0,
    ) -> None:
        self.size, self.base = size, dataset
        #: Whether it waits for its lake's increments.
        self.follows = dataset.follow is not None
        increment = dataset.snapshot.increment
        first = increment.index if self.follows and increment is not None else epoch
        at = dataset if self.follows else dataset.for_epoch(first)
        #: Whether its epochs are known one by one (of any size), not ``size`` rows from 0 on.
        self.varies = self.follows or start != first * size(at) or at.grows_at is not None
        #: ``(epoch, first offset, dataset)`` of each increment known, in order.
        self.known: list[tuple[int, int, LakeDataset]] = [(first, start, at)]

    def reader(self, current: UnitReader) -> UnitReader:
        """A reader of the snapshot the stream stands on: ``current``, or a new one.

        A followed lake's increment, or a lake that grew, may have gone on to another snapshot;
        the new reader counts into ``current``'s counters, so ``stats()`` goes on counting.
        """
        ds = self.known[0][2]
        if current.snapshot is ds.snapshot:
            return current
        reader = ds.reader()
        reader.count_into(current.counters)
        return reader

    @classmethod
    def resumed(
        cls, dataset: LakeDataset, record: SourceRecord, size: Callable[[LakeDataset], int] = len
    ) -> SourceStream:
        """The stream of ``dataset`` from the increment a saved record names (if any)."""
        if record.increment is None or dataset.follow is None:
            return cls(dataset, record.start, size, record.epoch)
        return cls(on_increment(dataset, record.increment), record.start, size)

    def spans(self) -> Spans:
        """Where its epochs start: ``n`` rows each, or the increments' first offsets."""
        if not self.varies:
            return self.size(self.known[0][2])
        ends = [start for _, start, _ in self.known] + [self._end()]
        return self.known[0][0], np.asarray(ends, dtype=np.int64)

    def _end(self) -> int:
        _, start, ds = self.known[-1]
        return start + self.size(ds)

    def covers(self, offset: int) -> bool:
        """Whether the increments known hold ``offset`` (a lake's epochs always do)."""
        return not self.varies or offset < self._end()

    def cover(self, offset: int) -> None:
        """Know the increments up to the one holding ``offset`` (waiting for them).

        Raises:
            CaughtUpError: If the lake gives no more rows within the follow timeout.
        """
        while not self.covers(offset):
            epoch, _, ds = self.known[-1]
            self.known.append((epoch + 1, self._end(), ds.for_epoch(epoch + 1)))

    def dataset(self, epoch: int) -> LakeDataset:
        """The dataset of ``epoch`` (an increment known, or the lake's own)."""
        for known, _, ds in self.known:
            if known == epoch:
                return ds
        return (self.known[0][2] if self.follows else self.base).for_epoch(epoch)

    def holding(self, count: int) -> tuple[int, int, LakeDataset]:
        """The ``(epoch, first offset, dataset)`` known that holds offset ``count``.

        A followed lake's: or the last increment known (the next one is not waited for).
        """
        if not self.follows:
            self.cover(count)
        held = self.known[0]
        for at in self.known:
            if at[1] <= count:
                held = at
        return held

    def record(self, count: int) -> SourceRecord:
        """What the state records of the source, standing at offset ``count`` of its stream.

        A followed lake's is of the increment that holds ``count`` (or starts there).
        """
        epoch, start, ds = self.holding(count)
        if not self.varies:  # epochs of one size from offset 0
            return SourceRecord(ds.fingerprint, ds.config_hash, self.size(ds))
        if not self.follows:
            return SourceRecord(ds.fingerprint, ds.config_hash, self.size(ds), None, start, epoch)
        increment = ds.snapshot.increment
        marks = None if increment is None else increment.to_list()
        return SourceRecord(ds.fingerprint, ds.config_hash, self.size(ds), marks, start)

    def runs(self, first: int, stop: int, name: str, topology: Topology) -> list[DeliveredRun]:
        """What offsets ``[first, stop)`` of the stream are, epoch by epoch, as audit runs."""
        if not self.varies:
            return epoch_runs(first, stop, self.size(self.known[0][2]), name, topology)
        out = []
        while first < stop:
            epoch, start, ds = self.holding(first)
            rows = self.size(ds)
            end = min(stop, start + rows)
            out.append(DeliveredRun(epoch, first - start, end - start, rows, topology, stream=name))
            first = end
        return out

    def locate(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The epoch of each offset (known: :meth:`cover` first), and its place in it."""
        spans = self.spans()
        if isinstance(spans, int):
            spans = max(spans, 1)  # a lake of no token
            return offsets // spans, offsets % spans
        first, starts = spans
        index = np.searchsorted(starts, offsets, side="right") - 1
        return first + index, offsets - starts[index]

    def epoch_of(self, offset: int) -> int:
        """The epoch of one offset (known: :meth:`cover` first), as :meth:`locate` gives it."""
        if not self.varies:
            return offset // max(self.size(self.known[0][2]), 1)  # a lake of no token: 0
        return int(self.locate(np.array([offset]))[0][0])

    def forget_before(self, count: int) -> None:
        """Drop the increments wholly before offset ``count`` (every rank is past them)."""
        while len(self.known) > 1 and self.known[1][1] <= count:
            self.known.pop(0)


def pinned_datasets(
    streams: Mapping[str, SourceStream],
    counts: Mapping[str, int],
    given: Mapping[str, LakeDataset],
) -> dict[str, LakeDataset]:
    """What a checkpoint pins of each source, at these counts.

    A lake that grew: the snapshot of the epoch its count stands in (the one its record names);
    else the dataset as given.
    """
    return {
        name: stream.holding(counts.get(name, 0))[2]
        if stream.varies and not stream.follows
        else given[name]
        for name, stream in streams.items()
    }


def first_state(
    mixture: Mixture, sources: dict[str, SourceRecord], topology: dict[str, int]
) -> MixtureState:
    """A mixture's state before its first row: its weights from slot 0, every count 0."""
    return MixtureState(
        seed=mixture.seed,
        slot=0,
        counts={n: 0 for n in mixture.names},
        history=(WeightChange(0, dict(mixture.raw_weights)),),
        epoch=0,
        epoch_start=0,
        epoch_rows=mixture.epoch_rows,
        sources=sources,
        topology=topology,
    )


def moved_to(
    state: MixtureState,
    streams: Mapping[str, SourceStream],
    cursor: MixCursor,
    config: Callable[[LakeDataset], str] | None = None,
) -> MixtureState:
    """``state`` at ``cursor``: each of ``streams`` forgets what it is past, its record moved."""
    counts = dict(cursor.counts)
    for name, stream in streams.items():
        stream.forget_before(counts.get(name, 0))
    sources = {**state.sources, **stream_records(streams, counts, config)}
    return dataclasses.replace(state, slot=cursor.slot, counts=counts, sources=sources)


def stream_records(
    streams: Mapping[str, SourceStream],
    counts: Mapping[str, int],
    config: Callable[[LakeDataset], str] | None = None,
) -> dict[str, SourceRecord]:
    """Each source's record at its count (none given: where its stream is known from).

    ``config``: what a record names as the source's configuration (None: its order's hash).
    """
    out = {}
    for name, stream in streams.items():
        at = stream.record(counts.get(name, stream.known[0][1]))
        if config is not None:
            at = dataclasses.replace(at, config=config(stream.known[0][2]))
        out[name] = at
    return out
