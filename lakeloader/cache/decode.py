"""Decoding one unit into its cached form: read, screen, pack into the arena, keep the rest."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Protocol, TypeAlias

import numpy as np
import pyarrow as pa

from lakeloader.cache.packed import RowLayout, compact, pack
from lakeloader.cache.views import write_views
from lakeloader.errors import LakeDataError
from lakeloader.io.fetch import url_of
from lakeloader.io.prefetch import FetchResult, Pending
from lakeloader.io.reader import UnitReader
from lakeloader.io.retry import describe
from lakeloader.io.sparse import Fetched
from lakeloader.state.quarantine import OnError, QuarantineEntry, Validate, verdict

logger = logging.getLogger(__name__)

#: Row groups from this size on are followed by returning freed memory to the system.
RELEASE_BYTES = 64 << 20
#: Seconds between checks of a decode waiting for the byte gate.
GATE_POLL_SECONDS = 0.5


@dataclass(frozen=True, eq=False)
class UnitRef:
    """A decoded unit as a batch builder gets it (pickled between processes).

    Attributes:
        start: Its first row in the rank's arena, or -1 when nothing of it is packed.
        table: Its other columns: in memory, an Arrow IPC file in the cache folder (when
            another process needs them), or None when every column is packed.
        views: Its string and binary columns whose views are in its arena rows (they stay
            in ``table`` too: the views point into their data buffers).
        where: Its file, row group and rows, for error messages.
    """

    start: int
    num_rows: int
    packed: tuple[str, ...]
    table: pa.Table | str | None
    views: tuple[str, ...] = ()
    where: str = ""


#: What the store holds for a unit: the decoded unit, or why it is quarantined.
Held: TypeAlias = "UnitRef | QuarantineEntry"


@dataclass(frozen=True)
class DecodeJob:
    """One unit to decode, and where its decoded form goes.

    Attributes:
        position: The piece's position in the epoch's virtual sequence.
        start: Arena row to pack into (-1: nothing is packed).
        table_path: IPC file for the columns not packed (None: keep them in memory).
        view_buffers: The data buffer index of each of the layout's view columns (empty:
            write no views).
        fetched: The unit's bytes fetched ahead, or the error fetching them raised; None:
            the decoder fetches them itself.
    """

    position: int
    file_index: int
    row_group: int
    row_start: int
    num_rows: int
    start: int
    table_path: str | None
    view_buffers: tuple[int, ...] = ()
    fetched: FetchResult | None = None


@dataclass(eq=False)
class UnitDecoder:
    """Reads, screens (quarantine) and packs units (no ``layout``: keeps Arrow tables)."""

    reader: UnitReader
    layout: RowLayout | None
    on_error: OnError
    validate: Validate | None

    def decode(self, job: DecodeJob, records: np.ndarray | None) -> Held:
        """Decode a unit, packing it into ``records`` (the arena) at ``job.start``.

        Raises:
            LakeDataError: If the unit cannot be read or is rejected (``on_error="raise"``).
        """
        try:
            held = self._decode(job, records)
        finally:
            if isinstance(job.fetched, Fetched):
                job.fetched.discard()  # its file, if any: the decoded unit does not need it
        info = self.reader.snapshot.files[job.file_index]
        if info.row_group_bytes[job.row_group] >= RELEASE_BYTES:
            pa.default_memory_pool().release_unused()  # hand a big row group's memory back
        return held

    def _decode(self, job: DecodeJob, records: np.ndarray | None) -> Held:
        table = self._screen(job)
        if isinstance(table, QuarantineEntry):
            return table
        rows = table.num_rows
        path = url_of(self.reader.fs, self.reader.snapshot.files[job.file_index].path)
        where = f"{path}, row group {job.row_group}, rows [{job.row_start}, {job.row_start + rows})"
        if job.start < 0 or self.layout is None or not self.layout.names or records is None:
            return UnitRef(-1, rows, (), _keep_table(compact(table), job.table_path), (), where)
        out = records[job.start : job.start + rows]
        unit = pack(table, self.layout, out)
        start = job.start if unit.rows is not None else -1
        rest = unit.table if unit.table.num_columns or start < 0 else None
        kept = _keep_table(rest, job.table_path)
        views = []
        if start >= 0 and job.view_buffers and kept is not None:
            # From the columns as the loader's process will hold them (read back from the
            # IPC file when there is one), so that the views point into its data buffers.
            as_kept = read_ipc(kept) if isinstance(kept, str) else kept
            for name, index in zip(self.layout.views, job.view_buffers, strict=True):
                if name not in as_kept.column_names or as_kept.column(name).num_chunks != 1:
                    continue
                if write_views(as_kept.column(name).chunk(0), out[name], index) is not None:
                    views.append(name)
        return UnitRef(start, rows, unit.packed, kept, tuple(views), where)

    def _screen(self, job: DecodeJob) -> pa.Table | QuarantineEntry:
        """Read a unit, or say why it is quarantined."""
        rg, start, rows = job.row_group, job.row_start, job.num_rows
        path = self.reader.snapshot.files[job.file_index].path
        try:
            table = self.reader.read(job.file_index, rg, start, rows, job.fetched)
        except LakeDataError as exc:
            if self.on_error != "skip":
                raise
            reason = describe(exc.__cause__ or exc)
        else:
            rejected = None if self.validate is None else verdict(self.validate, table)
            if rejected is None:
                return table
            if self.on_error != "skip":
                raise LakeDataError(
                    f"{url_of(self.reader.fs, path)}, row group {rg}, rows [{start}, "
                    f"{start + rows}): rejected by validate: {rejected}. Fix the data, or pass "
                    "on_error='skip' to quarantine such units"
                )
            reason = f"rejected by validate: {rejected}"
        logger.warning(
            "quarantined %s, row group %d, rows [%d, %d): %s", path, rg, start, start + rows, reason
        )
        return QuarantineEntry(path, rg, start, rows, reason)


def _keep_table(table: pa.Table | None, path: str | None) -> pa.Table | str | None:
    """The columns a unit did not pack: as they are, or as an IPC file at ``path``."""
    if table is None or path is None:
        return table
    with pa.OSFile(path + ".tmp", "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    os.replace(path + ".tmp", path)
    return path


def read_ipc(path: str) -> pa.Table:
    """A unit's table from its IPC file, memory-mapped (zero copy)."""
    with pa.memory_map(path, "r") as source:
        return pa.ipc.open_file(source).read_all()


