"""Preemption: SIGTERM turns into a checkpoint at the next step boundary and a clean exit.

How the flag, the deadline and :data:`GRACE` work together is in docs/design.md.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lakeloader.checkpoint.barrier import collective_device

logger = logging.getLogger(__name__)

#: Seconds between the deadline's ``SystemExit`` and ``os._exit`` when the former cannot run.
GRACE = 5.0


class Preemption:
    """Catch SIGTERM (or other signals) and turn it into a checkpoint at a step boundary.

    Args:
        deadline: Seconds from the signal to leaving the block before the process exits
            anyway with status ``128 + signal``.
        signals: The signals caught (default: SIGTERM).

    Example:
        >>> import os, signal
        >>> with Preemption(deadline=10.0) as preempt:
        ...     for step in range(1, 100):
        ...         if step == 3:
        ...             os.kill(os.getpid(), signal.SIGTERM)  # the machine's notice
        ...         if preempt.requested():
        ...             break  # here: ckpt.save(step, loader, model=..., optimizer=...)
        >>> step, preempt.signalled
        (3, 'SIGTERM')
    """

    def __init__(
        self, deadline: float = 25.0, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)
    ) -> None:
        if deadline <= 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline}")
        if not signals:
            raise ValueError("signals must name at least one signal")
        self.deadline = deadline
        self.signals = signals
        #: The name of the signal received by this process, or None.
        self.signalled: str | None = None
        self._agreed = False
        self._previous: dict[signal.Signals, Any] = {}
        self._timer: threading.Timer | None = None
        self._expired = False
        #: Held while the deadline fires or the block ends: a timer that fires as the block
        #: ends cleanly does nothing.
        self._lock = threading.Lock()
        self._left = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Preemption catches signals: enter it in the main thread")
        self._left = False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._caught)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._left = True
            if self._timer is not None:
                self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _caught(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self._expired:  # the deadline passed: leave now, through the exit handlers
            raise SystemExit(128 + sig.value)
        if self.signalled is not None:
            return
        self.signalled = sig.name
        logger.warning(
            "%s received: a checkpoint is saved at the next step boundary (deadline %g s)",
            sig.name,
            self.deadline,
        )
        self._timer = threading.Timer(self.deadline, self._expire, args=(sig, time.monotonic()))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, sig: signal.Signals, since: float) -> None:
        with self._lock:
            if self._left:  # the block ended as the deadline came: nothing to end
                return
            self._expired = True
        logger.error(
            "%s: no checkpoint within the %g s deadline (%.1f s since the signal); exiting "
            "with status %d",
            sig.name,
            self.deadline,
            time.monotonic() - since,
            128 + sig.value,
        )
        last = threading.Timer(GRACE, os._exit, args=(128 + sig.value,))
        last.daemon = True
        last.start()
        os.kill(os.getpid(), sig)  # the handler raises SystemExit in the main thread

    def requested(self) -> bool:
        """Whether any rank was signalled: call it once per step on every rank.

        Under torch.distributed it is a collective (an all-reduce of one number), so every
        rank gets the same answer at the same step; once True it stays True.
        """
        if self._agreed:
            return True
        mine = self.signalled is not None
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = bool(flag.item())
        self._agreed = mine
        return mine
