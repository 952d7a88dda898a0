"""One data file of a lake as a snapshot pins it: size, version, row groups, schema.

A table version's file may have deleted rows and renamed columns: :class:`FileInfo` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class FileInfo:
    """One data file of a snapshot (its path without protocol, its size in bytes).

    Attributes:
        version: A token that changes when the file is rewritten (GCS generation, else ETag,
            version id or modification time: see ``discovery.version_token``).
        row_group_rows: Row count of every row group, in file order (rows that remain, when
            rows are deleted).
        row_group_bytes: Uncompressed size of every row group, for memory estimates.
        partitions: Partition values ``(key, value)`` (from hive folders, or from a table's
            metadata).
        schema: The file's own Arrow schema (without metadata), with the table's names for
            renamed columns; None for a zero-byte file.
        deleted: Physical row positions in the file (sorted) that a table version deleted.
        physical_rows: Row count of every row group in the file itself, when rows are
            deleted (else empty: the same as ``row_group_rows``).
        renames: ``(name, name in the file)`` of each column renamed since it was written.
    """

    path: str
    size: int
    version: str
    row_group_rows: tuple[int, ...]
    row_group_bytes: tuple[int, ...]
    partitions: tuple[tuple[str, str], ...]
    schema: pa.Schema | None
    deleted: tuple[int, ...] = ()
    physical_rows: tuple[int, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    @property
    def num_rows(self) -> int:
        """Rows in the file."""
        return sum(self.row_group_rows)

    @property
    def file_rows(self) -> tuple[int, ...]:
        """Rows of every row group in the file itself, deleted ones included."""
        return self.physical_rows or self.row_group_rows

    def physical_name(self, column: str) -> str:
        """The name a column has in the file.

        >>> FileInfo("f", 1, "v", (1,), (1,), (), None, renames=(("b", "a"),)).physical_name("b")
        'a'
        """
        if not self.renames:  # every unit read asks, for every column: the usual case first
            return column
        return dict(self.renames).get(column, column)

    def missing_column(self, name: str, typ: pa.DataType, rows: int) -> pa.Array:
        """``rows`` values of a column the file lacks: its partition value, else nulls."""
        value = dict(self.partitions).get(name)
        if value is None:
            return pa.nulls(rows, typ)
        return pa.repeat(pa.scalar(value).cast(typ), rows)

    def kept(self, row_group: int) -> np.ndarray | None:
        """Which rows of a row group remain (a boolean mask), or None when all do.

        >>> f = FileInfo("f", 1, "v", (2, 2), (1, 1), (), None, (1, 3), (3, 3))
        >>> f.kept(1).tolist()
        [False, True, True]
        """
        if not self.deleted:
            return None
        rows = self.file_rows
        first = sum(rows[:row_group])
        gone = np.asarray(self.deleted, dtype=np.int64)
        gone = gone[(gone >= first) & (gone < first + rows[row_group])] - first
        if not len(gone):
            return None
        mask = np.ones(rows[row_group], dtype=bool)
        mask[gone] = False
        return mask
