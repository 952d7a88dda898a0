"""The commits of a Delta table after a version: what they appended, and what they rewrote.

Read from the log's JSON commits: an ``add`` with ``dataChange`` true is appended data; a
commit of only ``dataChange`` false actions (``OPTIMIZE``) adds nothing new; a ``remove`` with
``dataChange`` true (DELETE, UPDATE, MERGE, overwrite) rewrites data already there.
"""

from __future__ import annotations

import json
import urllib.parse

import fsspec

from lakeloader.errors import LakeDataError
from lakeloader.follow import OnRewrite
from lakeloader.lake.increments import rewritten
from lakeloader.lake.tables.files import TableFile


def data_path(fs: fsspec.AbstractFileSystem, root: str, path: str) -> str:
    """The filesystem path of a data file as the log names it (a URL, or under ``root``)."""
    relative = urllib.parse.unquote(path)
    url = relative if "://" in relative else f"{root.rstrip('/')}/{relative}"
    return str(fs._strip_protocol(url))


def read_commit(
    fs: fsspec.AbstractFileSystem, root: str, version: int
) -> tuple[str, list[TableFile], bool]:
    """Parse ``_delta_log/<version>.json`` of the table at ``root`` (a filesystem path).

    Returns:
        Its ``commitInfo`` operation, the files it added with ``dataChange`` true, and whether
        it removed data (a ``remove`` with ``dataChange`` true).

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
        rows = json.loads(add.get("stats") or "{}").get("numRecords")
        parts = tuple(
            (k, str(v)) for k, v in (add.get("partitionValues") or {}).items() if v is not None
        )
        added.append(
            TableFile(data_path(fs, root, add["path"]), None if rows is None else int(rows), parts)
        )
    return operation, added, rewrites


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
        operation, added, rewrites = read_commit(fs, root, version)
        if rewrites:
            rewritten(f"{fs.unstrip_protocol(root)} version {version} ({operation})", on_rewrite)
        elif added:
            return version, added
    return None
