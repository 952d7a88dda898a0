"""One pass over a mixture for one rank: each source's rows read by a pass of its own.

Each global batch is drawn by the mixture's cursor (:mod:`lakeloader.order.mixture`); the
rank's share is cut into parts, one per source and epoch of that source
(:func:`~lakeloader.order.mixture.rank_parts`), and each part is a slot range of that epoch's
order, which a :class:`SourcePass` (a unit store and a builder over one epoch of one source)
reads and builds like a single lake's step. The parts' columns are laid out in slot order
(:mod:`lakeloader.pipeline.merge`) with the source of each row, and only then made tensors.
Steps are planned ahead in chunks, so that every source decodes ahead in its plan order.
A source's pass is closed once all ranks are past its epoch.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from lakeloader.cache.packed import RowLayout
from lakeloader.cache.store import Screening
from lakeloader.io.reader import UnitReader
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.order.batches import BatchSpec, range_specs
from lakeloader.order.mixture import MixCursor, MixPart, MixWeights, rank_parts_many
from lakeloader.order.plan import batch_runs, expand_runs
from lakeloader.pipeline.builders import LocalBuilder
from lakeloader.pipeline.cleanup import close_safely
from lakeloader.pipeline.merge import merge_columns
from lakeloader.pipeline.recipe import COLUMNS, BatchRecipe, finish_payload
from lakeloader.pipeline.workspace import PassSpec, PassWorkspace
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.topology import Topology

#: Steps planned ahead of delivery at most (the byte budget usually stops it earlier).
LOOKAHEAD_STEPS: Final = 64
#: Steps planned by one call.
PLAN_CHUNK: Final = 16


class SourcePass:
    """One epoch of one source in a mixture: its unit store and a builder of its slot ranges.

    Its units are decoded in this process's threads.

    Args:
        mixture: The mixture.
        source: The source's index.
        epoch: The source's epoch.
        reader: Reads the source's units.
        options: The loader's options (the byte budget is shared among sources).
        unit_dir: The loader's folder for decoded units.
        coordinator: The recovery coordinator.
    """

    def __init__(
        self,
        mixture: Mixture,
        source: int,
        epoch: int,
        reader: UnitReader,
        options: LoaderOptions,
        unit_dir: str,
        coordinator: RecoveryCoordinator,
    ) -> None:
        ds = mixture.sources[mixture.names[source]]
        self.epoch = epoch
        self.rows = len(ds)
        budget = max(options.cache_bytes // len(mixture.names), 1)
        self.spec = PassSpec(
            plan=ds.plan(epoch),
            start=0,
            options=dataclasses.replace(options, cache_bytes=budget),
            topology=Topology(1, 0, 0, options.batch_size),
            screening=Screening(ds.on_error, ds.validate, ds.lost),
            layout=RowLayout.of(reader.schema),
            recipe=BatchRecipe(lists=ds.list_format),
        )
        self.space = PassWorkspace(self.spec, reader, None, unit_dir, coordinator)
        self._builder = LocalBuilder(self.spec, self.space, reader.schema)

    def build(self, step: BatchSpec) -> dict[str, Any]:
        """The columns of a part (its rows in the partition-major order of its range)."""
        kind, columns = self._builder.build(step)
        self._builder.skipped.pop(step.step, None)
        assert kind == COLUMNS
        result: dict[str, Any] = columns
        return result

    def close(self, wait: bool = False) -> None:
        """Stop decoding; delete the pass's units."""
        self.space.close(wait)


@dataclass(frozen=True)
class _Step:
    """A planned step of the rank: its parts, the source of each row, the cursor after it."""

    sources: np.ndarray
    parts: tuple[tuple[tuple[int, int], BatchSpec, np.ndarray], ...]
    cursor: MixCursor


