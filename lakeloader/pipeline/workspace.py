"""What one pass holds: its folder, the arena, who decodes, and the unit store.

A :class:`PassWorkspace` is made as a pass starts and closed as it ends. Everything the pass
shares with its workers lives in a folder of its own, deleted on close, so that decodes of an
abandoned pass that a worker finishes late cannot touch the next pass's files. On the default
tensor path with workers, the workers decode (:class:`WorkerDecodes`); otherwise the loader's
own threads do (:class:`~lakeloader.cache.decode.LocalDecodes`).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from lakeloader.cache.arena import Arena
from lakeloader.cache.decode import DecodeJob, Decodes, Held, LocalDecodes, UnitDecoder
from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening, UnitStore
from lakeloader.io.fetch import is_local
from lakeloader.io.prefetch import Pending, Prefetcher
from lakeloader.io.reader import UnitReader
from lakeloader.options import LoaderOptions
from lakeloader.order.plan import EpochPlan
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.topology import Topology
from lakeloader.workers.dispatch import DECODE, Dispatcher
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import DecodeTask

#: Rows an arena starts with at most (address space only; it grows if the budget needs more).
ARENA_START_ROWS: Final = 1 << 24


@dataclass(frozen=True)
class PassSpec:
    """What one pass over an epoch is: the plan, where it starts, and how it runs.

    Attributes:
        plan: The epoch's plan.
        start: The global slot the pass starts at (the position G).
        options: The loader's options.
        topology: The loader's topology.
        screening: What to do with units that fail or are rejected, and those known skipped.
        layout: How tensor-typed columns are packed (None: rows go to a transform or a
            collate_fn and nothing is packed).
        recipe: How rows become a batch.
    """

    plan: EpochPlan
    start: int
    options: LoaderOptions
    topology: Topology
    screening: Screening
    layout: RowLayout | None
    recipe: BatchRecipe = field(default_factory=BatchRecipe)


class WorkerDecodes:
    """Decodes in the DataLoader's worker processes (the default tensor path).

    Args:
        dispatcher: Hands decode tasks to the workers.
        generation: The pass's generation of the pool.
        arena: The pass's arena.
    """

    def __init__(self, dispatcher: Dispatcher, generation: int, arena: Arena) -> None:
        self._dispatcher = dispatcher
        self._generation = generation
        self._arena = arena

    def submit(self, job: DecodeJob, nbytes: int, fetch: Pending | None = None) -> Future[Held]:
        """Queue ``job`` for the next worker in turn, sent once ``fetch`` (if any) is done."""

        def make() -> DecodeTask:  # the arena's handle as it is when the task is sent
            task_job = job if fetch is None else dataclasses.replace(job, fetched=fetch.claim())
            return DecodeTask(self._generation, job.position, task_job, self._arena.handle)

        ready = fetch.future if fetch is not None else None
        return self._dispatcher.submit(job.position, make, nbytes, ready)

    def reap(self) -> None:
        """Notice dead workers now (see :meth:`Dispatcher.reap`)."""
        self._dispatcher.reap()

    def close(self, wait: bool) -> None:
        """Stop sending; cancel queued decodes."""
        self._dispatcher.close(wait)


class PassWorkspace:
    """The folder, arena, decodes and unit store of one pass.

    Args:
        spec: The pass.
        reader: Reads units (its counters are the loader's).
        pool: The workers, or None. They decode only on the default tensor path (a layout
            with packed columns and no code of the user's); with a transform, a collate_fn or
            a batch_transform they build batches instead, and the loader's threads decode.
        unit_dir: The loader's folder for decoded units.
        arena: An arena shared with other passes (a mixture's sources), which this one
            neither makes nor closes; None: its own, when it packs rows.
        decode_pool: Threads that decode in this process, shared with other passes (a
            mixture's sources); None: ``io_threads`` of its own.
    """

    def __init__(
        self,
        spec: PassSpec,
        reader: UnitReader,
        pool: WorkerPool | None,
        unit_dir: str,
        arena: Arena | None = None,
        decode_pool: ThreadPoolExecutor | None = None,
    ) -> None:
        opts, layout = spec.options, spec.layout
        packs = layout is not None and bool(layout.names)
        self.dir = tempfile.mkdtemp(prefix="pass-", dir=unit_dir)
        self.arena: Arena | None = arena
        self._owns_arena = arena is None
        if packs and layout is not None and arena is None:
            budget_rows = opts.cache_bytes // layout.row_bytes
            self.arena = Arena(
                self.dir, layout.record, min(budget_rows, ARENA_START_ROWS), budget_rows
            )
        self.generation = pool.new_generation() if pool is not None else 0
        decodes: Decodes
        self.remote: WorkerDecodes | None = None
        if pool is not None and self.arena is not None and not spec.recipe.user_code:
            dispatcher = Dispatcher(
                pool,
                DECODE,
                opts.cache_bytes,
                opts.prefetch_factor,
                lambda key: (self.store.describe(np.array([key]))[0], ""),
                reader.counters,
            )
            self.remote = decodes = WorkerDecodes(dispatcher, self.generation, self.arena)
        else:
            decoder = UnitDecoder(reader, layout, spec.screening.on_error, spec.screening.validate)
            decodes = LocalDecodes(
                decoder, opts.io_threads, opts.cache_bytes, self.records, decode_pool
            )
        #: Whether the workers decode (else, with a pool, they build batches).
        self.workers_decode = self.remote is not None
        #: Fetches units ahead of their decode (None: a local lake, which pyarrow reads).
        self.prefetcher: Prefetcher | None = None
        if not is_local(reader.fs):
            self.prefetcher = Prefetcher(reader, self.dir if self.workers_decode else None)
        shares_tables = self.remote is not None or pool is not None
        self.store = UnitStore(
            reader,
            spec.plan,
            layout,
            self.arena,
            self.dir if shares_tables else None,
            spec.screening.known,
            decodes,
            self.prefetcher,
        )

    def records(self) -> np.ndarray | None:
        """The arena's rows now (it may have grown since the last call), or None."""
        return self.arena.records if self.arena is not None else None

    def close(self, wait: bool = True) -> None:
        """Stop fetching and decoding, drop every unit and delete the pass's folder."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.store.close(wait)
        if self.arena is not None and self._owns_arena:
            self.arena.close()
        shutil.rmtree(self.dir, ignore_errors=True)
