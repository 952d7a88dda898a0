"""One pass over an epoch for one rank: plan ahead, decode ahead, build, deliver in order.

The reader-state tracker's position moves only when a batch is handed to the training loop.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, Protocol

from lakeloader.errors import CacheBudgetWarning, warn_user
from lakeloader.order.batches import BatchSpec, batch_specs
from lakeloader.order.plan import steps_in_epoch
from lakeloader.pipeline.background import ThreadBuilder
from lakeloader.pipeline.builders import WorkerBuilder
from lakeloader.pipeline.cleanup import close_safely
from lakeloader.pipeline.collate import pin
from lakeloader.pipeline.recipe import READY, finish_payload
from lakeloader.pipeline.stores import Stores
from lakeloader.state.tracker import Delivery, ReaderStateTracker
from lakeloader.units import human_bytes
from lakeloader.workers.pool import WorkerPool

#: Steps planned ahead of delivery at most (the byte budget usually stops it earlier).
LOOKAHEAD_STEPS: Final = 256
#: Steps planned by one call (planning is vectorised across steps; see batches.batch_specs).
PLAN_CHUNK: Final = 64


class PassPart(Protocol):
    """What builds a pass's batches or tokens beside its stores (stopped before them)."""

    def close(self, wait: bool) -> None:
        """Stop (waiting for work under way when ``wait``)."""


def close_pass(part: PassPart | None, stores: Stores, wait: bool = False) -> None:
    """Stop a pass's builders or threads, then close its stores and delete its files."""
    if part is not None:
        part.close(wait)
    stores.close(wait)


class PassIterator:
    """A pass's skeleton: plan steps ahead within a byte budget, deliver them in order, close.

    A kind of pass gives :meth:`_plan_more` (or its own :meth:`_plan_ahead`) and
    :meth:`_deliver`, and may change :attr:`lookahead` and what :meth:`cache_bytes` counts;
    ``part`` (its builders or threads) and ``stores`` are closed with it, or when it is
    collected unclosed.
    """

    #: Steps planned ahead at most (see LOOKAHEAD_STEPS).
    lookahead: int = LOOKAHEAD_STEPS

    def __init__(
        self, num_steps: int | None, budget: int, part: PassPart | None, stores: Stores
    ) -> None:
        #: Batches this pass delivers in all, from where it starts (None: endless, a packed
        #: stream's: it plans its own way, and its ``_deliver`` ends it).
        self.num_steps = num_steps
        self._budget, self._part, self._stores = budget, part, stores
        self._next_plan = self._next_deliver = 0
        self._closed = False
        # closes the pass when collected unclosed (a ``break``): neither part nor stores may
        # hold the iterator, which would then never be collected
        self._finalizer = weakref.finalize(self, close_safely, close_pass, part, stores)

    def _plan_ahead(self) -> None:
        """Plan steps while the lookahead and the budget allow (the next step always)."""
        assert self.num_steps is not None
        while (
            self._next_plan < self.num_steps
            and self._next_plan < self._next_deliver + self.lookahead
            and (self._next_plan == self._next_deliver or self.cache_bytes() < self._budget)
        ):
            if not self._plan_more():
                return

    def _plan_more(self) -> bool:
        """Plan one step or more; False: none can be now."""
        raise NotImplementedError

    def _deliver(self) -> Any:
        """The next step's batch, the position moved past it."""
        raise NotImplementedError

    def __iter__(self) -> PassIterator:
        return self

    def __next__(self) -> Any:
        end = sys.maxsize if self.num_steps is None else self.num_steps
        if self._closed or self._next_deliver >= end:
            self.close()
            raise StopIteration
        self._plan_ahead()
        return self._deliver()

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._stores.held_bytes()

    def cache_peak_bytes(self) -> int:
        """Most bytes held at once by a store open."""
        return self._stores.peak_bytes()

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Stop decoding and building, drop the cached units (idempotent).

        Args:
            wait: Wait for the pass's threads.
            ended_by: What ended the pass before its end (``"a newer iter(loader)"``), which
                an epoch's pass names in a later ``next()``'s error; None for its own end.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        close_pass(self._part, self._stores, wait)


