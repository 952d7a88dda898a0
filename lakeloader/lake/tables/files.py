"""A table version's listing of data files, made into a snapshot (footers read in parallel)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa

from lakeloader.errors import LakeDataError, LakeNotFoundError
from lakeloader.io.fetch import url_of
from lakeloader.lake.discovery import DiscoveredFile
from lakeloader.lake.files import FileInfo
from lakeloader.lake.increments import SourceRequest
from lakeloader.lake.snapshot import Snapshot, TableVersion, build_snapshot

#: Field metadata key of a Parquet field id (written by Iceberg and Delta column mapping).
FIELD_ID = b"PARQUET:field_id"


@dataclass(frozen=True)
class TableFile:
    """A data file as a table version lists it (its path without protocol).

    ``rows`` counts deleted rows too (None: the metadata does not say); ``deleted`` are the
    sorted positions of the rows the version deleted.
    """

    path: str
    rows: int | None
    partitions: tuple[tuple[str, str], ...] = ()
    deleted: tuple[int, ...] = ()


@dataclass(frozen=True)
class TableColumns:
    """The data columns of a table version (partition columns that files lack left out).

    ``by_field_id`` names each field id when files match by it (Iceberg, Delta column
    mapping); None matches them by name.
    """

    names: tuple[str, ...]
    by_field_id: Mapping[int, str] | None = None


def table_snapshot(
    fs: fsspec.AbstractFileSystem,
    files: Sequence[TableFile],
    table: TableColumns,
    version: TableVersion,
    request: SourceRequest,
) -> Snapshot:
    """Read the footers of a table version's files and pin them as a snapshot.

    Raises:
        LakeNotFoundError: If the version holds no data file.
        LakeDataError: If a footer cannot be read, or a file's rows differ from the metadata.
    """
    if not files:
        raise LakeNotFoundError(f"{version.describe()} holds no data file")
    listed = {f.path: f for f in files}

    def check(info: FileInfo) -> FileInfo:
        said = listed[info.path]
        if said.rows is not None and info.num_rows != said.rows:
            raise LakeDataError(
                f"{url_of(fs, said.path)}: {info.num_rows} rows in its footer but "
                f"{said.rows} in the metadata of {version.describe()}; the file was replaced "
                "or the table is corrupt: repair the table (or pass on_error='skip')"
            )
        return as_table_file(info, said, table)

    found = [DiscoveredFile(f.path, f.partitions) for f in sorted(files, key=lambda f: f.path)]
    return build_snapshot(fs, found, request, version, check)


def as_table_file(info: FileInfo, listed: TableFile, table: TableColumns) -> FileInfo:
    """A file's footer info with the table's names, columns and deleted rows applied.

    Columns are matched by field id when the table gives them (a renamed column keeps its id)
    and by name otherwise; columns the version no longer has are left out.

    >>> f = pa.field("a", pa.int64(), metadata={FIELD_ID: b"1"})
    >>> info = FileInfo("f", 1, "v", (2, 2), (8, 8), (), pa.schema([f]))
    >>> out = as_table_file(info, TableFile("f", 4, deleted=(0,)), TableColumns(("b",), {1: "b"}))
    >>> out.schema.names, out.renames, out.row_group_rows, out.physical_rows
    (['b'], (('b', 'a'),), (1, 2), (2, 2))
    """
    renames: list[tuple[str, str]] = []
    schema = info.schema
    if schema is not None:
        fields = []
        for field in schema:
            name = field.name
            if table.by_field_id is not None and field.metadata and FIELD_ID in field.metadata:
                name = table.by_field_id.get(int(field.metadata[FIELD_ID]), "")
            if name not in table.names:
                continue  # dropped since, or not the table's
            if name != field.name:
                renames.append((name, field.name))
            fields.append(field.with_name(name).remove_metadata())
        schema = pa.schema(fields)
    partitions = tuple(
        (k, v) for k, v in listed.partitions if schema is None or k not in schema.names
    )
    rows = info.row_group_rows
    physical: tuple[int, ...] = ()
    if listed.deleted:
        first = np.cumsum(rows) - rows
        gone = np.bincount(
            np.searchsorted(first, np.asarray(listed.deleted), side="right") - 1,
            minlength=len(rows),
        )
        physical, rows = rows, tuple(int(r) for r in np.asarray(rows) - gone)
    return dataclasses.replace(
        info,
        schema=schema,
        partitions=partitions,
        row_group_rows=rows,
        physical_rows=physical,
        deleted=listed.deleted,
        renames=tuple(renames),
    )
