"""Row filters: a pyarrow expression over partition and data columns, applied exactly.

Each row group's count of matching rows is resolved when the dataset is made (by partition
values and statistics, else by reading the filter's columns); the order plans over those
counts, and reading a unit applies the filter again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from lakeloader.errors import LakeDataError
from lakeloader.io.fetch import column_chunks, is_local, url_of
from lakeloader.io.per_file import per_file
from lakeloader.io.retry import describe
from lakeloader.lake.files import FileInfo
from lakeloader.lake.snapshot import Snapshot
from lakeloader.state.quarantine import OnError, QuarantineEntry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowFilter:
    """A validated filter, kept in the order configuration as ``text``.

    ``fields`` are the columns it reads (data and partition columns, selected or not).
    """

    expression: pc.Expression
    fields: pa.Schema
    text: str

    @property
    def columns(self) -> tuple[str, ...]:
        """The names of the columns it reads."""
        return tuple(self.fields.names)

    @classmethod
    def of(cls, expression: Any, schema: pa.Schema) -> RowFilter:
        """Check ``expression`` against the lake's columns (:func:`lake_schema`).

        >>> f = RowFilter.of(pc.field("x") > 1, pa.schema([("x", pa.int64()), ("y", pa.int8())]))
        >>> f.columns, f.text
        (('x',), '(x > 1)')

        Raises:
            TypeError: If it is not a ``pyarrow.compute.Expression``.
            ValueError: If it cannot be evaluated on the lake's columns (naming them).
        """
        if not isinstance(expression, pc.Expression):
            raise TypeError(
                "filter must be a pyarrow.compute.Expression such as pc.field('x') > 0, got "
                f"{type(expression).__name__} {expression!r}"
            )
        error = _evaluation_error(expression, schema)
        if error is not None:
            raise ValueError(
                f"filter {expression} cannot be evaluated on the lake's columns "
                f"{schema.names}: {error}"
            )
        used = [
            schema.field(i)
            for i in range(len(schema))
            if _evaluation_error(expression, schema.remove(i))
        ]
        return cls(expression, pa.schema(used), str(expression))

    def apply(self, table: pa.Table, info: FileInfo) -> pa.Table:
        """The rows of ``table`` (a piece of ``info``'s file) that match.

        Columns the filter reads that ``table`` lacks come from the file's partition values,
        or are nulls (a column the file does not have).
        """
        for name in self.columns:
            if name not in table.column_names:
                typ = self.fields.field(name).type
                column = info.missing_column(name, typ, table.num_rows)
                table = table.append_column(pa.field(name, typ), column)
        return table.filter(self.expression)


def _evaluation_error(expression: pc.Expression, schema: pa.Schema) -> str | None:
    try:
        schema.empty_table().filter(expression)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def lake_schema(snapshot: Snapshot) -> pa.Schema:
    """Every column of the lake, selected or not (typed as the first file that has it)."""
    fields: dict[str, pa.Field] = {}
    for info in snapshot.files:
        for field in info.schema or ():
            fields.setdefault(field.name, field)
    for key, typ in snapshot.partition_types:
        fields.setdefault(key, pa.field(key, typ))
    return pa.schema(list(fields.values()))


class RowGroupReader(Protocol):
    """What counting reads through: a :class:`~lakeloader.io.reader.UnitReader`."""

    def read(self, file_index: int, row_group: int, row_start: int, num_rows: int) -> pa.Table:
        """Rows ``[row_start, row_start + num_rows)`` of a row group, conformed to its schema."""
        ...


#: Makes a reader of some columns of a snapshot (the dataset's ``UnitReader``, with its retries).
ReaderFactory = Callable[[Snapshot, Sequence[str]], RowGroupReader]
#: Row groups that could not be counted, quarantined whole (``on_error="skip"``).
Unreadable = tuple[QuarantineEntry, ...]


def filtered(
    fs: fsspec.AbstractFileSystem,
    snapshot: Snapshot,
    row_filter: RowFilter | None,
    progress: bool | None,
    on_error: OnError,
    reader: ReaderFactory,
) -> tuple[Snapshot, Unreadable]:
    """``snapshot`` with ``row_filter``'s counts (made once: a manifest's snapshot has them).

    Returns:
        The snapshot, and the row groups quarantined whole because they could not be counted
        (``on_error="skip"``; none for a snapshot filtered already).

    Raises:
        ValueError: If ``snapshot`` was filtered by another filter.
        LakeDataError: If a row group cannot be read to be counted (``on_error="raise"``).
    """
    wanted = None if row_filter is None else row_filter.text
    if snapshot.row_filter == wanted:
        return snapshot, ()
    if snapshot.row_filter is not None or row_filter is None:
        raise ValueError(
            f"the snapshot was filtered by {snapshot.row_filter}, this dataset by {wanted}: "
            "pass the filter the checkpoint was taken with"
        )
    count = _Counter(fs, snapshot, row_filter, reader, on_error)
    files = range(len(snapshot.files))
    resolved = per_file(fs, count.resolve, files, "applying the filter", progress)
    kept = sum(f.num_rows for f, _ in resolved)
    logger.info("filter %s keeps %d of %d rows", row_filter.text, kept, snapshot.num_rows)
    unreadable = tuple(e for _, lost in resolved for e in lost)
    infos = tuple(f for f, _ in resolved)
    return dataclasses.replace(snapshot, files=infos, row_filter=row_filter.text), unreadable


@dataclass(frozen=True)
class _Counter:
    """Counts the matching rows of a snapshot's files, one file per call."""

    fs: fsspec.AbstractFileSystem
    snapshot: Snapshot
    row_filter: RowFilter
    reader: ReaderFactory
    on_error: OnError

    def resolve(self, index: int) -> tuple[FileInfo, Unreadable]:
        """A file with each row group's matching rows as its counts, and those quarantined.

        A row group that cannot be read keeps all its rows under ``on_error="skip"``.
        """
        info = self.snapshot.files[index]
        if info.schema is None or not info.row_group_rows:
            return info, ()
        maybe, whole = _by_statistics(self.fs, info, self.snapshot, self.row_filter)
        counts, lost = [], []
        for rg, rows in enumerate(info.row_group_rows):
            if rg not in maybe or rows == 0:
                counts.append(0)
            elif rg in whole:
                counts.append(rows)
            else:
                try:
                    counts.append(self._count(index, rg))
                except LakeDataError as exc:
                    if self.on_error != "skip":
                        raise
                    counts.append(rows)
                    reason = describe(exc.__cause__ or exc)
                    logger.warning(
                        "quarantined %s, row group %d: it cannot be read to apply the filter (%s)",
                        url_of(self.fs, info.path),
                        rg,
                        reason,
                    )
                    lost.append(QuarantineEntry(info.path, rg, 0, rows, reason))
        resolved = dataclasses.replace(
            info, row_group_rows=tuple(counts), physical_rows=info.file_rows
        )
        return resolved, tuple(lost)

    def _count(self, index: int, rg: int) -> int:
        """Rows of a row group that match, from its filter columns (deleted rows left out)."""
        info = self.snapshot.files[index]
        rows = info.row_group_rows[rg]
        assert info.schema is not None
        fields = [info.schema.field(c) for c in self.row_filter.columns if c in info.schema.names]
        if not fields:  # only partition values, or columns the file lacks
            table = pa.table({"_": pa.nulls(rows)}).select([])  # `rows` rows, no column
        else:  # the file's own types: no cast
            own = dataclasses.replace(self.snapshot, schema=pa.schema(fields))
            table = self.reader(own, [f.name for f in fields]).read(index, rg, 0, rows)
        return int(self.row_filter.apply(table, info).num_rows)


