"""The worker process's side: what it is given, what it does, and what it answers."""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import os
import pickle
import random
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TextIO, TypeAlias

import numpy as np
import pyarrow as pa
import torch
import torch.utils.data._utils.worker as torch_worker

from lakeloader.cache.arena import ArenaHandle, FileMap
from lakeloader.cache.decode import DecodeJob, UnitDecoder, UnitRef
from lakeloader.cache.packed import RowLayout, gather_packed
from lakeloader.cache.store import UnitOpener
from lakeloader.errors import LakeError, LakeWarning
from lakeloader.io.retry import describe
from lakeloader.order.packing import separated
from lakeloader.pipeline.collate import Transform
from lakeloader.pipeline.recipe import BatchRecipe, Sources, build_payload, samples_payload
from lakeloader.pipeline.rows import gather_rows, row_lists, transform_rows
from lakeloader.signals import process_receives
from lakeloader.workers.shipping import ship

#: Seconds between a waiting worker's checks that the loader's process is still alive.
WATCHDOG_SECONDS = 1.0
#: Value of a worker's "building" cell while it waits for a task.
IDLE = -1
#: The package's logger: what workers forward to the loader's process.
LOGGER = "lakeloader"
#: Attribute of a worker's log record that carries a LakeWarning's category to the loader.
WARNING_ATTR = "lake_warning"


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker needs, sent once when it starts (pickled for spawn contexts).

    Attributes:
        seed: The dataset's seed (worker ``i`` is seeded with ``worker_seed(seed, rank, i)``).
        decoders: One per source read (a mixture's in order), named by a
            :class:`DecodeTask`'s index; empty when workers only build batches.
        transforms: Each source's row ``transform`` (or None), in the same order: a mixed
            :class:`Task`'s ``source_of`` and a :class:`TokensTask`'s ``source`` index it (so
            that a transform is not pickled with each task: under fork, it never is).
    """

    schema: pa.Schema
    layout: RowLayout | None
    recipe: BatchRecipe
    worker_init_fn: Callable[[int], None] | None
    seed: int
    rank: int
    decoders: tuple[UnitDecoder, ...] = ()
    transforms: tuple[Transform | None, ...] = ()


@dataclass(frozen=True)
class Started:
    """A worker's first message: it is set up, or ``error`` (the traceback) says why not."""

    worker: int
    error: str | None = None


def worker_seed(seed: int, rank: int, worker: int) -> int:
    """The seed of one worker: 63 bits hashed from ``(seed, rank, worker)``, for any ``seed``."""
    words = [w % 2**64 for w in (seed, rank, worker)]
    state = np.random.SeedSequence(words, pool_size=4).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@dataclass(frozen=True)
class Task:
    """Build one batch (the user's code runs on it): its units, rows and the rows' seeds.

    Attributes:
        generation: The pass (answers to an abandoned pass are dropped).
        refs: Units the Arrow path takes columns from; ``take`` indexes their concatenation.
        outbox: The folder the batch is shipped through (:mod:`lakeloader.workers.shipping`).
        rows: Arena row of each batch row (None: nothing packed), for the packed ``names``.
        arena: The arena's handle as it was when the task was sent, or None.
        extra: Columns computed, in batch order (a mixture's source of each row), or None.
        source_of: A mixed batch's rows' sources (indices into the setup's ``transforms``), or
            None.
    """

    generation: int
    step: int
    refs: Sequence[UnitRef]
    take: np.ndarray
    seeds: np.ndarray
    outbox: str
    rows: np.ndarray | None = None
    names: tuple[str, ...] = ()
    arena: ArenaHandle | None = None
    extra: Mapping[str, np.ndarray] | None = None
    source_of: np.ndarray | None = None


@dataclass(frozen=True)
class DecodeTask:
    """Decode one unit into the loader's arena.

    ``decoder``: the index of a decoder of the setup, or the decoder itself, of a snapshot the
    workers were not set up with (a followed lake's increment: it comes with each task).
    """

    generation: int
    step: int
    job: DecodeJob
    arena: ArenaHandle | None
    decoder: int | UnitDecoder = 0


@dataclass(frozen=True)
class SamplesTask:
    """Build one batch of packed samples already cut: the user's code runs on them."""

    generation: int
    step: int
    columns: dict[str, np.ndarray]
    seeds: np.ndarray
    outbox: str


@dataclass(frozen=True)
class TokensTask(Task):
    """Make a decoded unit's rows (a :class:`Task`'s) into tokens with a row ``transform``.

    Each row goes through the setup's transform of ``source`` (with its seed of ``seeds``);
    the rows' ``column`` is laid end to end with ``eos_id`` after each row. ``layout``: the
    arena's rows, if any.
    """

    schema: pa.Schema | None = None
    source: int = 0
    column: str = ""
    eos_id: int | None = None
    layout: RowLayout | None = None


#: Anything handed to a worker.
Work: TypeAlias = "Task | DecodeTask | SamplesTask | TokensTask"


@dataclass(frozen=True)
class Result:
    """A worker's answer: the payload (a batch's, or a decoded unit), or its failure.

    Attributes:
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


class _ForwardLogs(logging.Handler):
    """Sends a worker's log records and lakeloader warnings to the loader's process."""

    def __init__(self, results: Connection, lock: threading.Lock) -> None:
        super().__init__()
        self._results = results
        self._lock = lock
        self._show = warnings.showwarning

    def showwarning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        """Send a LakeWarning home (whatever the logger's level); show the others here."""
        if not issubclass(category, LakeWarning):
            self._show(message, category, filename, lineno, file, line)
            return
        record = logging.LogRecord(LOGGER, logging.WARNING, filename, lineno, message, None, None)
        setattr(record, WARNING_ATTR, category)
        self.handle(record)

    def emit(self, record: logging.LogRecord) -> None:
        record.msg, record.args = record.getMessage(), None
        record.exc_info, record.exc_text = None, None
        with contextlib.suppress(OSError, ValueError), self._lock:  # unless the loader is gone
            self._results.send(record)


class _Worker:
    """A worker's state between tasks: its decoders and its maps of the shared files."""

    def __init__(self, setup: WorkerSetup, worker_id: int, results: Connection) -> None:
        self._setup = setup
        self._id = worker_id
        self._results = results
        self._lock = threading.Lock()  # log records may come from pyarrow's threads too
        self._decoders: dict[int, UnitDecoder] = {}  # made for this process on first use
        self._arena = FileMap(writable=True)
        self._opener = UnitOpener()
        forward = _ForwardLogs(results, self._lock)
        forward.setLevel(logging.getLogger(LOGGER).getEffectiveLevel())
        root = logging.getLogger(LOGGER)
        root.handlers, root.propagate = [forward], False
        warnings.showwarning = forward.showwarning

    def run(self, task: Work) -> None:
        """Do a task and answer it."""
        try:
            if isinstance(task, DecodeTask):
                result = self._decode(task)
            elif isinstance(task, TokensTask):
                result = self._tokens(task)
            elif isinstance(task, SamplesTask):
                kind, batch = samples_payload(task.columns, self._setup.recipe, task.seeds)
                payload = kind, ship(batch, task.outbox)
                result = Result(task.generation, task.step, self._id, payload=payload)
            else:
                result = self._build(task)
        except Exception as exc:
            result = self._failed(task, exc)
        with self._lock:
            self._results.send(result)

    def _failed(self, task: Work, exc: Exception) -> Result:
        """A lakeloader error to raise as it is in the loader, with its cause; else a traceback."""
        if not (isinstance(exc, LakeError) and _round_trips(exc)):
            return Result(task.generation, task.step, self._id, error=traceback.format_exc())
        cause = exc.__cause__
        if cause is not None and not _round_trips(cause):
            cause = RuntimeError(describe(cause))
        return Result(task.generation, task.step, self._id, exception=exc, cause=cause)

    def _records(self, arena: ArenaHandle | None, layout: RowLayout | None) -> np.ndarray | None:
        """The arena's rows as the loader's process had them when it sent the task."""
        if arena is None or layout is None:
            return None
        size = arena.capacity * layout.row_bytes
        return self._arena.bytes(arena.path, size).view(layout.record)

    def _build(self, task: Task) -> Result:
        layout, schema, recipe = self._setup.layout, self._setup.schema, self._setup.recipe
        records = self._records(task.arena, layout)
        ready: dict[str, np.ndarray] = {}
        if records is not None and task.rows is not None and layout is not None:
            ready = gather_packed(records, task.rows, layout, task.names)
        units = self._opener.open(task.refs, records)
        sources = (
            None if task.source_of is None else Sources(task.source_of, self._setup.transforms)
        )
        kind, batch = build_payload(
            units, task.take, schema, recipe, ready, task.seeds, task.extra, sources
        )
        payload = kind, ship(batch, task.outbox)
        return Result(task.generation, task.step, self._id, payload=payload)

    def _tokens(self, task: TokensTask) -> Result:
        units = self._opener.open(task.refs, self._records(task.arena, task.layout))
        rows = gather_rows(units, task.take, task.schema or self._setup.schema)
        transform = self._setup.transforms[task.source]
        assert transform is not None, "tokens are made in a worker only with a transform"
        rows = transform_rows(rows, transform, task.seeds)
        made = separated(*row_lists(rows, task.column), task.eos_id)
        payload = "tokens", ship(made, task.outbox)
        return Result(task.generation, task.step, self._id, payload=payload)

    def _decode(self, task: DecodeTask) -> Result:
        if isinstance(task.decoder, UnitDecoder):  # unpickled here: its filesystem is its own
            decoder = task.decoder
        elif task.decoder in self._decoders:
            decoder = self._decoders[task.decoder]
        else:  # a copy with a filesystem of its own, made from its pickle
            decoder = copy.copy(self._setup.decoders[task.decoder])
            decoder.reader = decoder.reader.with_fs(pickle.loads(pickle.dumps(decoder.reader.fs)))
            self._decoders[task.decoder] = decoder
        records = self._records(task.arena, decoder.layout)
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


def worker_main(
    worker_id: int,
    num_workers: int,
    setup: WorkerSetup,
    tasks: Connection,
    results: Connection,
    building: Any,
) -> None:
    """A worker's life: set up as torch's DataLoader does, then do tasks until told to stop.

    ``torch.utils.data.get_worker_info()`` gives the worker's id, ``num_workers`` and seed, as
    in torch's workers (its ``dataset`` is None: the loader, not the dataset, plans the work).
    A ``None`` task asks it to exit; answers and log records go to ``results``; ``building`` is
    a shared cell that holds the key of the task under way, read by the pool on a death.
    """
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the training process reports a Ctrl-C
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ends it at once, whatever it inherited
    process_receives()
    try:
        seed = worker_seed(setup.seed, setup.rank, worker_id)  # seeded as torch's workers are
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(np.random.SeedSequence(seed).generate_state(4))
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=worker_id,
            num_workers=num_workers,
            seed=seed,
            dataset=None,  # type: ignore[arg-type]
        )
        if setup.worker_init_fn is not None:
            setup.worker_init_fn(worker_id)
        worker = _Worker(setup, worker_id, results)
    except BaseException:  # the pool raises it in the training loop instead of respawning
        results.send(Started(worker_id, traceback.format_exc()))
        return
    results.send(Started(worker_id))
    gc.freeze()  # what the worker inherited stays: no collection touches (and copies) it
    parent = os.getppid()
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
