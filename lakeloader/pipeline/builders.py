"""Building a step's batch: in the loader's process, or in the workers for a transform.

A builder returns the payload that :func:`~lakeloader.pipeline.recipe.finish_payload` turns
into the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, Final, Protocol

import numpy as np
import pyarrow as pa

from lakeloader.cache.arena import Arena
from lakeloader.cache.decode import Held, UnitRef
from lakeloader.cache.packed import Packed, gather_packed
from lakeloader.cache.screening import Screened, screen
from lakeloader.cache.store import UnitOpener, UnitStore
from lakeloader.cache.views import views_array
from lakeloader.order.batches import BatchSpec, share_slots
from lakeloader.pipeline.collate import empty_like, gather_columns, python_values
from lakeloader.pipeline.recipe import COLLATED, Payload, build_payload
from lakeloader.pipeline.rows import gather_rows
from lakeloader.pipeline.workspace import PassSpec
from lakeloader.randomness import slot_seeds
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.workers.dispatch import BUILD, Dispatcher
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import Task
from lakeloader.workers.shipping import Shipped, receive

#: Seconds between checks for steps to hand out while waiting for a batch from the workers.
TOP_UP_SECONDS: Final = 0.05

_NO_SEEDS: Final = np.zeros(0, dtype=np.uint64)
#: Quarantined units of a screened step, and the rows of this rank they cost.
Skipped = tuple[tuple[QuarantineEntry, ...], int]


class Space(Protocol):
    """Where a pass's units are: a :class:`~lakeloader.pipeline.stores.Store`."""

    dir: str
    store: UnitStore
    arena: Arena | None


def arena_rows(arena: Arena | None) -> np.ndarray | None:
    """An arena's rows now (it may have grown since the last call), or None."""
    return arena.records if arena is not None else None


class LocalBuilder:
    """Builds batches of the pass ``spec`` from its store ``space``, in the loader's process."""

    def __init__(self, spec: PassSpec, space: Space, schema: pa.Schema) -> None:
        self._spec = spec
        self._space = space
        self._schema = schema
        self._opener = UnitOpener()
        #: What the steps built for a lake's pass lost (by step), until their delivery pops it.
        self.skipped: dict[int, Skipped] = {}
        #: Batches run the user's code (an empty share is then cut from a sample batch).
        self.user_code = spec.recipe.user_code
        self._empty: Payload | None = None
        self._sample: Payload | None = None  # a batch of this pass, until _empty is made

    def seeds(self, step: BatchSpec, screened: Screened) -> np.ndarray:
        """Each row's seed (:mod:`lakeloader.randomness`), in batch order."""
        plan, topo = self._spec.plan, self._spec.topology
        slots = share_slots(step, plan.num_partitions, topo.world_size, topo.rank)
        if screened.kept is not None:
            slots = slots[screened.kept]
        return slot_seeds(plan.seed, plan.epoch, slots)

    def screened(
        self,
        step: BatchSpec,
        deadline: float | None = None,
        views: bool = True,
        whole: bool = False,
    ) -> Screened:
        """The step's units without quarantined ones, its rows renumbered to match.

        Waits for the units until ``deadline`` (``time.monotonic()``; None: the loader's
        ``timeout`` from now). ``views``: whether string columns may come from their views in
        the arena (only this process holds the buffers they point into); ``whole``: see
        :func:`~lakeloader.cache.screening.screen`.

        Raises:
            RuntimeError: If the units are not decoded within the loader's ``timeout``.
        """
        spec = self._spec
        timeout = spec.options.wait_timeout
        if deadline is not None and timeout is not None:
            timeout = max(0.0, deadline - time.monotonic())
        try:
            held: list[Held] = self._space.store.get(step.positions, timeout)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            raise timed_out(spec, step.step) from None
        layout = spec.layout if self._space.arena is not None else None
        return screen(step, held, spec.plan, layout, len(self._schema), views, whole)

    def build(self, step: BatchSpec) -> Payload:
        """Build a step's payload here."""
        spec, screened = self._spec, self.screened(step)
        self.skipped[step.step] = (screened.skipped, screened.lost)
        if self.user_code and step.num_rows == screened.lost:
            return self.empty()
        records = arena_rows(self._space.arena)
        ready: dict[str, Any] = {}
        if screened.rows is not None and records is not None and spec.layout is not None:
            fields = screened.names + screened.views
            ready.update(gather_packed(records, screened.rows, spec.layout, fields))
            self.resolve_views(ready, screened.views)
        units = self._opener.open(screened.refs, records) if screened.refs else []
        seeds = self.seeds(step, screened) if self.user_code else _NO_SEEDS
        payload = build_payload(units, screened.take, self._schema, spec.recipe, ready, seeds)
        return self.seen(payload)

    def resolve_views(self, ready: dict[str, Any], names: tuple[str, ...]) -> None:
        """Turn the gathered view columns ``names`` of ``ready`` into Python values."""
        buffers = self._space.store.view_buffers
        for name in names:
            typ = self._schema.field(name).type
            ready[name] = python_values(views_array(ready[name], typ, buffers))

    def units(self, screened: Screened) -> list[Packed]:
        """The step's decoded units (not quarantined), opened."""
        records = arena_rows(self._space.arena)
        return self._opener.open(screened.refs, records) if screened.refs else []

    def rows(self, screened: Screened) -> list[Any]:
        """The step's rows as dicts, in its order."""
        return gather_rows(self.units(screened), screened.take, self._schema)

    def arrow_columns(self, screened: Screened, skip: tuple[str, ...]) -> dict[str, Any]:
        """The step's columns but ``skip`` (gathered elsewhere), through the Arrow path."""
        ready = dict.fromkeys(skip, np.zeros(0))  # never read: these columns are dropped below
        columns = gather_columns(self.units(screened), screened.take, self._schema, ready)
        return {name: value for name, value in columns.items() if name not in skip}

    def seen(self, payload: Payload) -> Payload:
        """Remember a built batch: an empty share is cut from it (see :meth:`empty`)."""
        if self.user_code and self._empty is None:
            self._sample = payload
        return payload

    def empty(self) -> Payload:
        """The payload of an empty share with the user's code: the others' structure, no row.

        A batch built in this pass cut to no row (:func:`empty_like`); before any, the first
        row of the epoch that is not quarantined built and cut; with every piece quarantined,
        ``[]``.
        """
        if self._empty is None and self._sample is not None:
            self._empty, self._sample = (COLLATED, empty_like(self._sample[1])), None
        if self._empty is None:
            self._empty = COLLATED, []
            store, timeout = self._space.store, self._spec.options.wait_timeout
            for piece in range(self._spec.plan.num_pieces):
                (held,) = store.get(np.array([piece]), timeout)
                if isinstance(held, UnitRef):
                    units = self._opener.open([held], arena_rows(self._space.arena))
                    one, seeds = np.zeros(1, np.int64), np.zeros(1, np.uint64)
                    _, batch = build_payload(units, one, self._schema, self._spec.recipe, {}, seeds)
                    self._empty = COLLATED, empty_like(batch)
                    break
        return self._empty


