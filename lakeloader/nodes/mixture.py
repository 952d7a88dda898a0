"""A mixture of lakes as a source of batches.

Each ``for batch in loader`` is one pass of ``mixture.epoch_rows`` rows (full global batches;
the sources' own epochs run apart); the state is a
:class:`~lakeloader.state.mixture_state.MixtureState`, O(sources), and a restore continues
under any world size, batch size or worker count, with the weights and sources of the mixture
it is given (:mod:`lakeloader.recovery.mixture_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Position
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import (
    Host,
    Node,
    decoding_setup,
    read_counts,
    row_units,
)
from lakeloader.nodes.streams import SourceStream, moved_streams, pinned_datasets
from lakeloader.nodes.views import mixture_view
from lakeloader.order.mixture import MixCursor, Spans
from lakeloader.order.plan import rank_bounds
from lakeloader.pipeline.mixing import MixtureIterator
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.recovery.mixture_resume import records, resume_mixture
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.mixture_state import MixtureState, WeightChange
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.state.tracker import Delivery, ReaderStateTracker, ReaderView
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class MixtureNode(Node):
    """A :class:`~lakeloader.Mixture`'s batches (see the module docstring).

    Every batch holds ``mixture.source_key``: the source of each row, an index into
    ``mixture.names``. With ``num_workers > 0``, worker processes decode every source's row
    groups (else this process's ``io_threads`` do); with the user's code (a source's
    ``transform``, a ``collate_fn``, a ``batch_transform``) they build the batches instead.
    A pass that ends at its last step leaves its sources' decoded row groups to the next pass,
    which goes on with them (released by ``close()``, ``load_state_dict()``, or when the
    loader is collected). Each source's
    ``transform``, ``on_error`` and ``validate`` apply to its rows; the loader's
    ``collate_fn`` and the mixture's ``batch_transform`` to the mixed batch (rows meet the
    transform with ``mixture.source_key`` set). A unit a source skips is in the state's
    ``quarantine``, for every later pass and resume.

    Args:
        host: The loader.
        mixture: The mixture.
    """

    @property
    def what(self) -> str:
        """``"mixture"``."""
        return "mixture"

    def __init__(self, host: Host, mixture: Mixture) -> None:
        super().__init__(host)
        self.mixture = self.dataset = mixture
        self._cursor: MixCursor | None = None
        self._stored: MixtureState
        self._readers = [mixture.sources[n].reader() for n in mixture.names]
        #: Each source's stream of rows (a followed lake's increments), in the names' order.
        self._streams = [SourceStream(mixture.sources[n]) for n in mixture.names]
        self._streams_known()
        #: The pass under way (epoch, rows of it delivered); its record of steps, for the audit.
        self.tracker = ReaderStateTracker(host.topology, drop_last=False)
        #: Each source's rows delivered (the counts of the last step handed over).
        self._counts: dict[str, int] = {n: 0 for n in mixture.names}
        first = WeightChange(0, dict(mixture.raw_weights))
        self._state = MixtureState(
            seed=mixture.seed,
            slot=0,
            counts={n: 0 for n in mixture.names},
            history=(first,),
            epoch=0,
            epoch_start=0,
            epoch_rows=mixture.epoch_rows,
            sources=records(mixture),
            topology=host.topology.to_dict(),
        )

    @property
    def _state(self) -> MixtureState:
        """The position: the last state set, moved to the cursor of the last batch delivered.

        A followed source's record is of the increment its count stands in.
        """
        if self._cursor is not None:
            cursor, self._cursor = self._cursor, None
            counts = dict(cursor.counts)
            sources = dict(self._stored.sources)
            if self.varies:
                for name, stream in zip(self.mixture.names, self._streams, strict=True):
                    stream.forget_before(counts.get(name, 0))
                    sources[name] = stream.record(counts.get(name, 0))
            self._stored = dataclasses.replace(
                self._stored, slot=cursor.slot, counts=counts, sources=sources
            )
        return self._stored

    @_state.setter
    def _state(self, state: MixtureState) -> None:
        self._stored, self._cursor = state, None
        self.tracker.epoch, self.tracker.position = state.epoch, state.slot - state.epoch_start
        self.tracker.quarantine = state.quarantine

    def cover(self, counts: Sequence[int], wait: bool) -> list[Spans] | None:
        """Each source's spans, reaching past ``counts``.

        A followed source asks its lake for its next increment only when ``wait`` (the step
        to be delivered next needs it), as a followed lake does at its epoch's end: the
        increments are the same whatever the lookahead. None: they do not reach, and
        ``wait`` is False.

        Raises:
            CaughtUpError: If a followed source's lake gives no more rows in time.
        """
        pairs = list(zip(self._streams, counts, strict=True))
        if not wait and not all(stream.covers(int(count) - 1) for stream, count in pairs):
            return None
        for stream, count in pairs:
            stream.cover(int(count) - 1)
        return [stream.spans() for stream in self._streams]

    def pass_steps(self) -> int:
        """Steps in a whole pass over the mixture for this topology."""
        return -(-self._state.epoch_rows // self.host.global_batch_size)

    @property
    def epoch(self) -> int:
        """The pass over the mixture under way (or just finished)."""
        return self._state.epoch

    def steps_left(self) -> int:
        """Global steps left in the pass under way, for the topology of now."""
        state = self._state
        rows = state.epoch_rows - (state.slot - state.epoch_start)
        return -(-max(rows, 0) // self.host.global_batch_size)

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Accepted for the usual epoch loop: a mixture's stream goes on from where it is.

        Raises:
            ValueError: If ``epoch`` is neither the pass under way nor the next one, or with
                ``restart=True`` (a mixture's sources cannot be rewound).
        """
        state = self._state
        if restart or epoch not in (state.epoch, state.epoch + 1):
            raise ValueError(
                f"a mixture streams on: set_epoch({epoch}) while in pass {state.epoch} "
                "(only that pass or the next, and no restart, can be asked for)"
            )
        if epoch == state.epoch + 1 and not state.epoch_done:
            logger.info(
                "pass %d left early: pass %d starts at slot %d", state.epoch, epoch, state.slot
            )
        if epoch != state.epoch:
            self.host._close_iterator("set_epoch()")
            self._state = _next_pass(state)

    def begin(self) -> Iterator[Any]:
        """One pass of ``epoch_rows`` rows, going on with the stores the last one left."""
        self.host._close_iterator("a newer iter(loader)")
        if self._state.epoch_done:
            self._state = _next_pass(self._state)
        res = self.host._res
        self._follow_streams()
        # workers decode only sources that read one snapshot for good: a task names a file by
        # its place in the snapshot its worker knows
        decode = not self._workers_build and all(stream.plain for stream in self._streams)
        pool = None
        if self.host.options.num_workers and self._workers_build:
            pool = self.host._ensure_pool()
        elif self.host.options.num_workers and decode:
            pool = self._pool_for(self._readers)
        state, size = self._state, self.host.global_batch_size
        cursor = MixCursor(state.slot, state.counts)
        sources = res.take_carried()
        if not isinstance(sources, Stores) or sources.at != cursor:
            if sources is not None:
                sources.close()
            unit_dir = res.unit_folder(self.host.options.cache_dir, self.host.options.cache_bytes)
            sources = Stores(
                self._leaves(),
                self.host.options,
                Topology(1, 0, 0, self.host.options.batch_size),
                unit_dir,
                pool,
                self._layout(),
                workers_decode=decode,
            )
        left = state.epoch_rows - (state.slot - state.epoch_start)
        it = MixtureIterator(
            self.mixture,
            self.mixture.weights,
            cursor,
            -(-left // size),
            self.host.topology,
            self.host.options,
            sources,
            pool if self._workers_build else None,
            self._recipe(),
            self._delivered,
            res.carry,
            self,
        )
        res.iterator = it
        return it

    def _follow_streams(self) -> None:
        """A reader of the snapshot each source's stream stands on (``SourceStream.reader``)."""
        self._readers = [s.reader(r) for s, r in zip(self._streams, self._readers, strict=True)]

    def _leaves(self) -> list[Leaf]:
        """Each source's lake and reader, in the order of the mixture's names."""
        known = self._state.quarantine
        return [
            Leaf(stream.known[0][2], r, known, BatchRecipe(ds.transform, lists=ds.list_format))
            for stream, r, ds in zip(
                self._streams, self._readers, self.mixture.sources.values(), strict=True
            )
        ]

    def _recipe(self) -> BatchRecipe:
        """How the mixed rows become a batch: the loader's collate_fn, the batch_transform."""
        lists = self.mixture.sources[self.mixture.names[0]].list_format
        collate = self.host.options.collate_fn
        return BatchRecipe(None, collate, self.mixture.batch_transform, lists)

    @property
    def _workers_build(self) -> bool:
        """Whether workers build the batches (the user's code runs), rather than decode."""
        return bool(self.host.options.num_workers) and (
            self._recipe().user_code
            or any(ds.transform is not None for ds in self.mixture.sources.values())
        )

    @property
    def workers_build(self) -> bool:
        """Whether workers build batches (a transform or collate_fn) rather than decode."""
        return self._workers_build

    def _layout(self) -> RowLayout | None:
        """How rows are packed into the arena, or None.

        None on the row path (a transform, a collate_fn) and where workers build (they take
        every column from the units' files).
        """
        rows_path = self.host.options.collate_fn is not None or any(
            ds.transform is not None for ds in self.mixture.sources.values()
        )
        packs = not rows_path and not self._workers_build
        return RowLayout.of(self._readers[0].schema) if packs else None

    def worker_setup(self) -> WorkerSetup:
        """Workers that build the mixed batches, or decode every source's units."""
        if self._workers_build:
            return WorkerSetup(
                schema=self._readers[0].schema,
                layout=None,
                recipe=self._recipe(),
                worker_init_fn=self.host.options.worker_init_fn,
                seed=self.mixture.seed,
                rank=self.host.topology.rank,
                num_workers=self.host.options.num_workers,
            )
        layout = self._layout()
        named = zip(self.mixture.names, self._readers, strict=True)
        return decoding_setup(
            self.host, [(self.mixture.sources[n], r, layout) for n, r in named], self.mixture.seed
        )

    def _delivered(
        self, cursor: MixCursor, skipped: tuple[QuarantineEntry, ...], lost: int
    ) -> None:
        """The only place the position moves: a batch was handed over."""
        self._cursor = cursor  # the state is made of it when asked for (not at every step)
        topology, runs = self.host.topology, []
        named = zip(self.mixture.names, self._streams, strict=True)
        for name, stream in named:
            first, stop = self._counts.get(name, 0), cursor.counts.get(name, 0)
            runs += stream.runs(first, stop, name, topology)
        self._counts = dict(cursor.counts)
        lo, hi = rank_bounds(topology.global_batch, topology.world_size, topology.rank)
        at = cursor.slot - self._stored.epoch_start
        self.tracker.delivered(Delivery(at, hi - lo - lost, False, (), lost), runs=runs)
        if skipped:
            self.add_quarantine(skipped)

    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose rows these runs took, each of its source's epoch."""
        streams = dict(zip(self.mixture.names, self._streams, strict=True))
        return [e for r in runs for e in row_units(streams[r.stream].dataset(r.epoch), r, reason)]

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the state (merged, sorted)."""
        state = self._state
        self._state = dataclasses.replace(state, quarantine=tuple(merge(state.quarantine, entries)))

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The mixture's position: plain types, O(sources)."""
        refuse_fetched_ahead(fetched_ahead, "a mixture")
        return self._state.to_dict()

    def _streams_known(self) -> None:
        """What follows from the sources' streams: whether any is known epoch by epoch."""
        #: Whether a source's epochs are known one by one (a followed lake's increments, a
        #: lake that grew since a checkpoint): its record is kept up at each step.
        self.varies = any(stream.varies for stream in self._streams)
        self.follows = any(stream.follows for stream in self._streams)

    def restore(self, state_dict: dict[str, Any]) -> None:
        """Continue from a mixture state taken under any topology.

        The weights and sources are this mixture's: changes are recorded in the state and
        logged.

        Raises:
            StateFormatError: If the dict is not a mixture state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one.
        """
        self._restore(MixtureState.from_dict(state_dict), {})

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, on the lakes of now.

        A source whose lake changed since the checkpoint finishes its saved epoch on the
        snapshot the checkpoint pinned, and its later epochs take the lake of now (see
        ``RecoveryCoordinator.resume_source``).

        Raises:
            StateFormatError: If it holds another kind of loader's state.
            LakeChangedError: Under ``on_lake_change="error"``, when files a source's saved
                epoch still needs are gone or rewritten.
        """
        saved = MixtureState.from_dict(dict(ckpt.state_dict))
        self._restore(saved, moved_streams(ckpt, coordinator, saved, self.mixture.sources))

    def _restore(self, saved: MixtureState, moved: dict[str, SourceStream]) -> None:
        """Continue from ``saved``; the ``moved`` sources' streams are the coordinator's."""
        self.host._close_iterator("load_state_dict()")
        self.host._res.drop_carried()
        streams = [
            moved[n]
            if n in moved
            else SourceStream.resumed(self.mixture.sources[n], saved.sources[n])
            if n in saved.sources
            else SourceStream(self.mixture.sources[n])
            for n in self.mixture.names
        ]
        now = {
            n: stream.record(stream.known[0][1])
            for n, stream in zip(self.mixture.names, streams, strict=True)
        }
        resumed = resume_mixture(saved, self.mixture, now, frozenset(moved))
        self.tracker.record.restored()
        self._counts = dict(resumed.state.counts)
        if moved:  # what the loader reads now (a re-sliced loader is made on it, too)
            bases = {n: stream.base for n, stream in moved.items()}
            self.mixture = self.dataset = self.mixture.with_sources(bases)
        self._streams = streams
        self._streams_known()
        self._follow_streams()
        for change in resumed.changes:
            logger.info("mixture resumed at slot %d: %s", resumed.state.slot, change)
        self._state = dataclasses.replace(resumed.state, topology=self.host.topology.to_dict())

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks (the same on every rank)."""
        return self._state

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state a checkpoint holds, with every rank's quarantine (from the barrier)."""
        self.add_quarantine(quarantine)
        return self.state()

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units the sources skipped so far, sorted; merged across ranks at saves."""
        return list(self._state.quarantine)

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source, of the epoch its count stands in."""
        streams = dict(zip(self.mixture.names, self._streams, strict=True))
        return pinned_datasets(streams, self._state.counts, self.mixture.sources)

    def view(self) -> ReaderView:
        """The pass under way, each rank's share of the next step, where each source stands."""
        state, mix = self._state, self.mixture
        streams = dict(zip(mix.names, self._streams, strict=True))
        cursor, topo = MixCursor(state.slot, state.counts), self.host.topology
        return mixture_view(
            self.tracker, streams, cursor, mix.weights, mix.seed, topo, self.steps_left()
        )

    def stats(self) -> dict[str, int]:
        """What the sources' readers did."""
        return read_counts(reader.counters for reader in self._readers)


def _next_pass(state: MixtureState) -> MixtureState:
    """The state at the start of the next pass (where the last one ended)."""
    return dataclasses.replace(state, epoch=state.epoch + 1, epoch_start=state.slot)