class Decodes(Protocol):
    """Runs decode jobs: the loader's own threads, or the DataLoader's worker processes."""

    def submit(self, job: DecodeJob, nbytes: int, fetch: Pending | None = None) -> Future[Held]:
        """Start decoding ``job`` (once ``fetch`` is done), holding about ``nbytes`` bytes."""

    def close(self, wait: bool) -> None:
        """Stop: drop queued jobs (their futures are cancelled)."""


class LocalDecodes:
    """Decodes in a thread pool of this process while the bytes they hold fit (one always runs).

    Args:
        records: The arena's rows, read at each decode (it may have grown), or None.
        pool: Threads shared with other decodes (a mixture's sources), not started or stopped
            here.
    """

    def __init__(
        self,
        decoder: UnitDecoder,
        limit: int,
        records: Callable[[], np.ndarray | None],
        pool: ThreadPoolExecutor,
    ) -> None:
        self._decoder = decoder
        self._records = records
        self._pool = pool
        self._futures: weakref.WeakSet[Future[Held]] = weakref.WeakSet()
        self._limit = max(1, limit)
        self._used = 0  # bytes held by the decodes under way, each capped at the limit
        self._cond = threading.Condition()
        self._closed = False  # then every waiting decode goes through: its result is dropped

    def submit(self, job: DecodeJob, nbytes: int, fetch: Pending | None = None) -> Future[Held]:
        """Queue ``job`` for a decoding thread, which waits for ``fetch`` if it is given."""
        future = self._pool.submit(self._run, job, nbytes, fetch)
        self._futures.add(future)
        return future

    def _run(self, job: DecodeJob, nbytes: int, fetch: Pending | None) -> Held:
        if fetch is not None:
            job = dataclasses.replace(job, fetched=fetch.claim())
        n = min(max(0, nbytes), self._limit)
        with self._cond:
            while self._used and self._used + n > self._limit and not self._closed:
                self._cond.wait(GATE_POLL_SECONDS)
            self._used += n
        try:
            return self._decoder.decode(job, self._records())
        finally:
            with self._cond:
                self._used -= n
                self._cond.notify_all()

    def close(self, wait: bool) -> None:
        """Cancel the queued decodes (waiting for those underway unless ``wait`` is False)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        running = [f for f in list(self._futures) if not f.cancel()]  # queued ones are dropped
        if wait:
            wait_futures(running)