class WorkerBuilder:
    """Has the workers build the batches of ``space``, ``prefetch_factor`` steps per worker ahead.

    ``local`` screens the steps (in this process, so that quarantine is decided in one place);
    ``planned``: the step of a given index, once planned (None before).
    """

    def __init__(
        self,
        spec: PassSpec,
        space: Space,
        local: LocalBuilder,
        pool: WorkerPool,
        generation: int,
        planned: Callable[[int], BatchSpec | None],
    ) -> None:
        self._spec = spec
        self._space = space
        self._local = local
        self._planned = planned
        self._generation = generation
        self._ahead = spec.options.num_workers * spec.options.prefetch
        self._dispatcher = Dispatcher(pool, BUILD, 1, spec.options.prefetch_factor, self._describe)
        self._futures: dict[int, Future[Any]] = {}
        self._next = 0  # the next step to hand out

    def _describe(self, step: int) -> tuple[str, str]:
        spec = self._planned(step)
        units = self._space.store.describe(spec.positions) if spec is not None else []
        return f"step {step} of epoch {self._spec.plan.epoch}", "; ".join(units)

    def _top_up(self, delivering: int) -> None:
        """Hand out the next steps whose units are decoded, up to the cap ahead."""
        store = self._space.store
        while self._next < delivering + self._ahead:
            step = self._planned(self._next)
            if step is None or not store.ready(step.positions):
                return
            if store.failed(step.positions) and step.step != delivering:
                return  # its error is raised once every earlier batch has been delivered
            self._submit(step)

    def _submit(self, step: BatchSpec, deadline: float | None = None) -> None:
        local, space = self._local, self._space
        screened = local.screened(step, deadline, views=False)
        local.skipped[step.step] = (screened.skipped, screened.lost)
        if local.user_code and step.num_rows == screened.lost:  # empty: built here, once a pass
            done: Future[Any] = Future()
            done.set_result(local.empty())
            self._futures[step.step] = done
            self._next = max(self._next, step.step + 1)
            return
        generation, seeds = self._generation, local.seeds(step, screened)
        arena = space.arena

        def make() -> Task:  # the arena's handle as it is when the task is sent
            handle = arena.handle if arena is not None and screened.rows is not None else None
            return Task(
                generation,
                step.step,
                screened.refs,
                screened.take,
                seeds,
                space.dir,
                screened.rows,
                screened.names,
                handle,
            )

        self._futures[step.step] = self._dispatcher.submit(step.step, make)
        self._next = max(self._next, step.step + 1)

    def build(self, step: BatchSpec) -> Payload:
        """The payload of ``step``, built by its worker.

        Raises:
            RuntimeError: If it takes longer than the loader's ``timeout``.
        """
        timeout = self._spec.options.timeout
        deadline = time.monotonic() + timeout if timeout else None
        self._dispatcher.reap()
        self._top_up(step.step)
        if step.step not in self._futures:
            self._submit(step, deadline)  # waits for its units (and raises their error)
        future = self._futures.pop(step.step)
        while not future.done():
            # Wake when the batch is built, or when the next step's units are decoded.
            later = self._planned(self._next)
            waits = self._space.store.futures(later.positions) if later is not None else []
            wait_futures([future, *waits], TOP_UP_SECONDS, return_when=FIRST_COMPLETED)
            self._top_up(step.step)
            if deadline is not None and time.monotonic() > deadline and not future.done():
                raise timed_out(self._spec, step.step)
        kind, value = future.result()
        return self._local.seen((kind, receive(value) if isinstance(value, Shipped) else value))

    def close(self, wait: bool) -> None:
        """Stop handing out steps; cancel those queued."""
        self._dispatcher.close(wait)


def timed_out(spec: PassSpec, step: int) -> RuntimeError:
    """The error of a step that took longer than the loader's ``timeout``."""
    return RuntimeError(
        f"DataLoader timed out after {spec.options.timeout} seconds waiting for step {step} "
        f"of epoch {spec.plan.epoch}"
    )
