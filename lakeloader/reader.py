"""Fetching and decoding one unit (a row group or a row range of one) through fsspec.

The reader conforms every unit to the snapshot's unified schema (selected columns only,
missing columns as nulls, hive partition values as constant columns), so that units of
different files concatenate into one batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.errors import LakeDataError, LakeError
from lakeloader.fetch import chunk_ranges, coalesce, fetch_ranges, is_local, read_footer, url_of
from lakeloader.retry import RetryPolicy, describe
from lakeloader.snapshot import FileInfo, Snapshot


@dataclass
class ReadCounters:
    """Thread-safe counters of what the reader did (for ``loader.stats()``)."""

    units_decoded: int = 0
    bytes_read: int = 0
    requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_request(self, nbytes: int) -> None:
        """Count one ranged request to the store and the bytes it returned."""
        with self._lock:
            self.requests += 1
            self.bytes_read += nbytes

    def add_local_read(self, nbytes: int) -> None:
        """Count bytes that pyarrow reads from a local file itself."""
        with self._lock:
            self.bytes_read += nbytes

    def add_unit(self) -> None:
        """Count one decoded unit."""
        with self._lock:
            self.units_decoded += 1

    def add(self, units: int, nbytes: int, requests: int) -> None:
        """Count what another process's reader did (a worker that decoded for this one)."""
        with self._lock:
            self.units_decoded += units
            self.bytes_read += nbytes
            self.requests += requests

    def totals(self) -> tuple[int, int, int]:
        """(units decoded, bytes read, requests) so far."""
        with self._lock:
            return self.units_decoded, self.bytes_read, self.requests


class UnitReader:
    """Reads units of one snapshot; safe to call from several threads.

    Local files are opened by pyarrow itself. Remote files cost one ranged request per footer
    (cached per process, so none when this process built the snapshot) and one concurrent
    batch of coalesced ranged requests per unit, for the selected columns only (see
    :mod:`lakeloader.fetch`).

    Args:
        fs: The lake's filesystem.
        snapshot: The pinned snapshot.
        columns: Columns to return (file columns and partition columns), in this order.
        retry: Retry policy for transient storage failures.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        snapshot: Snapshot,
        columns: Sequence[str],
        retry: RetryPolicy,
    ) -> None:
        self.fs = fs
        self.snapshot = snapshot
        self.columns = list(columns)
        self.schema = pa.schema([snapshot.schema.field(c) for c in self.columns])
        self.retry = retry
        self.counters = ReadCounters()
        self._local = is_local(fs)

    def with_fs(self, fs: fsspec.AbstractFileSystem) -> UnitReader:
        """The same reader over another filesystem object, with counters of its own."""
        return UnitReader(fs, self.snapshot, self.columns, self.retry)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["counters"]  # a lock does not pickle; counts stay with their process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["counters"] = ReadCounters()
        self.__dict__.update(state)

    def _footer(self, info: FileInfo) -> pq.FileMetaData:
        return read_footer(
            self.fs, info.path, info.size, self.retry, self.counters.add_request, info.version
        )

    def _read_row_group(self, info: FileInfo, row_group: int, file_cols: list[str]) -> pa.Table:
        meta = self._footer(info)
        ranges = coalesce(chunk_ranges(meta, row_group, set(file_cols)))
        if self._local:
            source: Any = info.path
            self.counters.add_local_read(sum(end - start for start, end in ranges))
        else:
            source = fetch_ranges(
                self.fs, info.path, info.size, ranges, self.retry, self.counters.add_request
            )
        table: pa.Table = pq.ParquetFile(source, metadata=meta).read_row_group(
            row_group, columns=file_cols
        )
        return table

    def read(self, file_index: int, row_group: int, row_start: int, num_rows: int) -> pa.Table:
        """Read rows ``[row_start, row_start + num_rows)`` of one row group.

        Raises:
            LakeDataError: Naming the file's URL, the row group and pyarrow's error, if the
                row group cannot be read or decoded, or no longer matches the snapshot.
            StoreUnavailableError: If the store keeps failing past the retry deadline.
        """
        info = self.snapshot.files[file_index]
        partitions = dict(info.partitions)
        file_cols = [c for c in self.columns if info.schema is not None and c in info.schema.names]
        try:
            table = self._read_row_group(info, row_group, file_cols)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeDataError(
                f"{url_of(self.fs, info.path)}, row group {row_group}: cannot read or decode "
                f"({describe(exc)}); repair or remove the file, or pass "
                "on_error='skip' to quarantine the unit"
            ) from exc
        if table.num_rows != info.row_group_rows[row_group]:
            raise LakeDataError(
                f"{url_of(self.fs, info.path)}, row group {row_group}: {table.num_rows} rows "
                f"read but the snapshot says {info.row_group_rows[row_group]}; the file "
                "changed after the snapshot was taken: rebuild the dataset"
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
