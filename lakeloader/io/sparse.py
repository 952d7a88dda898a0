"""A file of which some ranges are in memory, and the bytes of a unit fetched ahead."""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

#: A range's bytes, as a client returns them.
Blob: TypeAlias = bytes | bytearray
#: Bytes of a file held in memory or mapped.
Chunk: TypeAlias = Blob | memoryview
#: Bytes-like parts of a file: ``(offset in the file, data)``.
Parts = Sequence[tuple[int, Chunk]]


@dataclass(frozen=True, eq=False)
class Fetched:
    """The footer and the coalesced column-chunk ranges of one unit, fetched ahead.

    The ranges' bytes are in memory (``blobs``), else back to back in the file ``path`` (in
    the pass's folder). The footer pickles as its Thrift bytes.
    """

    footer: pq.FileMetaData
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    blobs: tuple[Blob, ...] | None = None
    path: str | None = None

    def parts(self) -> list[tuple[int, Chunk]] | None:
        """``(offset, data)`` of each range; None if its file is gone (fetch again).

        A file is mapped, not read: pages are touched as pyarrow decodes them.
        """
        if self.blobs is not None:
            return list(zip(self.starts, self.blobs, strict=True))
        assert self.path is not None
        try:
            with open(self.path, "rb") as fh:
                view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
        except (FileNotFoundError, ValueError):  # removed, or empty
            return None
        out: list[tuple[int, Chunk]] = []
        offset = 0
        for start, length in zip(self.starts, self.lengths, strict=True):
            out.append((start, view[offset : offset + length]))
            offset += length
        return out

    def discard(self) -> None:
        """Delete the file holding the ranges, if any (idempotent)."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class SparseFile:
    """A read-only file for pyarrow of which some ranges are in memory; reads elsewhere are fetched.

    A read outside them (a footer whose column-chunk sizes are wrong) is logged.
    """

    def __init__(self, size: int, parts: Parts, fetch: Callable[[int, int], Blob]) -> None:
        self._size = size
        self._parts = sorted(parts, key=lambda p: p[0])
        self._starts = [p[0] for p in self._parts]
        self._fetch = fetch
        self._pos = 0
        self.closed = False

    def read(self, nbytes: int = -1) -> Chunk:
        """Read up to ``nbytes`` bytes (all the rest if negative) from the position."""
        start = self._pos
        end = self._size if nbytes is None or nbytes < 0 else min(self._size, start + nbytes)
        self._pos = end
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0:
            part_start, blob = self._parts[i]
            if end <= part_start + len(blob):
                return memoryview(blob)[start - part_start : end - part_start]  # no copy
        logger.debug("bytes [%d, %d) were not prefetched; fetching them", start, end)
        return self._fetch(start, end)

    def seek(self, offset: int, whence: int = 0) -> int:
        """Move the position, as ``io`` files do."""
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        """The position."""
        return self._pos

    def close(self) -> None:
        """Mark closed (the memory goes with the object)."""
        self.closed = True
