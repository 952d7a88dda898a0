"""DataLoader worker processes: they decode units, or build batches for a transform.

Workers do one of two kinds of task. On the default tensor path they decode units into the
rank's arena (:class:`DecodeTask`), and the loader's process assembles batches from it, which
costs a row copy per batch. With a transform or a collate_fn, which run per row, they build
batches (:class:`Task`) from units the loader decoded. Any worker can do any task and answers
on its own pipe, where its log records travel too. The pool notices a worker
that died (its sentinel becomes ready), hands back the tasks it owed so the loader can give
them to another worker, and starts a fresh one in its place.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import pickle
import random
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any, TypeAlias

import numpy as np
import pyarrow as pa
import torch

from lakeloader.arena import ArenaHandle, FileMap
from lakeloader.cache import UnitOpener
from lakeloader.collate import Collate, Transform, build_payload
from lakeloader.decode import DecodeJob, UnitDecoder, UnitRef
from lakeloader.errors import LakeError
from lakeloader.packed import RowLayout
from lakeloader.retry import describe

logger = logging.getLogger(__name__)

#: Seconds a worker gets to exit after being asked to, before it is terminated.
SHUTDOWN_GRACE = 5.0
#: Seconds between a waiting worker's checks that the loader's process is still alive.
WATCHDOG_SECONDS = 1.0
#: Value of a worker's "building" cell while it waits for a task.
IDLE = -1
#: The package's logger: what workers forward to the loader's process.
LOGGER = "lakeloader"
#: fcntl command to set a pipe's capacity (Linux), and the capacity asked for.
F_SETPIPE_SZ = 1031
PIPE_BYTES = 1 << 20


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker needs, sent once when it starts (pickled for spawn contexts).

    Attributes:
        schema: Schema of the decoded units.
        layout: How the units' tensor-typed columns are packed (None: not packed).
        transform: Per-row transform, or None.
        collate_fn: The user's collate function, or None.
        worker_init_fn: Called with the worker id once the worker has started, as in torch.
        base_seed: Worker ``i`` seeds ``torch`` and ``random`` with ``base_seed + i``.
        num_workers: Workers in the pool.
        decoder: Decodes units (when workers decode for the loader), or None.
    """

    schema: pa.Schema
    layout: RowLayout | None
    transform: Transform | None
    collate_fn: Collate | None
    worker_init_fn: Callable[[int], None] | None
    base_seed: int
    num_workers: int
    decoder: UnitDecoder | None = None


@dataclass(frozen=True)
class Task:
    """Build one batch (a transform or collate_fn's row path): the units and the row indices.

    ``generation`` tells apart the passes of a pool that outlives one (persistent workers):
    answers to a pass that was abandoned are dropped, never mistaken for the new pass's steps.
    """

    generation: int
    step: int
    refs: Sequence[UnitRef]
    take: np.ndarray


@dataclass(frozen=True)
class DecodeTask:
    """Decode one unit into the loader's arena (the default tensor path).

    ``step`` is the unit's position in the epoch's virtual sequence: a task's key, as a
    batch's step is for a :class:`Task`.
    """

    generation: int
    step: int
    job: DecodeJob
    arena: ArenaHandle | None


#: Anything handed to a worker.
Work: TypeAlias = "Task | DecodeTask"


@dataclass(frozen=True)
class Result:
    """A worker's answer: the payload, or its failure.

    Attributes:
        generation: The pass the task belonged to.
        step: The task's key.
        worker: The worker that answered.
        payload: A batch's payload, or a decoded unit (:data:`~lakeloader.decode.Held`).
        error: The formatted traceback of a failure.
        exception: A lakeloader error to raise as it is (bad data, a store that is down).
        cause: That error's cause (pickling drops ``__cause__``; the loader puts it back).
        counts: What the worker's reader did for a decode: units, bytes, requests.
    """

    generation: int
    step: int
    worker: int
    payload: Any = None
    error: str | None = None
    exception: LakeError | None = None
    cause: BaseException | None = None
    counts: tuple[int, int, int] = (0, 0, 0)

    def raised(self) -> LakeError | None:
        """The lakeloader error to raise in the loader's process, with its cause, or None."""
        if self.exception is not None:
            self.exception.__cause__ = self.cause
        return self.exception


class _ForwardLogs(logging.Handler):
    """Sends a worker's log records to the loader's process, which logs them as its own.

    Retries, quarantine warnings and the like then reach the handlers the user configured
    (and ``caplog``), whichever process did the work.
    """

    def __init__(self, results: Connection, lock: threading.Lock) -> None:
        super().__init__()
        self._results = results
        self._lock = lock

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None
        record.exc_info, record.exc_text = None, None
        try:
            with self._lock:
                self._results.send(record)
        except (OSError, ValueError):  # the loader is gone
            return


