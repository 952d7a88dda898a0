"""A snapshot as plain data: what a checkpoint pins so that recovery never re-lists the lake.

The fingerprint is recomputed on load: a manifest that does not hash to it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import pyarrow as pa

from lakeloader.errors import StateFormatError
from lakeloader.lake.files import FileInfo
from lakeloader.lake.increments import Increment
from lakeloader.lake.snapshot import Snapshot, TableVersion, assemble_snapshot

MANIFEST_KIND: Final = "lakeloader.manifest"
MANIFEST_VERSION: Final = 2
#: Versions read: 1 had no deleted rows, renames or table version.
READABLE_VERSIONS: Final = (1, 2)


def to_manifest(snapshot: Snapshot, source: str | list[str]) -> dict[str, Any]:
    """Describe a snapshot in plain types (msgpack-serialisable; schemas as IPC bytes).

    ``source`` is the lake's as given to ``LakeDataset`` (URLs keep their protocol, which the
    file paths do not), so that the filesystem can be rebuilt without listing.
    """
    schemas: dict[bytes, int] = {}  # each distinct schema once, by its index
    files = []
    for f in snapshot.files:
        ref = -1
        if f.schema is not None:
            ref = schemas.setdefault(f.schema.serialize().to_pybytes(), len(schemas))
        entry = [
            f.path,
            f.size,
            f.version,
            list(f.row_group_rows),
            list(f.row_group_bytes),
            [list(p) for p in f.partitions],
            ref,
        ]
        if f.deleted or f.renames or f.physical_rows:
            entry += [list(f.deleted), list(f.physical_rows), [list(r) for r in f.renames]]
        files.append(entry)
    table = snapshot.table
    return {
        "kind": MANIFEST_KIND,
        "version": MANIFEST_VERSION,
        "source": source,
        "fingerprint": snapshot.fingerprint,
        "files": files,
        "schemas": list(schemas),
        "table": None if table is None else dataclasses.asdict(table),
        "row_filter": snapshot.row_filter,
        "increment": None if snapshot.increment is None else snapshot.increment.to_list(),
    }


def from_manifest(manifest: dict[str, Any], columns: Sequence[str] | None = None) -> Snapshot:
    """Rebuild the snapshot a manifest describes, without touching the lake.

    Raises:
        StateFormatError: If the manifest is malformed or does not match its fingerprint.
    """
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise StateFormatError("not a lakeloader manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise StateFormatError(
            f"manifest version {manifest.get('version')!r} is not supported "
            f"(this lakeloader reads versions {list(READABLE_VERSIONS)})"
        )
    try:
        schemas = [pa.ipc.read_schema(pa.py_buffer(b)) for b in manifest["schemas"]]
        infos = [_file_info(entry, schemas) for entry in manifest["files"]]
        table = manifest.get("table")
        version = None if table is None else TableVersion(**table)
    except (KeyError, TypeError, ValueError, IndexError, pa.ArrowException) as exc:
        raise StateFormatError(f"malformed lakeloader manifest: {exc!r}") from exc
    increment = manifest.get("increment")
    snapshot = dataclasses.replace(
        assemble_snapshot(infos, columns, version),
        row_filter=manifest.get("row_filter"),
        increment=None if increment is None else Increment.from_list(increment),
    )
    recorded = manifest.get("fingerprint")
    if snapshot.fingerprint != recorded:
        raise StateFormatError(
            f"manifest is corrupt: it hashes to {snapshot.fingerprint}, not to its fingerprint "
            f"{recorded!r}"
        )
    return snapshot


def _file_info(entry: list[Any], schemas: list[pa.Schema]) -> FileInfo:
    """A manifest's file entry as a :class:`FileInfo`."""
    path, size, version, rows, nbytes, parts, ref, *selection = entry
    deleted, physical, renames = selection or ([], [], [])
    return FileInfo(
        path=str(path),
        size=int(size),
        version=str(version),
        row_group_rows=tuple(int(r) for r in rows),
        row_group_bytes=tuple(int(b) for b in nbytes),
        partitions=tuple((str(k), str(v)) for k, v in parts),
        schema=schemas[ref] if ref >= 0 else None,
        deleted=tuple(int(d) for d in deleted),
        physical_rows=tuple(int(r) for r in physical),
        renames=tuple((str(a), str(b)) for a, b in renames),
    )


def pack_manifest(snapshot: Snapshot, source: str | list[str]) -> bytes:
    """The manifest of a snapshot as msgpack bytes."""
    data: bytes = msgpack.packb(to_manifest(snapshot, source), use_bin_type=True)
    return data


def unpack_manifest(data: bytes) -> dict[str, Any]:
    """Parse manifest bytes (a StateFormatError if not msgpack; :func:`from_manifest` checks)."""
    try:
        value: dict[str, Any] = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise StateFormatError(f"manifest is not valid msgpack: {exc!r}") from exc
    return value
