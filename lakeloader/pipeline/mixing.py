"""One pass over a mixture for one rank: each source's rows read by a pass of its own.

Each global batch is drawn by the mixture's cursor; the rank's share is cut into parts, one
per source epoch (:func:`~lakeloader.order.mixture.draw_parts`), each read by that epoch's
:class:`~lakeloader.pipeline.stores.Store`, and :mod:`lakeloader.pipeline.mixed_steps` builds
the batch from them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from lakeloader.lake.following import CaughtUpError
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.order.batches import BatchSpec, range_rows, range_specs
from lakeloader.order.mixture import (
    MixCursor,
    Spans,
    draw_parts,
    epoch_first,
    slot_sources,
)
from lakeloader.order.plan import batch_runs, expand_runs
from lakeloader.pipeline.iterator import PassIterator
from lakeloader.pipeline.mixed_steps import MixedBuilder, MixedStep, Part
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.stores import Stores
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool

if TYPE_CHECKING:
    from lakeloader.nodes.streams import SourceStream


logger = logging.getLogger(__name__)

#: Steps planned by one call.
PLAN_CHUNK: Final = 256


class MixtureIterator(PassIterator):
    """Iterator over one rank's batches of one pass over a mixture.

    Args:
        mixture: The mixture (its weights in force).
        cursor: Where the mixture stands (delivered).
        sources: The sources' stores: new, or left by a pass that ended at ``cursor``.
        pool: The DataLoader's workers when they build the batches, or None.
        recipe: How the mixed rows become a batch; each source's ``transform`` is its store's.
        delivered: Told the cursor after each batch handed over, with the units it found
            quarantined and the rows of this rank they held.
        ended: Told the sources' passes when this pass ended at its last step (they can go on);
            a pass ended otherwise closes them.
        streams: Each source's stream (in the order of the names): where its epochs start,
            covering the draws to come (a followed source waits for its lake only for the step
            delivered next; when it gives no more rows, the pass ends after the steps planned).
    """

    num_steps: int

    lookahead = 512

    def __init__(
        self,
        mixture: Mixture,
        cursor: MixCursor,
        num_steps: int,
        topology: Topology,
        options: LoaderOptions,
        sources: Stores,
        pool: WorkerPool | None,
        recipe: BatchRecipe,
        delivered: Callable[[MixCursor, tuple[QuarantineEntry, ...], int], None],
        ended: Callable[[Stores], None],
        streams: Sequence[SourceStream],
    ) -> None:
        self._mixture, self._topology = mixture, topology
        self._delivered, self._ended = delivered, ended
        self._streams = streams
        #: Whether a source waits for its lake's increments (steps are then planned one by one).
        self._follows = any(stream.follows for stream in streams)
        #: Whether a source's epochs are known one by one (its spans change as it goes on).
        self._varies = any(stream.varies for stream in streams)
        self._spans: list[Spans] = []
        self._caught_up = False
        self._planned_cursor = cursor
        self._planned: deque[MixedStep] = deque()
        sources.at = None  # under way
        self._builder = MixedBuilder(mixture, sources, recipe, options, pool)
        super().__init__(num_steps, options.cache_bytes, self._builder, sources)

    def _plan_more(self) -> bool:
        chunk = 1 if self._follows else PLAN_CHUNK  # wait for no more than a step
        try:  # False: the increments known end before (planned once they are needed)
            return self._plan_chunk(min(chunk, self.num_steps - self._next_plan))
        except CaughtUpError as caught:
            logger.info("a followed source of the mixture caught up with its lake: %s", caught)
            self._caught_up = True
            return False

    def _plan_chunk(self, count: int) -> bool:
        """Plan ``count`` steps: draw them, cut the rank's shares, ask each source for its parts.

        Returns False, planning nothing, when the sources' spans do not cover them yet.
        """
        topo, size, names = self._topology, self._topology.global_batch, self._mixture.names
        before = self._planned_cursor
        if self._varies or not self._spans:  # a lake's epochs: n rows each, always
            drawn = slot_sources(
                self._mixture.weights, self._mixture.seed, before.slot, count * size
            )
            ahead = np.bincount(drawn, minlength=len(names))
            last = [before.counts.get(n, 0) + int(ahead[i]) - 1 for i, n in enumerate(names)]
            pairs = list(zip(self._streams, last, strict=True))
            wait = self._next_plan == self._next_deliver  # the step delivered next needs them
            if not wait and not all(stream.covers(at) for stream, at in pairs):
                return False
            for stream, at in pairs:
                stream.cover(at)  # a followed source waits for its lake
            self._spans = [stream.spans() for stream in self._streams]
        table, after, totals = draw_parts(
            before,
            self._mixture.weights,
            self._mixture.seed,
            count,
            size,
            self._spans,
            topo.world_size,
            topo.rank,
        )
        width = table.shares.shape[1]
        lengths = table.stop - table.start
        keys = table.source * (int(table.epoch.max()) + 1) + table.epoch
        rows = np.full((count, width), -1, dtype=np.int64) if self._builder.fast else None
        made: dict[int, Part] = {}
        for key in np.unique(keys).tolist():
            idx = np.flatnonzero(keys == key)  # this source epoch's parts, in step order
            pair = (int(table.source[idx[0]]), int(table.epoch[idx[0]]))
            source_pass = self._stores.get(*pair)
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
            where = _dests(table.at, table.at_start[idx], starts, stops, plan.num_partitions)
            if rows is not None:
                arena = store.arena_starts(positions)[piece] + row
                rows.reshape(-1)[np.repeat(table.step[idx] * width, lengths[idx]) + where] = arena
            ends, cuts = np.cumsum(per_part).tolist(), np.cumsum(lengths[idx]).tolist()
            p0 = r0 = 0
            columns = zip(
                idx.tolist(), starts.tolist(), stops.tolist(), ends, cuts, specs, strict=True
            )
            for i, start, stop, p1, r1, spec in columns:
                made[i] = Part(pair, start, stop, positions[p0:p1], where[r0:r1], spec)
                p0, r0 = p1, r1
        bounds = np.searchsorted(table.step, np.arange(count + 1)).tolist()
        whole = np.all(rows >= 0, axis=1).tolist() if rows is not None else [False] * count
        ordered = [made[i] for i in range(len(made))]
        for k, sources in enumerate(table.shares):
            cursor = before.after((k + 1) * size, names, totals[k])
            packed = rows[k] if rows is not None and whole[k] else None
            parts = tuple(ordered[bounds[k] : bounds[k + 1]])
            self._planned.append(MixedStep(sources, parts, cursor, packed))
        self._planned_cursor = after
        self._next_plan += count
        return True

    def _deliver(self) -> Any:
        if not self._planned and self._caught_up:  # a followed source has no row for it yet
            self.close()
            raise StopIteration
        step = self._planned.popleft()
        batch, skipped, lost = self._builder.build(self._next_deliver, step, self._planned)
        self._next_deliver += 1
        self._delivered(step.cursor, skipped, lost)
        if skipped:  # the sources' later epochs skip them unread
            self._stores.learn(skipped)
        self._release(step.cursor)
        if self._next_deliver >= self.num_steps:  # the sources go on: the next pass may take them
            self._finalizer.detach()
            self._builder.close(True)
            self._closed = True
            self._stores.at = step.cursor
            self._ended(self._stores)
        return batch

    def _release(self, cursor: MixCursor) -> None:
        """Evict what ``cursor`` is past in every source epoch open; close those it is done with."""
        names, spans = self._mixture.names, self._spans
        for source, epoch in list(self._stores.open):
            rows = spans[source]
            if isinstance(rows, int):  # a lake's epochs: n rows each
                first, end = epoch * rows, (epoch + 1) * rows
            else:
                bounds = epoch_first(
                    spans, np.array([source, source]), np.array([epoch, epoch + 1])
                )
                first, end = bounds.tolist()
            count = cursor.counts.get(names[source], 0)
            self._stores.release(source, epoch, min(max(count - first, 0), end - first))


def _dests(
    at: np.ndarray, base: np.ndarray, starts: np.ndarray, stops: np.ndarray, num_partitions: int
) -> np.ndarray:
    """Where each row of each part (partition-major in its range) goes in its share.

    ``at[base[i]:]`` holds where each position of part ``i``'s range goes; the result holds it
    for the rows of the parts, part after part, in the order a part's build gives them.
    """
    first, counts = batch_runs(starts, stops, num_partitions)
    slots = expand_runs(first.ravel(), counts.ravel(), num_partitions)
    where: np.ndarray = at[slots - np.repeat(starts - base, stops - starts)]
    return where
