"""A lake kept in several places (two buckets, a bucket and a local copy) read as one.

The first copy's snapshot is the dataset's identity; every mirror must hold the same files by
their path under its root. Reads fail over between copies (``io.reader.UnitReader``).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

import fsspec

from lakeloader.errors import LakeDataError, MirrorWarning, StoreUnavailableError, warn_user
from lakeloader.io.fetch import url_of
from lakeloader.lake.files import FileInfo
from lakeloader.lake.increments import SourceRequest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.source import as_source

logger = logging.getLogger(__name__)

#: A mirror as ``LakeDataset(mirrors=...)`` takes it: a URL (the dataset's storage options),
#: or ``(url, storage_options)``.
MirrorSpec: TypeAlias = "str | tuple[str, dict[str, Any]]"
_REMEDY = "the copies must hold the same files: sync them, or leave the mirror out"


@dataclass(frozen=True)
class Mirror:
    """A copy of the lake: where its files are, by their path under the primary's root.

    Attributes:
        root: The folder every file of the primary lay under when the mirror was checked.
        files: ``{path under the root: (the mirror's path, its version)}``.
    """

    url: str
    fs: fsspec.AbstractFileSystem
    root: str
    files: Mapping[str, tuple[str, str]]

    def serving(self, snapshot: Snapshot) -> Snapshot | None:
        """``snapshot`` with this copy's paths and versions (None: it lacks one of its files)."""
        files = []
        for f in snapshot.files:
            found = self.files.get(posixpath.relpath(f.path, self.root))
            if found is None:
                return None
            files.append(replace(f, path=found[0], version=found[1]))
        return replace(snapshot, files=tuple(files))


def open_mirrors(
    primary: Snapshot,
    fs: fsspec.AbstractFileSystem,
    mirrors: Sequence[Any],
    request: SourceRequest,
    pinned: bool = False,
) -> tuple[Mirror, ...]:
    """Each mirror, checked against the primary's snapshot; one that is down is left out.

    ``pinned``: the primary's snapshot is an earlier one (a checkpoint's): the mirror must
    hold its files, and may hold files added since.
    """
    copies = []
    for spec in mirrors:
        url, options = (spec, request.storage_options) if isinstance(spec, str) else spec
        try:
            mirror_fs, found = as_source(url).snapshot(replace(request, storage_options=options))
        except StoreUnavailableError as exc:
            warn_user(
                f"mirror {url} did not answer ({exc}); it is left out of this dataset's reads: "
                "make the dataset again once it is back to use it",
                MirrorWarning,
            )
            continue
        check_same(primary, fs, found, mirror_fs, pinned)
        files = {name: (f.path, f.version) for name, f in _relative(found.files).items()}
        copies.append(Mirror(str(url), mirror_fs, _root(primary.files), files))
        logger.info("mirror %s holds the same %d files", url, len(found.files))
    return tuple(copies)


def check_same(
    primary: Snapshot,
    fs: fsspec.AbstractFileSystem,
    mirror: Snapshot,
    mirror_fs: fsspec.AbstractFileSystem,
    pinned: bool = False,
) -> None:
    """Check that a mirror holds the primary's files, by their path under each one's root.

    ``pinned``: files the mirror has beyond the primary's are allowed.

    Raises:
        LakeDataError: If a file is missing on either side, or differs in size, row groups
            or schema (naming it, with both values).
    """
    ours, theirs = _relative(primary.files), _relative(mirror.files)
    where = f"{url_of(mirror_fs, _root(mirror.files))} (of {url_of(fs, _root(primary.files))})"
    for name in sorted(set(ours) - set(theirs) if pinned else set(ours) ^ set(theirs)):
        side = "the mirror" if name in ours else "the primary"
        raise LakeDataError(f"mirror {where}: {name} is missing from {side}; {_REMEDY}")
    for name, info in ours.items():
        other = theirs[name]
        for what, a, b in (
            ("size", info.size, other.size),
            ("row groups' rows", info.file_rows, other.file_rows),
            ("schema", _schema(info), _schema(other)),
        ):
            if a != b:
                raise LakeDataError(
                    f"mirror {where}: {name} differs in {what}: {a} on the primary, {b} on "
                    f"the mirror; {_REMEDY}"
                )


def _root(files: Sequence[FileInfo]) -> str:
    """The folder that every file lies under."""
    return posixpath.commonpath([posixpath.dirname(f.path) for f in files]) if files else ""


def _relative(files: Sequence[FileInfo]) -> dict[str, FileInfo]:
    """Files by their path under the folder they all lie under, in the snapshot's order."""
    root = _root(files)
    return {posixpath.relpath(f.path, root) if root else f.path: f for f in files}


def _schema(info: FileInfo) -> str:
    return "" if info.schema is None else info.schema.to_string(show_schema_metadata=False)
