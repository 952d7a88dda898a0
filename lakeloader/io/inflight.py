"""How many fetches to keep in flight: Little's law over measured latency and demand.

The limit is ``HEADROOM x demand (units/s) x fetch time (s) + 1``, within ``[FLOOR, CEILING]``:
the fetch time an exponential average, the demand the rate of the last ``RATE_WINDOW`` takes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Final

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
    """The number of fetches to keep in flight (see the module docstring); thread-safe."""

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
        """Record that a decoder took a fetched unit (at ``now``, ``time.monotonic()``)."""
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