class _Worker:
    """A worker's state between tasks: its decoder and its maps of the shared files."""

    def __init__(self, setup: WorkerSetup, worker_id: int, results: Connection) -> None:
        self._setup = setup
        self._id = worker_id
        self._results = results
        self._lock = threading.Lock()  # log records may come from pyarrow's threads too
        self._decoder = setup.decoder.in_child() if setup.decoder is not None else None
        self._arena = FileMap(writable=True)
        self._opener = UnitOpener()
        forward = _ForwardLogs(results, self._lock)
        forward.setLevel(logging.getLogger(LOGGER).getEffectiveLevel())
        root = logging.getLogger(LOGGER)
        root.handlers, root.propagate = [forward], False

    def run(self, task: Work) -> None:
        """Do a task and answer it."""
        try:
            result = self._decode(task) if isinstance(task, DecodeTask) else self._build(task)
        except LakeError as exc:
            result = self._failed(task, exc)
        except Exception:
            result = Result(task.generation, task.step, self._id, error=traceback.format_exc())
        with self._lock:
            self._results.send(result)

    def _failed(self, task: Work, exc: LakeError) -> Result:
        """A lakeloader error to raise as it is in the loader, with its cause."""
        if not _round_trips(exc):  # the loader gets it as a traceback instead
            return Result(task.generation, task.step, self._id, error=traceback.format_exc())
        cause = exc.__cause__
        if cause is not None and not _round_trips(cause):
            cause = RuntimeError(describe(cause))
        return Result(task.generation, task.step, self._id, exception=exc, cause=cause)

    def _build(self, task: Task) -> Result:
        setup = self._setup
        units = self._opener.open(task.refs, None)
        payload = build_payload(
            units, task.take, setup.schema, setup.layout, setup.transform, setup.collate_fn, {}
        )
        return Result(task.generation, task.step, self._id, payload=payload)

    def _decode(self, task: DecodeTask) -> Result:
        decoder, layout = self._decoder, self._setup.layout
        assert decoder is not None
        records = None
        if task.arena is not None and layout is not None:
            size = task.arena.capacity * layout.row_bytes
            records = self._arena.bytes(task.arena.path, size).view(layout.record)
        before = decoder.reader.counters.totals()
        held = decoder.decode(task.job, records)
        after = decoder.reader.counters.totals()
        counts = (after[0] - before[0], after[1] - before[1], after[2] - before[2])
        return Result(task.generation, task.step, self._id, payload=held, counts=counts)

    def idle(self) -> None:
        """Let go of every map and table: the pass may be over."""
        self._arena.drop()
        self._opener.drop()


