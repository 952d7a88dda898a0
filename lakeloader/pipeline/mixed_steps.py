"""Building a mixture's batches from their parts: in the loader's process, or in the workers.

A step (:class:`MixedStep`) is parts, each a slot range of one source epoch's order read from
that epoch's :class:`~lakeloader.pipeline.stores.Store`: one gather of arena rows where every
column is packed and no user code runs; else each part is screened by its store, the columns
every part has in the arena gathered at once, and the parts' units built as one batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from lakeloader.cache.decode import UnitRef
from lakeloader.cache.packed import gather_packed
from lakeloader.cache.screening import Screened
from lakeloader.cache.store import UnitOpener
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.order.batches import BatchSpec, range_specs
from lakeloader.order.mixture import MixCursor
from lakeloader.pipeline.builders import arena_rows, timed_out
from lakeloader.pipeline.recipe import (
    COLUMNS,
    BatchRecipe,
    Sources,
    build_payload,
    finish_payload,
)
from lakeloader.pipeline.stores import Store, Stores
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.workers.dispatch import BUILD, Dispatcher
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import Task
from lakeloader.workers.shipping import built


class Part(NamedTuple):
    """A planned part of a step: ``[start, stop)`` of the order of epoch ``pair`` (source, epoch).

    ``positions``: the pieces it reads; ``dest``: where each of its rows (partition-major in
    its range) goes in the share; ``spec``: its range as a step of its source epoch, for the
    builder to screen and gather (None where every column is packed: a step is then one gather
    of arena rows).
    """

    pair: tuple[int, int]
    start: int
    stop: int
    positions: np.ndarray
    dest: np.ndarray
    spec: BatchSpec | None


class _Mixed(NamedTuple):
    """A step's parts laid end to end, as one batch is built from them.

    ``ready`` holds the columns every part has in the arena (gathered, in batch order); ``take``
    indexes the concatenation of ``refs`` (part after part) in batch order, for the others;
    ``extra`` is the source of each row (as a column) and the sources' row transforms;
    ``skipped``, the units found quarantined, held ``lost`` rows of this rank.
    """

    refs: list[UnitRef]
    take: np.ndarray
    seeds: np.ndarray
    extra: tuple[dict[str, np.ndarray], Sources]
    skipped: tuple[QuarantineEntry, ...]
    lost: int
    ready: dict[str, Any]


class MixedStep(NamedTuple):
    """A planned step of the rank: each row's source, and the mixture's cursor after it.

    ``rows``: the arena row of each row, when every column of every piece is packed into the
    arena (else None).
    """

    sources: np.ndarray
    parts: tuple[Part, ...]
    cursor: MixCursor
    rows: np.ndarray | None


class MixedBuilder:
    """Builds a mixture's batches from its sources' stores, with the workers of ``pool`` if any.

    ``recipe`` makes the mixed rows a batch; each source's ``transform`` is its store's.
    """

    def __init__(
        self,
        mixture: Mixture,
        sources: Stores,
        recipe: BatchRecipe,
        options: LoaderOptions,
        pool: WorkerPool | None,
    ) -> None:
        self._mixture, self._sources = mixture, sources
        self._recipe, self._options = recipe, options
        self._schema = sources.schema
        self._layout, self._arena = sources.layout, sources.arena
        packed = self._layout is not None and len(self._layout.names) == len(self._schema)
        #: Every column packed into the arena and no user code: a step is one gather.
        self.fast = self._arena is not None and packed and not recipe.user_code
        self._opener = UnitOpener()
        self._builds: Dispatcher | None = None
        #: Steps handed to the workers (by index in the pass): the build, what it skipped.
        self._sent: dict[int, tuple[Future[Any], tuple[QuarantineEntry, ...], int]] = {}
        #: Those steps as planned (their units named in the workers' errors).
        self._steps: dict[int, MixedStep] = {}
        self._ahead = 0
        if pool is not None:
            self._builds = Dispatcher(pool, BUILD, 1, options.prefetch_factor, self._describe)
            self._ahead = options.num_workers * options.prefetch

    def build(
        self, index: int, step: MixedStep, upcoming: Sequence[MixedStep]
    ) -> tuple[Any, tuple[QuarantineEntry, ...], int]:
        """Step ``index``'s batch, the units it found quarantined and the rows they held.

        ``upcoming``: the steps planned after it, which the workers may build ahead.
        """
        key, sources = self._mixture.source_key, step.sources.astype(np.int64)
        if step.rows is not None and self._arena is not None and self._layout is not None:
            timeout, full, held = self._options.wait_timeout, self._layout.names, []
            for part in step.parts:
                source_pass = self._sources.open[part.pair]
                try:
                    held += source_pass.store.get(part.positions, timeout)
                except FutureTimeout:
                    raise timed_out(source_pass.spec, index) from None
            if all(isinstance(h, UnitRef) and (h.packed is full or h.packed == full) for h in held):
                columns = gather_packed(self._arena.records, step.rows, self._layout, full)
                columns[key] = sources
                return finish_payload((COLUMNS, columns), self._recipe), (), 0
        if self._builds is not None:
            return self._built(index, step, upcoming)
        mixed = self._mixed(step, views=True)
        units = self._opener.open(mixed.refs, arena_rows(self._arena)) if mixed.refs else []
        args = (self._schema, self._recipe, mixed.ready, mixed.seeds, *mixed.extra)
        payload = build_payload(units, mixed.take, *args)
        return finish_payload(payload, self._recipe), mixed.skipped, mixed.lost

    def _mixed(self, step: MixedStep, views: bool, deadline: float | None = None) -> _Mixed:
        """The step's parts screened by their stores (without quarantined units), laid end to end.

        ``views``: whether string columns may come from their views in the arena.
        """
        screens: list[tuple[Store, Screened]] = []
        dests, part_seeds = [], []
        for part in step.parts:
            store = self._sources.open[part.pair]
            spec = part.spec
            if spec is None:  # planned as one gather, but not every column came back packed
                bounds = np.array([part.start]), np.array([part.stop])
                (spec,) = range_specs(store.spec.plan, np.zeros(1, np.int64), *bounds)
            screened = store.builder.screened(spec, deadline, views, whole=True)
            screens.append((store, screened))
            dests.append(part.dest if screened.kept is None else part.dest[screened.kept])
            part_seeds.append(store.builder.seeds(spec, screened))
        kept = np.sort(np.concatenate(dests))
        places = [np.searchsorted(kept, dest) for dest in dests]
        seeds = np.empty(len(kept), dtype=np.uint64)
        for place, part_seed in zip(places, part_seeds, strict=True):
            seeds[place] = part_seed
        ready = self._ready(screens, places, len(kept))
        take = np.empty(len(kept), dtype=np.int64)
        of = np.empty(len(kept), dtype=np.int64)
        refs: list[UnitRef] = []
        for part, (_, screened), place in zip(step.parts, screens, places, strict=True):
            if len(ready) < len(self._schema):  # the Arrow path takes the other columns
                take[place] = screened.take + sum(r.num_rows for r in refs)
                refs += screened.refs
            of[place] = part.pair[0]
        transforms = tuple(leaf.recipe.transform for leaf in self._sources.leaves)
        extra = {self._mixture.source_key: step.sources.astype(np.int64)[kept]}
        skipped = tuple(q for _, screened in screens for q in screened.skipped)
        lost = sum(screened.lost for _, screened in screens)
        return _Mixed(refs, take, seeds, (extra, Sources(of, transforms)), skipped, lost, ready)

    def _built(
        self, index: int, step: MixedStep, upcoming: Sequence[MixedStep]
    ) -> tuple[Any, tuple[QuarantineEntry, ...], int]:
        """The step's batch, built by its worker (handed out ahead where its units are in)."""
        timeout = self._options.timeout
        deadline = time.monotonic() + timeout if timeout else None
        assert self._builds is not None
        self._builds.reap()
        self._top_up(index, upcoming)
        if index not in self._sent:
            self._submit(index, step, deadline)  # waits for its units (and raises their error)
        future, skipped, lost = self._sent.pop(index)
        payload = built(future, deadline, timeout, f"step {index} of pass {self._mixture!r}")
        del self._steps[index]  # named in its error until it is in
        return finish_payload(payload, self._recipe), skipped, lost

    def _top_up(self, under_way: int, upcoming: Sequence[MixedStep]) -> None:
        """Hand the steps after the one under way whose units are decoded to the workers."""
        for offset, step in enumerate(upcoming, start=1):
            index = under_way + offset
            if offset > self._ahead:
                return
            if index in self._sent:
                continue
            held = [(self._sources.open[p.pair].store, p.positions) for p in step.parts]
            if not all(store.ready(positions) for store, positions in held):
                return
            if any(store.failed(positions) for store, positions in held):
                return  # its error is raised once every earlier batch has been delivered
            self._submit(index, step)

    def _submit(self, index: int, step: MixedStep, deadline: float | None = None) -> None:
        mixed = self._mixed(step, views=False, deadline=deadline)
        stores = self._sources
        extra, sources = mixed.extra

        def make() -> Task:
            return Task(
                stores.generation,
                index,
                mixed.refs,
                mixed.take,
                mixed.seeds,
                stores.dir,
                extra=extra,
                source_of=sources.of,
            )

        assert self._builds is not None
        self._steps[index] = step
        self._sent[index] = (self._builds.submit(index, make), mixed.skipped, mixed.lost)

    def _describe(self, index: int) -> tuple[str, str]:
        step, open_ = self._steps.get(index), self._sources.open
        parts = [(open_.get(p.pair), p) for p in (step.parts if step else ())]  # this thread's
        units = [u for store, p in parts if store for u in store.store.describe(p.positions)]
        return f"step {index} of a pass over {self._mixture!r}", "; ".join(units)

    def _ready(
        self, screens: list[tuple[Store, Screened]], dests: list[np.ndarray], size: int
    ) -> dict[str, Any]:
        """The columns every part has in the arena, in slot order: their rows gathered at once."""
        layout = self._layout
        if self._arena is None or layout is None or any(s.rows is None for _, s in screens):
            return {}
        packed = _common([s.names for _, s in screens])
        views = _common([s.views for _, s in screens])
        rows = np.empty(size, dtype=np.int64)
        for (_, screened), dest in zip(screens, dests, strict=True):
            assert screened.rows is not None
            rows[dest] = screened.rows
        ready = gather_packed(self._arena.records, rows, layout, packed + views)
        if views:  # each source's views point into its own buffers
            resolved = []
            for (store, _), dest in zip(screens, dests, strict=True):
                part = {name: ready[name][dest] for name in views}
                store.builder.resolve_views(part, views)
                resolved.append(part)
            ready.update((n, _placed([r[n] for r in resolved], dests, size)) for n in views)
        return ready

    def close(self, wait: bool) -> None:
        """Stop handing steps to the workers; cancel those queued."""
        if self._builds is not None:
            self._builds.close(wait)


def _common(names: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The columns every part has (in the first part's order)."""
    if all(n is names[0] for n in names):
        return names[0]
    shared = set(names[0]).intersection(*names[1:])
    return tuple(n for n in names[0] if n in shared)


def _placed(parts: list[Any], dests: list[np.ndarray], size: int) -> Any:
    """One column of ``size`` rows: row ``r`` of part ``j`` goes to row ``dests[j][r]``.

    The parts' values are lists of Python values, or Arrow arrays where Python cannot hold
    them (see collate.python_values); ``dests`` together are a permutation of ``range(size)``.
    """
    if isinstance(parts[0], list):
        rows: list[Any] = [None] * size
        for values, dest in zip(parts, dests, strict=True):
            for at, item in zip(dest.tolist(), values, strict=True):
                rows[at] = item
        return rows
    whole = pa.concat_arrays(
        [v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v for v in parts]
    )
    where = np.empty(size, dtype=np.int64)
    where[np.concatenate(dests)] = np.arange(size)
    return whole.take(pa.array(where))
