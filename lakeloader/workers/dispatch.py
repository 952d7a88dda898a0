"""Decoding units in the DataLoader's worker processes, for the loader's unit store.

On the default tensor path a batch is one row copy out of the arena, far cheaper than
shipping it between processes, while decoding Parquet is the expensive part. So there the
workers decode units into the arena (one process each, no GIL between them) and the loader's
process assembles batches. :class:`RemoteDecodes` is the store's view of that: ``submit``
returns a future, and a thread of the loader's process sends queued jobs to workers within
the decode byte budget, completes the futures as answers arrive, and gives the jobs of a
worker that died to its fresh replacement.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait

from lakeloader.cache.arena import ArenaHandle
from lakeloader.cache.decode import DecodeJob, Held
from lakeloader.errors import WorkerError
from lakeloader.io.reader import ReadCounters
from lakeloader.io.retry import describe
from lakeloader.workers.pool import Death, WorkerPool
from lakeloader.workers.process import DecodeTask, Result

logger = logging.getLogger(__name__)

#: Seconds between the receiving thread's checks for a close.
POLL_SECONDS = 0.5
#: Times a unit may kill its worker before the loader gives up on it.
MAX_DECODE_ATTEMPTS = 3


@dataclass
class _Job:
    job: DecodeJob
    nbytes: int
    future: Future[Held]


class RemoteDecodes:
    """Runs decode jobs in a worker pool (see the module docstring).

    Args:
        pool: The DataLoader's workers (started, with a decoder in their setup).
        generation: The pass's generation of the pool.
        arena: The arena's current handle (it grows), or None when nothing is packed.
        limit: Bytes held by the decodes sent and not answered, at most (one always runs).
        per_worker: Jobs handed to each worker ahead.
        counters: Where the workers' reads are counted.
        describe: Names a job's unit (file, row group, rows) for error messages.
    """

    def __init__(
        self,
        pool: WorkerPool,
        generation: int,
        arena: Callable[[], ArenaHandle | None],
        limit: int,
        per_worker: int,
        counters: ReadCounters,
        describe: Callable[[DecodeJob], str],
    ) -> None:
        self._pool = pool
        self._describe = describe
        self._generation = generation
        self._arena = arena
        self._limit = max(1, limit)
        self._cap = max(1, per_worker) * len(pool.pids())
        self._counters = counters
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._sent: dict[int, _Job] = {}
        self._attempts: dict[int, int] = {}
        self._in_flight = 0
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(
            target=self._receive, name="lakeloader-decodes", daemon=True
        )
        self._thread.start()

    def submit(self, job: DecodeJob, nbytes: int) -> Future[Held]:
        """Queue ``job``; the receiving thread sends it when the budget allows."""
        future: Future[Held] = Future()
        with self._lock:
            self._queue.append(_Job(job, nbytes, future))
        self._wake()
        return future

    def reap(self) -> None:
        """Notice dead workers now.

        The loader calls it at each step, so that a death is handled before the next batch
        whatever the receiving thread is doing.
        """
        if self._pool.all_alive():  # a waitid per worker; the lock only after a death
            return
        # The receiving thread collects under the lock too: a death it was handling
        # meanwhile has its replacement started by now, and collect() finds any other.
        with self._lock:
            if not self._closed:
                self._handle(*self._pool.collect([]))

    def _wake(self) -> None:
        with self._lock:
            if self._wake_w >= 0:  # the receiving thread closes the pipe as it ends
                os.write(self._wake_w, b"x")

    def _receive(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave the loader waiting on futures forever
            logger.exception("the thread receiving decoded units failed")
            self._fail(exc)
        finally:
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _loop(self) -> None:
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

    def _fail(self, exc: BaseException) -> None:
        """Fail every job not answered yet with ``exc``."""
        with self._lock:
            self._closed = True
            items = [*self._sent.values(), *self._queue]
            self._sent.clear()
            self._queue.clear()
        error = WorkerError(f"decoding in the workers stopped: {describe(exc)}")
        error.__cause__ = exc
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)

    def _send(self) -> None:
        """Hand queued jobs to workers while the byte budget and the queues allow."""
        while self._queue and len(self._sent) < self._cap:
            head = self._queue[0]
            nbytes = min(head.nbytes, self._limit)
            if self._sent and self._in_flight + nbytes > self._limit:
                return
            self._queue.popleft()
            if not head.future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            self._dispatch(head)

    def _dispatch(self, item: _Job) -> None:
        self._sent[item.job.position] = item
        self._in_flight += min(item.nbytes, self._limit)
        task = DecodeTask(self._generation, item.job.position, item.job, self._arena())
        self._pool.submit(task)

    def _handle(self, results: list[Result], deaths: list[Death]) -> None:
        for result in results:
            item = self._sent.pop(result.step, None)
            if item is None:
                continue
            self._in_flight -= min(item.nbytes, self._limit)
            self._counters.add(*result.counts)
            raised = result.raised()
            if raised is not None:
                item.future.set_exception(raised)
            elif result.error is not None:
                item.future.set_exception(
                    WorkerError(
                        f"worker {result.worker} failed to decode "
                        f"{self._describe(item.job)}:\n{result.error}"
                    )
                )
            else:
                item.future.set_result(result.payload)
        for death in deaths:
            self._redo(death)

    def _redo(self, death: Death) -> None:
        """Give a dead worker's jobs to the others (or its replacement)."""
        jobs = [self._sent.pop(t.step) for t in death.owed if t.step in self._sent]
        logger.warning(
            "DataLoader worker %d (pid %s) died with exit code %s; decoding %d unit(s) it "
            "held again in a fresh worker",
            death.worker,
            death.pid,
            death.exitcode,
            len(jobs),
        )
        for item in jobs:
            self._in_flight -= min(item.nbytes, self._limit)
            if item.job.position == death.building:
                attempts = self._attempts.get(item.job.position, 1) + 1
                self._attempts[item.job.position] = attempts
                if attempts > MAX_DECODE_ATTEMPTS:
                    item.future.set_exception(
                        WorkerError(
                            f"decoding {self._describe(item.job)} killed its worker "
                            f"{attempts - 1} times; giving up. Check the memory available "
                            "to workers"
                        )
                    )
                    continue
            self._dispatch(item)

    def close(self, wait: bool) -> None:
        """Stop sending; cancel queued jobs (answers to jobs sent are dropped)."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
        self._wake()
        for item in queued:
            item.future.cancel()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
