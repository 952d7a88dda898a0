"""DataLoader worker processes that build batches from the shared unit cache.

Any worker can build any batch: a task names the step, the unit files and the row indices,
and the worker answers with the batch's payload on its own pipe. The pool notices a worker
that died (its sentinel becomes ready), hands back the tasks it owed so the loader can give
them to another worker, and starts a fresh one in its place.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import queue
import random
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from lakeloader.cache import UnitOpener, UnitRef
from lakeloader.collate import Collate, Transform, build_payload
from lakeloader.packed import RowLayout

logger = logging.getLogger(__name__)

#: Seconds a worker gets to exit after being asked to, before it is terminated.
SHUTDOWN_GRACE = 5.0
#: Seconds between a waiting worker's checks that the loader's process is still alive.
WATCHDOG_SECONDS = 1.0
#: Value of a worker's "building" cell while it waits for a task.
IDLE = -1
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
    """

    schema: pa.Schema
    layout: RowLayout | None
    transform: Transform | None
    collate_fn: Collate | None
    worker_init_fn: Callable[[int], None] | None
    base_seed: int
    num_workers: int


@dataclass(frozen=True)
class Task:
    """Build one batch: the step, the decoded units' files and the row indices.

    ``generation`` tells apart the passes of a pool that outlives one (persistent workers):
    answers to a pass that was abandoned are dropped, never mistaken for the new pass's steps.
    """

    generation: int
    step: int
    refs: Sequence[UnitRef]
    take: np.ndarray


@dataclass(frozen=True)
class Result:
    """A worker's answer: the payload, or the formatted traceback of its failure."""

    generation: int
    step: int
    worker: int
    payload: Any = None
    error: str | None = None


def _worker_main(
    worker_id: int, setup: WorkerSetup, tasks: Any, results: Connection, building: Any
) -> None:
    torch.set_num_threads(1)
    seed = setup.base_seed + worker_id
    torch.manual_seed(seed)
    random.seed(seed)
    if setup.worker_init_fn is not None:
        setup.worker_init_fn(worker_id)
    parent = os.getppid()
    opener = UnitOpener()
    while True:
        try:
            task: Task | None = tasks.get(timeout=WATCHDOG_SECONDS)
        except queue.Empty:
            if os.getppid() != parent:  # the loader's process died: do not linger as an orphan
                return
            continue
        if task is None:
            return
        building.value = task.step  # read by the pool if this process dies now
        try:
            units = opener.open(task.refs)
            payload = build_payload(
                units, task.take, setup.schema, setup.layout, setup.transform, setup.collate_fn
            )
            results.send(Result(task.generation, task.step, worker_id, payload=payload))
        except Exception:
            error = traceback.format_exc()
            results.send(Result(task.generation, task.step, worker_id, error=error))
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
    tasks: Any
    results: Connection
    building: Any  # shared int: the step the worker is building, or IDLE
    owed: dict[int, Task] = field(default_factory=dict)


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
    owed: list[Task]
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
        tasks = self._ctx.Queue()
        reader, writer = self._ctx.Pipe(duplex=False)
        _widen_pipe(reader.fileno())
        building = self._ctx.Value("q", IDLE, lock=False)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(worker_id, self._setup, tasks, writer, building),
            name=f"lakeloader-worker-{worker_id}",
            daemon=True,
        )
        proc.start()
        writer.close()
        return _Slot(proc, tasks, reader, building)

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

    def submit(self, task: Task) -> int:
        """Give a task to the worker that owes the fewest; returns that worker's id."""
        worker = min(range(len(self._slots)), key=lambda i: len(self._slots[i].owed))
        slot = self._slots[worker]
        slot.owed[task.step] = task
        slot.tasks.put(task)
        return worker

    def _drain(self, slot: _Slot, into: list[Result]) -> None:
        try:
            while slot.results.poll():
                result: Result = slot.results.recv()
                if result.generation == self.generation:
                    slot.owed.pop(result.step, None)
                    into.append(result)
        except (EOFError, OSError):
            return

    def wait(
        self, timeout: float | None, extra: Sequence[int] = ()
    ) -> tuple[list[Result], list[Death], bool]:
        """Wait for results, worker deaths or one of the ``extra`` file descriptors.

        Returns:
            The results that arrived, the workers that died (already replaced by fresh
            ones, their owed tasks returned for resubmission), and whether an ``extra``
            descriptor became readable.
        """
        by_conn = {s.results: s for s in self._slots}
        by_sentinel = {s.process.sentinel: i for i, s in enumerate(self._slots)}
        ready = wait([*by_conn, *by_sentinel, *extra], timeout)
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
            self._drain(slot, results)
            slot.process.join(timeout=SHUTDOWN_GRACE)
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
        return results, deaths, any(fd in ready for fd in extra)

    def _close_slot(self, slot: _Slot) -> None:
        slot.tasks.cancel_join_thread()
        slot.tasks.close()
        slot.results.close()

    def shutdown(self, graceful: bool = True) -> None:
        """Ask every worker to exit, then terminate those that do not.

        Args:
            graceful: Ask first (a ``None`` task). A finaliser passes False, and so does an
                interpreter that is shutting down: putting on a queue starts its feeder
                thread, which can no longer start then, and the put would hang.
        """
        graceful = graceful and not sys.is_finalizing()
        for slot in self._slots:
            if not graceful:
                slot.process.terminate()
                continue
            try:
                slot.tasks.put(None)
            except (OSError, ValueError):
                logger.debug("worker %s queue already closed", slot.process.name)
        for slot in self._slots:
            slot.process.join(timeout=SHUTDOWN_GRACE)
            if slot.process.is_alive():
                slot.process.terminate()
                slot.process.join(timeout=SHUTDOWN_GRACE)
            self._close_slot(slot)
        self._slots = []
