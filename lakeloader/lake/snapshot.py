"""The frozen description of a lake at one moment: files, sizes, versions, schemas, row groups.

Planning and reading only ever look at a pinned :class:`Snapshot`, never at the live lake;
its fingerprint identifies it in states and checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import fsspec
import msgpack
import pyarrow as pa

from lakeloader.errors import LakeDataError, SchemaMismatchError
from lakeloader.io.fetch import read_footer, url_of
from lakeloader.io.per_file import per_file
from lakeloader.io.retry import RetryPolicy, describe
from lakeloader.lake.discovery import DiscoveredFile, Paths, discover_listed, version_token
from lakeloader.lake.files import FileInfo
from lakeloader.lake.increments import Increment, SourceRequest
from lakeloader.lake.schema import unify_schemas, without_views

logger = logging.getLogger(__name__)

#: Version of the snapshot description (affects the fingerprint).
SNAPSHOT_FORMAT_VERSION = 1
_INT_RE = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class TableVersion:
    """Which version of which table a snapshot is.

    Attributes:
        format: ``"delta"`` or ``"iceberg"``.
        location: The table's URI (Delta) or metadata file (Iceberg) as given.
        table_id: The Delta table id, or the Iceberg table UUID.
        version: The Delta version or the Iceberg snapshot id.
    """

    format: str
    location: str
    table_id: str
    version: int

    def describe(self) -> str:
        """The table version, for messages and ``inspect``.

        >>> TableVersion("delta", "s3://b/t", "1f2e", 3).describe()
        'delta table s3://b/t (id 1f2e) at version 3'
        """
        return f"{self.format} table {self.location} (id {self.table_id}) at version {self.version}"


@dataclass(frozen=True)
class Snapshot:
    """A lake pinned at one moment.

    Attributes:
        files: The data files, sorted by path.
        schema: The unified schema of the selected columns, partition columns last.
        partition_types: Arrow type of each hive partition column.
        column_names: Every column of every file, then the partition keys.
        fingerprint: Hash of the files and the table version (:func:`fingerprint`); equal
            fingerprints mean the same data.
        table: The table version the files are of (None for a folder).
        row_filter: The filter whose matching rows ``row_group_rows`` count (None: all rows).
            Not in the fingerprint: the lake is the same.
        increment: Which increment of a followed lake it is (None: not following).
    """

    files: tuple[FileInfo, ...]
    schema: pa.Schema
    partition_types: tuple[tuple[str, pa.DataType], ...]
    column_names: tuple[str, ...]
    fingerprint: str
    table: TableVersion | None = None
    row_filter: str | None = None
    increment: Increment | None = None

    @cached_property
    def num_rows(self) -> int:
        """Rows in the whole lake (counted once: ``len(dataset)`` is asked for at every step)."""
        return sum(f.num_rows for f in self.files)

    @property
    def num_row_groups(self) -> int:
        """Row groups in the whole lake."""
        return sum(len(f.row_group_rows) for f in self.files)


def read_file_info(
    fs: fsspec.AbstractFileSystem, found: DiscoveredFile, retry: RetryPolicy
) -> FileInfo:
    """Read one file's Parquet footer, and its size and version unless the listing gave them.

    Raises:
        LakeDataError: If the file is not a readable Parquet file.
    """
    size, version = found.size, found.version
    if size is None or version is None:
        try:
            info = retry.call(lambda: fs.info(found.path), url_of(fs, found.path))
        except FileNotFoundError as exc:
            raise LakeDataError(
                f"{url_of(fs, found.path)}: file vanished while listing the lake"
            ) from exc
        size, version = int(info.get("size") or 0), version_token(info)
    if size == 0:
        logger.warning("%s is a zero-byte file; it is taken as an empty file", found.path)
        return FileInfo(found.path, 0, version, (), (), found.partitions, None)
    meta = read_footer(fs, found.path, size, retry, version=version)
    try:
        schema = without_views(meta.schema.to_arrow_schema().remove_metadata())
    except Exception as exc:
        raise LakeDataError(
            f"{url_of(fs, found.path)}: its Parquet schema has no Arrow equivalent "
            f"({describe(exc)}); rewrite the file or leave it out of the lake"
        ) from exc
    rgs = [meta.row_group(i) for i in range(meta.num_row_groups)]
    rows, nbytes = tuple(rg.num_rows for rg in rgs), tuple(rg.total_byte_size for rg in rgs)
    return FileInfo(found.path, size, version, rows, nbytes, found.partitions, schema)


def _partition_types(files: Sequence[FileInfo]) -> tuple[tuple[str, pa.DataType], ...]:
    values: dict[str, list[str]] = {}
    for f in files:
        for key, value in f.partitions:
            values.setdefault(key, []).append(value)
    return tuple(
        (key, pa.int64() if all(_is_int64(v) for v in vals) else pa.string())
        for key, vals in values.items()
    )


def _is_int64(text: str) -> bool:
    """Whether a hive partition value is a plain ASCII integer that fits in int64."""
    return bool(_INT_RE.fullmatch(text)) and -(2**63) <= int(text) < 2**63


def fingerprint(files: Sequence[FileInfo], table: TableVersion | None = None) -> str:
    """Hash a snapshot's identity: paths, sizes, versions, row group rows, hive values, schemas.

    Deleted rows, renames and the table version count where there are any; the rows of a
    file are those in it (a filter's counts of matching rows are not the lake's identity).
    """
    entries = []
    for f in files:
        entry: list[Any] = [
            f.path,
            f.size,
            f.version,
            list(f.file_rows),
            list(f.partitions),
            f.schema.to_string(show_schema_metadata=False) if f.schema is not None else "",
        ]
        if f.deleted or f.renames:
            entry += [list(f.deleted), [list(r) for r in f.renames]]
        entries.append(entry)
    payload: list[Any] = [SNAPSHOT_FORMAT_VERSION, entries]
    if table is not None:
        payload.append([table.format, table.table_id, table.version])
    return hashlib.sha256(msgpack.packb(payload)).hexdigest()[:32]


def build_snapshot(
    fs: fsspec.AbstractFileSystem,
    found: Sequence[DiscoveredFile],
    request: SourceRequest,
    table: TableVersion | None = None,
    check: Callable[[FileInfo], FileInfo] | None = None,
) -> Snapshot:
    """Read every footer in parallel and freeze the result.

    ``request.columns`` are the columns whose types must agree across files (None: all).
    ``check`` makes each footer's info the snapshot's (a table's names and deleted rows); a
    ``LakeDataError`` it raises counts as an unreadable file.

    Raises:
        LakeDataError: If a footer cannot be read or ``check`` rejects it (unless
            ``request.skip_unreadable``).
    """

    def read(d: DiscoveredFile) -> FileInfo | None:
        try:
            info = read_file_info(fs, d, request.retry)
            return info if check is None else check(info)
        except LakeDataError as exc:
            if not request.skip_unreadable:
                raise
            logger.warning("left out of the snapshot (on_error='skip'): %s", exc)
            return None

    infos = per_file(fs, read, found, "reading footers", request.progress)
    return assemble_snapshot([i for i in infos if i is not None], request.columns, table)


def assemble_snapshot(
    infos: Sequence[FileInfo],
    columns: Sequence[str] | None,
    table: TableVersion | None = None,
) -> Snapshot:
    """Freeze file infos into a snapshot: unified schema, hive columns, fingerprint.

    Raises:
        SchemaMismatchError: If the schemas cannot be unified, or a hive key is also a column.
    """
    ptypes = _partition_types(infos)
    file_names = [n for f in infos if f.schema is not None for n in f.schema.names]
    for key, _ in ptypes:
        if key in file_names:
            raise SchemaMismatchError(
                f"hive partition key {key!r} is also a column in the files; rename the folder"
            )
    schema = unify_schemas(infos, columns)
    for key, typ in ptypes:
        if columns is None or key in columns:
            schema = schema.append(pa.field(key, typ))
    names = tuple(dict.fromkeys(file_names + [k for k, _ in ptypes]))
    return Snapshot(tuple(infos), schema, ptypes, names, fingerprint(infos, table), table)


def snapshot_lake(
    source: Paths, request: SourceRequest | None = None
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """Discover a lake and read its footers."""
    request = request or SourceRequest({}, None, None, RetryPolicy(), False)
    fs, listed = discover_listed(source, request.storage_options, request.retry)
    return fs, build_snapshot(fs, [d for d, _ in listed], request)
