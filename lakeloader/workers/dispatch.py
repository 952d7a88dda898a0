"""Handing work to the DataLoader's worker processes, and the one place that sees them die."""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Final

from lakeloader.errors import WorkerError
from lakeloader.io.retry import describe
from lakeloader.recovery.reassign import reassign
from lakeloader.signals import main_thread_only
from lakeloader.workers.pool import Death, WorkerPool
from lakeloader.workers.process import Result, Work

logger = logging.getLogger(__name__)

#: Seconds between the receiving thread's checks for a close.
POLL_SECONDS: Final = 0.5


@dataclass(frozen=True)
class WorkKind:
    """How a kind of work is named in messages.

    ``advice`` says what to check when the work keeps killing its worker; ``lead`` goes before
    a piece of work's name when it is the subject of a message.
    """

    verb: str
    gerund: str
    noun: str
    advice: str
    lead: str = ""


DECODE: Final = WorkKind(
    "decode", "decoding", "unit(s)", "Check the memory available to workers", "decoding "
)
BUILD: Final = WorkKind(
    "build",
    "building",
    "batch(es)",
    "Check the transform and collate_fn on those rows, and the memory available to workers",
)


@dataclass
class _Job:
    key: int
    worker: int
    nbytes: int
    make: Callable[[], Work]
    future: Future[Any]
    ready: Future[Any] | None = None  # sent only once this is done (its unit's fetch)


#: Names a piece of work by its key for messages: (what it is, more detail or "").
Describe = Callable[[int], tuple[str, str]]


