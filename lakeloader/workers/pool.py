"""The pool of DataLoader worker processes: start, hand out tasks, collect, replace the dead."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import select
import signal
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from lakeloader.errors import WorkerError, WorkerWarning
from lakeloader.recovery.reassign import MAX_ATTEMPTS
from lakeloader.workers.process import (
    IDLE,
    WARNING_ATTR,
    Result,
    Started,
    Work,
    WorkerSetup,
    worker_main,
)

logger = logging.getLogger(__name__)

#: Seconds a worker gets to exit after being asked to, before it is terminated.
SHUTDOWN_GRACE = 5.0
#: Seconds to reap a worker whose sentinel fired (it has exited: this is only a cap).
REAP_SECONDS = 0.5
#: fcntl command to set a pipe's capacity (Linux), and the capacity asked for.
F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20
#: Warnings registry of what workers sent: the same warning of several workers is said once.
_FORWARDED: dict[Any, Any] = {}


def _handle_record(record: logging.LogRecord) -> None:
    """Log a worker's log record here, or issue the warning it carries."""
    category = getattr(record, WARNING_ATTR, None)
    if category is None:
        logging.getLogger(record.name).handle(record)
    else:
        text = record.getMessage()
        warnings.warn_explicit(text, category, record.pathname, record.lineno, registry=_FORWARDED)


@dataclass
class _Slot:
    process: Any
    tasks: Connection
    results: Connection
    building: Any  # shared int: the key of the task under way (a step or a unit), or IDLE
    owed: dict[int, Work] = field(default_factory=dict)
    started: bool = False  # it reported that it is set up


@dataclass(frozen=True)
class Death:
    """A worker that died, with the tasks it still owed, in the order they were handed out.

    ``exitcode`` is -9 for SIGKILL; ``building`` is the key of the task under way when it died
    (a step, or a unit's position), or None if it was idle.
    """

    worker: int
    pid: int | None
    exitcode: int | None
    owed: list[Work]
    building: int | None


