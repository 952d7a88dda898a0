"""A unit that is a row range of its row group, streamed: its rows decoded a batch at a time."""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.io.fetch import column_chunks

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
    """Rows ``[row_start, row_start + num_rows)`` of a row group, streamed.

    ``source`` is a local path or a file object; ``columns`` are top-level. Decoded in batches
    of :func:`stream_batch_rows` rows, those before ``row_start`` dropped; the stream stops
    after the range's last row, so the row group is never held whole.

    Returns:
        The range's batches (the first and last sliced to it), and the rows of the row group
        streamed: fewer than ``row_start + num_rows`` when the row group ended early.
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
