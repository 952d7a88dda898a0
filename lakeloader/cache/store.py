"""The decoded-unit cache of one rank: decoded ahead in plan order, evicted once used."""

from __future__ import annotations

import heapq
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lakeloader.cache.arena import Arena, unlink_quietly
from lakeloader.cache.decode import DecodeJob, Decodes, Held, UnitRef, read_ipc
from lakeloader.cache.packed import Packed, RowLayout
from lakeloader.cache.views import ViewBuffers, data_buffer
from lakeloader.io.prefetch import Prefetcher
from lakeloader.io.reader import UnitReader
from lakeloader.order.plan import EpochPlan, piece_span, release_slots
from lakeloader.state.quarantine import OnError, QuarantineEntry, Validate

logger = logging.getLogger(__name__)

#: The columns of a unit that has every column packed.
_NO_COLUMNS = pa.table({})


@dataclass(frozen=True)
class Screening:
    """What to do with units that fail to decode or that the user's validator rejects.

    ``known`` units are quarantined already (by the loaded state): skipped without reading.
    """

    on_error: OnError = "raise"
    validate: Validate | None = None
    known: tuple[QuarantineEntry, ...] = ()


class UnitOpener:
    """Opens a batch's units, keeping only the previous batch's tables (so evicted ones free)."""

    def __init__(self) -> None:
        self._open: dict[str, pa.Table] = {}

    def open(self, refs: Sequence[UnitRef], records: np.ndarray | None) -> list[Packed]:
        """The units of one batch, their packed rows as slices of the arena ``records``."""
        now: dict[str, pa.Table] = {}
        out = []
        for ref in refs:
            table = ref.table
            if isinstance(table, str):
                path = table
                table = now.get(path) or self._open.get(path) or read_ipc(path)
                now[path] = table
            rows = None
            if ref.start >= 0:
                assert records is not None
                rows = records[ref.start : ref.start + ref.num_rows]
            out.append(Packed(rows, ref.packed, _NO_COLUMNS if table is None else table, ref.where))
        self._open = now
        return out

    def drop(self) -> None:
        """Forget the tables held (an idle worker must not keep evicted units alive)."""
        self._open = {}


@dataclass
class _Entry:
    future: Future[Held]
    nbytes: int
    start: int  # first of the arena rows reserved for the unit, or -1
    rows: int
    buffers: tuple[int, ...] = ()  # data buffer indices reserved for its views


