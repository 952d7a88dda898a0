"""One data file of a lake as a snapshot pins it: size, version, row groups, schema."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True)
class FileInfo:
    """One data file of a snapshot.

    Attributes:
        path: Filesystem path (no protocol).
        size: Size in bytes.
        version: A token that changes when the file is rewritten (GCS generation, else ETag,
            version id or modification time: see ``discovery.version_token``).
        row_group_rows: Row count of every row group, in file order.
        row_group_bytes: Uncompressed size of every row group, for memory estimates.
        partitions: Hive partition values ``(key, value)`` from the file's folders.
        schema: The file's own Arrow schema (without metadata); None for a zero-byte file.
    """

    path: str
    size: int
    version: str
    row_group_rows: tuple[int, ...]
    row_group_bytes: tuple[int, ...]
    partitions: tuple[tuple[str, str], ...]
    schema: pa.Schema | None

    @property
    def num_rows(self) -> int:
        """Rows in the file."""
        return sum(self.row_group_rows)
