"""The checkpoint folder's storage calls, retried like data reads, refusals named at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import fsspec

from lakeloader.io.access import access_error, refused
from lakeloader.io.retry import RetryPolicy

T = TypeVar("T")


@dataclass(eq=False)
class CheckpointStore:
    """A filesystem's calls for one checkpoint folder at ``url`` (no credentials), retried."""

    fs: fsspec.AbstractFileSystem
    url: str
    retry: RetryPolicy

    def _call(self, fn: Callable[[], T], path: str, needs: str) -> T:
        where = self._url(path)
        try:
            return self.retry.call(fn, where)
        except Exception as exc:
            if refused(exc):
                raise access_error(where, exc, needs) from exc
            raise

    def _url(self, path: str) -> str:
        protocol = self.url.split("://", 1)[0] if "://" in self.url else ""
        return f"{protocol}://{path}" if protocol and "://" not in path else path

    def ls(self, path: str) -> list[str]:
        """Names below ``path`` (FileNotFoundError if there is none)."""
        names: list[str] = self._call(lambda: self.fs.ls(path, detail=False), path, "list")
        return names

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return bool(self._call(lambda: self.fs.exists(path), path, "read"))

    def cat(self, path: str) -> bytes:
        """The bytes of ``path``."""
        data: bytes = self._call(lambda: self.fs.cat_file(path), path, "read")
        return data

    def sizes(self, path: str) -> dict[str, int]:
        """Every file below ``path``, with its size (empty if there is none)."""

        def find() -> dict[str, int]:
            found = self.fs.find(path, detail=True)
            return {name: int(info["size"]) for name, info in found.items()}

        return self._call(find, path, "list")

    def put(self, path: str, data: bytes) -> None:
        """Write ``path`` whole (a retry writes it again from the start)."""

        def write() -> None:
            with self.fs.open(path, "wb") as fh:
                fh.write(data)

        self._call(write, path, "write")

    def makedirs(self, path: str) -> None:
        """Make ``path`` and its parents (nothing on stores without folders)."""
        self._call(lambda: self.fs.makedirs(path, exist_ok=True), path, "write")

    def mv(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``."""
        self._call(lambda: self.fs.mv(src, dst), dst, "write")

    def rm(self, path: str, recursive: bool = False) -> None:
        """Remove ``path`` (a folder's contents with ``recursive``)."""
        self._call(lambda: self.fs.rm(path, recursive=recursive), path, "write")
