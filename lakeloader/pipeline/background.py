"""Building batches ahead in a background thread of the loader's process, when that pays.

Batches are delivered in step order either way, a step's error raised when that step is asked
for; docs/design.md says when the thread builds ahead and why.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, Final, TypeVar

from lakeloader.order.batches import BatchSpec
from lakeloader.pipeline.builders import LocalBuilder, timed_out
from lakeloader.pipeline.collate import pin
from lakeloader.pipeline.recipe import READY, Payload, finish_payload
from lakeloader.pipeline.workspace import PassSpec
from lakeloader.signals import main_thread_only

_T = TypeVar("_T")

#: The loop's time between ``next()`` calls (a moving average) from which steps are built in
#: the thread.
BUILD_AHEAD_AWAY_SECONDS: Final = 250e-6
#: Weight of the latest interval in that moving average.
AWAY_WEIGHT: Final = 0.1
#: Batches handed over that the builder keeps referenced (the newest ones; see docs/design.md).
KEPT_HANDED: Final = 2
#: Longest interval the average takes in, as a multiple of the threshold (so that one pause
#: of a tight loop moves the average by at most a fifth of the threshold).
AWAY_CAP: Final = 2.0


class Pace:
    """How long the training loop stays away between two ``next()`` calls (moving average).

    Times are passed in (seconds on one monotonic clock).
    """

    def __init__(self) -> None:
        self.away = 0.0
        self._returned: float | None = None  # when the last batch was handed over

    def asked(self, now: float) -> None:
        """The loop asks for its next batch at ``now``."""
        if self._returned is not None:
            away = min(now - self._returned, AWAY_CAP * BUILD_AHEAD_AWAY_SECONDS)
            self.away += AWAY_WEIGHT * (away - self.away)

    def returned(self, now: float) -> None:
        """A batch is handed over at ``now``."""
        self._returned = now

    @property
    def builds_ahead(self) -> bool:
        """Whether a thread can build ahead of this loop (it stays away long enough)."""
        return self.away >= BUILD_AHEAD_AWAY_SECONDS


class ThreadBuilder:
    """Builds steps with a :class:`LocalBuilder`: ahead in a thread, or in place.

    ``planned``: the step of a given index, once planned (None before).
    """

    def __init__(
        self, spec: PassSpec, local: LocalBuilder, planned: Callable[[int], BatchSpec | None]
    ) -> None:
        self._spec = spec
        self._build = functools.partial(_finished, local, spec)
        self._planned = planned
        self._ahead = spec.options.prefetch
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        #: Steps handed to the thread and not yet taken back.
        self._sent: set[int] = set()
        #: What the thread built, by step: the payload, or the exception the step raised.
        self._built: dict[int, Payload | BaseException] = {}
        self._ready = threading.Condition(threading.Lock())
        self._closed = False
        threading.Thread(target=self._run, name="lakeloader-build", daemon=True).start()
        self._next = 0  # the next step to hand to the thread
        self._pace = Pace()
        #: Batches handed over while building ahead, which the thread lets go of (see top_up).
        self._handed: deque[Any] = deque()

    def asked(self) -> None:
        """Note that the loop asks for its next batch (first thing in ``next()``)."""
        self._pace.asked(time.perf_counter())

    def build(self, step: BatchSpec) -> Payload:
        """The payload of ``step``: the thread's, if it was handed over, else built here.

        Raises:
            RuntimeError: If it takes longer than the loader's ``timeout``.
        """
        index = step.step
        if index not in self._sent:  # not handed to the thread: build it here, now
            self._next = max(self._next, index + 1)
            return self._build(step)
        self._sent.discard(index)
        built = self._built.pop(index, None)
        if built is None:
            with self._ready:
                timeout = self._spec.options.wait_timeout
                if not self._ready.wait_for(lambda: index in self._built or self._closed, timeout):
                    raise timed_out(self._spec, index)
                if index not in self._built:  # closed meanwhile, from another thread
                    raise CancelledError(f"step {index}: the pass was closed")
                built = self._built.pop(index)
        if isinstance(built, BaseException):  # raised in the training loop, where it waits
            raise built
        return built

    def top_up(self, next_step: int, batch: Any) -> None:
        """Keep the thread ``prefetch_factor`` to twice that many steps ahead of ``next_step``.

        Called once ``batch`` is handed over (kept referenced: see :data:`KEPT_HANDED`); does
        nothing while the loop asks again at once (its :class:`Pace`).
        """
        self._next = max(self._next, next_step)
        self._pace.returned(time.perf_counter())
        if not self._pace.builds_ahead:
            if self._handed:  # the loop turned tight: keep nothing for a thread that waits
                self._handed.clear()
            return
        self._handed.append(batch)
        if self._next - next_step > self._ahead:
            return
        steps = []
        while self._next < next_step + 2 * self._ahead:
            planned = self._planned(self._next)
            if planned is None:
                break
            steps.append(planned)
            self._next += 1
        if steps:
            self._sent.update(s.step for s in steps)
            self._queue.put(functools.partial(self._build_steps, steps))
        elif len(self._handed) > 2 * KEPT_HANDED:  # the pass's last steps: nothing to build
            self._queue.put(self._let_go)

    def run_ahead(self, work: Callable[[], _T]) -> Future[_T] | None:
        """Run ``work`` in the thread, after the steps handed to it, if the loop stays away.

        Returns None, and runs nothing, when the loop asks again at once.
        """
        if not self._pace.builds_ahead:
            return None
        future: Future[_T] = Future()
        self._queue.put(functools.partial(_run_into, work, future))
        return future

    def _build_steps(self, steps: list[BatchSpec]) -> None:
        for step in steps:
            if self._closed:
                return
            built: Payload | BaseException
            try:
                built = self._build(step)
            except BaseException as exc:
                built = exc
            with self._ready:
                self._built[step.step] = built
                self._ready.notify_all()
            self._let_go()

    def _let_go(self) -> None:
        """Drop the batches handed over but the newest :data:`KEPT_HANDED` (in the thread)."""
        while len(self._handed) > KEPT_HANDED:
            self._handed.popleft()

    def _run(self) -> None:
        main_thread_only()
        while (work := self._queue.get()) is not None:
            work()

    def close(self, wait: bool) -> None:
        """Drop the steps queued and stop the thread once the step under way ends (no join)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        self._sent.clear()
        self._built.clear()
        self._handed.clear()
        self._queue.put(None)


def _run_into(work: Callable[[], _T], future: Future[_T]) -> None:
    """Run ``work`` and set its result (or its exception) on ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(work())
    except BaseException as exc:  # raised where the result is waited for
        future.set_exception(exc)


def _finished(local: LocalBuilder, spec: PassSpec, step: BatchSpec) -> Payload:
    """Build a step and finish its batch (tensors, pinned if asked), in the thread."""
    batch = finish_payload(local.build(step), spec.recipe)
    return READY, pin(batch) if spec.options.pin_memory else batch
