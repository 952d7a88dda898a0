"""One memory-mapped file that holds the packed rows of every unit a rank has decoded."""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

#: Rows the arena starts with at least (address space only: pages are allocated on write).
MIN_CAPACITY_ROWS = 1 << 16


def unlink_quietly(path: str) -> None:
    """Delete a shared file that may already be gone (its folder removed by a cleanup)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.debug("%s was already gone", path)


@dataclass(frozen=True)
class ArenaHandle:
    """What a worker process needs to map the arena: its file and its current size in rows."""

    path: str
    capacity: int


class Arena:
    """Packed rows of decoded units in one growable, memory-mapped file (thread-safe).

    Args:
        capacity: Rows to start with (grown on demand).
        keep_rows: Freed rows below this mark keep their pages for reuse; above it their
            memory is returned to the system.
    """

    def __init__(self, directory: str, record: np.dtype, capacity: int, keep_rows: int) -> None:
        self.record = record
        self.path = os.path.join(directory, "arena.rows")
        self._keep_rows = max(0, keep_rows)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._free: list[tuple[int, int]] = []  # sorted, disjoint, coalesced [start, stop)
        self.capacity = 0
        self._map: mmap.mmap | None = None
        self.records = np.zeros(0, dtype=record)
        self._grow(max(MIN_CAPACITY_ROWS, capacity))

    @property
    def handle(self) -> ArenaHandle:
        """The file and size a worker maps."""
        return ArenaHandle(self.path, self.capacity)

    def _grow(self, capacity: int) -> None:
        """Extend the file to ``capacity`` rows and map it whole (caller holds the lock)."""
        old = self.capacity
        os.ftruncate(self._fd, capacity * self.record.itemsize)
        self._map = mmap.mmap(self._fd, capacity * self.record.itemsize)
        # Views of the previous map stay valid (it is closed when they are gone).
        self.records = np.frombuffer(self._map, dtype=self.record)
        self._release(old, capacity)
        self.capacity = capacity
        if old:
            logger.debug("arena %s grown from %d to %d rows", self.path, old, capacity)

    def alloc(self, rows: int) -> int:
        """Reserve ``rows`` consecutive rows; returns the first (growing the file if needed)."""
        if rows <= 0:
            raise ValueError(f"cannot allocate {rows} rows")
        with self._lock:
            while True:
                for i, (start, stop) in enumerate(self._free):
                    if stop - start > rows:
                        self._free[i] = (start + rows, stop)
                        return start
                    if stop - start == rows:
                        del self._free[i]
                        return start
                # Growing frees [old end, new end), merged with a free extent ending there.
                self._grow(max(2 * self.capacity, self.capacity + rows))

    def free(self, start: int, rows: int) -> None:
        """Give back rows ``[start, start + rows)`` (from :meth:`alloc`)."""
        with self._lock:
            self._release(start, start + rows)

    def _release(self, start: int, stop: int) -> None:
        """Free rows ``[start, stop)`` (merged); their whole pages above ``keep_rows`` go back."""
        i = bisect.bisect_left(self._free, (start, stop))
        if i < len(self._free) and self._free[i][0] == stop:
            stop = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, stop))
        size, page = self.record.itemsize, mmap.PAGESIZE
        lo = -(-max(start, self._keep_rows) * size // page) * page
        hi = stop * size // page * page
        if hi <= lo or self._map is None or not hasattr(mmap, "MADV_REMOVE"):
            return
        try:
            self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
        except OSError as exc:  # a file system without hole punching: the pages stay
            logger.debug("cannot return arena pages of %s: %s", self.path, exc)

    def close(self) -> None:
        """Delete the file and drop this map (other maps keep its pages until dropped)."""
        with self._lock:
            self._free = []
            self.records = np.zeros(0, dtype=self.record)
            self._map = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        unlink_quietly(self.path)


class FileMap:
    """A worker's map of a file the loader shares, remapped when the file or its size changes."""

    def __init__(self, writable: bool) -> None:
        self._writable = writable
        self._key: tuple[str, int] | None = None
        self._bytes = np.zeros(0, dtype=np.uint8)

    def bytes(self, path: str, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the file as a uint8 array (mapped on first use)."""
        if (path, nbytes) != self._key:
            mode = "r+b" if self._writable else "rb"
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self._writable else 0)
            with open(path, mode) as f:
                mapped = mmap.mmap(f.fileno(), nbytes, prot=prot)
            self._bytes = np.frombuffer(mapped, dtype=np.uint8)
            self._key = (path, nbytes)
        return self._bytes

    def drop(self) -> None:
        """Unmap (an idle worker must not hold a finished pass's memory)."""
        self._key = None
        self._bytes = np.zeros(0, dtype=np.uint8)
