"""A Delta Lake table version as a source, through the ``deltalake`` package (extra ``delta``).

Its add actions give the data files, deletion vectors the deleted rows; under column mapping
files match the table's columns by field id. Nothing is listed: only footers are read. Follow
mode reads the log's JSON commits: an ``add`` with ``dataChange`` true is appended data, a
``remove`` with ``dataChange`` true (DELETE, UPDATE, MERGE, overwrite) rewrites data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
from fsspec.core import url_to_fs

from lakeloader.errors import LakeDataError, LakeNotFoundError
from lakeloader.follow import OnRewrite
from lakeloader.lake.increments import Increment, Mark, SourceRequest, rewritten
from lakeloader.lake.snapshot import Snapshot, TableVersion
from lakeloader.lake.tables.files import TableColumns, TableFile, table_snapshot

logger = logging.getLogger(__name__)


def open_table(uri: str, version: int | None, options: dict[str, str]) -> Any:
    """The ``deltalake.DeltaTable`` at ``version`` (None: the newest).

    Raises:
        ImportError: If ``deltalake`` is not installed, saying which extra installs it.
        LakeNotFoundError: If there is no Delta table at ``uri``, or not that version.
    """
    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import DeltaError, TableNotFoundError
    except ImportError as exc:
        raise ImportError(
            "reading Delta tables needs the deltalake package: pip install deltalake (or "
            "pip install -e '.[delta]' in a clone of lakeloader)"
        ) from exc
    try:
        return DeltaTable(uri, version=version, storage_options=options or None)
    except TableNotFoundError as exc:
        raise LakeNotFoundError(
            f"{uri}: no Delta table there ({exc}); check the URI (the folder that holds "
            "_delta_log/) and storage_options"
        ) from exc
    except DeltaError as exc:
        newest = DeltaTable(uri, storage_options=options or None).version()
        raise LakeNotFoundError(
            f"{uri}: cannot open version {version} ({exc}); the table's versions go up to "
            f"{newest}, and versions older than its log retention may be gone"
        ) from exc


@dataclass(frozen=True)
class DeltaSource:
    """A version of a Delta Lake table's folder (None: the newest when the dataset is made).

    ``options`` are ``deltalake``'s storage options (from :func:`.options.delta_options`).
    """

    uri: str
    version: int | None = None
    options: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def describe(self) -> str:
        """The table's URI."""
        return self.uri

    def filesystem(self, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem of the table's folder."""
        fs: fsspec.AbstractFileSystem = url_to_fs(self.uri, **storage_options)[0]
        return fs

    def snapshot(self, request: SourceRequest) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
        """Pin the version: its add actions, deletion vectors and schema; then the footers."""
        table = open_table(self.uri, self.version, dict(self.options))
        fs = self.filesystem(request.storage_options)
        version = TableVersion("delta", self.uri, str(table.metadata().id), int(table.version()))
        return fs, table_snapshot(
            fs, _files(fs, self.uri, table), _columns(table), version, request
        )

    def increment(
        self, after: Increment | None, request: SourceRequest
    ) -> tuple[fsspec.AbstractFileSystem, Snapshot] | None:
        """The first increment is the version; then each later commit that appends rows."""
        upto = request.upto
        if after is None:
            source = self if upto is None else dataclasses.replace(self, version=upto.position)
            fs, snapshot = source.snapshot(request)
            assert snapshot.table is not None
            return fs, dataclasses.replace(
                snapshot, increment=Increment(0, Mark(snapshot.table.version))
            )
        table = open_table(self.uri, None if upto is None else upto.position, dict(self.options))
        fs = self.filesystem(request.storage_options)
        root, newest = fs._strip_protocol(self.uri), int(table.version())
        found = next_append(fs, root, after.upto.position, newest, request.on_rewrite)
        if found is None:
            return None
        newest, files = found
        version = TableVersion("delta", self.uri, str(table.metadata().id), newest)
        snapshot = table_snapshot(fs, files, _columns(table), version, request)
        taken = Increment(after.index + 1, Mark(newest), after.upto)
        return fs, dataclasses.replace(snapshot, increment=taken)


def _columns(table: Any) -> TableColumns:
    """The version's data columns; matched by field id under column mapping."""
    schema = pa.schema(table.schema().to_arrow())
    parts = set(table.metadata().partition_columns)
    names = tuple(f.name for f in schema if f.name not in parts)
    mode = table.metadata().configuration.get("delta.columnMapping.mode", "none")
    if mode not in ("name", "id"):  # no column mapping: files match by name
        return TableColumns(names)
    ids = {int(f.metadata[b"delta.columnMapping.id"]): f.name for f in schema if f.metadata}
    return TableColumns(names, ids)


def _files(fs: fsspec.AbstractFileSystem, uri: str, table: Any) -> list[TableFile]:
    """The version's data files, with the rows its deletion vectors delete."""
    actions = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    deleted: dict[str, tuple[int, ...]] = {}
    if "deletionVectors" in (table.protocol().reader_features or []):
        for vector in pa.table(table.deletion_vectors()).to_pylist():
            keep = np.asarray(vector["selection_vector"], dtype=bool)  # may stop short: kept
            gone = tuple(np.flatnonzero(~keep).tolist())
            deleted[fs._strip_protocol(vector["filepath"])] = gone
        logger.info("deletion vectors: %d files have deleted rows", len(deleted))
    out = []
    for action in actions:
        path = data_path(fs, uri, action["path"])
        partitions = tuple(
            (key[len("partition.") :], _partition_text(value))
            for key, value in action.items()
            if key.startswith("partition.") and value is not None
        )
        out.append(TableFile(path, int(action["num_records"]), partitions, deleted.get(path, ())))
    return out


def _partition_text(value: Any) -> str:
    """A typed partition value as text (dates in ISO form, booleans in lower case)."""
    if isinstance(value, bool):
        return str(value).lower()
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def data_path(fs: fsspec.AbstractFileSystem, root: str, path: str) -> str:
    """The filesystem path of a data file as the log names it (a URL, or under ``root``)."""
    relative = urllib.parse.unquote(path)
    url = relative if "://" in relative else f"{root.rstrip('/')}/{relative}"
    return str(fs._strip_protocol(url))


def next_append(
    fs: fsspec.AbstractFileSystem, root: str, after: int, newest: int, on_rewrite: OnRewrite
) -> tuple[int, list[TableFile]] | None:
    """The first commit after version ``after`` (up to ``newest``) that appends rows.

    ``root`` is the table's filesystem path. Commits that append nothing (compactions) are
    passed over, and so are those that remove data, under ``on_rewrite="skip"``.

    Returns:
        Its version and the files it added with ``dataChange`` true, or None if there is none.

    Raises:
        LakeChangedError: Under ``on_rewrite="error"``, naming a commit that rewrote data.
        LakeDataError: If an appended file has a deletion vector (not taken in as an increment).
    """
    for version in range(after + 1, newest + 1):
        path = f"{root.rstrip('/')}/_delta_log/{version:020d}.json"
        with fs.open(path, "rt") as handle:
            actions = [json.loads(line) for line in handle if line.strip()]
        operation, added, rewrites = "", [], False
        for action in actions:
            if "commitInfo" in action:
                operation = str(action["commitInfo"].get("operation", ""))
            if "remove" in action and action["remove"].get("dataChange", True):
                rewrites = True
            add = action.get("add")
            if add is None or not add.get("dataChange", True):
                continue
            if add.get("deletionVector"):
                raise LakeDataError(
                    f"{fs.unstrip_protocol(path)}: appended file {add['path']} has a deletion "
                    "vector, which follow mode does not take in; read the table by version instead"
                )
            rows = json.loads(add.get("stats") or "{}").get("numRecords")
            parts = tuple(
                (k, str(v)) for k, v in (add.get("partitionValues") or {}).items() if v is not None
            )
            file_path = data_path(fs, root, add["path"])
            added.append(TableFile(file_path, None if rows is None else int(rows), parts))
        if rewrites:
            rewritten(f"{fs.unstrip_protocol(root)} version {version} ({operation})", on_rewrite)
        elif added:
            return version, added
    return None
