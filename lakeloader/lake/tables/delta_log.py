"""The commits of a Delta table after a version: what they appended, and what they rewrote.

Read from the log's JSON commits (``_delta_log/<version>.json``, the Delta protocol's own
record): an ``add`` with ``dataChange`` true is appended data; a commit whose actions all have
``dataChange`` false (``OPTIMIZE``) only rearranges rows and adds nothing new; a ``remove``
with ``dataChange`` true (DELETE, UPDATE, MERGE, overwrite) rewrites data already there.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from dataclasses import dataclass

import fsspec

from lakeloader.errors import LakeDataError
from lakeloader.follow import OnRewrite
from lakeloader.lake.increments import rewritten
from lakeloader.lake.tables.files import TableFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Commit:
    """One commit's data files.

    Attributes:
        version: The table version it made.
        operation: Its ``commitInfo`` operation (``WRITE``, ``OPTIMIZE``, ``DELETE``...).
        added: Files it added with ``dataChange`` true.
        rewrites: Whether it removed data (a ``remove`` with ``dataChange`` true).
    """

    version: int
    operation: str
    added: tuple[TableFile, ...]
    rewrites: bool


def read_commit(fs: fsspec.AbstractFileSystem, root: str, version: int) -> Commit:
    """Parse ``_delta_log/<version>.json`` of the table at ``root`` (a filesystem path).

    Raises:
        LakeDataError: If an appended file has a deletion vector (not taken in as an increment).
    """
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
        relative = urllib.parse.unquote(add["path"])
        full = relative if "://" in relative else f"{root.rstrip('/')}/{relative}"
        stats = json.loads(add.get("stats") or "{}")
        parts = tuple(
            (k, str(v)) for k, v in (add.get("partitionValues") or {}).items() if v is not None
        )
        rows = stats.get("numRecords")
        added.append(
            TableFile(fs._strip_protocol(full), None if rows is None else int(rows), parts)
        )
    return Commit(version, operation, tuple(added), rewrites)


def next_append(
    fs: fsspec.AbstractFileSystem, root: str, after: int, newest: int, on_rewrite: OnRewrite
) -> tuple[int, list[TableFile]] | None:
    """The first commit after version ``after`` (up to ``newest``) that appends rows.

    Commits that append nothing (compactions) are passed over, and so are those that rewrite
    data (under ``on_rewrite="skip"``, with a warning).

    Returns:
        Its version and the files it added, or None if there is none yet.

    Raises:
        LakeChangedError: Under ``on_rewrite="error"``, naming a commit that rewrote data.
    """
    for version in range(after + 1, newest + 1):
        commit = read_commit(fs, root, version)
        if commit.rewrites:
            rewritten(
                f"{fs.unstrip_protocol(root)} version {version} ({commit.operation})", on_rewrite
            )
        elif commit.added:
            return version, list(commit.added)
    return None