def _by_statistics(
    fs: fsspec.AbstractFileSystem, info: FileInfo, snapshot: Snapshot, row_filter: RowFilter
) -> tuple[set[int], set[int]]:
    """Row groups that may match, and those that match in full, by partitions and statistics.

    A file with renamed columns is not judged by statistics (they carry the file's names).
    """
    every = set(range(len(info.row_group_rows)))
    if info.renames:
        return every, set()
    types = dict(snapshot.partition_types)
    partition = pc.scalar(True)
    for key, value in info.partitions:
        partition = partition & (pc.field(key) == pa.scalar(value).cast(types[key]))
    filesystem = (
        pafs.LocalFileSystem() if is_local(fs) else pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    )
    fragment = pads.ParquetFileFormat().make_fragment(
        info.path, filesystem=filesystem, partition_expression=partition
    )
    schema = row_filter.fields
    try:
        maybe = {rg.id for rg in fragment.subset(row_filter.expression, schema=schema).row_groups}
        failing = {
            rg.id for rg in fragment.subset(~row_filter.expression, schema=schema).row_groups
        }
    except (pa.ArrowException, OSError) as exc:
        logger.warning("%s: statistics not used for the filter (%s)", url_of(fs, info.path), exc)
        return every, set()
    meta = fragment.metadata
    data = [c for c in row_filter.columns if c in info.schema.names] if info.schema else []
    whole = {rg for rg in maybe - failing if _no_nulls(meta, rg, data)}
    return maybe, whole


def _no_nulls(meta: pq.FileMetaData, rg: int, columns: list[str]) -> bool:
    """Whether the statistics say these columns hold no null in the row group."""
    for chunk in column_chunks(meta, rg, columns):
        stats = chunk.statistics
        if stats is None or not stats.has_null_count or stats.null_count != 0:
            return False
    return True