class MixtureIterator:
    """Iterator over one rank's batches of one pass over a mixture (see the module docstring).

    Args:
        mixture: The mixture.
        weights: The weights in force.
        cursor: Where the mixture stands (delivered).
        num_steps: Steps in this pass.
        topology: The loader's topology.
        options: The loader's options.
        readers: One reader per source, in the order of the mixture's names.
        unit_dir: The loader's folder for decoded units.
        coordinator: The recovery coordinator.
        delivered: Told the cursor after each batch handed over.
    """

    def __init__(
        self,
        mixture: Mixture,
        weights: MixWeights,
        cursor: MixCursor,
        num_steps: int,
        topology: Topology,
        options: LoaderOptions,
        readers: list[UnitReader],
        unit_dir: str,
        coordinator: RecoveryCoordinator,
        delivered: Callable[[MixCursor], None],
    ) -> None:
        self._mixture, self._weights, self._topology = mixture, weights, topology
        self._options, self._readers = options, readers
        self._unit_dir, self._coordinator = unit_dir, coordinator
        self._delivered = delivered
        self._rows = mixture.rows()
        self._lists = BatchRecipe(lists=next(iter(mixture.sources.values())).list_format)
        self.num_steps = num_steps
        self._planned_cursor = cursor
        self._planned: deque[_Step] = deque()
        self._next_plan = self._next_deliver = 0
        self._passes: dict[tuple[int, int], SourcePass] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, close_safely, _close_passes, self._passes)

    def _source_pass(self, key: tuple[int, int]) -> SourcePass:
        if key not in self._passes:
            source, epoch = key
            self._passes[key] = SourcePass(
                self._mixture,
                source,
                epoch,
                self._readers[source],
                self._options,
                self._unit_dir,
                self._coordinator,
            )
        return self._passes[key]

    def _held_bytes(self) -> int:
        return sum(p.space.store.nbytes for p in self._passes.values())

    def _plan_ahead(self) -> None:
        while (
            self._next_plan < self.num_steps
            and self._next_plan < self._next_deliver + LOOKAHEAD_STEPS
            and (
                self._next_plan == self._next_deliver
                or self._held_bytes() < self._options.cache_bytes
            )
        ):
            self._plan_chunk(min(PLAN_CHUNK, self.num_steps - self._next_plan))

    def _plan_chunk(self, count: int) -> None:
        """Plan ``count`` steps: draw them, cut the rank's shares, ask each source for its parts."""
        topo, size, names = self._topology, self._topology.global_batch, self._mixture.names
        before = self._planned_cursor
        draw, after = before.take(self._weights, self._mixture.seed, count * size)
        shares = rank_parts_many(draw, self._rows, count, topo.world_size, topo.rank)
        drawn = draw.sources.reshape(count, size)
        totals = np.stack([(drawn == k).sum(axis=1) for k in range(len(names))], axis=1)
        totals = np.cumsum(totals, axis=0).tolist()  # drawn from each source, after each step
        groups: defaultdict[tuple[int, int], list[tuple[int, MixPart]]] = defaultdict(list)
        for k, (_, parts) in enumerate(shares):
            for part in parts:
                groups[(part.source, part.epoch)].append((k, part))
        planned: dict[tuple[int, tuple[int, int]], tuple[BatchSpec, np.ndarray]] = {}
        for key, items in groups.items():
            source_pass = self._source_pass(key)
            parts = [p for _, p in items]
            starts = np.array([p.start for p in parts], dtype=np.int64)
            stops = np.array([p.stop for p in parts], dtype=np.int64)
            plan = source_pass.spec.plan
            specs = range_specs(
                plan, np.array([self._next_plan + k for k, _ in items]), starts, stops
            )
            dests = _dests(parts, starts, stops, plan.num_partitions)
            for (k, _), spec, dest in zip(items, specs, dests, strict=True):
                source_pass.space.store.request(spec.positions)
                planned[(k, key)] = spec, dest
        for k, (sources, parts) in enumerate(shares):
            counts = dict(before.counts)
            counts.update(
                (name, before.counts.get(name, 0) + totals[k][i]) for i, name in enumerate(names)
            )
            steps = tuple((key, *planned[(k, key)]) for key in ((p.source, p.epoch) for p in parts))
            self._planned.append(
                _Step(sources, steps, MixCursor(before.slot + (k + 1) * size, counts))
            )
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
        columns = [self._passes[key].build(spec) for key, spec, _ in step.parts]
        merged = merge_columns(columns, [dest for _, _, dest in step.parts], len(step.sources))
        merged[self._mixture.source_key] = step.sources.astype(np.int64)
        batch = finish_payload((COLUMNS, merged), self._lists)
        self._next_deliver += 1
        self._delivered(step.cursor)
        self._release(step.cursor)
        if self._next_deliver >= self.num_steps:
            self.close()
        return batch

    def _release(self, cursor: MixCursor) -> None:
        """Evict what every rank is past; close the passes of epochs every rank is done with."""
        names = self._mixture.names
        for key in list(self._passes):
            source, epoch = key
            count, rows = cursor.counts.get(names[source], 0), self._rows[source]
            consumed = min(max(count - epoch * rows, 0), rows)
            if consumed >= rows:
                self._passes.pop(key).close()
            else:
                self._passes[key].space.store.release(consumed)

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._held_bytes()

    def cache_peak_bytes(self) -> int:
        """Most bytes held at once by a source's pass under way."""
        return max((p.space.store.peak_bytes for p in self._passes.values()), default=0)

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Stop decoding; drop every source's units (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _close_passes(self._passes, wait)


def _dests(
    parts: list[MixPart], starts: np.ndarray, stops: np.ndarray, num_partitions: int
) -> list[np.ndarray]:
    """Where each row a part's build gives (partition-major in its range) goes in its share."""
    first, counts = batch_runs(starts, stops, num_partitions)
    slots = expand_runs(first.ravel(), counts.ravel(), num_partitions)
    lengths = stops - starts
    base = np.cumsum(lengths) - lengths
    local = slots - np.repeat(starts - base, lengths)
    where = np.concatenate([p.at for p in parts])[local]
    return np.split(where, np.cumsum(lengths)[:-1])


def _close_passes(passes: dict[tuple[int, int], SourcePass], wait: bool = False) -> None:
    for source_pass in passes.values():
        source_pass.close(wait)
    passes.clear()
