"""Finding the data files of a lake through fsspec: a folder, glob, file, or a list of them.

Only names decide what is data: ``_SUCCESS``, ``_metadata``, ``_common_metadata`` and names
starting with ``.`` or ``_`` are skipped; any other file is taken as Parquet.
"""

from __future__ import annotations

import functools
import os
import posixpath
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import fsspec
from fsspec.core import url_to_fs

from lakeloader.errors import LakeDataError, LakeError, LakeNotFoundError
from lakeloader.io.retry import RetryPolicy

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


#: File names that are never data in a lake.
NON_DATA_NAMES: Final = frozenset({"_SUCCESS", "_metadata", "_common_metadata"})
#: How the names of Parquet files end (what a suggested glob keeps).
PARQUET_SUFFIXES: Final = (".parquet", ".parq", ".pq")
#: Files not named as Parquet that an error lists at most.
SHOWN_STRAYS: Final = 3
#: Keys of an fsspec info() dict that change when a file is rewritten, most specific first
#: (gcsfs's etag is not the object's version: GCS's generation comes first).
_VERSION_KEYS = ("generation", "ETag", "etag", "version_id", "mtime", "LastModified", "updated")


def version_token(info: dict[str, Any]) -> str:
    """A token that changes when a file is rewritten, from an fsspec ``info()`` dict."""
    for key in _VERSION_KEYS:
        if info.get(key) is not None:
            return f"{key}:{info[key]}"
    return "none"


def version_value(version: str, key: str) -> str | None:
    """The value of a version token made by :func:`version_token` if it is of ``key``.

    >>> version_value('ETag:"9b2cf5"', "ETag"), version_value('ETag:"9b2cf5"', "generation")
    ('"9b2cf5"', None)
    """
    prefix = key + ":"
    return version[len(prefix) :] if version.startswith(prefix) else None


@dataclass(frozen=True)
class DiscoveredFile:
    """A data file found by discovery (its path without protocol).

    Hive partition values outermost first; size and version None unless the listing gave them.
    """

    path: str
    partitions: tuple[tuple[str, str], ...]
    size: int | None = None
    version: str | None = None


def hive_partitions(relative_dir: str) -> tuple[tuple[str, str], ...]:
    """Parse the ``key=value`` segments of a folder path relative to the lake root.

    >>> hive_partitions("year=2024/month=05/extra")
    (('year', '2024'), ('month', '05'))
    """
    pairs = []
    for segment in relative_dir.split("/"):
        key, sep, value = segment.partition("=")
        if sep and key:
            pairs.append((key, value))
    return tuple(pairs)


def _relative_dir(path: str, root: str) -> str:
    parent = posixpath.dirname(path)
    if root and (parent == root or parent.startswith(root.rstrip("/") + "/")):
        return parent[len(root) :].lstrip("/")
    return ""


Listing = dict[str, dict[str, Any]]


def _files_only(listing: Listing) -> Listing:
    return {p: i for p, i in listing.items() if i.get("type", "file") == "file"}


def _expand_one(fs: fsspec.AbstractFileSystem, item: str) -> tuple[str, Listing]:
    """Resolve one source entry to (root folder, {data-file path: fsspec info})."""
    if any(ch in item for ch in "*?["):
        root = item.split("*")[0].split("?")[0].split("[")[0]
        root = root if root.endswith("/") else posixpath.dirname(root)
        return root.rstrip("/"), _files_only(fs.glob(item, detail=True))
    try:
        info = fs.info(item)
    except FileNotFoundError:
        info = {}
    if info.get("type") == "file":
        return posixpath.dirname(item), {item: info}
    if info.get("type") == "directory":
        return item.rstrip("/"), _files_only(fs.find(item, detail=True))
    raise LakeNotFoundError(
        f"{item!r} does not exist: give a folder, a glob, a Parquet file or a list of those"
    )


def _keep(path: str, root: str) -> bool:
    relative = path[len(root) :].lstrip("/") if path.startswith(root) else posixpath.basename(path)
    parts = [part for part in relative.split("/") if part]
    return not any(p in NON_DATA_NAMES or p.startswith((".", "_")) for p in parts)


def discover_listed(
    source: Paths,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> tuple[fsspec.AbstractFileSystem, list[tuple[DiscoveredFile, dict[str, Any]]]]:
    """List the data files of a lake, sorted by path, with sizes and versions from the listing.

    ``source`` is a folder, glob, file, ``file://``/``s3://``/``gs://`` URL or a list of these
    (all on one filesystem); ``retry`` None is the default policy. Each file comes with its
    listing entry.

    Raises:
        LakeNotFoundError: If the source holds no data file.
    """
    retry = retry or RetryPolicy()
    items = [os.fspath(s) for s in ([source] if isinstance(source, str | os.PathLike) else source)]
    if not items:
        raise LakeNotFoundError("the source is an empty list: name at least one Parquet file")
    fs = url_to_fs(items[0], **(storage_options or {}))[0]
    fs.invalidate_cache()  # fsspec caches instances and listings: a snapshot must see the lake now
    found: dict[str, tuple[DiscoveredFile, dict[str, Any]]] = {}
    for item in items:
        path = url_to_fs(item, **(storage_options or {}))[1]
        root, listing = retry.call(functools.partial(_expand_one, fs, path), path)
        for p, info in listing.items():
            if not _keep(p, root) or p in found:
                continue
            size, version = info.get("size"), version_token(info)
            partitions = hive_partitions(_relative_dir(p, root))
            size = None if size is None else int(size)
            listed = DiscoveredFile(p, partitions, size, None if version == "none" else version)
            found[p] = (listed, info)
    if not found:
        raise LakeNotFoundError(
            f"no data file under {source!r} (after skipping _SUCCESS, _metadata, "
            "_common_metadata and dot- or underscore-prefixed names)"
        )
    return fs, [found[p] for p in sorted(found)]


def add_glob_advice(
    exc: LakeDataError, source: Paths, storage_options: dict[str, Any], retry: RetryPolicy
) -> None:
    """Append to ``exc`` a glob that reads only the Parquet files of the folder ``source``.

    Only when ``source`` is one folder holding both files named as Parquet and others (named
    in the advice); the folder is listed again, and nothing is added if that fails.
    """
    if not isinstance(source, str | os.PathLike) or any(c in os.fspath(source) for c in "*?["):
        return
    try:
        _, listed = discover_listed(source, storage_options, retry)
    except (LakeError, OSError):
        return
    root = os.fspath(source).rstrip("/")
    names = [d.path for d, _ in listed]
    suffixes = Counter(s for n in names for s in PARQUET_SUFFIXES if n.endswith(s))
    strays = [n for n in names if not n.endswith(PARQUET_SUFFIXES)]
    if not (suffixes and strays):
        return
    common = posixpath.commonpath(names) if len(names) > 1 else posixpath.dirname(names[0])
    shown = ", ".join(posixpath.relpath(n, common) for n in strays[:SHOWN_STRAYS])
    if len(strays) > SHOWN_STRAYS:
        shown += f" and {len(strays) - SHOWN_STRAYS} more"
    glob = f"{root}/**/*{suffixes.most_common(1)[0][0]}"
    exc.args = (
        f"{exc.args[0] if exc.args else exc}. The folder holds files not named as "
        f"Parquet ({shown}): if they are not data, read only its Parquet files with "
        f"LakeDataset({glob!r})",
        *exc.args[1:],
    )
