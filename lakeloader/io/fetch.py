"""Few, large requests: one ranged GET per footer, coalesced ranged GETs per row group.

A remote file is never walked through a buffered file object (which costs a request for each
footer read and column chunk); local files are read by pyarrow natively.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from lakeloader.errors import LakeDataError
from lakeloader.io import pinned
from lakeloader.io.retry import RetryPolicy, describe
from lakeloader.io.sparse import Blob

#: Bytes read from the end of a file to get its footer in one request (most footers are
#: a few KB; wide tables with thousands of columns may need the one extra request).
FOOTER_TAIL_BYTES = 64 * 1024
#: Column-chunk ranges closer than this are fetched as one range.
COALESCE_GAP = 64 * 1024
#: The four bytes that end (and start) every Parquet file.
PARQUET_MAGIC = b"PAR1"

Ranges = list[tuple[int, int]]


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The full URL of a path (``s3://bucket/key``), for messages; local paths stay plain."""
    return path if is_local(fs) else str(fs.unstrip_protocol(path))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether pyarrow can open the filesystem's paths itself."""
    return isinstance(fs, LocalFileSystem)


class _FooterCache:
    """Footers parsed in this process, by (URL, size, version), the least recently used out."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[tuple[str, int, str], pq.FileMetaData] = OrderedDict()
        self._lock = threading.Lock()

    def unlock(self) -> None:
        """In a forked child: a lock of its own (a thread of the parent may hold the parent's)."""
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int, str]) -> pq.FileMetaData | None:
        with self._lock:
            meta = self._items.get(key)
            if meta is not None:
                self._items.move_to_end(key)
            return meta

    def put(self, key: tuple[str, int, str], meta: pq.FileMetaData) -> None:
        with self._lock:
            self._items[key] = meta
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)


#: Footers kept per process (a few KB each for ordinary schemas).
FOOTER_CACHE_FILES = 4096
_FOOTERS = _FooterCache(FOOTER_CACHE_FILES)
os.register_at_fork(after_in_child=_FOOTERS.unlock)


def read_footer(
    fs: fsspec.AbstractFileSystem,
    path: str,
    size: int,
    retry: RetryPolicy,
    on_request: Callable[[int], None] | None = None,
    version: str = "",
) -> pq.FileMetaData:
    """A file's parsed Parquet footer: one ranged request (two for huge footers), or none.

    ``on_request`` is called with the bytes of each request made. The last
    ``FOOTER_CACHE_FILES`` footers are cached per process by URL, size and version.

    Raises:
        LakeDataError: If the file is not a Parquet file, is truncated, or its footer does
            not parse; names the URL and the cause.
    """
    url = url_of(fs, path)
    key = (url, size, version)
    meta = _FOOTERS.get(key)
    if meta is not None:
        return meta
    source: str | pa.BufferReader = path
    if not is_local(fs):

        def cat(start: int, end: int) -> Blob:
            return fetch_ranges(fs, path, [(start, end)], retry, on_request, version)[0][1]

        start = max(0, size - FOOTER_TAIL_BYTES)
        tail = cat(start, size)
        if size < 12 or tail[-4:] != PARQUET_MAGIC:
            why = "shorter than a Parquet file's 12 bytes of magic and footer length"
            if tail[-4:] != PARQUET_MAGIC:
                why = f"it ends with {tail[-4:]!r}, not {PARQUET_MAGIC!r}"
            raise LakeDataError(
                f"{url}: not a Parquet file: {why} ({size} bytes); a truncated or half-written "
                "file looks like this. Repair it, remove it, or move it out of the lake"
            )
        length = int.from_bytes(tail[-8:-4], "little")
        if length + 8 > size - 4:
            raise LakeDataError(
                f"{url}: its footer claims {length} bytes but the file has {size}; the file is "
                "truncated or corrupt. Repair or remove it"
            )
        if length + 8 > len(tail):
            tail = cat(size - length - 8, start) + tail
        source = pa.BufferReader(tail[len(tail) - length - 8 :])
    try:
        meta = pq.read_metadata(source)
    except Exception as exc:
        raise LakeDataError(
            f"{url}: cannot read the Parquet footer ({describe(exc)}); repair or remove the "
            "file, or move it out of the lake"
        ) from exc
    _FOOTERS.put(key, meta)
    return meta


class ShortReadError(ConnectionError):
    """A ranged read returned fewer bytes than asked: a connection cut mid-body (retried)."""


def column_chunks(
    meta: pq.FileMetaData, row_group: int, names: Collection[str]
) -> list[pq.ColumnChunkMetaData]:
    """The column chunks of ``names`` (top-level columns) in one row group."""
    rg = meta.row_group(row_group)
    chunks = (rg.column(i) for i in range(rg.num_columns))
    return [c for c in chunks if c.path_in_schema.split(".")[0] in names]


def chunk_ranges(meta: pq.FileMetaData, row_group: int, names: Collection[str]) -> Ranges:
    """Byte ranges of the column chunks of ``names`` (top-level columns) in one row group.

    >>> import io, pyarrow as pa, pyarrow.parquet as pq
    >>> buf = io.BytesIO()
    >>> pq.write_table(pa.table({"a": [1, 2], "b": [3, 4]}), buf)
    >>> meta = pq.read_metadata(pa.BufferReader(buf.getvalue()))
    >>> [end > start >= 4 for start, end in chunk_ranges(meta, 0, {"b"})]
    [True]
    """
    out: Ranges = []
    for col in column_chunks(meta, row_group, names):
        offsets = [col.data_page_offset]
        if col.has_dictionary_page and col.dictionary_page_offset:
            offsets.append(col.dictionary_page_offset)
        start = min(offsets)
        out.append((start, start + col.total_compressed_size))
    return out


def coalesce(ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP) -> Ranges:
    """Merge ranges that overlap or lie within ``gap`` bytes of each other.

    >>> coalesce([(300, 400), (0, 100), (150, 200)], gap=60)
    [(0, 200), (300, 400)]
    """
    merged: Ranges = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def fetch_ranges(
    fs: fsspec.AbstractFileSystem,
    path: str,
    ranges: Ranges,
    retry: RetryPolicy,
    on_request: Callable[[int], None] | None = None,
    version: str = "",
) -> list[tuple[int, Blob]]:
    """``(start, bytes)`` of byte ranges of a file, fetched at once (pinned where possible)."""

    def cat_all() -> list[Blob]:
        blobs = pinned.cat_ranges(fs, path, version, ranges)
        for blob, (start, end) in zip(blobs, ranges, strict=True):
            if isinstance(blob, BaseException):  # an async fsspec before 2026.6 returns them
                raise blob
            if len(blob) != end - start:
                raise ShortReadError(f"{path}: {len(blob)} bytes read for range [{start}, {end})")
        return blobs

    blobs = retry.call(cat_all, url_of(fs, path)) if ranges else []
    for blob in blobs:
        if on_request is not None:
            on_request(len(blob))
    return list(zip([s for s, _ in ranges], blobs, strict=True))