class Dispatcher:
    """Runs a pass's work in the worker pool; a thread sends work and completes the futures.

    Args:
        limit: Bytes held by the work sent and not answered, at most (one always runs).
        per_worker: Work handed to each worker ahead, at most (a worker that is slow holds
            back only its own work).
        count: Takes what the worker's reader did for a decode, by its key.
    """

    def __init__(
        self,
        pool: WorkerPool,
        kind: WorkKind,
        limit: int,
        per_worker: int,
        describe: Describe,
        count: Callable[[int, tuple[int, int, int]], None] | None = None,
    ) -> None:
        self._pool = pool
        self._kind = kind
        self._limit = max(1, limit)
        self._per_worker = max(1, per_worker)
        self._owed = [0] * pool.num_workers  # work sent to each worker and not answered
        self._describe = describe
        self._count = count
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._sent: dict[int, _Job] = {}
        self._attempts: dict[int, int] = {}
        self._submitted = 0
        self._in_flight = 0
        self._closed = False
        self._failure: WorkerError | None = None  # why the receiving thread stopped
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._receive, name=f"lakeloader-{kind.verb}", daemon=True
        )
        self._thread.start()

    def submit(
        self, key: int, make: Callable[[], Work], nbytes: int = 0, ready: Future[Any] | None = None
    ) -> Future[Any]:
        """Queue a piece of work for the next worker in turn.

        Args:
            key: The work's key in the pass (a unit's position, or a step).
            make: Makes the task when it is sent (a decode then takes the arena's handle).
            nbytes: Bytes it holds while it runs (0: not budgeted).
            ready: Send it only once this is done (a decode: once its unit is fetched); the
                work of other workers, and the worker's later work, do not wait for it.
        """
        future: Future[Any] = Future()
        with self._lock:
            if self._failure is not None:  # nobody would ever send it
                future.set_exception(self._failure)
                return future
            worker = self._submitted % self._pool.num_workers
            self._submitted += 1
            self._queue.append(_Job(key, worker, min(nbytes, self._limit), make, future, ready))
        if ready is not None:
            ready.add_done_callback(lambda _: self._wake())
        self._wake()
        return future

    def reap(self) -> None:
        """Notice dead workers now (the loader calls it at each step)."""
        if self._failure is not None:
            raise self._failure
        if self._pool.all_alive():  # a waitid per worker; the lock only after a death
            return
        with self._lock:  # the receiving thread collects under it too
            if not self._closed:
                self._handle(*self._pool.collect([]))

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w >= 0:  # the receiving thread closes the pipe as it ends
                os.write(self._wake_w, b"x")

    def _receive(self) -> None:
        main_thread_only()
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    self._send()
                    waitables = [*self._pool.waitables(), self._wake_r]
                try:
                    ready = wait(waitables, POLL_SECONDS)
                except (OSError, ValueError):  # a worker replaced meanwhile: its pipe is closed
                    continue
                if self._wake_r in ready:
                    os.read(self._wake_r, 1 << 16)
                with self._lock:
                    if self._closed:
                        return
                    self._handle(*self._pool.collect([r for r in ready if r != self._wake_r]))
        except BaseException as exc:  # never leave the loader waiting on futures forever
            logger.exception("the thread receiving the workers' answers failed")
            self._fail(exc)
        finally:
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _fail(self, exc: BaseException) -> None:
        """Fail every piece of work not answered yet with ``exc``."""
        if isinstance(exc, WorkerError):
            error = exc
        else:
            error = WorkerError(f"the DataLoader's workers stopped answering: {describe(exc)}")
            error.__cause__ = exc
        with self._lock:
            self._closed = True
            self._failure = error
            items = [*self._sent.values(), *self._queue]
            self._sent.clear()
            self._queue.clear()
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)

    def _send(self) -> None:
        """Hand queued work to its workers, in submission order, while the byte budget allows.

        Work that is not ready, or whose worker holds ``per_worker`` pieces, waits without
        holding back the rest; the first piece that does not fit the budget stops the sending.
        """
        waiting: deque[_Job] = deque()
        while self._queue:
            head = self._queue.popleft()
            unready = head.ready is not None and not head.ready.done()
            if unready or self._owed[head.worker] >= self._per_worker:
                waiting.append(head)
                continue
            if self._sent and self._in_flight + head.nbytes > self._limit:
                self._queue.appendleft(head)
                break
            if head.future.set_running_or_notify_cancel():  # else cancelled while queued
                self._sent[head.key] = head
                self._owed[head.worker] += 1
                self._in_flight += head.nbytes
                self._pool.submit(head.make(), head.worker)
        waiting.extend(self._queue)
        self._queue = waiting

    def _handle(self, results: list[Result], deaths: list[Death]) -> None:
        for result in results:
            item = self._sent.pop(result.step, None)
            if item is None:
                continue
            self._owed[item.worker] -= 1
            self._in_flight -= item.nbytes
            if self._count is not None:
                self._count(item.key, result.counts)
            if result.exception is not None:  # its cause travels apart: put it back
                result.exception.__cause__ = result.cause
                item.future.set_exception(result.exception)
            elif result.error is not None:
                what, detail = self._describe(item.key)
                what += f" (its units: {detail})" if detail else ""
                head = f"worker {result.worker} failed to {self._kind.verb} {what}"
                error = WorkerError(f"{head}:\n{result.error}")
                item.future.set_exception(error)
            else:
                item.future.set_result(result.payload)
        for death in deaths:
            self._redo(death)

    def _redo(self, death: Death) -> None:
        """Give a dead worker's work to its replacement, as the coordinator decides."""
        owed = [t.step for t in death.owed if t.step in self._sent]
        decision = reassign(owed, death.building, self._attempts)
        self._attempts = dict(decision.attempts)
        logger.warning(
            "DataLoader worker %d (pid %s) died with exit code %s; %s %d %s it held again "
            "in a fresh worker: %s",
            death.worker,
            death.pid,
            death.exitcode,
            self._kind.gerund,
            len(owed),
            self._kind.noun,
            ", ".join(self._describe(k)[0] for k in owed) or "none",
        )
        for key, attempts in decision.given_up:
            item = self._sent.pop(key)
            self._owed[item.worker] -= 1
            self._in_flight -= item.nbytes
            what, detail = self._describe(key)
            units = f"Its units: {detail}. " if detail else ""
            error = f"{self._kind.lead}{what} killed its worker {attempts} times; giving up. "
            item.future.set_exception(WorkerError(error + units + self._kind.advice))
        for key in decision.resend:
            self._pool.submit(self._sent[key].make(), self._sent[key].worker)

    def close(self, wait: bool) -> None:
        """Stop sending; cancel queued work (answers to work sent are dropped)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        self._wake()
        for item in queued:
            item.future.cancel()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
