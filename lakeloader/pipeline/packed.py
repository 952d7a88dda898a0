"""A packed stream for one rank: its samples of each step, cut from the units they lie in.

:class:`PackedIterator` draws each step's samples (placed by :mod:`lakeloader.order.packing`),
takes this rank's share, requests the units they lie in ahead of use and copies each sample's
tokens out of them. A skipped unit's tokens come as padding, so no other sample moves. The
user's code (``collate_fn``, ``batch_transform``) runs in the DataLoader's workers if it has
any (each step's samples are cut here and sent, several steps ahead), else in the loader's
process. Sample ``n`` of source ``name`` has seed ``slot_seeds(its dataset's seed,
crc32(name), n)`` (``name`` is ``"lake"`` for one lake).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from multiprocessing.pool import ThreadPool
from typing import Any, Final

import numpy as np

from lakeloader.lake.following import CaughtUpError
from lakeloader.options import LoaderOptions, cores
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import Share, TokenStream, source_epochs, step_shares
from lakeloader.packing import Packing
from lakeloader.pipeline.iterator import PassIterator
from lakeloader.pipeline.packed_parts import (
    PackedSource,
    PlannedStep,
    StepCut,
    arena_layout,
    check_some_unit_left,
    token_stream,
)
from lakeloader.pipeline.recipe import (
    COLUMNS,
    BatchRecipe,
    Payload,
    finish_payload,
    samples_payload,
)
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.pipeline.token_counts import check_count
from lakeloader.pipeline.unit_tokens import EpochTokens
from lakeloader.randomness import slot_seeds
from lakeloader.signals import main_thread_only
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool
from lakeloader.workers.process import SamplesTask
from lakeloader.workers.shipping import built

logger = logging.getLogger(__name__)

#: Steps whose units are requested ahead of the one delivered, at least.
AHEAD_STEPS: Final = 4
#: Steps planned at once (see ``PackedIterator._plan_ahead``).
PLAN_STEPS: Final = 16
#: Chunks of :data:`PLAN_STEPS` planned ahead at most while the next step waits for its units.
MAX_CHUNKS: Final = 256
#: Bytes a unit requested holds per token, about: decoded, then made into tokens and positions.
UNIT_BYTES_PER_TOKEN: Final = 8
#: Threads that make decoded units into tokens (without workers).
TOKEN_THREADS: Final = 2


class PackedIterator(PassIterator):
    """Endless iterator over one rank's packed batches, from one source or a mixture's.

    Args:
        sources: The sources, in the order the cursor's weights name them.
        packing: How samples are cut (the same for every source).
        weights: The weights of the sources' samples.
        cursor: Samples drawn so far (in all, and from each source).
        seed: The seed of the samples' interleaving.
        topology: The loader's topology (its ``batch_size`` counts samples).
        options: The loader's options.
        unit_dir: The loader's folder for decoded units.
        pool: The DataLoader's workers, which decode the rows and run the user's code on the
            samples; None: this process's threads.
        delivered: Told the cursor, the units found skipped (source by source), and the tokens and
            padding handed out, after each batch handed over.
        recipe: The loader's ``collate_fn`` and the ``batch_transform``; a row transform is its
            source's.
        source_key: The batch's key of each sample's source (an index into ``sources``), or
            None: no such key (a single dataset).
    """

    def __init__(
        self,
        sources: list[PackedSource],
        packing: Packing,
        cursor: MixCursor,
        weights: MixWeights,
        seed: int,
        topology: Topology,
        options: LoaderOptions,
        unit_dir: str,
        pool: WorkerPool | None,
        delivered: Callable[[MixCursor, list[QuarantineEntry], int, int], None],
        recipe: BatchRecipe,
        source_key: str | None = None,
    ) -> None:
        self._sources, self._packing, self._weights, self._seed = sources, packing, weights, seed
        self._topology, self._recipe, self._source_key = topology, recipe, source_key
        self._delivered = delivered
        empty = [w for w, s in zip(weights.names, sources, strict=True) if s.stream.spans() == 0]
        if empty:
            raise ValueError(
                f"packing found no {packing.column!r} token in source(s) {empty} (every row "
                "empty): give sources with tokens"
            )
        self._stores = Stores(
            [
                Leaf(s.dataset, s.reader, s.known, BatchRecipe(lists=s.dataset.list_format))
                for s in sources
            ],
            dataclasses.replace(options, io_threads=max(1, min(options.io_threads, cores() - 1))),
            Topology(1, 0, 0, options.batch_size),
            unit_dir,
            pool,
            arena_layout([s.dataset for s in sources], sources[0].reader),
            workers_decode=True,
            increments_by_task=True,
        )
        self._epochs: dict[tuple[int, int], EpochTokens] = {}
        #: Make decoded units into tokens ahead of their use (daemon threads); with workers,
        #: one, or one per unit handed to them ahead (each waits for one) if they transform.
        transforms = any(s.dataset.transform is not None for s in sources)
        ahead = options.num_workers * options.prefetch
        threads = TOKEN_THREADS if pool is None else (ahead if transforms else 1)
        self._threads = ThreadPool(threads, initializer=main_thread_only)
        #: The workers that run the user's code on the samples cut (those that decode), if
        #: any, and the steps sent to them, oldest first.
        self._builds = self._stores.workers if recipe.user_code else None
        self._building: deque[tuple[str, StepCut, Future[Any]]] = deque()
        self._ahead, self._timeout = ahead, options.timeout
        super().__init__(None, options.cache_bytes, _TokenThreads(self._threads), self._stores)
        self._streams: dict[tuple[int, int], TokenStream] = {}
        #: Each unit held: the last step (by count of steps planned) that needs it, its bytes.
        self._last_use: dict[tuple[int, int, int], tuple[int, int]] = {}
        #: Each stream's first token that no step planned has reached, by (source, epoch).
        self._front: dict[tuple[int, int], np.ndarray] = {}
        self._planned: deque[PlannedStep] = deque()
        self._plan_cursor = cursor
        #: Bytes the units requested and not let go hold, about (see ``_plan_ahead``).
        self._held_bytes = 0
        self._sample_keys = [
            (s.dataset.config.seed, zlib.crc32(name.encode()))
            for s, name in zip(sources, weights.names, strict=True)
        ]

    def _stream(self, source: int, epoch: int) -> TokenStream:
        """Where the tokens of ``epoch`` of ``source`` lie (the last few kept)."""
        key = (source, epoch)
        if key not in self._streams:
            src = self._sources[source]
            ds = src.stream.dataset(epoch)
            self._streams[key] = token_stream(ds, epoch, src.counts_of(ds), self._packing.seq_len)
            while len(self._streams) > 4 * len(self._sources):
                del self._streams[next(iter(self._streams))]
        return self._streams[key]

    def _epoch(self, source: int, epoch: int) -> EpochTokens:
        """The units of ``epoch`` of ``source``, opened on first use."""
        key = (source, epoch)
        if key not in self._epochs:
            ds = self._sources[source].stream.dataset(epoch)
            store, stream = self._stores.get(source, epoch), self._stream(source, epoch)
            self._epochs[key] = EpochTokens(
                store,
                stream,
                self._packing,
                ds.transform,
                partial(check_count, ds),
                self._threads,
                self._stores.workers,
                source,
            )
        return self._epochs[key]

    def _plan_ahead(self) -> None:
        """Plan steps and request their units: :data:`AHEAD_STEPS` at least, then more.

        Past :data:`AHEAD_STEPS`, a chunk more a batch (up to :data:`MAX_CHUNKS` while the next
        step's units are not ready) while the units requested hold less than twice what the
        next :data:`AHEAD_STEPS` steps' units hold (and less than ``cache_bytes``), and while a
        followed lake already holds their samples.
        """
        chunk = 1 if any(s.stream.follows for s in self._sources) else PLAN_STEPS
        while len(self._planned) <= AHEAD_STEPS:
            if not self._plan_steps(chunk, may_wait=True):
                return
        near = itertools.islice(self._planned, AHEAD_STEPS + 1)
        keys = {key for step in near for key in step.units}
        held = self._last_use
        budget = min(self._budget, 2 * sum(held[k][1] for k in keys))
        chunks = 0  # more while the next step would wait for its units anyway
        while self._held_bytes < budget and (chunks == 0 or not self._ready(self._planned[0])):
            if not self._plan_steps(PLAN_STEPS, may_wait=False) or chunks > MAX_CHUNKS:
                return
            chunks += 1

    def _ready(self, step: PlannedStep) -> bool:
        """Whether the units of a step planned are made into tokens."""
        return all(self._epochs[s, e].ready(pos) for s, e, pos in step.units)

    def _plan_steps(self, count: int, may_wait: bool) -> bool:
        """Plan the next ``count`` steps and request their units; False if none was planned.

        ``may_wait``: wait for a followed lake's rows (else plan nothing when they are not in).
        """
        topo, cursor = self._topology, self._plan_cursor
        draw, _ = cursor.take(self._weights, self._seed, count * topo.global_batch)
        epochs, places = np.empty_like(draw.offsets), np.empty_like(draw.offsets)
        for i, source in enumerate(self._sources):
            mine = draw.sources == i
            if mine.any():
                last = int(draw.offsets[mine].max())
                if not may_wait and not source.stream.covers(last):
                    return False
                try:  # a followed lake: waits for the increments the step reaches
                    source.stream.cover(last)
                except CaughtUpError as caught:
                    logger.info("a packed stream caught up with its lake: %s", caught)
                    return False  # the pass ends after the steps planned
                epochs[mine], places[mine] = source.stream.locate(draw.offsets[mine])
        groups = source_epochs(draw.sources, epochs)
        streams = {pair: self._stream(*pair) for pair in groups}
        for pair, mine in groups.items():  # where every rank's samples have reached
            at = streams[pair]
            c, k = at.locate(places[mine])
            front = self._front.setdefault(pair, at.bounds[:-1].copy())
            np.maximum.at(front, c, at.spans(c, k)[1])
        shares = step_shares(
            draw.sources,
            draw.offsets,
            epochs,
            places,
            streams,
            topo.global_batch,
            topo.world_size,
            topo.rank,
        )
        names, G = self._weights.names, topo.global_batch
        step_of = np.repeat(np.arange(count), G) * len(names) + draw.sources
        drawn = np.bincount(step_of, minlength=count * len(names)).reshape(count, -1).cumsum(0)
        drawn += cursor.counts_of(names)  # each source's count after each step
        for step, share in enumerate(shares):
            by_epoch = source_epochs(share.source, share.epoch)
            units = [
                (s, e, pos)
                for (s, e), mine in by_epoch.items()
                for pos in self._stream(s, e).units(share.start[mine], share.stop[mine]).tolist()
            ]
            for key in units:
                nbytes = self._last_use[key][1] if key in self._last_use else 0
                if not nbytes:
                    self._epoch(*key[:2]).request(key[2])
                    nbytes = self._unit_bytes(*key)
                    self._held_bytes += nbytes
                self._last_use[key] = (self._next_plan, nbytes)
            after = cursor.after((step + 1) * G, names, drawn[step])
            self._planned.append(PlannedStep(after, share, by_epoch, units))
            self._next_plan += 1
        self._plan_cursor = self._planned[-1].after
        return True

    def _unit_bytes(self, source: int, epoch: int, pos: int) -> int:
        """Bytes the unit at ``pos`` of an epoch holds once requested, about."""
        ends = self._stream(source, epoch).ends
        return int(ends[pos] - (ends[pos - 1] if pos else 0)) * UNIT_BYTES_PER_TOKEN

    def _deliver(self) -> Any:
        if self._builds is None:  # the user's code, if any, runs here
            cut, recipe = self._cut(), self._recipe
            payload: Payload = (COLUMNS, cut.columns)
            if recipe.user_code:
                payload = samples_payload(cut.columns, recipe, self._seeds(cut.share))
            batch = finish_payload(payload, recipe)
        else:
            batch, cut = self._built()
        self._delivered(cut.cursor, cut.skips, cut.tokens, cut.padding)
        return batch

    def _built(self) -> tuple[Any, StepCut]:
        """The next step's batch from the workers; steps whose units are in are sent ahead."""
        assert self._builds is not None
        deadline = time.monotonic() + self._timeout if self._timeout else None
        self._builds.dispatcher.reap()
        if not self._building:
            self._send()  # waits for its units; StopIteration when no step is planned
        while len(self._building) < self._ahead and self._planned and self._ready(self._planned[0]):
            self._send()
        what, cut, future = self._building.popleft()
        payload = built(future, deadline, self._timeout, what)
        return finish_payload(payload, self._recipe), cut

    def _send(self) -> None:
        """Cut the next step's samples and send them to a worker."""
        assert self._builds is not None
        cut, key, stores = self._cut(), self._next_deliver, self._stores
        seeds = self._seeds(cut.share)

        def make(task_key: int) -> SamplesTask:
            return SamplesTask(stores.generation, task_key, cut.columns, seeds, stores.dir)

        what = f"the packed batch of step {key} of the pass"  # named in its errors
        self._building.append((what, cut, self._builds.run(what, make)))

    def _cut(self) -> StepCut:
        """The next step planned: its samples copied out of their units, units let go."""
        if not self._planned:  # caught up with a followed lake: the pass ends
            self.close()
            raise StopIteration
        cursor, share, by_epoch, _ = self._planned.popleft()
        L, n = self._packing.seq_len, len(share)
        tokens = np.empty((n, L), dtype=np.int64)  # every place is written: see ``_copy``
        positions = np.empty((n, L), dtype=np.int64)
        pads = np.zeros((n, L), dtype=bool)  # True where a skipped unit or a tail pads
        flat = (tokens.reshape(-1), positions.reshape(-1), pads.reshape(-1))
        for (s, e), mine in by_epoch.items():
            epoch = self._epoch(s, e)
            start, stop = share.start[mine], share.stop[mine]
            # Runs of samples whose tokens follow each other in the epoch and in the batch
            # (a stream's next samples; a short one, padded, ends its run): one copy each.
            cut = (
                (start[1:] != stop[:-1])
                | (mine[1:] != mine[:-1] + 1)
                | (stop[:-1] - start[:-1] != L)
            )
            firsts = np.concatenate([[0], np.flatnonzero(cut) + 1])
            lasts = np.concatenate([firsts[1:], [len(mine)]]) - 1
            runs = np.stack([start[firsts], stop[lasts], mine[firsts] * L], axis=1)
            self._copy(epoch, runs, flat)
            for row in mine[stop - start < L].tolist():  # a stream's last sample: padded
                size = int(share.stop[row] - share.start[row])
                tokens[row, size:], positions[row, size:] = self._packing.pad_id, 0
                pads[row, size:] = True
        columns = {"input_ids": tokens, "position_ids": positions, "pad_mask": pads}
        if self._source_key is not None:
            columns[self._source_key] = share.source.copy()
        self._next_deliver += 1
        skips = self._skipped()
        padding = int(np.count_nonzero(pads))
        self._release()
        return StepCut(cursor, share, columns, skips, n * L - padding, padding)

    def _copy(self, epoch: EpochTokens, runs: np.ndarray, out: tuple[Any, ...]) -> None:
        """Copy each run's tokens ``[start, stop)`` of an epoch to ``at`` of the flat batch.

        ``runs``: one ``(start, stop, at)`` a row; each run is copied unit by unit.
        """
        ends = epoch.stream.ends
        first, last = np.searchsorted(ends, runs[:, :2] - [0, 1], side="right").T
        spans = last - first + 1  # the units each run lies in
        run = np.repeat(np.arange(len(runs)), spans)
        pos = np.arange(len(run)) - np.repeat(np.cumsum(spans) - spans, spans) + first[run]
        starts = np.where(pos > 0, ends[pos - 1], 0)  # each unit's first token in the epoch
        a = np.maximum(runs[run, 0], starts)
        b = np.minimum(runs[run, 1], ends[pos])
        to = runs[run, 2] + a - runs[run, 0]
        bounds = (pos, a - starts, b - starts, to, to + b - a)
        pieces = zip(*(x.tolist() for x in bounds), strict=True)
        for p, lo, hi, t0, t1 in pieces:
            unit = epoch.unit(p)
            out[0][t0:t1] = unit.tokens[lo:hi]
            out[1][t0:t1] = unit.positions[lo:hi]
            if unit.padding:
                out[2][t0:t1] = True

    def _seeds(self, share: Share) -> np.ndarray:
        """Each sample's seed: ``slot_seeds`` of its source's seed and name, at its offset."""
        seeds = np.empty(len(share), dtype=np.uint64)
        for source, (seed, key) in enumerate(self._sample_keys):
            mine = share.source == source
            seeds[mine] = slot_seeds(seed, key, share.offset[mine])
        return seeds

    def _skipped(self) -> list[QuarantineEntry]:
        """The units found skipped since the last step, source by source (known to later epochs)."""
        found: list[list[QuarantineEntry]] = [[] for _ in self._sources]
        for (source, _), epoch in self._epochs.items():
            found[source] += epoch.skipped
            epoch.skipped.clear()
        for source, entries in enumerate(found):
            if entries:
                self._stores.learn(entries, source)
                check_some_unit_left(
                    self._sources[source].dataset, self._stores.leaves[source].known
                )
        return [entry for entries in found for entry in entries]

    def _release(self) -> None:
        """Let go of the units that no step planned needs and whose streams have passed them.

        Epochs that hold no unit are closed.
        """
        done = self._next_deliver - 1
        gone = [k for k, (step, _) in self._last_use.items() if step <= done and self._passed(*k)]
        by_epoch: dict[tuple[int, int], list[int]] = {}
        for source, epoch, pos in gone:
            self._held_bytes -= self._last_use.pop((source, epoch, pos))[1]
            by_epoch.setdefault((source, epoch), []).append(pos)
        for key, positions in by_epoch.items():
            self._epochs[key].drop(positions)
        for key in [k for k, e in self._epochs.items() if not e.held]:
            if (self._front[key] >= self._epochs[key].stream.bounds[1:]).all():
                del self._front[key]  # every sample of the epoch planned
            del self._epochs[key]
            self._stores.drop(*key)

    def _passed(self, source: int, epoch: int, pos: int) -> bool:
        """Whether every stream that the unit at ``pos`` lies in has passed its last token."""
        tokens, front = self._epochs[(source, epoch)].stream, self._front[(source, epoch)]
        start, end = int(tokens.ends[pos - 1]) if pos else 0, int(tokens.ends[pos])
        first = int(np.searchsorted(tokens.bounds, start, side="right")) - 1
        last = int(np.searchsorted(tokens.bounds, end - 1, side="right")) - 1
        first = max(first, 0)  # a stream that ends inside the unit has passed it at its end
        until = np.minimum(end, tokens.bounds[first + 1 : last + 2])
        return bool((front[first : last + 1] >= until).all())

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now, and of the tokens made of them."""
        return self._stores.held_bytes() + sum(e.nbytes for e in list(self._epochs.values()))

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Stop decoding and building; drop every epoch's units (idempotent)."""
        self._epochs.clear()
        self._building.clear()
        super().close(wait, ended_by)


@dataclasses.dataclass(frozen=True)
class _TokenThreads:
    """A pass's token threads, as a part :func:`close_pass` stops."""

    pool: ThreadPool

    def close(self, wait: bool) -> None:
        """Stop the threads (what they were making is not needed)."""
        self.pool.terminate()
