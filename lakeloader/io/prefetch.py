"""Fetching units from an object store ahead of their decode, in plan order, many at once.

Fetches run on daemon threads, as many at once as :class:`~lakeloader.io.inflight.InFlight`
sizes; only units the unit store asked for (within its byte budget) are fetched.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from lakeloader.errors import LakeError
from lakeloader.io.inflight import InFlight
from lakeloader.io.reader import UnitReader
from lakeloader.io.sparse import Fetched
from lakeloader.signals import main_thread_only

#: What a unit's fetch gives its decoder: the bytes, or the error to raise in its place.
FetchResult = Fetched | LakeError


@dataclass(frozen=True)
class _Request:
    key: int
    file_index: int
    row_group: int
    future: Future[FetchResult]


@dataclass(frozen=True)
class Pending:
    """A unit's fetch, queued or under way; a decoder waits for it with :meth:`claim`."""

    future: Future[FetchResult]
    sizer: InFlight

    def claim(self) -> FetchResult:
        """Wait for the bytes, counting the take as demand for the sizing."""
        self.sizer.taken()
        return self.future.result()


class Prefetcher:
    """Fetches units ahead in the order asked, as many at once as the sizing allows.

    Args:
        reader: Reads the footers and ranges (its counters count the requests).
        spill_dir: Folder to write each unit's bytes to, for worker processes to map; None:
            keep them in memory (the loader's own threads decode).
    """

    def __init__(self, reader: UnitReader, spill_dir: str | None) -> None:
        self._reader = reader
        self._spill = spill_dir
        self.sizer = InFlight()  # how many fetches run at once
        self._queue: deque[_Request] = deque()
        self._active = 0
        self._closed = False
        self._lock = threading.Lock()

    def fetch(self, key: int, file_index: int, row_group: int) -> Pending:
        """Queue a unit's fetch (after those queued before it)."""
        future: Future[FetchResult] = Future()
        with self._lock:
            self._queue.append(_Request(key, file_index, row_group, future))
        self._pump()
        return Pending(future, self.sizer)

    def _pump(self) -> None:
        """Start queued fetches while fewer than the limit are under way."""
        limit = self.sizer.limit()
        while True:
            with self._lock:
                if self._closed or not self._queue or self._active >= limit:
                    return
                request = self._queue.popleft()
                if not request.future.set_running_or_notify_cancel():
                    continue
                self._active += 1
            threading.Thread(
                target=self._run, args=(request,), name="lakeloader-fetch", daemon=True
            ).start()

    def _run(self, request: _Request) -> None:
        main_thread_only()
        began = time.monotonic()
        try:
            result = self._fetch(request)
        except BaseException as exc:  # a bug, not a storage failure: the decode raises it
            request.future.set_exception(exc)
        else:
            request.future.set_result(result)
        finally:
            self.sizer.fetched(time.monotonic() - began)
            with self._lock:
                self._active -= 1
        self._pump()

    def _fetch(self, request: _Request) -> FetchResult:
        try:
            fetched = self._reader.fetch(request.file_index, request.row_group)
        except LakeError as exc:  # raised by the decode, which quarantines or reports it
            return exc
        if self._spill is None:
            return fetched
        path = os.path.join(self._spill, f"fetch-{request.key}.bin")
        with self._lock:  # close() waits for a write under way: none starts after it
            if self._closed:
                return fetched
            with open(path, "wb") as fh:  # the ranges back to back
                fh.writelines(fetched.blobs or ())
            return dataclasses.replace(fetched, blobs=None, path=path)

    def close(self) -> None:
        """Cancel queued fetches (those under way finish on their own and are dropped)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        for request in queued:
            request.future.cancel()
