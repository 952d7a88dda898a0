"""One pass over a mixture for one rank: each source's rows read by a pass of its own.

Each global batch is drawn by the mixture's cursor (:mod:`lakeloader.order.mixture`); the
rank's share is cut into parts, one per source and epoch of that source
(:func:`~lakeloader.order.mixture.rank_parts`), and each part is a slot range of that epoch's
order, which a :class:`~lakeloader.pipeline.stores.Store` (a unit store and a builder over one
epoch of one source) reads and builds like a single lake's step. The parts'
columns are laid out in slot order (:mod:`lakeloader.pipeline.merge`) with the source of each
row, and only then made tensors. Steps are planned ahead in chunks, so that every source
decodes ahead in its plan order. A source's pass is closed once all ranks are past its epoch;
the others outlive a pass that ends at its last step, for the next one to go on with.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Final, NamedTuple

import numpy as np

from lakeloader.cache.decode import UnitRef
from lakeloader.cache.packed import gather_packed
from lakeloader.cache.screening import Screened
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.order.batches import BatchSpec, range_rows, range_specs
from lakeloader.order.mixture import MixCursor, MixWeights, draw_parts
from lakeloader.order.plan import EpochPlan, batch_runs, expand_runs
from lakeloader.pipeline.builders import timed_out
from lakeloader.pipeline.merge import merge_columns
from lakeloader.pipeline.recipe import (
    COLUMNS,
    BatchRecipe,
    Payload,
    columns_payload,
    finish_payload,
    rows_payload,
)
from lakeloader.pipeline.rows import transform_rows
from lakeloader.pipeline.stores import Store, Stores
from lakeloader.randomness import batch_seed, seed_globals
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology

#: Steps planned ahead of delivery at most (the byte budget usually stops it earlier).
LOOKAHEAD_STEPS: Final = 512
#: Steps planned by one call.
PLAN_CHUNK: Final = 256


class _Part(NamedTuple):
    """A planned part of a step: one source epoch's positions ``[start, stop)``.

    (Tuples, not frozen dataclasses: thousands are made per pass.)

    Attributes:
        pair: (source, epoch).
        start: First position in that epoch's order.
        stop: One past the last.
        positions: The pieces it reads.
        dest: Where each of its rows (partition-major in its range) goes in the share.
        spec: Its range as a step of its source epoch, for the builder to screen and gather
            (None where every column is packed: a step is then one gather of arena rows).
    """

    pair: tuple[int, int]
    start: int
    stop: int
    positions: np.ndarray
    dest: np.ndarray
    spec: BatchSpec | None


class _Step(NamedTuple):
    """A planned step of the rank.

    Attributes:
        sources: The source of each row.
        parts: Its parts.
        cursor: The mixture's cursor after it.
        rows: The arena row of each row, when every column of every piece is packed into the
            arena (else None).
    """

    sources: np.ndarray
    parts: tuple[_Part, ...]
    cursor: MixCursor
    rows: np.ndarray | None


class MixtureIterator:
    """Iterator over one rank's batches of one pass over a mixture (see the module docstring).

    Args:
        mixture: The mixture.
        weights: The weights in force.
        cursor: Where the mixture stands (delivered).
        num_steps: Steps in this pass.
        topology: The loader's topology.
        options: The loader's options.
        sources: The sources' stores: new, or left by a pass that ended at ``cursor``.
        recipe: How the mixed rows become a batch (the loader's ``collate_fn``, the mixture's
            ``batch_transform``); each source's ``transform`` is its store's.
        delivered: Told the cursor after each batch handed over, with the units it found
            quarantined and the rows of this rank they held.
        ended: Told the sources' passes when this pass ended at its last step (they can go on);
            a pass ended otherwise closes them.
    """

    def __init__(
        self,
        mixture: Mixture,
        weights: MixWeights,
        cursor: MixCursor,
        num_steps: int,
        topology: Topology,
        options: LoaderOptions,
        sources: Stores,
        recipe: BatchRecipe,
        delivered: Callable[[MixCursor, tuple[QuarantineEntry, ...], int], None],
        ended: Callable[[Stores], None],
    ) -> None:
        self._mixture, self._weights, self._topology = mixture, weights, topology
        self._options, self._sources = options, sources
        self._delivered, self._ended = delivered, ended
        self._rows = mixture.rows()
        self._recipe = recipe
        #: Rows go one by one through a source's transform or the collate_fn.
        self._rows_path = recipe.rows_path or any(leaf.recipe.transform for leaf in sources.leaves)
        self.num_steps = num_steps
        self._planned_cursor = cursor
        self._planned: deque[_Step] = deque()
        self._next_plan = self._next_deliver = 0
        self._schema = sources.schema
        sources.at = None  # under way
        self._layout, self._arena = sources.layout, sources.arena
        #: Every column packed into the arena and no user code: a step is one gather of rows
        #: planned ahead.
        packed = self._layout is not None and len(self._layout.names) == len(self._schema)
        self._fast = self._arena is not None and packed and not recipe.user_code
        self._closed = False

    def _plan_ahead(self) -> None:
        while (
            self._next_plan < self.num_steps
            and self._next_plan < self._next_deliver + LOOKAHEAD_STEPS
            and (
                self._next_plan == self._next_deliver
                or self._sources.held_bytes() < self._options.cache_bytes
            )
        ):
            self._plan_chunk(min(PLAN_CHUNK, self.num_steps - self._next_plan))

    def _plan_chunk(self, count: int) -> None:
        """Plan ``count`` steps: draw them, cut the rank's shares, ask each source for its parts.

        Where every column is packed, each row's arena row is worked out here, for all the
        steps at once, so that a step is then one gather.
        """
        topo, size, names = self._topology, self._topology.global_batch, self._mixture.names
        before = self._planned_cursor
        table, after, totals = draw_parts(
            before,
            self._weights,
            self._mixture.seed,
            count,
            size,
            self._rows,
            topo.world_size,
            topo.rank,
        )
        width = table.shares.shape[1]
        lengths = table.stop - table.start
        offsets = np.cumsum(lengths) - lengths  # of each part's rows in ``table.at``
        keys = table.source * (int(table.epoch.max()) + 1) + table.epoch
        rows = np.full((count, width), -1, dtype=np.int64) if self._fast else None
        made: dict[int, _Part] = {}
        for key in np.unique(keys).tolist():
            idx = np.flatnonzero(keys == key)  # this source epoch's parts, in step order
            pair = (int(table.source[idx[0]]), int(table.epoch[idx[0]]))
            source_pass = self._sources.get(*pair)
            plan, store = source_pass.spec.plan, source_pass.store
            starts, stops = table.start[idx], table.stop[idx]
            specs: list[BatchSpec] | list[None]
            if rows is None:  # specs of all the parts at once: the builder screens each
                specs = range_specs(plan, np.zeros(len(idx), dtype=np.int64), starts, stops)
                per_part = np.fromiter((len(s.positions) for s in specs), np.int64, len(specs))
                positions = np.concatenate([s.positions for s in specs])
            else:
                positions, per_part, piece, row = range_rows(plan, starts, stops)
                specs = [None] * len(idx)
            _, first = np.unique(positions, return_index=True)  # each piece once, in step order
            store.request(positions[np.sort(first)])
            at = table.at[expand_runs(offsets[idx], lengths[idx], 1)]
            where = _dests(at, starts, stops, plan.num_partitions)
            if rows is not None:
                arena = store.arena_starts(positions)[piece] + row
                rows.reshape(-1)[np.repeat(table.step[idx], lengths[idx]) * width + where] = arena
            ends, cuts = np.cumsum(per_part).tolist(), np.cumsum(lengths[idx]).tolist()
            p0 = r0 = 0
            columns = zip(
                idx.tolist(), starts.tolist(), stops.tolist(), ends, cuts, specs, strict=True
            )
            for i, start, stop, p1, r1, spec in columns:
                made[i] = _Part(pair, start, stop, positions[p0:p1], where[r0:r1], spec)
                p0, r0 = p1, r1
        bounds = np.searchsorted(table.step, np.arange(count + 1)).tolist()
        whole: list[bool] = [False] * count
        if rows is not None:
            complete: np.ndarray = np.all(rows >= 0, axis=1)
            whole = [bool(w) for w in complete.tolist()]
        ordered = [made[i] for i in range(len(made))]
        for k, (sources, after_step) in enumerate(zip(table.shares, totals.tolist(), strict=True)):
            counts = {**before.counts, **dict(zip(names, after_step, strict=True))}
            cursor = MixCursor(before.slot + (k + 1) * size, counts)
            packed = rows[k] if rows is not None and whole[k] else None
            parts = tuple(ordered[bounds[k] : bounds[k + 1]])
            self._planned.append(_Step(sources, parts, cursor, packed))
        self._planned_cursor = after
        self._next_plan += count

    def __iter__(self) -> MixtureIterator:
        return self

    def __next__(self) -> Any:
        if self._closed or self._next_deliver >= self.num_steps:
            self.close()
            raise StopIteration
        self._plan_ahead()
        step = self._planned.popleft()
        batch, skipped, lost = self._build(step)
        self._next_deliver += 1
        self._delivered(step.cursor, skipped, lost)
        self._release(step.cursor)
        if self._next_deliver >= self.num_steps:  # the sources go on: the next pass may take them
            self._closed = True
            self._sources.at = step.cursor
            self._ended(self._sources)
        return batch

    def _release(self, cursor: MixCursor) -> None:
        """Evict what ``cursor`` is past in every source epoch open; close those it is done with."""
        names, rows = self._mixture.names, self._rows
        for source, epoch in list(self._sources.open):
            count = cursor.counts.get(names[source], 0)
            consumed = min(max(count - epoch * rows[source], 0), rows[source])
            self._sources.release(source, epoch, consumed)

    def _build(self, step: _Step) -> tuple[Any, tuple[QuarantineEntry, ...], int]:
        """The step's batch, the units it found quarantined and the rows they held."""
        key, sources = self._mixture.source_key, step.sources.astype(np.int64)
        if step.rows is not None and self._arena is not None and self._layout is not None:
            timeout, full, held = self._options.timeout or None, self._layout.names, []
            for part in step.parts:
                source_pass = self._sources.open[part.pair]
                try:
                    held += source_pass.store.get(part.positions, timeout)
                except FutureTimeout:
                    raise timed_out(source_pass.spec, self._next_deliver) from None
            if all(isinstance(h, UnitRef) and (h.packed is full or h.packed == full) for h in held):
                columns = gather_packed(self._arena.records, step.rows, self._layout, full)
                columns[key] = sources
                return finish_payload((COLUMNS, columns), self._recipe), (), 0
        screens = [self._screen(part) for part in step.parts]
        kept = np.sort(np.concatenate([dest for _, _, _, dest in screens]))
        places = [np.searchsorted(kept, dest) for _, _, _, dest in screens]
        seeds = np.empty(len(kept), dtype=np.uint64)
        for (store, spec, screened, _), place in zip(screens, places, strict=True):
            seeds[place] = store.builder.seeds(spec, screened)
        skipped = tuple(q for _, _, screened, _ in screens for q in screened.skipped)
        lost = sum(screened.lost for _, _, screened, _ in screens)
        payload: Payload
        if self._rows_path:
            rows: list[Any] = [None] * len(kept)
            seed_globals(batch_seed(seeds))
            parts = zip(step.parts, screens, places, strict=True)
            for part, (store, _, screened, _), place in parts:
                mine = store.builder.rows(screened)
                for row in mine:
                    row[key] = part.pair[0]
                transform = store.spec.recipe.transform
                if transform is not None:
                    mine = transform_rows(mine, transform, seeds[place])
                for at, row in zip(place.tolist(), mine, strict=True):
                    rows[at] = row
            payload = rows_payload(rows, self._recipe, seeds)
        else:
            columns = self._columns(screens, places, len(kept))
            columns[key] = sources[kept]
            payload = columns_payload(columns, self._recipe, seeds)
        return finish_payload(payload, self._recipe), skipped, lost

    def _screen(self, part: _Part) -> tuple[Store, BatchSpec, Screened, np.ndarray]:
        """A part's units without the quarantined ones, and where its rows left go."""
        store = self._sources.open[part.pair]
        spec = part.spec or _spec_of(store.spec.plan, part)
        screened = store.builder.screened(spec)
        dest = part.dest if screened.kept is None else part.dest[screened.kept]
        return store, spec, screened, dest

    def _columns(
        self,
        screens: list[tuple[Store, BatchSpec, Screened, np.ndarray]],
        dests: list[np.ndarray],
        size: int,
    ) -> dict[str, Any]:
        """The parts' columns in slot order: packed rows gathered at once, others by part."""
        columns: dict[str, Any] = {}
        done: tuple[str, ...] = ()
        layout = self._layout
        if (
            self._arena is not None
            and layout is not None
            and all(s.rows is not None for _, _, s, _ in screens)
        ):
            packed = _common([s.names for _, _, s, _ in screens])
            views = _common([s.views for _, _, s, _ in screens])
            rows = np.empty(size, dtype=np.int64)
            for (_, _, screened, _), dest in zip(screens, dests, strict=True):
                assert screened.rows is not None
                rows[dest] = screened.rows
            gathered = gather_packed(self._arena.records, rows, layout, packed + views)
            columns.update((name, gathered[name]) for name in packed)
            if views:  # each source's views point into its own buffers
                resolved = []
                for (store, _, _, _), dest in zip(screens, dests, strict=True):
                    ready = {name: gathered[name][dest] for name in views}
                    store.builder.resolve_views(ready, views)
                    resolved.append(ready)
                columns.update(merge_columns(resolved, dests, size))
            done = packed + views
        if len(done) < len(self._schema):
            parts = [store.builder.arrow_columns(s, done) for store, _, s, _ in screens]
            columns.update(merge_columns(parts, dests, size))
        return {name: columns[name] for name in self._schema.names}

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._sources.held_bytes()

    def cache_peak_bytes(self) -> int:
        """Most bytes held at once by a source's pass open."""
        return self._sources.peak_bytes()

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Stop decoding; drop every source's units (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sources.close(wait)


def _dests(
    at: np.ndarray, starts: np.ndarray, stops: np.ndarray, num_partitions: int
) -> np.ndarray:
    """Where each row of each part (partition-major in its range) goes in its share.

    ``at`` holds, part after part, where each position of the part's range goes; so does the
    result, for the rows in the order a part's build gives them.
    """
    first, counts = batch_runs(starts, stops, num_partitions)
    slots = expand_runs(first.ravel(), counts.ravel(), num_partitions)
    lengths = stops - starts
    base = np.cumsum(lengths) - lengths
    where: np.ndarray = at[slots - np.repeat(starts - base, lengths)]
    return where


def _spec_of(plan: EpochPlan, part: _Part) -> BatchSpec:
    """A part's range as a step of its source epoch.

    For a step planned as one gather whose units came back without every column packed.
    """
    bounds = np.array([part.start]), np.array([part.stop])
    (spec,) = range_specs(plan, np.zeros(1, np.int64), *bounds)
    return spec


def _common(names: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The columns every part has (in the first part's order)."""
    if all(n is names[0] for n in names):
        return names[0]
    shared = set(names[0]).intersection(*names[1:])
    return tuple(n for n in names[0] if n in shared)
