"""Packed token streams as a source of batches: of a lake, or of a mixture's sources.

Each batch is ``batch_size`` samples of ``seq_len`` tokens: ``input_ids``, ``position_ids``
(the token's position in its document) and ``pad_mask`` (True on padding: the end of a stream's
epoch, or a skipped unit's tokens); a packed Mixture's also ``mixture.source_key``, each
sample's source, drawn by weight (each source packs its own stream as a packed lake does). The
stream is endless; its state is the samples delivered (a mixture's: its cursor, in samples),
the same on every rank (:mod:`lakeloader.order.packing`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import Host, Node, decoding_setup, read_counts, unit_entries
from lakeloader.nodes.mixture import CursorNode
from lakeloader.nodes.streams import (
    SourceStream,
    first_state,
    moved_to,
    pinned_datasets,
    stream_records,
)
from lakeloader.nodes.views import packed_view
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import TokenStream
from lakeloader.order.plan import rank_bounds
from lakeloader.pipeline.packed import PackedIterator
from lakeloader.pipeline.packed_parts import (
    PackedSource,
    arena_layout,
    token_stream,
)
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.token_counts import token_counts
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.formats import PACKED, PACKED_MIXTURE, read
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState, SourceRecord
from lakeloader.state.packed_state import PackedState, packed_mixture_dict
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import RECENT_STEPS, Delivery, ReaderStateTracker, ReaderView
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

#: The name of a single dataset's only source, in the samples' cursor.
ONLY = "lake"


class PackingNode(Node):
    """Packed samples of a :class:`~lakeloader.LakeDataset` (see the module docstring).

    ``batch_size`` counts samples. With ``num_workers > 0``, worker processes decode the
    units (a followed lake's increments too; a saved epoch on the snapshot a checkpoint pinned,
    of a lake that grew since, is decoded by this process's ``io_threads``), make them into
    tokens with the row ``transform`` if there is one, and run the user's code
    (``collate_fn``, ``batch_transform``) on the samples this process cuts.
    """

    what = "packed stream"
    dataset: Any  # a LakeDataset; a packed mixture's Mixture
    #: The samples delivered by the last step, until the state is asked for (made then).
    _pending: int | None = None
    #: The topology of the pass under way (None: no pass yet).
    _pass_topology: Topology | None = None

    def __init__(self, host: Host, dataset: Any) -> None:
        super().__init__(host)
        self._counts: dict[Any, np.ndarray] = {}  # by the fingerprint of an epoch's dataset
        self._tokens = self._padding = 0
        #: The samples delivered (of every epoch); the record of steps, for the audit.
        self.tracker = ReaderStateTracker(host.topology, drop_last=False)
        self._init(dataset)
        self.tracker.epoch = self.epoch

    def _init(self, dataset: Any) -> None:
        """Take the dataset in."""
        assert isinstance(dataset, LakeDataset) and dataset.packing is not None
        self.dataset = dataset
        self._take({ONLY: dataset})
        self._config = self._packing_hash(dataset)
        self._state = PackedState(dataset.fingerprint, self._config, 0)

    def _take(self, sources: Mapping[str, LakeDataset]) -> None:
        """Each source's reader and stream of samples (its packing column checked first)."""
        column = self.dataset.packing.column
        for ds in sources.values():
            if ds.transform is None and column not in ds.config.columns:
                raise KeyError(
                    f"Packing column {column!r} is not among the dataset's columns "
                    f"{list(ds.config.columns)}: read it, or give a transform that makes it"
                )
        self._readers = {n: ds.reader() for n, ds in sources.items()}
        self._streams = {n: SourceStream(ds, size=self._samples_of) for n, ds in sources.items()}

    def _packing_hash(self, ds: LakeDataset) -> str:
        packing = self.dataset.packing if ds.packing is None else ds.packing
        return config_hash({**ds.config.to_dict(), "packing": packing.to_dict()})

    def _source(self, name: str) -> PackedSource:
        """A source with its stream, its reader (``SourceStream.reader``), the quarantine so far."""
        stream = self._streams[name]
        reader = self._readers[name] = stream.reader(self._readers[name])
        ds = stream.known[0][2]
        return PackedSource(ds, reader, stream, self._counts_of, tuple(self.quarantine))

    def _counts_of(self, ds: LakeDataset) -> np.ndarray:
        """The token counts of an epoch's dataset's units (counted once per loader)."""
        if ds.fingerprint not in self._counts:
            self._counts[ds.fingerprint] = token_counts(ds)
        return self._counts[ds.fingerprint]

    def _samples_of(self, ds: LakeDataset) -> int:
        """Samples in an epoch of ``ds`` (a followed lake's: of the increment it is)."""
        packing, key = self.dataset.packing, ("samples", ds.fingerprint)
        assert packing is not None
        if key not in self._counts:
            counts = self._counts_of(ds)  # every epoch's, whatever its order
            streams = TokenStream.of(counts, ds.config.num_partitions, packing.seq_len)
            self._counts[key] = np.array(streams.num_samples)
        return int(self._counts[key])

    @property
    def _state(self) -> PackedState:
        """The state: the last one set, moved to the samples of the last step delivered."""
        if self._pending is not None:
            self._stored, self._pending = self._at(self._pending), None
        return self._stored

    @_state.setter
    def _state(self, state: PackedState) -> None:
        self._stored, self._pending = state, None

    def _samples(self) -> int:
        """Samples delivered (without making the state)."""
        return self._stored.samples if self._pending is None else self._pending

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (a followed lake's: of the last one, until known)."""
        stream, samples = self._streams[ONLY], self._samples()
        at = samples if stream.covers(samples) else samples - 1
        return stream.epoch_of(max(at, 0))

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from the cursor: this rank's :class:`PackedIterator`."""
        host, res, packing = self.host, self.host._res, self.dataset.packing
        cursor, weights, seed = self._drawn()
        sources = [self._source(name) for name in weights.names]
        host._close_iterator("a newer iter(loader)")
        assert packing is not None
        self._pass_topology = host.topology  # the pass's: what each delivery's runs are over
        # the workers are set up with the snapshots the sources stand on (a followed source's
        # increments come with each task: they do not restart the workers)
        pool = None
        if host.options.num_workers:
            pool = self._pool_for(s.reader for s in sources if not s.stream.follows)
        it = PackedIterator(
            sources,
            packing,
            cursor,
            weights,
            seed,
            self._pass_topology,
            host.options,
            res.unit_folder(host.options.cache_dir, host.options.cache_bytes),
            pool,
            self._delivered,
            self._recipe(),
            self._source_key(),
        )
        res.iterator = it
        return it

    def _source_key(self) -> str | None:
        """The batch's key of each sample's source (a packed Mixture's), or None."""
        return None

    def _recipe(self) -> BatchRecipe:
        """What is run on each step's samples: the ``collate_fn`` and ``batch_transform``."""
        return BatchRecipe(None, self.host.options.collate_fn, self.dataset.batch_transform)

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode the lake's units and run the user's code on the samples."""
        reader, ds = self._readers[ONLY], self.dataset
        layout, recipe = arena_layout([ds], reader), self._recipe()
        return decoding_setup(self.host, [(ds, reader, layout)], ds.config.seed, recipe)

    def _delivered(
        self, cursor: MixCursor, skipped: list[QuarantineEntry], tokens: int, pads: int
    ) -> None:
        """The only place the position moves: a batch was handed over."""
        self._tokens, self._padding = self._tokens + tokens, self._padding + pads
        runs, topo = [], self._pass_topology
        assert topo is not None, "delivered in a pass"
        for name, stream in self._streams.items():
            first, stop = self._counted().get(name, 0), cursor.counts.get(name, 0)
            runs += stream.runs(first, stop, name, topo)
        lo, hi = rank_bounds(topo.global_batch, topo.world_size, topo.rank)
        self.tracker.delivered(Delivery(cursor.slot, hi - lo, False, (), 0), runs=runs)
        self._moved(cursor, skipped)
        self.tracker.epoch = self.epoch

    def _counted(self) -> Mapping[str, int]:
        """Samples each source delivered so far."""
        return {ONLY: self._samples()}

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        # the epochs (increments) that state_dict(fetched_ahead=...) may stand back in are kept
        back = RECENT_STEPS * (self._pass_topology or self.host.topology).global_batch
        self._streams[ONLY].forget_before(cursor.slot - back)
        self._pending = cursor.slot  # the state is made of it when asked for
        self.add_quarantine(skipped)

    def _at(self, samples: int) -> PackedState:
        """The state with ``samples`` delivered, of the epoch (or increment) they stand in."""
        at = self._streams[ONLY].record(samples)
        return dataclasses.replace(
            self._stored, samples=samples, fingerprint=at.fingerprint, increment=at.increment,
            start=at.start, from_epoch=at.epoch,
        )  # fmt: skip

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples delivered, less ``fetched_ahead`` global batches: the same on every rank.

        Raises:
            ValueError: If ``fetched_ahead`` steps were not delivered (or more than are kept).
        """
        if fetched_ahead:
            size = self.host.topology.global_batch
            back = fetched_ahead * size
            if not 0 <= back <= self._state.samples or fetched_ahead > RECENT_STEPS:
                raise ValueError(
                    f"state_dict(fetched_ahead={fetched_ahead}): only "
                    f"{self._state.samples // size} steps were delivered "
                    f"(at most {RECENT_STEPS} steps back are kept)"
                )
            return self._at(self._state.samples - back).to_dict()
        return self._state.to_dict()

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from a state (any rank's; a list of every rank's is taken too)."""
        self._restore(read(state_dict, PACKED, self._samples_of(self.dataset)), None)

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, on the lake of now (see ``coordinator.resume_source``)."""
        saved = read(ckpt.state_dict, PACKED, self._samples_of(self.dataset))
        size, count = self._samples_of, saved.samples
        at = coordinator.resume_source(
            ckpt, ONLY, self.dataset, _record(saved), count, size, self._config, exact=True
        )
        moved = None if at is None else SourceStream(at.dataset, at.start, size, at.epoch)
        self._restore(saved, moved)

    def _restore(self, saved: PackedState, moved: SourceStream | None) -> None:
        """Continue from ``saved``; ``moved``: the stream the recovery coordinator mapped.

        Raises:
            StateMismatchError: If ``saved`` is of another snapshot, configuration or packing.
        """
        self.host._close_iterator("load_state_dict()")
        stream = moved
        if stream is None:
            stream = SourceStream.resumed(self.dataset, _record(saved), self._samples_of)
            now = stream.record(saved.samples).fingerprint
            if (saved.fingerprint, saved.config) != (now, self._config):
                raise StateMismatchError(
                    f"the packed state is of snapshot {saved.fingerprint} with configuration "
                    f"{saved.config}; this loader reads {now} with {self._config}: resume with "
                    "the same lake snapshot, order settings and packing"
                )
        if moved is not None:  # what the loader reads now (a re-sliced loader too)
            self.dataset = stream.base
        self._streams, self._state = {ONLY: stream}, saved
        self._moved(MixCursor(saved.samples, {ONLY: saved.samples}), [])
        self._restored()

    def barrier_position(self) -> Stand:
        """What the checkpoint barrier compares across ranks: snapshot, packing, samples."""
        at = self._state
        return Stand(at.fingerprint, at.config, 0, at.samples, at.quarantine)

    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose tokens these runs' samples took, each of its source's epoch."""
        out, seq_len = [], self.dataset.packing.seq_len
        for r in runs:
            ds = self._streams[r.stream].dataset(r.epoch)
            tokens = token_stream(ds, r.epoch, self._counts_of(ds), seq_len)
            units = ds.plan(r.epoch).order[tokens.sample_units(r.start, r.stop)]
            out += unit_entries(ds, np.asarray(units, dtype=np.int64), reason)
        return out

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the state."""
        entries = list(entries)
        if not entries:
            return
        self._state = self._state.with_quarantine(entries)
        self.tracker.quarantine = self._state.quarantine

    def _restored(self) -> None:
        """The tracker at a restored state: its epoch, the samples delivered, the quarantine."""
        self.tracker.record.restored()
        self.tracker.position = self._drawn()[0].slot
        self.tracker.epoch = self.epoch
        self.tracker.quarantine = tuple(self.barrier_position().quarantine)

    def _drawn(self) -> tuple[MixCursor, MixWeights, int]:
        """The samples' cursor, the weights that draw each sample's source, the seed."""
        samples = self._samples()
        return MixCursor(samples, {ONLY: samples}), MixWeights.of({ONLY: 1.0}), 0

    def view(self) -> ReaderView:
        """The samples delivered, each rank's share of the next step, where each source is."""
        (cursor, weights, seed), topo = self._drawn(), self.host.topology
        seq_len = self.dataset.packing.seq_len
        args = (cursor, weights, seed, topo, self._counts_of, seq_len)
        return packed_view(self.tracker, self._streams, *args)

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshot a checkpoint pins: of the epoch the samples stand in."""
        return pinned_datasets(self._streams, {ONLY: self._state.samples}, {ONLY: self.dataset})

    def stats(self) -> dict[str, int]:
        """What the readers did, and the tokens and padding this rank handed out."""
        return {
            **read_counts(reader.counters for reader in self._readers.values()),
            "tokens": self._tokens,
            "padding": self._padding,
        }


def _record(saved: PackedState) -> SourceRecord:
    """The record of a packed state's source: where its stream stands (no rows counted)."""
    return SourceRecord(
        saved.fingerprint, saved.config, 0, saved.increment, saved.start, saved.from_epoch
    )


class PackedMixtureNode(CursorNode, PackingNode):
    """Packed samples of a Mixture with a packing: each sample's source drawn by weight.

    ``batch_size`` counts samples. ``state_dict()`` is the samples' cursor (a mixture's state,
    the same on every rank); ``load_state_dict`` continues under any world size and batch,
    and new weights or sources.
    """

    what = "packed mixture"
    _exact = True
    _slots = "sample"
    _format = PACKED_MIXTURE

    def _init(self, dataset: Any) -> None:
        """Take the mixture in."""
        assert isinstance(dataset, Mixture) and dataset.packing is not None
        self.mixture = self.dataset = dataset
        self._take(dataset.sources)
        sources = stream_records(self._streams, {}, self._packing_hash)
        self._mixed = first_state(dataset, sources, self._topology())

    def _topology(self) -> dict[str, int]:
        """The run's shape as the state records it: rank 0's, so that every rank's is equal."""
        return {**self.host.topology.to_dict(), "rank": 0}

    def _counting(self) -> tuple[Callable[[LakeDataset], int], Callable[[LakeDataset], str] | None]:
        return self._samples_of, self._packing_hash

    @property
    def epoch(self) -> int:
        """0: each source runs through its own epochs (see ``state_dict()``)."""
        return 0

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units and run the user's code on the samples."""
        mix = self.mixture
        layout = arena_layout(list(mix.sources.values()), self._readers[mix.names[0]])
        return self._decoding(layout, self._recipe())

    def _drawn(self) -> tuple[MixCursor, MixWeights, int]:
        at, mix = self._mixed, self.mixture
        return MixCursor(at.slot, at.counts), mix.weights, mix.seed

    def _source_key(self) -> str | None:
        return self.mixture.source_key

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        self._mixed = moved_to(self._mixed, self._streams, cursor, self._packing_hash)
        self.add_quarantine(skipped)

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the cursor (entries name their files)."""
        self._mixed = self._mixed.with_quarantine(entries)
        self.tracker.quarantine = self._mixed.quarantine

    def _resumed(self, state: MixtureState) -> None:
        self._mixed = dataclasses.replace(state, topology=self._topology())
        self._restored()

    def _counted(self) -> Mapping[str, int]:
        return self._mixed.counts

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples' cursor: plain types, the same on every rank."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return packed_mixture_dict(self._mixed)
