"""An Iceberg table snapshot as a source, through ``pyiceberg`` (extra ``iceberg``).

Its scan plan gives the data files, position deletes the deleted rows; files match the
snapshot's schema by field id. Equality deletes are refused.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from lakeloader.errors import LakeChangedError, LakeDataError, LakeNotFoundError
from lakeloader.follow import OnRewrite
from lakeloader.lake.increments import Increment, Mark, SourceRequest, rewritten
from lakeloader.lake.snapshot import Snapshot, TableVersion
from lakeloader.lake.tables.files import TableColumns, TableFile, table_snapshot

logger = logging.getLogger(__name__)


def open_table(location: str, properties: dict[str, str]) -> Any:
    """The static table of a metadata file.

    Raises:
        ImportError: If ``pyiceberg`` is not installed, saying which extra installs it.
        LakeNotFoundError: If the metadata file cannot be read.
    """
    try:
        from pyiceberg.table import StaticTable
    except ImportError as exc:
        raise ImportError(
            "reading Iceberg tables needs pyiceberg: pip install 'pyiceberg[pyarrow]' (or "
            "pip install -e '.[iceberg]' in a clone of lakeloader)"
        ) from exc
    try:
        return StaticTable.from_metadata(location, properties=properties)
    except (OSError, ValueError) as exc:
        raise LakeNotFoundError(
            f"{location}: cannot read it as an Iceberg metadata file ({exc}); pass a "
            "pyiceberg Table or the location of its metadata/*.metadata.json"
        ) from exc


@dataclass(frozen=True)
class IcebergSource:
    """A snapshot of the Iceberg table of a metadata file (None: the current one).

    ``properties`` are pyiceberg's FileIO properties (endpoint, credentials).
    """

    location: str
    snapshot_id: int | None = None
    properties: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    def describe(self) -> str:
        """The table's metadata file."""
        return self.location

    def filesystem(self, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem of the table's files."""
        fs: fsspec.AbstractFileSystem = url_to_fs(self.location, **storage_options)[0]
        return fs

    def snapshot(self, request: SourceRequest) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
        """Pin the snapshot: its scan plan, position deletes and schema; then the footers.

        Raises:
            LakeNotFoundError: If there is no such snapshot.
        """
        table = open_table(self.location, dict(self.properties))
        snap = _at(table, self.snapshot_id)
        if snap is None:
            known = [s.snapshot_id for s in table.snapshots()]
            raise LakeNotFoundError(
                f"{self.location}: no snapshot {self.snapshot_id} (the table has "
                f"{known or 'no snapshots: nothing was written'})"
            )
        fs = self.filesystem(request.storage_options)
        files = _files(fs, table, snap.snapshot_id, self.location)
        return fs, self._table_snapshot(fs, table, snap, files, request)

    def _table_snapshot(
        self,
        fs: fsspec.AbstractFileSystem,
        table: Any,
        snap: Any,
        files: list[TableFile],
        request: SourceRequest,
    ) -> Snapshot:
        version = TableVersion(
            "iceberg", self.location, str(table.metadata.table_uuid), int(snap.snapshot_id)
        )
        schema = table.schemas()[snap.schema_id]
        names = TableColumns(
            tuple(f.name for f in schema.fields), {f.field_id: f.name for f in schema.fields}
        )
        return table_snapshot(fs, files, names, version, request)

    def increment(
        self, after: Increment | None, request: SourceRequest
    ) -> tuple[fsspec.AbstractFileSystem, Snapshot] | None:
        """The first increment is the snapshot; then each later one that appends files."""
        upto = request.upto
        fs = self.filesystem(request.storage_options)
        table = open_table(newest_metadata(fs, self.location), dict(self.properties))
        if after is None:
            wanted = self.snapshot_id if upto is None else int(upto.path)
            source = dataclasses.replace(self, snapshot_id=wanted)
            fs, snapshot = source.snapshot(request)
            assert snapshot.table is not None
            head = table.snapshot_by_id(snapshot.table.version)
            return fs, dataclasses.replace(snapshot, increment=Increment(0, _mark(head)))
        head = _at(table, None if upto is None else int(upto.path))
        if head is None:
            return None
        found = next_append(table, int(after.upto.path), head, request.on_rewrite, fs)
        if found is None:
            return None
        snap, files = found
        snapshot = self._table_snapshot(fs, table, snap, files, request)
        taken = Increment(after.index + 1, _mark(snap), after.upto)
        return fs, dataclasses.replace(snapshot, increment=taken)


def newest_metadata(fs: fsspec.AbstractFileSystem, location: str) -> str:
    """The newest metadata file beside ``location`` (``NNNNN-<uuid>.metadata.json``).

    A file catalog (SqlCatalog, Hadoop-style tables) writes each table version's metadata as
    the next-numbered file in the same folder.
    """
    folder = location.rsplit("/", 1)[0]
    names = [p.rsplit("/", 1)[-1] for p in fs.glob(f"{fs._strip_protocol(folder)}/*.metadata.json")]
    numbered = {
        name: int(name.split("-", 1)[0]) for name in names if name.split("-", 1)[0].isdigit()
    }
    if not numbered:
        return location
    return f"{folder}/{max(numbered, key=numbered.__getitem__)}"


def _at(table: Any, snapshot_id: int | None) -> Any:
    """The table's snapshot of that id (None: the current one), or None."""
    return table.current_snapshot() if snapshot_id is None else table.snapshot_by_id(snapshot_id)


def _added_files(table: Any, snap: Any, fs: fsspec.AbstractFileSystem) -> list[TableFile]:
    """The data files an append snapshot added."""
    from pyiceberg.manifest import ManifestContent, ManifestEntryStatus

    out = []
    for manifest in snap.manifests(table.io):
        if (
            manifest.added_snapshot_id != snap.snapshot_id
            or manifest.content != ManifestContent.DATA
        ):
            continue
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            if entry.status == ManifestEntryStatus.ADDED:
                data = entry.data_file
                out.append(TableFile(fs._strip_protocol(data.file_path), int(data.record_count)))
    return out


def next_append(
    table: Any, after: int, head: Any, on_rewrite: OnRewrite, fs: fsspec.AbstractFileSystem
) -> tuple[Any, list[TableFile]] | None:
    """The first snapshot after ``after`` (up to ``head``) that appends data files.

    Compactions (``replace``) are passed over; overwrites and deletes of data already there
    go by ``on_rewrite``.

    Raises:
        LakeChangedError: If ``after`` is not an ancestor of ``head`` (the history was
            rewritten or expired), or under ``on_rewrite="error"`` for a rewrite.
    """
    chain = []
    snap = head
    while snap is not None and snap.snapshot_id != after:
        chain.append(snap)
        parent = snap.parent_snapshot_id
        snap = None if parent is None else table.snapshot_by_id(parent)
    if snap is None:
        raise LakeChangedError(
            f"snapshot {after} is no longer an ancestor of snapshot {head.snapshot_id}: the "
            "table's history was rewritten or expired; follow it anew from a new dataset"
        )
    for snap in reversed(chain):
        operation = str(snap.summary.operation.value if snap.summary else "append")
        if operation == "replace":
            continue
        if operation != "append":
            rewritten(f"snapshot {snap.snapshot_id} ({operation})", on_rewrite)
            continue
        added = _added_files(table, snap, fs)
        if added:
            return snap, added
    return None


def _mark(snap: Any) -> Mark:
    """An Iceberg snapshot as a follow mark: its sequence number, then its id."""
    return Mark(int(snap.sequence_number or 0), str(snap.snapshot_id))


def _files(
    fs: fsspec.AbstractFileSystem, table: Any, snapshot_id: int, where: str
) -> list[TableFile]:
    """The snapshot's data files with the rows their position deletes delete."""
    try:
        tasks = list(table.scan(snapshot_id=snapshot_id).plan_files())
    except ValueError as exc:
        if "equality delete" not in str(exc):
            raise
        raise LakeDataError(
            f"{where}, snapshot {snapshot_id}: has equality delete files, which lakeloader "
            "cannot apply to a file's rows before reading them; compact the table "
            "(rewrite its data files) so that the deletes are applied, then read the new "
            "snapshot"
        ) from exc
    positions: dict[str, set[int]] = defaultdict(set)
    read = dict.fromkeys(delete.file_path for task in tasks for delete in task.delete_files)
    for path in read:  # a position delete file's (file_path, pos) rows
        with fs.open(fs._strip_protocol(path), "rb") as handle:
            deletes = pq.read_table(handle, columns=["file_path", "pos"])
        by_file = deletes.group_by("file_path").aggregate([("pos", "list")])
        for name, pos in zip(*by_file.to_pydict().values(), strict=True):
            positions[name].update(pos)
    out = []
    for task in tasks:
        data = task.file
        gone = tuple(sorted(positions.get(data.file_path, ())))
        out.append(TableFile(fs._strip_protocol(data.file_path), int(data.record_count), (), gone))
    if read:
        logger.info(
            "position deletes: %d files, %d rows", len(read), sum(map(len, positions.values()))
        )
    return out