class EpochIterator(PassIterator):
    """Iterator over one rank's batches of one epoch.

    Args:
        stores: The pass's stores, of one leaf: the lake.
        tracker: Where the pass starts (its epoch, its position G); told of each batch as it
            is handed over.
        pool: The workers, or None (everything in this process).
        on_finish: Called once when the pass ends (or is closed).
        owner: Kept alive as long as the iterator (the loader, as torch's iterators do).
    """

    num_steps: int

    def __init__(
        self,
        stores: Stores,
        tracker: ReaderStateTracker,
        pool: WorkerPool | None,
        on_finish: Callable[[], None],
        owner: object = None,
    ) -> None:
        self._space = space = stores.get(0, tracker.epoch)
        self.spec = spec = dataclasses.replace(space.spec, start=tracker.position)
        self._owner = owner
        self._tracker = tracker
        self._on_finish = on_finish
        topo = spec.topology
        num_steps = steps_in_epoch(
            spec.start, spec.plan.num_rows, topo.global_batch, spec.options.drop_last
        )
        self._local = space.builder
        self._planned: deque[BatchSpec] = deque()
        #: The chunk of steps after ``_planned`` (its first step), planned in the build thread.
        self._chunk: tuple[int, Future[list[BatchSpec]]] | None = None
        self._specs: dict[int, BatchSpec] = {}
        self._workers: WorkerBuilder | ThreadBuilder | None = None
        if pool is not None and stores.workers is None:
            self._workers = WorkerBuilder(
                spec, space, self._local, pool, stores.generation, self._specs.get
            )
        elif not spec.recipe.rows_path:  # this process assembles batches: a thread, ahead
            self._workers = ThreadBuilder(spec, self._local, self._specs.get)
        self._thread = self._workers if isinstance(self._workers, ThreadBuilder) else None
        self._ended_by: str | None = None
        self._budget_warned = False
        super().__init__(num_steps, spec.options.cache_bytes, self._workers, stores)

    def _plan_ahead(self) -> None:
        if self._stores.workers is not None:  # notice dead decoding workers now
            self._stores.workers.dispatcher.reap()
        super()._plan_ahead()

    def _plan_more(self) -> bool:
        """Plan the next step and request its units."""
        if not self._planned:  # the chunk the build thread planned, or one planned now
            ahead, self._chunk = self._chunk, None
            if ahead is not None and ahead[0] == self._next_plan:
                self._planned.extend(ahead[1].result())
            else:
                self._planned.extend(self._plan_chunk(self._next_plan))
        step = self._planned.popleft()
        self._space.store.request(step.positions)
        self._specs[step.step] = step
        self._next_plan += 1
        return True

    def _plan_chunk(self, first: int) -> list[BatchSpec]:
        spec, topo = self.spec, self.spec.topology
        return batch_specs(
            spec.plan,
            first_step=first,
            num_steps=min(PLAN_CHUNK, self.num_steps - first),
            start=spec.start,
            global_batch=topo.global_batch,
            world_size=topo.world_size,
            rank=topo.rank,
        )

    def __next__(self) -> Any:
        if self._thread is not None:
            self._thread.asked()
        if self._ended_by is not None:
            raise RuntimeError(
                f"this iterator over epoch {self.spec.plan.epoch} was ended by "
                f"{self._ended_by}: iterate the newest iter(loader), which continues from the "
                "last batch delivered"
            )
        return super().__next__()

    def _deliver(self) -> Any:
        thread, index = self._thread, self._next_deliver
        step = self._specs[index]
        payload = (self._workers or self._local).build(step)
        batch = finish_payload(payload, self.spec.recipe)
        if self.spec.options.pin_memory and payload[0] != READY:
            batch = pin(batch)
        store = self._space.store
        if store.nbytes > self.spec.options.cache_bytes and self._next_plan == index + 1:
            self._warn_budget(step)
        del self._specs[index]
        skipped, rows = self._local.skipped.pop(index)
        self._next_deliver += 1
        last = self._next_deliver == self.num_steps
        delivery = Delivery(step.slot_stop, step.num_rows - rows, last, skipped, rows)
        self._tracker.delivered(delivery, self.spec.plan.num_rows)
        store.release(step.slot_stop)
        if thread is not None:  # steps planned: LOOKAHEAD_STEPS ahead
            thread.top_up(self._next_deliver, batch)
            # the build thread plans the next chunk once half the planned steps are requested
            first, half = (
                self._next_plan + len(self._planned),
                len(self._planned) <= PLAN_CHUNK // 2,
            )
            if self._chunk is None and first < self.num_steps and half:
                future = thread.run_ahead(functools.partial(self._plan_chunk, first))
                if future is not None:
                    self._chunk = (first, future)
        return batch

    def _warn_budget(self, step: BatchSpec) -> None:
        """Say once that the step being delivered alone holds more than the budget."""
        if self._budget_warned:
            return
        self._budget_warned = True
        held, budget = self._space.store.nbytes, self.spec.options.cache_bytes
        most = int(self.spec.plan.piece_rows(step.positions).max())
        warn_user(
            f"this step's {len(step.positions)} decoded pieces (up to {most:,} rows each) hold "
            f"{human_bytes(held)}, more than cache_bytes={human_bytes(budget)}: a step draws "
            "from about C pieces, each decoded whole, so the loader holds them whatever the "
            f"budget, and decodes nothing ahead. Give it cache_bytes of at least "
            f"{human_bytes(2 * held)}, or build the dataset with a smaller max_unit_rows (this "
            "changes the order; row groups larger than it then cost more decoding)",
            CacheBudgetWarning,
        )

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._space.store.nbytes

    def cache_peak_bytes(self) -> int:
        """Most bytes of decoded units held at once in this pass."""
        return self._space.store.peak_bytes

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Close the pass (see ``PassIterator.close``); a later ``next()`` names ``ended_by``."""
        if ended_by is not None and not self._closed and self._next_deliver < self.num_steps:
            self._ended_by = ended_by
        if not self._closed:
            super().close(wait)
            self._on_finish()
