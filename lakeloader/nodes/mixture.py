"""A mixture of lakes as a source of batches.

Each ``for batch in loader`` is one pass of ``mixture.epoch_rows`` rows (the sources' own
epochs run apart); the state is a :class:`~lakeloader.state.mixture_state.MixtureState`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import (
    Host,
    Node,
    decoding_setup,
    make_setup,
    read_counts,
    row_units,
)
from lakeloader.nodes.streams import (
    SourceStream,
    first_state,
    moved_to,
    pinned_datasets,
    stream_records,
)
from lakeloader.nodes.views import mixture_view
from lakeloader.order.mixture import MixCursor
from lakeloader.order.plan import rank_bounds
from lakeloader.pipeline.mixing import MixtureIterator
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.recovery.mixture_resume import resume_mixture
from lakeloader.state.formats import MIXTURE, read
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import Delivery, ReaderStateTracker, ReaderView
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class CursorNode(Node):
    """A node whose position is a mixture's cursor over its sources' streams."""

    mixture: Mixture
    _streams: dict[str, SourceStream]
    _readers: dict[str, UnitReader]
    #: The cursor: a mixture's state, at the last batch delivered.
    _mixed: MixtureState
    #: Whether a checkpoint's files gone or rewritten are refused whatever the policy.
    _exact = False
    #: What the cursor's slots are, as the log names them.
    _slots = "slot"
    #: The format of its states (a state, or a list of every rank's: quarantines merged).
    _format = MIXTURE

    def _counting(self) -> tuple[Callable[[LakeDataset], int], Callable[[LakeDataset], str] | None]:
        """An epoch's offsets, and a source's configuration in its record (None: order's hash)."""
        return len, None

    def _resumed(self, state: MixtureState) -> None:
        """Stand at ``state`` (the mixture and its streams are the resumed ones)."""
        raise NotImplementedError

    def restore(self, state_dict: Any) -> None:
        """Continue from a state taken under any topology, with this mixture's weights.

        Any rank's state, or a list of every rank's (their quarantines merged).
        """
        self._resume(read(state_dict, self._format), {})

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, each source whose lake changed mapped onto its lake of now.

        See ``RecoveryCoordinator.resume_source`` (``LakeChangedError`` under
        ``on_lake_change="error"``).
        """
        saved, sources, moved = read(ckpt.state_dict, self._format), self.mixture.sources, {}
        size, config = self._counting()
        for name in sorted(set(sources) & set(saved.sources)):
            live, count, record = sources[name], saved.counts.get(name, 0), saved.sources[name]
            expected = None if config is None else config(live)
            args = (live, record, count, size, expected, self._exact)
            at = coordinator.resume_source(ckpt, name, *args)
            if at is not None:
                moved[name] = SourceStream(at.dataset, at.start, size, at.epoch)
        self._resume(saved, moved)

    def _resume(self, saved: MixtureState, moved: Mapping[str, SourceStream]) -> None:
        """Continue from ``saved``; the mixture reads the ``moved`` sources' lakes of now.

        The other sources go on from their saved records, or start.
        """
        self.host._close_iterator("load_state_dict()")
        self.host._res.drop_carried()
        (size, config), mixture = self._counting(), self.mixture
        if moved:
            mixture = mixture.with_sources({n: stream.base for n, stream in moved.items()})
        streams = {
            n: moved[n]
            if n in moved
            else SourceStream.resumed(ds, saved.sources[n], size)
            if n in saved.sources
            else SourceStream(ds, size=size)
            for n, ds in mixture.sources.items()
        }
        now = stream_records(streams, {}, config)
        state, changes = resume_mixture(saved, mixture, now, frozenset(moved))
        self.mixture = self.dataset = mixture  # a re-sliced loader is made on it, too
        self._streams = streams
        self._resumed(state)
        for change in changes:
            logger.info("%s resumed at %s %d: %s", self.what, self._slots, saved.slot, change)

    def barrier_position(self) -> Stand:
        """What the checkpoint barrier compares across ranks: the cursor (the same on all).

        Its digests: of the sources' snapshots; of the seed, weights and sources' settings.
        """
        at = self._mixed
        weights = [[c.start, sorted(c.weights.items())] for c in at.history]
        sources = sorted((n, r.config) for n, r in at.sources.items())
        order = config_hash({"seed": at.seed, "history": weights, "sources": sources})
        lakes = config_hash({n: r.fingerprint for n, r in at.sources.items()})
        return Stand(lakes, order, at.epoch, at.slot, at.quarantine)

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source, of the epoch its count stands in."""
        return pinned_datasets(self._streams, self._mixed.counts, self.mixture.sources)

    def _decoding(self, layout: RowLayout | None, recipe: BatchRecipe | None = None) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        sources = [(ds, self._readers[n], layout) for n, ds in self.mixture.sources.items()]
        return decoding_setup(self.host, sources, self.mixture.seed, recipe)


class MixtureNode(CursorNode):
    """A :class:`~lakeloader.Mixture`'s batches (see the module docstring).

    Every batch holds ``mixture.source_key``: the source of each row, an index into
    ``mixture.names``. With ``num_workers > 0``, worker processes decode every source's row
    groups (a followed source's increments too; a lake that grew since a checkpoint: its
    saved epoch's rest in this process's threads), or build the batches where the user's
    code runs (a ``transform``, a ``collate_fn``, a ``batch_transform``). A pass that ends at
    its last step leaves its sources' decoded row groups to the next pass (released by
    ``close()``, ``load_state_dict()``, or when the loader is collected).
    """

    what = "mixture"

    def __init__(self, host: Host, mixture: Mixture) -> None:
        super().__init__(host)
        self.mixture = self.dataset = mixture
        self._cursor: MixCursor | None = None
        self._stored: MixtureState
        #: The topology of the pass under way (``begin``): what its deliveries are over.
        self._pass_topology = host.topology
        self._readers = {n: ds.reader() for n, ds in mixture.sources.items()}
        #: Each source's stream of rows (a followed lake's increments), in the names' order.
        self._streams = {n: SourceStream(ds) for n, ds in mixture.sources.items()}
        #: The pass under way (epoch, rows of it delivered); its record of steps, for the audit.
        self.tracker = ReaderStateTracker(host.topology, drop_last=False)
        # each source's record as a resume finds it again (a followed lake's names its increment)
        sources = stream_records(self._streams, {})
        self._mixed = first_state(mixture, sources, host.topology.to_dict())

    @property
    def _mixed(self) -> MixtureState:
        """The position: the last state set, moved to the cursor of the last batch delivered."""
        if self._cursor is not None:
            cursor, self._cursor = self._cursor, None
            varies = any(stream.varies for stream in self._streams.values())
            streams = self._streams if varies else {}  # else the records never change
            self._stored = moved_to(self._stored, streams, cursor)
        return self._stored

    @_mixed.setter
    def _mixed(self, state: MixtureState) -> None:
        self._stored, self._cursor = state, None
        self.tracker.epoch, self.tracker.position = state.epoch, state.slot - state.epoch_start
        self.tracker.quarantine = state.quarantine

    def pass_steps(self) -> int:
        """Steps in a whole pass over the mixture for this topology."""
        return self._steps(self._mixed.epoch_rows)

    def _steps(self, rows: int) -> int:
        """Global steps that ``rows`` rows fill (the last one may be short)."""
        return -(-max(rows, 0) // self.host.topology.global_batch)

    def steps_left(self) -> int:
        """Global steps left in the pass under way, for the topology of now."""
        state = self._mixed
        return self._steps(state.epoch_rows - (state.slot - state.epoch_start))

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Accepted for the usual epoch loop: a mixture's stream goes on from where it is.

        Raises:
            ValueError: If ``epoch`` is neither the pass under way nor the next one, or with
                ``restart=True`` (a mixture's sources cannot be rewound).
        """
        state = self._mixed
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
            self._mixed = _next_pass(state)

    def begin(self) -> Iterator[Any]:
        """One pass of ``epoch_rows`` rows, going on with the stores the last one left."""
        self.host._close_iterator("a newer iter(loader)")
        if self._mixed.epoch_done:
            self._mixed = _next_pass(self._mixed)
        res, opts = self.host._res, self.host.options
        self._follow_streams()
        # a task names a file by its place in the snapshot its worker knows: workers are set
        # up with the snapshots the sources stand on (a followed source's increments come with
        # each task: they do not restart the workers)
        build = self.workers_build
        pool = self.host._ensure_pool() if build else None
        if opts.num_workers and not build:
            streams = self._streams
            pool = self._pool_for(r for n, r in self._readers.items() if not streams[n].follows)
        state = self._mixed
        cursor = MixCursor(state.slot, state.counts)
        self._pass_topology = topology = self.host.topology  # fixed for the pass
        sources = res.take_carried()
        if not isinstance(sources, Stores) or sources.at != cursor:
            if sources is not None:
                sources.close()
            unit_dir = res.unit_folder(opts.cache_dir, opts.cache_bytes)
            whole = Topology(1, 0, 0, opts.batch_size)
            layout = self._layout()
            sources = Stores(self._leaves(), opts, whole, unit_dir, pool, layout, not build, True)
        it = MixtureIterator(
            self.mixture,
            cursor,
            self.steps_left(),
            topology,
            opts,
            sources,
            pool if build else None,
            self._recipe(),
            self._delivered,
            res.carry,
            list(self._streams.values()),
        )
        res.iterator = it
        return it

    def _follow_streams(self) -> None:
        """A reader of the snapshot each source's stream stands on (``SourceStream.reader``)."""
        self._readers = {n: s.reader(self._readers[n]) for n, s in self._streams.items()}

    def _leaves(self) -> list[Leaf]:
        """Each source's lake and reader, in the order of the mixture's names."""
        known, leaves = self._mixed.quarantine, []
        for name, ds in self.mixture.sources.items():
            recipe = BatchRecipe(ds.transform, lists=ds.list_format)
            leaves.append(Leaf(self._streams[name].known[0][2], self._readers[name], known, recipe))
        return leaves

    def _recipe(self) -> BatchRecipe:
        """How the mixed rows become a batch: the loader's collate_fn, the batch_transform."""
        lists = self.mixture.sources[self.mixture.names[0]].list_format
        collate = self.host.options.collate_fn
        return BatchRecipe(None, collate, self.mixture.batch_transform, lists)

    @property
    def workers_build(self) -> bool:
        """Whether workers build the batches (the user's code runs), rather than decode."""
        return bool(self.host.options.num_workers) and (
            self._recipe().user_code
            or any(ds.transform is not None for ds in self.mixture.sources.values())
        )

    def _layout(self) -> RowLayout | None:
        """How rows are packed into the arena; None on the row path and where workers build."""
        rows_path = self.host.options.collate_fn is not None or any(
            ds.transform is not None for ds in self.mixture.sources.values()
        )
        packs = not rows_path and not self.workers_build
        return RowLayout.of(self._reader().schema) if packs else None

    def _reader(self) -> UnitReader:
        """The first source's reader (whose schema the batches have)."""
        return self._readers[self.mixture.names[0]]

    def worker_setup(self) -> WorkerSetup:
        """Workers that build the mixed batches, or decode every source's units."""
        if self.workers_build:
            transforms = tuple(ds.transform for ds in self.mixture.sources.values())
            reader, seed = self._reader(), self.mixture.seed
            return make_setup(self.host, reader.schema, seed, self._recipe(), transforms=transforms)
        return self._decoding(self._layout())

    def _delivered(
        self, cursor: MixCursor, skipped: tuple[QuarantineEntry, ...], lost: int
    ) -> None:
        """The only place the position moves: a batch was handed over (in the pass begun)."""
        before = self._stored.counts if self._cursor is None else self._cursor.counts
        self._cursor = cursor  # the state is made of it when asked for (not at every step)
        topology, runs = self._pass_topology, []
        for name, stream in self._streams.items():
            first, stop = before.get(name, 0), cursor.counts.get(name, 0)
            runs += stream.runs(first, stop, name, topology)
        lo, hi = rank_bounds(topology.global_batch, topology.world_size, topology.rank)
        at = cursor.slot - self._stored.epoch_start
        self.tracker.delivered(Delivery(at, hi - lo - lost, False, (), lost), runs=runs)
        if skipped:
            self.add_quarantine(skipped)

    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose rows these runs took, each of its source's epoch."""
        streams = self._streams
        return [e for r in runs for e in row_units(streams[r.stream].dataset(r.epoch), r, reason)]

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the state (merged, sorted)."""
        self._mixed = self._mixed.with_quarantine(entries)

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The mixture's position: plain types, O(sources)."""
        refuse_fetched_ahead(fetched_ahead, "a mixture")
        return self._mixed.to_dict()

    def _resumed(self, state: MixtureState) -> None:
        self.tracker.record.restored()
        self._follow_streams()
        self._mixed = dataclasses.replace(state, topology=self.host.topology.to_dict())

    def view(self) -> ReaderView:
        """The pass under way, each rank's share of the next step, where each source stands."""
        state, mix = self._mixed, self.mixture
        cursor, topo = MixCursor(state.slot, state.counts), self.host.topology
        return mixture_view(
            self.tracker, self._streams, cursor, mix.weights, mix.seed, topo, self.steps_left()
        )

    def stats(self) -> dict[str, int]:
        """What the sources' readers did."""
        return read_counts(reader.counters for reader in self._readers.values())


def _next_pass(state: MixtureState) -> MixtureState:
    """The state at the start of the next pass (where the last one ended)."""
    return dataclasses.replace(state, epoch=state.epoch + 1, epoch_start=state.slot)
