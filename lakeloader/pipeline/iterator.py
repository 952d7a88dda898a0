"""One pass over an epoch for one rank: plan ahead, decode ahead, build, deliver in order.

The iterator walks the rank's steps from the start position. It plans steps ahead (each a
:class:`~lakeloader.order.batches.BatchSpec`), asks the unit store to decode their units in
plan order
within the byte budget, hands each step whose units are ready to a worker (or builds it
in-process without workers), and yields batches strictly in step order. Only when a batch is
handed to the training loop does the loader's position move.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from lakeloader.cache.arena import Arena, ArenaHandle
from lakeloader.cache.decode import DecodeJob, Decodes, Held, LocalDecodes, UnitDecoder
from lakeloader.cache.packed import RowLayout, gather_packed
from lakeloader.cache.screening import Screened, screen
from lakeloader.cache.store import Screening, UnitOpener, UnitStore
from lakeloader.cache.views import views_array
from lakeloader.cli.tables import human_bytes
from lakeloader.errors import CacheBudgetWarning, WorkerError
from lakeloader.io.reader import UnitReader
from lakeloader.order.batches import BatchSpec, batch_specs
from lakeloader.order.plan import EpochPlan, steps_in_epoch
from lakeloader.pipeline.collate import (
    Collate,
    Transform,
    build_payload,
    finish_payload,
    pin,
    python_values,
)
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.workers.dispatch import RemoteDecodes
from lakeloader.workers.pool import Death, WorkerPool
from lakeloader.workers.process import Result, Task

logger = logging.getLogger(__name__)

#: Steps planned ahead of delivery at most (the byte budget usually stops it earlier).
LOOKAHEAD_STEPS = 256
#: Rows an arena starts with at most (address space only; it grows if the budget needs more).
ARENA_START_ROWS = 1 << 24
#: Steps planned by one call (planning is vectorised across steps; see batches.batch_specs).
PLAN_CHUNK = 64
#: Attempts at one batch whose worker keeps dying before the loader gives up.
MAX_BATCH_ATTEMPTS = 3
#: Seconds between liveness checks while waiting for workers.
POLL_SECONDS = 1.0


@dataclass(frozen=True)
class IterConfig:
    """What one epoch pass needs to know besides the plan (all plain values)."""

    plan: EpochPlan
    start: int
    global_batch: int
    world_size: int
    rank: int
    drop_last: bool
    num_workers: int
    prefetch_factor: int
    timeout: float
    cache_bytes: int
    io_threads: int
    pin_memory: bool
    transform: Transform | None
    collate_fn: Collate | None
    screening: Screening
    layout: RowLayout | None


@dataclass(frozen=True)
class Delivery:
    """What the loader learns as a batch is handed over.

    Attributes:
        slot_stop: One past the last global slot of the step (the new position G).
        rows: Rows this rank delivered.
        last: Whether it is the pass's last step.
        skipped: Quarantined units whose rows this step would have held.
        rows_skipped: Rows of this rank's share left out for them.
    """

    slot_stop: int
    rows: int
    last: bool
    skipped: tuple[QuarantineEntry, ...]
    rows_skipped: int


OnDelivered = Callable[[Delivery], None]


class EpochIterator:
    """Iterator over one rank's batches of one epoch (see the module docstring).

    Args:
        cfg: The pass's configuration.
        reader: Reads units (its counters are the loader's).
        on_delivered: Called with a :class:`Delivery` as each batch is handed over.
        on_finish: Called once when the pass ends (or is closed).
        pool: Worker processes: they decode units (default tensor path) or build batches
            (with a transform or a collate_fn). None: everything happens in this process.
        unit_dir: Folder for the arena and the unit files shared with the workers (None:
            nothing is packed, every column takes the Arrow path).
    """

    def __init__(
        self,
        cfg: IterConfig,
        reader: UnitReader,
        on_delivered: OnDelivered,
        on_finish: Callable[[], None],
        pool: WorkerPool | None,
        unit_dir: str | None,
    ) -> None:
        self.cfg = cfg
        self._schema = reader.schema
        self._on_delivered = on_delivered
        self._on_finish = on_finish
        self._pool = pool
        self.num_steps = steps_in_epoch(
            cfg.start, cfg.plan.num_rows, cfg.global_batch, cfg.drop_last
        )
        layout = cfg.layout if cfg.layout is not None and cfg.layout.names else None
        # Everything this pass shares lives in a folder of its own, deleted as it closes:
        # decodes of an abandoned pass that a worker finishes late cannot touch the next's.
        self._dir = tempfile.mkdtemp(prefix="pass-", dir=unit_dir) if unit_dir else None
        self._arena: Arena | None = None
        if layout is not None and self._dir is not None:
            budget_rows = cfg.cache_bytes // layout.row_bytes
            start_rows = min(budget_rows, ARENA_START_ROWS)
            self._arena = Arena(self._dir, layout.record, start_rows, budget_rows)
        self._generation = pool.new_generation() if pool else 0
        self._remote: RemoteDecodes | None = None
        decodes: Decodes
        if pool is not None and self._arena is not None:
            # The default tensor path: workers decode, this process assembles (a row copy).
            self._remote = decodes = RemoteDecodes(
                pool,
                self._generation,
                self._arena_handle,
                cfg.cache_bytes,
                cfg.prefetch_factor,
                reader.counters,
                self._describe_job,
            )
            pool = None
        else:
            decoder = UnitDecoder(
                reader, cfg.layout, cfg.screening.on_error, cfg.screening.validate
            )
            decodes = LocalDecodes(decoder, cfg.io_threads, cfg.cache_bytes, self._records)
        self._pool = pool
        self._store = UnitStore(
            reader,
            cfg.plan,
            cfg.layout,
            self._arena,
            self._dir if self._remote is not None or pool is not None else None,
            cfg.screening.known,
            decodes,
        )
        self._opener = UnitOpener()
        self._planned: deque[BatchSpec] = deque()
        self._specs: dict[int, BatchSpec] = {}
        #: Per screened step: the quarantined units and the rows of this rank they cost.
        self._skipped: dict[int, tuple[tuple[QuarantineEntry, ...], int]] = {}
        self._done: dict[int, Result] = {}
        self._attempts: dict[int, int] = {}
        self._next_plan = self._next_dispatch = self._next_deliver = 0
        self._wake_r, self._wake_w = os.pipe() if pool else (-1, -1)
        self._closed = False
        self._budget_warned = False

    def _records(self) -> np.ndarray | None:
        """The arena's rows now (it may have grown since the last call)."""
        return self._arena.records if self._arena is not None else None

    def _arena_handle(self) -> ArenaHandle | None:
        return self._arena.handle if self._arena is not None else None

    # ------------------------------------------------------------------ planning
    def _plan_ahead(self) -> None:
        c = self.cfg
        while (
            self._next_plan < self.num_steps
            and self._next_plan < self._next_deliver + LOOKAHEAD_STEPS
            and (self._next_plan == self._next_deliver or self._store.nbytes < c.cache_bytes)
        ):
            if not self._planned:
                n = min(PLAN_CHUNK, self.num_steps - self._next_plan)
                self._planned.extend(
                    batch_specs(
                        c.plan, self._next_plan, n, c.start, c.global_batch, c.world_size, c.rank
                    )
                )
            spec = self._planned.popleft()
            self._store.request(spec.positions, on_ready=self._wake)
            self._specs[spec.step] = spec
            self._next_plan += 1

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                logger.debug("wake pipe closed")

    # ------------------------------------------------------------------ delivery
    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._closed or self._next_deliver >= self.num_steps:
            self.close()
            raise StopIteration
        step = self._next_deliver
        if self._remote is not None:
            self._remote.reap()
        self._plan_ahead()
        spec = self._specs[step]
        payload = self._build(spec) if self._pool is None else self._from_workers(step)
        batch = finish_payload(payload)
        if self.cfg.pin_memory:
            batch = pin(batch)
        if self._store.nbytes > self.cfg.cache_bytes and self._next_plan == step + 1:
            self._warn_budget(spec)
        del self._specs[step]
        skipped, rows = self._skipped.pop(step)
        self._next_deliver += 1
        self._on_delivered(
            Delivery(
                spec.slot_stop,
                spec.num_rows - rows,
                self._next_deliver == self.num_steps,
                skipped,
                rows,
            )
        )
        self._store.release(spec.slot_stop)
        return batch

    def _warn_budget(self, spec: BatchSpec) -> None:
        """Say once that the step being delivered alone holds more than the budget."""
        if self._budget_warned:
            return
        self._budget_warned = True
        held, plan = self._store.nbytes, self.cfg.plan
        most = int(plan.piece_rows(spec.positions).max())
        warnings.warn(
            f"this step's {len(spec.positions)} decoded pieces (up to {most:,} rows each) hold "
            f"{human_bytes(held)}, more than cache_bytes={human_bytes(self.cfg.cache_bytes)}: a "
            "step draws from about C pieces, each decoded whole, so the loader holds them "
            "whatever the budget, and decodes nothing ahead. Give it cache_bytes of at least "
            f"{human_bytes(2 * held)}, or build the dataset with a smaller max_unit_rows (this "
            "changes the order; row groups larger than it then cost more decoding)",
            CacheBudgetWarning,
            stacklevel=3,
        )

    def _screened(self, spec: BatchSpec) -> Screened:
        """The step's units without quarantined ones, and its rows renumbered to match."""
        try:
            held: list[Held] = self._store.get(spec.positions, self.cfg.timeout or None)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            raise self._timed_out(spec.step) from None
        layout = self.cfg.layout if self._arena is not None else None
        screened = screen(spec, held, self.cfg.plan, layout, len(self._schema))
        self._skipped[spec.step] = (screened.skipped, screened.lost)
        return screened

    def _build(self, spec: BatchSpec) -> Any:
        """Build a step's batch in this process (no workers)."""
        c, screened = self.cfg, self._screened(spec)
        records = self._records()
        ready: dict[str, Any] = {}
        if screened.rows is not None and records is not None and c.layout is not None:
            fields = screened.names + screened.views
            ready.update(gather_packed(records, screened.rows, c.layout, fields))
            buffers = self._store.view_buffers
            for name in screened.views:
                typ = self._schema.field(name).type
                ready[name] = python_values(views_array(ready[name], typ, buffers))
        units = self._opener.open(screened.refs, records) if screened.refs else []
        return build_payload(units, screened.take, self._schema, c.transform, c.collate_fn, ready)

    def _dispatch(self, pool: WorkerPool) -> None:
        cap = max(1, self.cfg.num_workers * self.cfg.prefetch_factor)
        while self._next_dispatch < self._next_plan and pool.num_owed < cap:
            spec = self._specs[self._next_dispatch]
            if not self._store.ready(spec.positions):
                return
            if self._store.failed(spec.positions):
                # The error belongs to this step: raise it only once every earlier batch
                # has been delivered, so the position says exactly how far training got.
                if spec.step == self._next_deliver:
                    self._screened(spec)
                return
            screened = self._screened(spec)
            pool.submit(Task(self._generation, spec.step, screened.refs, screened.take))
            self._next_dispatch += 1

    def _from_workers(self, step: int) -> Any:
        pool = self._pool
        assert pool is not None
        waited_since = time.monotonic()
        while True:
            self._plan_ahead()
            self._dispatch(pool)
            ready = step in self._done  # still look (without blocking) for deaths and results
            results, deaths, woke = pool.wait(0 if ready else POLL_SECONDS, [self._wake_r])
            if woke:
                os.read(self._wake_r, 1 << 16)
            for result in results:
                self._done[result.step] = result
            if deaths:
                self._recover(pool, deaths)
            if step in self._done:
                break
            if results:
                waited_since = time.monotonic()
            elif self.cfg.timeout and time.monotonic() - waited_since > self.cfg.timeout:
                raise self._timed_out(step)
        result = self._done.pop(step)
        if result.error is not None:
            raise WorkerError(
                f"worker {result.worker} failed to build step {step} of epoch "
                f"{self.cfg.plan.epoch}:\n{result.error}"
            )
        return result.payload

    def _recover(self, pool: WorkerPool, deaths: list[Death]) -> None:
        for death in deaths:
            steps = sorted(t.step for t in death.owed if t.step not in self._done)
            logger.warning(
                "DataLoader worker %d (pid %s) died with exit code %s; rebuilding steps %s of "
                "epoch %d in a fresh worker",
                death.worker,
                death.pid,
                death.exitcode,
                steps,
                self.cfg.plan.epoch,
            )
            # Only the batch the worker was building when it died counts as an attempt; the
            # others were merely queued behind it, and an idle worker's death blames nothing.
            for task in death.owed:
                if task.step in self._done:
                    continue
                if task.step == death.building:
                    attempts = self._attempts.get(task.step, 1) + 1
                    if attempts > MAX_BATCH_ATTEMPTS:
                        raise WorkerError(self._describe_poison(task.step, attempts - 1))
                    self._attempts[task.step] = attempts
                pool.submit(task)

    def _timed_out(self, step: int) -> RuntimeError:
        return RuntimeError(
            f"DataLoader timed out after {self.cfg.timeout} seconds waiting for step {step} "
            f"of epoch {self.cfg.plan.epoch}"
        )

    def _describe_job(self, job: DecodeJob) -> str:
        return self._store.describe(np.array([job.position]))[0]

    def _describe_poison(self, step: int, attempts: int) -> str:
        spec = self._specs[step]
        plan = self.cfg.plan
        files = self._store.describe(spec.positions)
        return (
            f"step {step} of epoch {plan.epoch} killed its worker {attempts} times; giving up. "
            f"Its units: {files}. Check the transform and collate_fn on those rows, and the "
            "memory available to workers"
        )

    # ------------------------------------------------------------------- teardown
    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._store.nbytes

    def cache_peak_bytes(self) -> int:
        """Most bytes of decoded units held at once in this pass."""
        return self._store.peak_bytes

    def close(self, wait: bool = True) -> None:
        """Stop decoding and drop the cached units (idempotent; see ``UnitStore.close``)."""
        if self._closed:
            return
        self._closed = True
        self._store.close(wait)
        if self._arena is not None:
            self._arena.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._on_finish()
