"""Fetching and decoding one unit (a row group or a row range of one, streamed) through fsspec."""

from __future__ import annotations

import contextlib
import pickle
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.errors import (
    LakeDataError,
    LakeError,
    MirrorWarning,
    StoreUnavailableError,
    warn_user,
)
from lakeloader.io.access import access_error, refused
from lakeloader.io.fetch import (
    chunk_ranges,
    coalesce,
    column_chunks,
    fetch_ranges,
    is_local,
    read_footer,
    url_of,
)
from lakeloader.io.retry import RetryPolicy, describe
from lakeloader.io.sparse import Blob, Fetched, Parts, SparseFile
from lakeloader.lake.files import FileInfo
from lakeloader.lake.snapshot import Snapshot

T = TypeVar("T")

if TYPE_CHECKING:
    from lakeloader.lake.filtering import RowFilter

#: Most rows decoded at once when a unit that is a row range of its row group is streamed.
STREAM_BATCH_ROWS = 64 * 1024
#: Most uncompressed bytes (of the selected columns, by the footer) in one streamed batch.
#: Rows of a few hundred bytes reach ``STREAM_BATCH_ROWS`` first; wide rows get fewer.
STREAM_BATCH_BYTES = 16 << 20
#: Read buffer per column chunk when streaming (pyarrow's ``buffer_size``).
STREAM_BUFFER_BYTES = 1 << 20


def stream_batch_rows(meta: pq.FileMetaData, row_group: int, names: Collection[str]) -> int:
    """Rows per batch to stream a row group's ``names`` (top-level columns) with.

    The largest power of two within ``STREAM_BATCH_ROWS`` whose rows hold at most
    ``STREAM_BATCH_BYTES`` uncompressed bytes by the footer (a dictionary-encoded column
    decodes larger, so its batches may exceed the bound).

    >>> import io, pyarrow as pa, pyarrow.parquet as pq
    >>> buf = io.BytesIO()
    >>> text = [f"{i:01000d}" for i in range(1000)]
    >>> pq.write_table(pa.table({"a": [1.0] * 1000, "s": text}), buf)
    >>> meta = pq.read_metadata(pa.BufferReader(buf.getvalue()))
    >>> stream_batch_rows(meta, 0, {"a"}), stream_batch_rows(meta, 0, {"a", "s"}) < 32768
    (65536, True)
    """
    size = sum(c.total_uncompressed_size for c in column_chunks(meta, row_group, names))
    row_bytes = max(1.0, size / max(1, meta.row_group(row_group).num_rows))
    rows = max(1, min(STREAM_BATCH_ROWS, int(STREAM_BATCH_BYTES / row_bytes)))
    return 1 << (rows.bit_length() - 1)


def stream_rows(
    source: Any,
    meta: pq.FileMetaData,
    row_group: int,
    row_start: int,
    num_rows: int,
    columns: list[str],
) -> tuple[list[pa.RecordBatch], int]:
    """Rows ``[row_start, row_start + num_rows)`` of a row group's top-level ``columns``.

    Decoded in batches of :func:`stream_batch_rows` rows, those before ``row_start`` dropped;
    the stream stops after the range's last row, so the row group is never held whole.

    Returns:
        The range's batches, and the rows of the row group streamed: fewer than
        ``row_start + num_rows`` when the row group ended early.
    """
    stop = row_start + num_rows
    batch_rows = min(stream_batch_rows(meta, row_group, columns), stop)
    kept: list[pa.RecordBatch] = []
    end = 0
    with (
        pq.ParquetFile(
            source, metadata=meta, buffer_size=STREAM_BUFFER_BYTES, pre_buffer=False
        ) as parquet,
        contextlib.closing(
            parquet.iter_batches(batch_size=batch_rows, row_groups=[row_group], columns=columns)
        ) as batches,
    ):
        for batch in batches:
            first, end = end, end + batch.num_rows
            if end > row_start:
                lo = max(row_start - first, 0)
                kept.append(batch.slice(lo, min(stop - first, batch.num_rows) - lo))
            if end >= stop:
                break
    return kept, end


@dataclass
class ReadCounters:
    """Thread-safe counters of what the reader did (for ``loader.stats()``)."""

    units_decoded: int = 0
    bytes_read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_request(self, nbytes: int) -> None:
        """Count one ranged request to the store and the bytes it returned."""
        self.add(nbytes=nbytes, requests=1)

    def add(self, units: int = 0, nbytes: int = 0, requests: int = 0) -> None:
        """Count units decoded, bytes read and requests made (here, or by a worker)."""
        with self._lock:
            self.units_decoded += units
            self.bytes_read += nbytes
            self.requests += requests

    def totals(self) -> tuple[int, int, int]:
        """(units decoded, bytes read, requests) so far."""
        with self._lock:
            return self.units_decoded, self.bytes_read, self.requests


