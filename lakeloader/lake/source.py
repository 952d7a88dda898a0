"""Where a dataset's snapshot comes from: the ``Source`` seam.

A source gives a pinned :class:`~lakeloader.lake.snapshot.Snapshot` and the fsspec filesystem
that reads its files: a folder (:class:`FolderSource`), or a Delta or Iceberg table version.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import fsspec
from fsspec.core import url_to_fs

from lakeloader.errors import LakeDataError, LakeNotFoundError
from lakeloader.io.access import access_error, refused
from lakeloader.io.fetch import url_of
from lakeloader.lake.discovery import Paths, add_glob_advice, discover_listed
from lakeloader.lake.increments import Increment, SourceRequest, listed_ns, newer_files
from lakeloader.lake.snapshot import Snapshot, build_snapshot, snapshot_lake


@runtime_checkable
class Source(Protocol):
    """What a dataset reads its snapshot from."""

    def describe(self) -> str | list[str]:
        """Plain data naming the source (kept in checkpoints; never credentials)."""

    def filesystem(self, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        """The filesystem that reads the source's files."""

    def snapshot(self, request: SourceRequest) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
        """Pin the source as it is now.

        Raises:
            LakeNotFoundError: If it holds no data file.
            LakeDataError: If a footer cannot be read (unless ``request.skip_unreadable``).
            SchemaMismatchError: If file schemas conflict.
        """


@dataclass(frozen=True)
class FolderSource:
    """A folder, glob or file, or a list of them: local paths or any fsspec URL, as given.

    Example:
        >>> FolderSource.of(["a/", "b/"]).describe()
        ['a/', 'b/']
    """

    paths: str | tuple[str, ...]

    @classmethod
    def of(cls, paths: Paths) -> FolderSource:
        """A folder source from a path, a URL or a sequence of them."""
        if isinstance(paths, str | os.PathLike):
            return cls(os.fspath(paths))
        return cls(tuple(os.fspath(p) for p in paths))

    def describe(self) -> str | list[str]:
        """The URL, or the list of URLs."""
        return self.paths if isinstance(self.paths, str) else list(self.paths)

    def filesystem(self, storage_options: dict[str, Any]) -> fsspec.AbstractFileSystem:
        """The filesystem of the first URL (all URLs of a lake share one)."""
        first = self.paths if isinstance(self.paths, str) else self.paths[0]
        fs: fsspec.AbstractFileSystem = url_to_fs(first, **storage_options)[0]
        return fs

    def snapshot(self, request: SourceRequest) -> tuple[fsspec.AbstractFileSystem, Snapshot]:
        """List the files and read their footers in parallel.

        Raises:
            StoreAccessError: If the store refuses access, naming the URL.
        """
        paths = self.describe()
        try:
            return snapshot_lake(paths, request)
        except Exception as exc:
            if isinstance(exc, LakeDataError):  # a stray file? suggest a glob of the Parquet
                add_glob_advice(exc, paths, request.storage_options, request.retry)
            if not refused(exc):
                raise
            raise access_error(str(paths), exc) from exc

    def increment(
        self, after: Increment | None, request: SourceRequest
    ) -> tuple[fsspec.AbstractFileSystem, Snapshot] | None:
        """The files listed with a modification time after ``after``'s mark (up to ``upto``).

        A folder cannot tell a rewritten file from a new one (``on_rewrite`` does not apply).

        Raises:
            LakeNotFoundError: If the first increment holds no data file, or the listing
                gives no modification times.
        """
        fs, listed = discover_listed(self.describe(), request.storage_options, request.retry)
        marked = []
        for found, info in listed:
            ns = listed_ns(info)
            if ns is None:
                raise LakeNotFoundError(
                    f"{url_of(fs, found.path)}: the listing gives no modification time, which "
                    "follow mode orders appended files by; follow a Delta or Iceberg table instead"
                )
            marked.append((found, ns))
        files, last = newer_files(marked, None if after is None else after.upto, request.upto)
        if last is None:
            return None
        snapshot = build_snapshot(fs, files, request)
        index = 0 if after is None else after.index + 1
        start = None if after is None else after.upto
        return fs, dataclasses.replace(snapshot, increment=Increment(index, last, start))


@runtime_checkable
class Growing(Protocol):
    """A source that follow mode can take increments of (see :mod:`lakeloader.lake.increments`)."""

    def increment(
        self, after: Increment | None, request: SourceRequest
    ) -> tuple[fsspec.AbstractFileSystem, Snapshot] | None:
        """The increment after ``after`` (None: the first), up to ``request.upto``.

        Another rank's increment is taken again with its mark as ``upto``, so that every rank
        has the same. Returns None when nothing new was appended.

        Raises:
            LakeNotFoundError: If the first increment holds no data file.
            LakeChangedError: If data already taken in was rewritten (under ``"error"``).
        """


def as_source(source: Source | Paths) -> Source:
    """``source`` itself when it is a :class:`Source`, else a :class:`FolderSource` of it."""
    if isinstance(source, Source):
        return source
    return FolderSource.of(source)