class WorkerPool:
    """A fixed number of worker processes, each with a task queue and a result pipe.

    ``context``: a multiprocessing context or its name (None: the platform default).
    """

    def __init__(
        self, setup: WorkerSetup, num_workers: int, context: BaseContext | str | None
    ) -> None:
        self._setup = setup
        self._ctx: Any = context if isinstance(context, BaseContext) else mp.get_context(context)
        self._size = num_workers  # what each worker's torch.utils.data.get_worker_info() says
        self._slots = [self._start(i) for i in range(num_workers)]
        self._sentinels = self._watch()
        self._collecting = 0  # collect() calls under way (see all_alive)
        self._start_deaths: dict[int, int] = {}  # deaths in a row before starting, by worker
        self._failure: WorkerError | None = None  # once workers cannot start, every collect says so
        self.restarts = 0
        self.generation = 0

    def _start(self, worker_id: int) -> _Slot:
        task_reader, task_writer = self._ctx.Pipe(duplex=False)
        reader, writer = self._ctx.Pipe(duplex=False)
        try:  # a whole batch fits in the pipe (Linux pipes hold 64 KB by default)
            fcntl.fcntl(reader.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # above /proc/sys/fs/pipe-max-size, or not Linux: the default will do
            logger.debug("could not widen the result pipe to %d bytes", PIPE_BYTES)
        building = self._ctx.Value("q", IDLE, lock=False)
        proc = self._ctx.Process(
            target=worker_main,
            args=(worker_id, self._size, self._setup, task_reader, writer, building),
            name=f"lakeloader-worker-{worker_id}",
            daemon=True,
        )
        proc.start()
        writer.close()
        task_reader.close()
        return _Slot(proc, task_writer, reader, building)

    def _watch(self) -> select.poll:
        """A poll over the workers' sentinels (each readable once its worker has exited)."""
        sentinels = select.poll()
        for slot in self._slots:
            sentinels.register(slot.process.sentinel, select.POLLIN)
        return sentinels

    def pids(self) -> list[int | None]:
        """Process ids of the workers, by worker id."""
        return [s.process.pid for s in self._slots]

    def new_generation(self) -> int:
        """Forget every task handed out so far; their late answers will be dropped."""
        self.generation += 1
        for slot in self._slots:
            slot.owed.clear()
        return self.generation

    @property
    def num_workers(self) -> int:
        """Workers in the pool (the dead are replaced under the same number)."""
        return len(self._slots)

    def submit(self, task: Work, worker: int) -> None:
        """Give a task to a worker (to its replacement, if it died meanwhile)."""
        slot = self._slots[worker]
        slot.owed[task.step] = task
        try:
            slot.tasks.send(task)
        except OSError:  # it died: collect() reports it and hands the task back
            logger.debug("worker %d is gone; task %d waits for its replacement", worker, task.step)

    def _drain(self, slot: _Slot, into: list[Result]) -> None:
        try:
            while slot.results.poll():
                message = slot.results.recv()
                if isinstance(message, logging.LogRecord):  # a worker's log line or warning
                    _handle_record(message)
                elif isinstance(message, Started):
                    self._started(slot, message)
                elif message.generation == self.generation:
                    slot.owed.pop(message.step, None)
                    into.append(message)
        except (EOFError, OSError):
            return

    def _started(self, slot: _Slot, message: Started) -> None:
        """Note a worker as set up, or raise why it failed to start (with its traceback).

        The user's ``worker_init_fn`` raised, say: starting it again would fail again.
        """
        if message.error is not None:
            self._failure = WorkerError(
                f"DataLoader worker {message.worker} (pid {slot.process.pid}) failed to start:"
                f"\n{message.error}"
            )
            raise self._failure
        slot.started = True
        self._start_deaths[message.worker] = 0

    def all_alive(self) -> bool:
        """Whether every worker is surely running; False when one may have died.

        One ``poll(2)`` over the sentinels, reaping nothing: callers confirm a False with
        :meth:`collect`. False too while a collect() in another thread replaces a worker.
        """
        return not self._sentinels.poll(0) and not self._collecting

    def waitables(self) -> list[Any]:
        """What :meth:`collect` needs to hear about: result pipes and process sentinels."""
        return [*(s.results for s in self._slots), *(s.process.sentinel for s in self._slots)]

    def collect(self, ready: Sequence[Any]) -> tuple[list[Result], list[Death]]:
        """Take the results that arrived and replace the workers that died.

        ``ready`` is what a ``wait`` over :meth:`waitables` returned (maybe stale: objects of
        workers replaced since are ignored). Once workers cannot start, every call raises why.
        """
        if self._failure is not None:
            raise self._failure
        self._collecting += 1
        try:
            return self._collect(ready)
        finally:
            self._collecting -= 1

    def _collect(self, ready: Sequence[Any]) -> tuple[list[Result], list[Death]]:
        by_conn = {s.results: s for s in self._slots}
        by_sentinel = {s.process.sentinel: i for i, s in enumerate(self._slots)}
        results: list[Result] = []
        deaths: list[Death] = []
        for obj in ready:
            if obj in by_conn:
                self._drain(by_conn[obj], results)
        dead = {by_sentinel[obj] for obj in ready if isinstance(obj, int) and obj in by_sentinel}
        dead |= {i for i, s in enumerate(self._slots) if not s.process.is_alive()}
        for worker in sorted(dead):
            slot = self._slots[worker]
            slot.process.join(timeout=REAP_SECONDS)
            if slot.process.is_alive():  # a stale sentinel (its number reused)
                continue
            self._drain(slot, results)
            self._count_start_death(worker, slot)
            step: int | None = int(slot.building.value)
            if step not in slot.owed:  # idle (IDLE is in no owed work), or of an abandoned pass
                step = None
            proc = slot.process
            deaths.append(Death(worker, proc.pid, proc.exitcode, list(slot.owed.values()), step))
            slot.tasks.close()
            slot.results.close()
            self._slots[worker] = self._start(worker)
            self.restarts += 1
            _warn_replaced(deaths[-1])
        if deaths:
            self._sentinels = self._watch()
        return results, deaths

    def _count_start_death(self, worker: int, slot: _Slot) -> None:
        """Give up on a worker after ``MAX_ATTEMPTS`` deaths in a row before it is set up.

        Deaths by ``SIGKILL`` (from outside) do not count.
        """
        code = slot.process.exitcode
        if slot.started or code == -signal.SIGKILL:
            return
        self._start_deaths[worker] = deaths = self._start_deaths.get(worker, 0) + 1
        if deaths >= MAX_ATTEMPTS:
            self._failure = WorkerError(
                f"DataLoader worker {worker} died {deaths} times while starting (last exit "
                f"code {code}), before its worker_init_fn returned; check what the workers "
                "import and run at start"
            )
            raise self._failure

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every worker to exit (``graceful``: a ``None`` task), then terminate the rest.

        A finaliser passes False, and so does an interpreter that is shutting down.
        """
        graceful = graceful and not sys.is_finalizing()
        for slot in self._slots:
            if not graceful:
                slot.process.terminate()
                continue
            try:
                slot.tasks.send(None)
            except (OSError, ValueError):
                logger.debug("worker %s queue already closed", slot.process.name)
        for slot in self._slots:
            slot.process.join(timeout=SHUTDOWN_GRACE)
            if slot.process.is_alive():
                slot.process.terminate()
                slot.process.join(timeout=SHUTDOWN_GRACE)
            slot.tasks.close()
            slot.results.close()
        self._slots = []
        self._sentinels = self._watch()


def _warn_replaced(death: Death) -> None:
    """Say that a worker died and a fresh one took its place (its work is done again)."""
    how = " (SIGKILL: killed from outside, often by the out-of-memory killer)"
    warnings.warn(
        f"DataLoader worker {death.worker} (pid {death.pid}) died with exit code "
        f"{death.exitcode}{how if death.exitcode == -signal.SIGKILL else ''}: a fresh worker "
        f"took its place, and the {len(death.owed)} task(s) it held are handed out again (the "
        "'lakeloader' log names them)",
        WorkerWarning,
        stacklevel=2,
    )