class UnitStore:
    """Decoded units of one epoch for one rank.

    Args:
        table_dir: Folder for the IPC files of the columns not packed, when another process
            reads them (None: they stay in memory).
        known: Units quarantined already (see :class:`Screening`).
        prefetcher: Fetches each unit's bytes ahead of its decode, in the order units are
            requested (None: decoders read for themselves, as from a local lake).
    """

    def __init__(
        self,
        reader: UnitReader,
        plan: EpochPlan,
        layout: RowLayout | None,
        arena: Arena | None,
        table_dir: str | None,
        known: tuple[QuarantineEntry, ...],
        decodes: Decodes,
        prefetcher: Prefetcher | None = None,
    ) -> None:
        self._reader = reader
        self._plan = plan
        self._layout = layout
        self._arena = arena
        self._dir = table_dir
        self._known = known
        self._decodes = decodes
        self._prefetcher = prefetcher
        self._entries: dict[int, _Entry] = {}
        #: Units decoded (or quarantined), by position: what a step reads without a lock.
        self._held: dict[int, Held] = {}
        #: (release slot, position) of every entry, the next to evict first.
        self._releases: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._views = ViewBuffers()
        self.nbytes = 0  # held or being decoded (estimates until a unit is decoded)
        self.peak_bytes = 0

    def _start(self, position: int) -> _Entry:
        """Start a unit's decode."""
        file_index, rg, row_start, rows = piece_span(self._plan, position)
        info = self._reader.snapshot.files[file_index]
        estimate = int(info.row_group_bytes[rg] * rows / max(1, info.row_group_rows[rg]))
        for known in self._known:
            if known.covers(info.path, rg, row_start, rows):
                done: Future[Held] = Future()
                done.set_result(QuarantineEntry(info.path, rg, row_start, rows, known.reason))
                return _Entry(done, 0, -1, rows)
        layout, arena = self._layout, self._arena
        start = arena.alloc(rows) if arena is not None else -1  # an arena packs some column
        name = f"e{self._plan.epoch}-p{position}.arrow"
        path = None if self._dir is None else os.path.join(self._dir, name)
        views = layout.views if start >= 0 and layout is not None else ()
        buffers = tuple(self._views.reserve() for _ in views)
        job = DecodeJob(position, file_index, rg, row_start, rows, start, path, buffers)
        # Charged its peak: a whole row group is read at once, a row range is streamed.
        whole = row_start == 0 and rows == info.row_group_rows[rg]
        prefetcher = self._prefetcher
        fetch = None if prefetcher is None else prefetcher.fetch(position, file_index, rg)
        future = self._decodes.submit(job, info.row_group_bytes[rg] if whole else estimate, fetch)
        future.add_done_callback(lambda f: self._decoded(position, f))
        return _Entry(future, estimate, start, rows, buffers)

    def _decoded(self, position: int, future: Future[Held]) -> None:
        """Count a decoded unit's real size (called as its decode finishes)."""
        if future.cancelled() or future.exception() is not None:
            return
        held = future.result()
        with self._lock:
            entry = self._entries.get(position)
            if entry is None or entry.future is not future:
                return  # evicted already (its file may be gone: it is not measured)
            # Measured under the lock: an eviction removes the entry before it deletes files.
            size = 0 if isinstance(held, QuarantineEntry) else self._size(held)
            if isinstance(held, UnitRef) and held.views:
                self._register_views(held, entry)
            self.nbytes += size - entry.nbytes
            entry.nbytes = size
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
            self._held[position] = held

    def _register_views(self, ref: UnitRef, entry: _Entry) -> None:
        """Hold the data buffers a decoded unit's views point into, at the indices reserved."""
        assert self._layout is not None
        full = self._layout.views
        table = read_ipc(ref.table) if isinstance(ref.table, str) else ref.table
        assert table is not None
        for name in ref.views:
            index = entry.buffers[full.index(name)]
            self._views.put(index, data_buffer(table.column(name).chunk(0)))

    @property
    def view_buffers(self) -> tuple[pa.Buffer, ...]:
        """The data buffers the arena's views point into, by index (see lakeloader.cache.views)."""
        return self._views.snapshot

    def _size(self, ref: UnitRef) -> int:
        """Bytes a unit holds: its packed rows and its other columns."""
        size = ref.num_rows * self._layout.row_bytes if ref.start >= 0 and self._layout else 0
        if isinstance(ref.table, str):
            return size + os.path.getsize(ref.table)
        return size + (ref.table.nbytes if ref.table is not None else 0)

    def request(self, positions: np.ndarray) -> None:
        """Start decoding the units at these positions unless already held or underway."""
        entries = self._entries
        missing = [p for p in positions.tolist() if p not in entries]  # only this thread adds
        if not missing:
            return
        releases = release_slots(self._plan, np.asarray(missing, dtype=np.int64))
        for pos, rel in zip(missing, releases.tolist(), strict=True):
            entry = self._start(pos)
            with self._lock:
                entries[pos] = entry
                heapq.heappush(self._releases, (rel, pos))
                self.nbytes += entry.nbytes
            if entry.future.done():  # finished before it had an entry to count itself in
                self._decoded(pos, entry.future)

    def arena_starts(self, positions: np.ndarray) -> np.ndarray:
        """The first arena row of each requested unit (-1: not packed into the arena)."""
        entries = self._entries
        return np.fromiter((entries[p].start for p in positions.tolist()), np.int64, len(positions))

    def ready(self, positions: np.ndarray) -> bool:
        """Whether every unit at these positions is decoded (or failed)."""
        return not self.futures(positions)

    def futures(self, positions: np.ndarray) -> list[Future[Held]]:
        """The decodes of the units at these positions that are still under way."""
        with self._lock:
            return [f for p in positions if not (f := self._entries[int(p)].future).done()]

    def failed(self, positions: np.ndarray) -> bool:
        """Whether reading any unit at these positions failed (``get`` would raise)."""
        with self._lock:
            futures = [self._entries[int(p)].future for p in positions]
        return any(f.done() and not f.cancelled() and f.exception() for f in futures)

    def get(self, positions: np.ndarray, timeout: float | None = None) -> list[Held]:
        """Each unit at these positions, or its quarantine entry (requesting them if needed).

        Raises:
            concurrent.futures.TimeoutError: If they are not all decoded within ``timeout``
                seconds (None: wait forever).
        """
        wanted = positions.tolist()
        held = [self._held.get(p) for p in wanted]
        if None not in held:  # all decoded: the common case, without a lock or a wait
            return held  # type: ignore[return-value]
        self.request(positions)
        with self._lock:
            futures = [self._entries[p].future for p in wanted]
        if timeout is not None and wait_futures(futures, timeout).not_done:
            raise FutureTimeout()
        results = [f.result() for f in futures]  # raises a unit's error
        for p, f in zip(wanted, futures, strict=True):
            if p not in self._held:
                # Done, but its callback may not have run yet: the unit's views are only
                # usable once their data buffers are registered, so register them now.
                self._decoded(p, f)
        return [self._held.get(p, r) for p, r in zip(wanted, results, strict=True)]

    def describe(self, positions: np.ndarray) -> list[str]:
        """Name the units at these positions as ``file, row group, rows [a, b)``."""
        spans = [piece_span(self._plan, int(p)) for p in positions]
        files = self._reader.snapshot.files
        return [f"{files[f].path}, row group {rg}, rows [{a}, {a + n})" for f, rg, a, n in spans]

    def release(self, delivered: int) -> None:
        """Evict every unit whose last use lies before global slot ``delivered``."""
        due = []
        with self._lock:
            while self._releases and self._releases[0][0] <= delivered:
                due.append(heapq.heappop(self._releases)[1])
        self.drop(due)

    def drop(self, positions: Iterable[int]) -> None:
        """Evict the units at these positions now (a reader that knows its own last uses)."""
        with self._lock:
            entries = [self._pop(int(p)) for p in positions if int(p) in self._entries]
        for entry in entries:
            self._discard(entry)

    def _pop(self, position: int) -> _Entry:
        """Forget a unit (caller holds the lock)."""
        entry = self._entries.pop(position)
        self._held.pop(position, None)
        self.nbytes -= entry.nbytes
        return entry

    def _discard(self, entry: _Entry) -> None:
        if not entry.future.done() and not entry.future.cancel():
            return  # a decode underway may still write its rows: they stay reserved
        if entry.start >= 0 and self._arena is not None:
            self._arena.free(entry.start, entry.rows)
        self._views.free(entry.buffers)
        if entry.future.cancelled() or entry.future.exception() is not None:
            return
        ref = entry.future.result()
        if isinstance(ref, UnitRef) and isinstance(ref.table, str):
            unlink_quietly(ref.table)

    def close(self, wait: bool = True) -> None:
        """Stop decoding and drop every unit (deleting unit files).

        Args:
            wait: Wait for decodes underway. A finaliser passes False: it may run on one of
                this store's own threads, which must not wait for itself.
        """
        self._decodes.close(wait)
        with self._lock:
            entries = [self._pop(p) for p in list(self._entries)]
            self._releases = []
        for entry in entries:
            self._discard(entry)
