"""Fetching and decoding one unit (a row group or a row range of one) through fsspec.

The reader conforms every unit to the snapshot's unified schema (selected columns only,
missing columns as nulls, hive partition values as constant columns), so that units of
different files concatenate into one batch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.errors import UnreadableFileError
from lakeloader.snapshot import FileInfo, Snapshot

#: Footers kept decoded, so that reading a unit does not fetch its file's footer again.
FOOTER_CACHE_FILES = 256


class _CountingFile:
    """A read-only file wrapper that counts the bytes pyarrow reads through it."""

    def __init__(self, raw: Any, counter: ReadCounters) -> None:
        self._raw = raw
        self._counter = counter
        self.closed = False

    def read(self, nbytes: int = -1) -> bytes:
        data: bytes = self._raw.read(nbytes)
        self._counter.add_bytes(len(data))
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self._raw.close()


@dataclass
class ReadCounters:
    """Thread-safe counters of what the reader did (for ``loader.stats()``)."""

    units_decoded: int = 0
    bytes_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, n: int) -> None:
        """Count bytes read from storage."""
        with self._lock:
            self.bytes_read += n

    def add_unit(self) -> None:
        """Count one decoded unit."""
        with self._lock:
            self.units_decoded += 1


class UnitReader:
    """Reads units of one snapshot; safe to call from several threads.

    Args:
        fs: The lake's filesystem.
        snapshot: The pinned snapshot.
        columns: Columns to return (file columns and partition columns), in this order.
    """

    def __init__(
        self, fs: fsspec.AbstractFileSystem, snapshot: Snapshot, columns: Sequence[str]
    ) -> None:
        self.fs = fs
        self.snapshot = snapshot
        self.columns = list(columns)
        self.schema = pa.schema([snapshot.schema.field(c) for c in self.columns])
        self.counters = ReadCounters()
        self._footers: OrderedDict[str, pq.FileMetaData] = OrderedDict()
        self._lock = threading.Lock()

    def _footer(self, info: FileInfo) -> pq.FileMetaData | None:
        with self._lock:
            meta = self._footers.get(info.path)
            if meta is not None:
                self._footers.move_to_end(info.path)
        return meta

    def _remember(self, info: FileInfo, meta: pq.FileMetaData) -> None:
        with self._lock:
            self._footers[info.path] = meta
            while len(self._footers) > FOOTER_CACHE_FILES:
                self._footers.popitem(last=False)

    def read(self, file_index: int, row_group: int, row_start: int, num_rows: int) -> pa.Table:
        """Read rows ``[row_start, row_start + num_rows)`` of one row group.

        Raises:
            UnreadableFileError: Naming the file and row group, if reading or decoding fails.
        """
        info = self.snapshot.files[file_index]
        partitions = dict(info.partitions)
        file_cols = [c for c in self.columns if info.schema is not None and c in info.schema.names]
        try:
            with self.fs.open(info.path, "rb") as raw:
                fh = _CountingFile(raw, self.counters)
                meta = self._footer(info)
                pf = pq.ParquetFile(fh, metadata=meta, pre_buffer=True)
                self._remember(info, pf.metadata)
                table = pf.read_row_group(row_group, columns=file_cols)
        except Exception as exc:
            raise UnreadableFileError(
                f"{info.path}, row group {row_group}: cannot read "
                f"({type(exc).__name__}: {exc}); repair or remove the file"
            ) from exc
        if table.num_rows != info.row_group_rows[row_group]:
            raise UnreadableFileError(
                f"{info.path}, row group {row_group}: {table.num_rows} rows read but the "
                f"snapshot says {info.row_group_rows[row_group]}; the file changed after the "
                "snapshot was taken: rebuild the dataset"
            )
        table = table.slice(row_start, num_rows)
        arrays = []
        for f in self.schema:
            if f.name in file_cols:
                col = table.column(f.name)
                arrays.append(col if col.type == f.type else col.cast(f.type))
            elif f.name in partitions:
                value = partitions[f.name]
                arrays.append(pa.repeat(pa.scalar(value).cast(f.type), num_rows))
            else:
                arrays.append(pa.nulls(num_rows, f.type))
        self.counters.add_unit()
        return pa.Table.from_arrays(arrays, schema=self.schema)