def _round_trips(exc: BaseException) -> bool:
    """Whether an exception survives pickling both ways (a custom ``__init__`` may not)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def _worker_main(
    worker_id: int, setup: WorkerSetup, tasks: Connection, results: Connection, building: Any
) -> None:
    torch.set_num_threads(1)
    seed = setup.base_seed + worker_id
    torch.manual_seed(seed)
    random.seed(seed)
    if setup.worker_init_fn is not None:
        setup.worker_init_fn(worker_id)
    parent = os.getppid()
    worker = _Worker(setup, worker_id, results)
    while True:
        if not tasks.poll(WATCHDOG_SECONDS):
            if os.getppid() != parent:  # the loader's process died: do not linger as an orphan
                return
            worker.idle()
            continue
        try:
            task: Work | None = tasks.recv()
        except EOFError:
            return
        if task is None:
            return
        building.value = task.step  # read by the pool if this process dies now
        worker.run(task)
        building.value = IDLE


def _widen_pipe(fd: int) -> None:
    """Let a whole batch fit in the result pipe, so that neither side waits on the other.

    A batch of 1,024 rows of 18 numeric columns is about 80 KB; Linux pipes hold 64 KB by
    default, which splits each batch in two blocking writes and reads.
    """
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size, or not Linux: the default will do
        logger.debug("could not widen the result pipe to %d bytes", PIPE_BYTES)


@dataclass
class _Slot:
    process: Any
    tasks: Connection
    results: Connection
    building: Any  # shared int: the step the worker is building, or IDLE
    owed: dict[int, Work] = field(default_factory=dict)


@dataclass(frozen=True)
class Death:
    """A worker that died, with the tasks it still owed.

    Attributes:
        worker: The worker id.
        pid: Its process id.
        exitcode: Its exit code (``-9`` for SIGKILL).
        owed: The tasks it had not answered, in the order they were handed out.
        building: The step it was building when it died, or None if it was idle.
    """

    worker: int
    pid: int | None
    exitcode: int | None
    owed: list[Work]
    building: int | None


class WorkerPool:
    """A fixed number of worker processes, each with a task queue and a result pipe.

    Args:
        setup: What every worker needs.
        num_workers: Processes to run.
        context: A multiprocessing context or its name (None: the platform default).
    """

    def __init__(
        self, setup: WorkerSetup, num_workers: int, context: BaseContext | str | None
    ) -> None:
        self._setup = setup
        self._ctx: Any = (
            mp.get_context(context) if not isinstance(context, BaseContext) else context
        )
        self._slots = [self._start(i) for i in range(num_workers)]
        self.restarts = 0
        self.generation = 0

    def _start(self, worker_id: int) -> _Slot:
        task_reader, task_writer = self._ctx.Pipe(duplex=False)
        reader, writer = self._ctx.Pipe(duplex=False)
        _widen_pipe(reader.fileno())
        building = self._ctx.Value("q", IDLE, lock=False)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(worker_id, self._setup, task_reader, writer, building),
            name=f"lakeloader-worker-{worker_id}",
            daemon=True,
        )
        proc.start()
        writer.close()
        task_reader.close()
        return _Slot(proc, task_writer, reader, building)

    @property
    def num_owed(self) -> int:
        """Tasks handed out and not yet answered."""
        return sum(len(s.owed) for s in self._slots)

    def pids(self) -> list[int | None]:
        """Process ids of the workers, by worker id."""
        return [s.process.pid for s in self._slots]

    def new_generation(self) -> int:
        """Forget every task handed out so far; their late answers will be dropped."""
        self.generation += 1
        for slot in self._slots:
            slot.owed.clear()
        return self.generation

    def submit(self, task: Work) -> int:
        """Give a task to the worker that owes the fewest; returns that worker's id."""
        worker = min(range(len(self._slots)), key=lambda i: len(self._slots[i].owed))
        slot = self._slots[worker]
        slot.owed[task.step] = task
        try:
            slot.tasks.send(task)
        except OSError:  # it died: wait() reports it and hands the task back
            logger.debug("worker %d is gone; step %d waits for its replacement", worker, task.step)
        return worker

    def _drain(self, slot: _Slot, into: list[Result]) -> None:
        try:
            while slot.results.poll():
                message = slot.results.recv()
                if isinstance(message, logging.LogRecord):  # a worker's log line
                    logging.getLogger(message.name).handle(message)
                elif message.generation == self.generation:
                    slot.owed.pop(message.step, None)
                    into.append(message)
        except (EOFError, OSError):
            return

    def all_alive(self) -> bool:
        """Whether no worker has died (and not been replaced yet)."""
        return all(s.process.is_alive() for s in self._slots)

    def waitables(self) -> list[Any]:
        """What :meth:`collect` needs to hear about: result pipes and process sentinels."""
        return [*(s.results for s in self._slots), *(s.process.sentinel for s in self._slots)]

    def wait(
        self, timeout: float | None, extra: Sequence[int] = ()
    ) -> tuple[list[Result], list[Death], bool]:
        """Wait for results, worker deaths or one of the ``extra`` file descriptors.

        Returns:
            The results that arrived, the workers that died (already replaced by fresh
            ones, their owed tasks returned for resubmission), and whether an ``extra``
            descriptor became readable.
        """
        ready = wait([*self.waitables(), *extra], timeout)
        results, deaths = self.collect(ready)
        return results, deaths, any(fd in ready for fd in extra)

    def collect(self, ready: Sequence[Any]) -> tuple[list[Result], list[Death]]:
        """Take the results that arrived and replace the workers that died.

        Args:
            ready: What a :func:`multiprocessing.connection.wait` over :meth:`waitables`
                returned (it may be stale: objects of workers replaced since are ignored).
        """
        by_conn = {s.results: s for s in self._slots}
        by_sentinel = {s.process.sentinel: i for i, s in enumerate(self._slots)}
        results: list[Result] = []
        deaths: list[Death] = []
        for obj in ready:
            if obj in by_conn:
                self._drain(by_conn[obj], results)
        # The sentinel fires once every thread of the worker has exited; waitpid (is_alive)
        # is checked too, as a second, independent signal.
        dead = {by_sentinel[obj] for obj in ready if isinstance(obj, int) and obj in by_sentinel}
        dead |= {i for i, s in enumerate(self._slots) if not s.process.is_alive()}
        for worker in sorted(dead):
            slot = self._slots[worker]
            slot.process.join(timeout=SHUTDOWN_GRACE)
            if slot.process.is_alive():  # a stale sentinel whose number a new one reuses
                continue
            self._drain(slot, results)
            step = int(slot.building.value)
            deaths.append(
                Death(
                    worker,
                    slot.process.pid,
                    slot.process.exitcode,
                    list(slot.owed.values()),
                    step if step != IDLE and step in slot.owed else None,
                )
            )
            self._close_slot(slot)
            self._slots[worker] = self._start(worker)
            self.restarts += 1
        return results, deaths

    def _close_slot(self, slot: _Slot) -> None:
        slot.tasks.close()
        slot.results.close()

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every worker to exit, then terminate those that do not.

        Args:
            graceful: Ask first (a ``None`` task). A finaliser passes False, and so does an
                interpreter that is shutting down.
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
            self._close_slot(slot)
        self._slots = []
