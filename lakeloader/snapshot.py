"""The frozen description of a lake at one moment: files, sizes, versions, schemas, row groups.

A :class:`Snapshot` is built once (listing the lake and reading every footer in parallel) and
then pinned: planning, reading and recovery only ever look at it, never at the live lake, so
an epoch sees exactly the files it started with. Its fingerprint identifies it in states and
checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from lakeloader._keys import SNAPSHOT_FORMAT_VERSION
from lakeloader.discovery import DiscoveredFile, Source, discover
from lakeloader.errors import SchemaMismatchError, UnreadableFileError

logger = logging.getLogger(__name__)

#: From this many files on, footer reading shows a progress bar (on a terminal).
PROGRESS_MIN_FILES = 64
_VERSION_KEYS = ("ETag", "etag", "generation", "version_id", "mtime", "LastModified", "updated")


@dataclass(frozen=True)
class FileInfo:
    """One data file of a snapshot.

    Attributes:
        path: Filesystem path (no protocol).
        size: Size in bytes.
        version: A token that changes when the file is rewritten (ETag, generation or mtime).
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


@dataclass(frozen=True)
class Snapshot:
    """A lake pinned at one moment.

    Attributes:
        files: The data files, sorted by path.
        schema: The unified schema of all files, partition columns last.
        partition_types: Arrow type of each hive partition column.
        fingerprint: Hash of everything above; equal fingerprints mean the same data.
    """

    files: tuple[FileInfo, ...]
    schema: pa.Schema
    partition_types: tuple[tuple[str, pa.DataType], ...]
    fingerprint: str

    @property
    def num_rows(self) -> int:
        """Rows in the whole lake."""
        return sum(f.num_rows for f in self.files)

    @property
    def num_row_groups(self) -> int:
        """Row groups in the whole lake."""
        return sum(len(f.row_group_rows) for f in self.files)


def _version_token(info: dict[str, Any]) -> str:
    for key in _VERSION_KEYS:
        if info.get(key) is not None:
            return f"{key}:{info[key]}"
    return "none"


def read_file_info(fs: fsspec.AbstractFileSystem, found: DiscoveredFile) -> FileInfo:
    """Read one file's size, version token and Parquet footer.

    Raises:
        UnreadableFileError: If the file is not a readable Parquet file.
    """
    try:
        info = fs.info(found.path)
    except FileNotFoundError as exc:
        raise UnreadableFileError(f"{found.path}: file vanished while listing the lake") from exc
    size = int(info.get("size") or 0)
    if size == 0:
        logger.warning("%s is a zero-byte file; it is taken as an empty file", found.path)
        return FileInfo(found.path, 0, _version_token(info), (), (), found.partitions, None)
    try:
        with fs.open(found.path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
            schema = meta.schema.to_arrow_schema().remove_metadata()
    except Exception as exc:
        raise UnreadableFileError(
            f"{found.path}: cannot read the Parquet footer ({type(exc).__name__}: {exc}); "
            "repair or remove the file"
        ) from exc
    rgs = [meta.row_group(i) for i in range(meta.num_row_groups)]
    return FileInfo(
        path=found.path,
        size=size,
        version=_version_token(info),
        row_group_rows=tuple(rg.num_rows for rg in rgs),
        row_group_bytes=tuple(rg.total_byte_size for rg in rgs),
        partitions=found.partitions,
        schema=schema,
    )


def unify_schemas(files: Sequence[FileInfo]) -> pa.Schema:
    """Unify the file schemas, naming both files and both schemas on a conflict.

    Raises:
        SchemaMismatchError: If two files disagree on a column's type.
    """
    unified: pa.Schema | None = None
    first_seen: dict[str, FileInfo] = {}
    for f in files:
        if f.schema is None:
            continue
        try:
            unified = f.schema if unified is None else pa.unify_schemas([unified, f.schema])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            for field in f.schema:
                other = first_seen.get(field.name)
                if other and other.schema and other.schema.field(field.name).type != field.type:
                    raise SchemaMismatchError(
                        f"column {field.name!r} differs between {other.path} and {f.path}:"
                        f"\n--- {other.path}\n{other.schema}\n--- {f.path}\n{f.schema}\n"
                        "rewrite one of them, or select other columns with columns=[...]"
                    ) from exc
            raise SchemaMismatchError(f"{f.path}: schema cannot be unified: {exc}") from exc
        for field in f.schema:
            first_seen.setdefault(field.name, f)
    return unified if unified is not None else pa.schema([])


def _partition_types(files: Sequence[FileInfo]) -> tuple[tuple[str, pa.DataType], ...]:
    values: dict[str, list[str]] = {}
    for f in files:
        for key, value in f.partitions:
            values.setdefault(key, []).append(value)
    result = []
    for key, vals in values.items():
        is_int = all(v.lstrip("-").isdigit() for v in vals)
        result.append((key, pa.int64() if is_int else pa.string()))
    return tuple(result)


def fingerprint(files: Sequence[FileInfo], schema: pa.Schema) -> str:
    """Hash the identity of a snapshot: paths, sizes, versions, row groups and schema."""
    payload = [
        SNAPSHOT_FORMAT_VERSION,
        [[f.path, f.size, f.version, list(f.row_group_rows), list(f.partitions)] for f in files],
        schema.to_string(show_schema_metadata=False),
    ]
    return hashlib.sha256(msgpack.packb(payload)).hexdigest()[:32]


def build_snapshot(
    fs: fsspec.AbstractFileSystem,
    found: Sequence[DiscoveredFile],
    *,
    max_threads: int = 32,
    progress: bool | None = None,
    reader: Callable[[fsspec.AbstractFileSystem, DiscoveredFile], FileInfo] = read_file_info,
) -> Snapshot:
    """Read every footer in parallel and freeze the result.

    Args:
        fs: The lake's filesystem.
        found: The discovered data files, sorted by path.
        max_threads: Footers read at once (I/O bound, so more than the core count).
        progress: Show a progress bar; None shows one for many files on a terminal.
        reader: Reads one file's info (a seam for object stores' single-request footers).

    Raises:
        UnreadableFileError: If a footer cannot be read.
        SchemaMismatchError: If the schemas cannot be unified.
    """
    show = len(found) >= PROGRESS_MIN_FILES if progress is None else progress
    with ThreadPoolExecutor(max_workers=max(1, min(max_threads, len(found)))) as pool:
        infos = list(
            tqdm(
                pool.map(lambda d: reader(fs, d), found),
                total=len(found),
                desc="reading footers",
                unit="file",
                disable=None if show else True,
            )
        )
    schema = unify_schemas(infos)
    ptypes = _partition_types(infos)
    for key, typ in ptypes:
        if key in schema.names:
            raise SchemaMismatchError(
                f"hive partition key {key!r} is also a column in the files; rename the folder"
            )
        schema = schema.append(pa.field(key, typ))
    return Snapshot(tuple(infos), schema, ptypes, fingerprint(infos, schema))


def snapshot_lake(
    source: Source, storage_options: dict[str, Any] | None = None, *, progress: bool | None = None
) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
    """Discover a lake and read its footers: the one call that pins a lake.

    >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
    >>> root = tempfile.mkdtemp()
    >>> pq.write_table(pa.table({"x": list(range(10))}), f"{root}/a.parquet", row_group_size=4)
    >>> _, snap = snapshot_lake(root)
    >>> snap.num_rows, snap.files[0].row_group_rows
    (10, (4, 4, 2))
    """
    fs, found = discover(source, storage_options)
    return fs, build_snapshot(fs, found, progress=progress)
