"""What a pass is (:class:`PassSpec`), and its decodes in the DataLoader's workers."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Final

import numpy as np

from lakeloader.cache.arena import Arena
from lakeloader.cache.decode import DecodeJob, Held, UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening, UnitStore
from lakeloader.io.prefetch import Pending
from lakeloader.io.reader import ReadCounters
from lakeloader.options import LoaderOptions
from lakeloader.order.plan import EpochPlan
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.topology import Topology
from lakeloader.workers.dispatch import DECODE, Dispatcher
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import DecodeTask, Work

#: Rows an arena starts with at most (address space only; it grows if the budget needs more).
ARENA_START_ROWS: Final = 1 << 24
#: Keys of a pass's decode tasks per unit store: a key is ``store * STORE_KEYS + position``.
STORE_KEYS: Final = 1 << 40


@dataclass(frozen=True)
class PassSpec:
    """What one pass over an epoch is: the plan, where it starts, and how it runs.

    Attributes:
        start: The global slot the pass starts at (the position G).
        screening: What to do with units that fail or are rejected, and those known skipped.
        layout: How tensor-typed columns are packed (None: rows go to a transform or a
            collate_fn and nothing is packed).
    """

    plan: EpochPlan
    start: int
    options: LoaderOptions
    topology: Topology
    screening: Screening
    layout: RowLayout | None
    recipe: BatchRecipe


class WorkerDecodes:
    """Decodes in the DataLoader's worker processes, for every unit store of a pass.

    A task's key is the store's number times :data:`STORE_KEYS` plus the unit's position;
    other work of the pass through the same workers (:meth:`run`: a packed step's samples, a
    unit's tokens) has keys below 0.
    """

    def __init__(self, pool: WorkerPool, options: LoaderOptions, generation: int) -> None:
        self.generation = generation
        self._stores: list[tuple[UnitStore, ReadCounters]] = []
        #: What each piece of other work under way is (by its key), and how many were given.
        self._others: dict[int, str] = {}
        self._issued = 0
        self.dispatcher = Dispatcher(
            pool, DECODE, options.cache_bytes, options.prefetch_factor, self._describe, self._count
        )

    def _describe(self, key: int) -> tuple[str, str]:
        if key < 0:
            return self._others.get(key, "work of the pass"), ""
        store, position = divmod(key, STORE_KEYS)
        return self._stores[store][0].describe(np.array([position]))[0], ""

    def _count(self, key: int, counts: tuple[int, int, int]) -> None:
        if key >= 0:
            self._stores[key // STORE_KEYS][1].add(*counts)

    def run(self, what: str, make: Callable[[int], Work]) -> Future[Any]:
        """Have a worker do ``what`` (so messages name it); ``make`` makes its task of a key."""
        self._issued += 1
        key = -self._issued
        self._others[key] = what
        future = self.dispatcher.submit(key, partial(make, key))
        future.add_done_callback(lambda _: self._others.pop(key, None))
        return future

    def register(self, store: UnitStore, counters: ReadCounters) -> int:
        """Number a store of the pass: the first key of its units."""
        self._stores.append((store, counters))
        return (len(self._stores) - 1) * STORE_KEYS


class StoreDecodes:
    """One unit store's decodes through the pass's :class:`WorkerDecodes`.

    ``decoder``: the index of the store's decoder among the workers', or the decoder itself,
    sent with each task (a snapshot the workers were not set up with).
    """

    def __init__(self, workers: WorkerDecodes, decoder: int | UnitDecoder) -> None:
        self._workers = workers
        self._decoder = decoder
        self._arena: Arena | None = None
        self._base = -1
        self._futures: weakref.WeakSet[Future[Held]] = weakref.WeakSet()

    def bind(self, store: UnitStore, counters: ReadCounters, arena: Arena | None) -> None:
        """Register the store (named in messages), where its reads are counted, its arena."""
        self._base = self._workers.register(store, counters)
        self._arena = arena

    def submit(self, job: DecodeJob, nbytes: int, fetch: Pending | None = None) -> Future[Held]:
        """Queue ``job`` for the next worker in turn, sent once ``fetch`` (if any) is done."""
        key = self._base + job.position

        def make() -> DecodeTask:  # the arena's handle as it is when the task is sent
            task_job = job if fetch is None else dataclasses.replace(job, fetched=fetch.claim())
            handle = self._arena.handle if self._arena is not None else None
            return DecodeTask(self._workers.generation, key, task_job, handle, self._decoder)

        ready = fetch.future if fetch is not None else None
        future = self._workers.dispatcher.submit(key, make, nbytes, ready)
        self._futures.add(future)
        return future

    def close(self, wait: bool) -> None:
        """Drop this store's queued decodes (one under way still answers)."""
        for future in list(self._futures):
            future.cancel()