class UnitReader:
    """Reads units of one snapshot, conformed to its schema; safe to call from several threads.

    ``columns`` only (file and partition columns, in this order), missing ones as nulls,
    partition values as constant columns, so that units of different files concatenate.
    When the copy reads go to keeps failing past the retry deadline, they go on from the
    next of ``mirrors`` (``LakeDataset(mirrors=...)``), with a warning. ``row_filter`` is the
    dataset's (the snapshot's counts are its matching rows).
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        snapshot: Snapshot,
        columns: Sequence[str],
        retry: RetryPolicy,
        row_filter: RowFilter | None = None,
        mirrors: Sequence[tuple[fsspec.AbstractFileSystem, Snapshot]] = (),
    ) -> None:
        self.fs = fs
        self.row_filter = row_filter
        self.snapshot = snapshot
        self.columns = list(columns)
        self.schema = pa.schema([snapshot.schema.field(c) for c in self.columns])
        self.retry = retry
        self.counters = ReadCounters()
        self._local = is_local(fs)
        self.mirrors = tuple(UnitReader(f, s, columns, retry, row_filter) for f, s in mirrors)
        self._share_counters()
        self._copy = 0  # the copy reads go to: 0 this one, i the mirror i - 1

    def with_fs(self, fs: fsspec.AbstractFileSystem) -> UnitReader:
        """The same reader over another filesystem object (the mirrors' too), own counters."""
        copies = [(pickle.loads(pickle.dumps(m.fs)), m.snapshot) for m in self.mirrors]
        twin = UnitReader(fs, self.snapshot, self.columns, self.retry, self.row_filter, copies)
        twin._copy = self._copy
        return twin

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["counters"]  # a lock does not pickle; counts stay with their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["counters"] = ReadCounters()
        self.__dict__.update(state)
        self._share_counters()

    def count_into(self, counters: ReadCounters) -> None:
        """Count this reader's reads (its mirrors' too) into ``counters`` from now on."""
        self.counters = counters
        self._share_counters()

    def _share_counters(self) -> None:
        """The mirrors count into this reader's counters: one reader, whichever copy served."""
        for mirror in self.mirrors:
            mirror.counters = self.counters

    def _on_copies(self, call: Callable[[UnitReader], T]) -> T:
        """``call`` on the copy reads go to; past its retry deadline, on the next one.

        A late success on a copy that failed meanwhile does not move reads back to it.
        """
        copies, first = (self, *self.mirrors), self._copy
        for tried in range(len(copies) - 1):
            at = (first + tried) % len(copies)
            try:
                return call(copies[at])
            except StoreUnavailableError as exc:
                if self._copy == at:
                    self._copy = nxt = (at + 1) % len(copies)
                    where = url_of(copies[nxt].fs, copies[nxt].snapshot.files[0].path)
                    warn_user(f"{exc} -- reads go on from the copy holding {where}", MirrorWarning)
        return call(copies[(first + len(copies) - 1) % len(copies)])

    def _footer(self, info: FileInfo) -> pq.FileMetaData:
        return read_footer(
            self.fs, info.path, info.size, self.retry, self.counters.add_request, info.version
        )

    def _read_rows(
        self,
        info: FileInfo,
        row_group: int,
        row_start: int,
        num_rows: int,
        file_cols: list[str],
        fetched: Fetched | None,
    ) -> pa.Table:
        """Rows of a row group's ``file_cols``: a whole row group at once, a range streamed.

        Rows a table version deleted are dropped (the range counts the rows that remain).
        """
        meta = fetched.footer if fetched is not None else self._footer(info)
        expected = info.file_rows[row_group]
        found = meta.row_group(row_group).num_rows
        if found != expected:
            raise self._changed(info, row_group, found, "in its footer")
        kept = info.kept(row_group)
        live = expected if kept is None else int(kept.sum())
        screen = self.row_filter if info.row_group_rows[row_group] != live else None
        read_cols = file_cols
        if screen is not None:  # the filter's own columns too
            names = [] if info.schema is None else info.schema.names
            extra = [c for c in screen.columns if c not in file_cols and c in names]
            read_cols = file_cols + extra
        physical = [info.physical_name(c) for c in read_cols]
        ranges = coalesce(chunk_ranges(meta, row_group, set(physical)))
        if self._local:
            source: Any = info.path
            self.counters.add(nbytes=sum(end - start for start, end in ranges))
        else:
            parts: Parts | None = fetched.parts() if fetched is not None else None
            if parts is None:
                parts = self._fetch(info, ranges)
            source = SparseFile(info.size, parts, lambda a, b: self._fetch(info, [(a, b)])[0][1])
        if kept is not None or screen is not None or (row_start == 0 and num_rows == expected):
            table: pa.Table = pq.ParquetFile(source, metadata=meta).read_row_group(
                row_group, columns=physical
            )
            if table.num_rows != expected:
                raise self._changed(info, row_group, table.num_rows, "read")
            if kept is not None:
                table = table.filter(pa.array(kept))
            table = self._named(table, info, physical, read_cols)
            if screen is not None:
                table = screen.apply(table, info).select(file_cols)
                matching = info.row_group_rows[row_group]
                if table.num_rows != matching:
                    raise self._changed(info, row_group, table.num_rows, "match", matching)
            if kept is not None or screen is not None:
                table = table.slice(row_start, num_rows)
            return table
        batches, streamed = stream_rows(source, meta, row_group, row_start, num_rows, physical)
        if streamed < row_start + num_rows:
            raise self._changed(info, row_group, streamed, "in its stream")
        return self._named(pa.Table.from_batches(batches), info, physical, read_cols)

    @staticmethod
    def _named(table: pa.Table, info: FileInfo, physical: list[str], names: list[str]) -> pa.Table:
        """The table with the dataset's names for the file's renamed columns."""
        if not info.renames:
            return table
        logical = dict(zip(physical, names, strict=True))
        return table.rename_columns([logical.get(n, n) for n in table.column_names])

    def _fetch(self, info: FileInfo, ranges: list[tuple[int, int]]) -> list[tuple[int, Blob]]:
        on_request = self.counters.add_request
        return fetch_ranges(self.fs, info.path, ranges, self.retry, on_request, info.version)

    def _file_columns(self, info: FileInfo) -> list[str]:
        """The selected columns that the file has (the others are nulls or partitions)."""
        return [c for c in self.columns if info.schema is not None and c in info.schema.names]

    def fetch(self, file_index: int, row_group: int) -> Fetched:
        """Fetch a row group's selected column chunks (and its file's footer), to decode later.

        From the copy of the lake reads go to (see ``mirrors``); it raises what :meth:`read`
        raises.
        """
        return self._on_copies(lambda r: r._fetch_unit(file_index, row_group))

    def _fetch_unit(self, file_index: int, row_group: int) -> Fetched:
        info = self.snapshot.files[file_index]
        try:
            meta = self._footer(info)
            physical = [info.physical_name(c) for c in self._file_columns(info)]
            parts = self._fetch(info, coalesce(chunk_ranges(meta, row_group, set(physical))))
        except Exception as exc:
            raise self._failure(info, row_group, exc) from exc
        starts = tuple(s for s, _ in parts)
        return Fetched(meta, starts, tuple(len(b) for _, b in parts), tuple(b for _, b in parts))

    def _failure(self, info: FileInfo, row_group: int, exc: Exception) -> LakeError:
        """What a failure to read a unit is: a lakeloader error, refused access, or bad data."""
        if isinstance(exc, LakeError):
            return exc
        if refused(exc):  # credentials, not data: never quarantined, never retried
            return access_error(url_of(self.fs, info.path), exc, "read")
        return LakeDataError(
            f"{url_of(self.fs, info.path)}, row group {row_group}: cannot read or decode "
            f"({describe(exc)}); repair or remove the file, or pass "
            "on_error='skip' to quarantine the unit"
        )

    def _changed(
        self, info: FileInfo, row_group: int, rows: int, how: str, expected: int | None = None
    ) -> LakeDataError:
        """The error for a row group found with ``rows`` rows, not ``expected`` (the file's)."""
        said = info.file_rows[row_group] if expected is None else expected
        return LakeDataError(
            f"{url_of(self.fs, info.path)}, row group {row_group}: {rows} rows {how} but "
            f"the snapshot says {said}; the file changed after the snapshot was taken: "
            "rebuild the dataset"
        )

    def read(
        self,
        file_index: int,
        row_group: int,
        row_start: int,
        num_rows: int,
        fetched: Fetched | LakeError | None = None,
    ) -> pa.Table:
        """Read rows ``[row_start, row_start + num_rows)`` of one row group of a snapshot file.

        ``fetched`` is the row group's bytes fetched ahead (:meth:`fetch`), or the error that
        fetching them raised (raised here, as if reading had); None: fetch them now.

        Raises:
            LakeDataError: Naming the file's URL, the row group and pyarrow's error, if the
                row group cannot be read or decoded, or no longer matches the snapshot.
            LakeChangedError: If the store no longer has the snapshot's version of the file.
            StoreAccessError: If the store refuses the read (credentials, permissions).
            StoreUnavailableError: If the store keeps failing past the retry deadline.
        """
        if self.mirrors and isinstance(fetched, StoreUnavailableError):
            fetched = None  # fetched ahead from a copy that is down: read from another
        return self._on_copies(
            lambda r: r._read(file_index, row_group, row_start, num_rows, fetched)
        )

    def _read(
        self,
        file_index: int,
        row_group: int,
        row_start: int,
        num_rows: int,
        fetched: Fetched | LakeError | None,
    ) -> pa.Table:
        if isinstance(fetched, LakeError):
            raise fetched
        info = self.snapshot.files[file_index]
        file_cols = self._file_columns(info)
        try:
            table = self._read_rows(info, row_group, row_start, num_rows, file_cols, fetched)
        except Exception as exc:
            failure = self._failure(info, row_group, exc)
            if failure is exc:
                raise
            raise failure from exc
        arrays = []
        for f in self.schema:
            if f.name in file_cols:
                col = table.column(f.name)
                arrays.append(col if col.type == f.type else col.cast(f.type))
            else:
                arrays.append(info.missing_column(f.name, f.type, num_rows))
        self.counters.add(units=1)
        return pa.Table.from_arrays(arrays, schema=self.schema)
