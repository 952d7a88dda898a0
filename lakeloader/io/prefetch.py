"""Fetching units from an object store ahead of their decode, in plan order, many at once.

Fetches run on daemon threads, as many at once as :class:`InFlight` sizes; only units the unit
store asked for (within its byte budget) are fetched.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

from lakeloader.errors import LakeError
from lakeloader.io.reader import UnitReader
from lakeloader.io.sparse import Fetched
from lakeloader.signals import main_thread_only

#: Fetches in flight before anything is measured.
START: Final = 8
#: Fewest and most fetches in flight.
FLOOR: Final = 2
CEILING: Final = 64
#: In flight per unit of (demand x latency): room for bursts and for the estimates' lag.
HEADROOM: Final = 2.0
#: Takes over which the demand rate is measured.
RATE_WINDOW: Final = 32
#: Weight of the newest fetch in the latency's exponential average.
LATENCY_WEIGHT: Final = 0.2


class InFlight:
    """The number of fetches to keep in flight (Little's law over measured latency and demand).

    The limit is ``HEADROOM x demand (units/s) x fetch time (s) + 1``, within
    ``[FLOOR, CEILING]``: the fetch time an exponential average, the demand the rate of the last
    ``RATE_WINDOW`` takes. Thread-safe.
    """

    def __init__(self) -> None:
        self._latency: float | None = None
        self._takes: deque[float] = deque(maxlen=RATE_WINDOW)
        self._lock = threading.Lock()

    def fetched(self, seconds: float) -> None:
        """Record that one fetch took ``seconds`` from request to last byte."""
        with self._lock:
            if self._latency is None:
                self._latency = seconds
            else:
                self._latency += LATENCY_WEIGHT * (seconds - self._latency)

    def taken(self, now: float | None = None) -> None:
        """Record that a decoder took a fetched unit (``now``: ``time.monotonic()`` if None)."""
        with self._lock:
            self._takes.append(time.monotonic() if now is None else now)

    def limit(self) -> int:
        """Fetches to keep in flight now."""
        with self._lock:
            if self._latency is None or len(self._takes) < 4:
                return START
            span = self._takes[-1] - self._takes[0]
            rate = (len(self._takes) - 1) / span if span > 0 else math.inf
            want = min(HEADROOM * rate * self._latency + 1, float(CEILING))
        return max(FLOOR, math.ceil(want - 1e-9))  # 17.000000000000004 is 17


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

    Each unit's bytes are written to a file in ``spill_dir`` for worker processes to map, or
    with None kept in memory (the loader's own threads decode).
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
