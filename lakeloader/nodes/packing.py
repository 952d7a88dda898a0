"""Packed token streams as a source of batches: of a lake, or of a mixture's sources.

Each batch is ``batch_size`` samples of ``seq_len`` tokens: ``input_ids``, ``position_ids``
(the token's position in its document) and ``pad_mask`` (True on padding: the end of a stream's
epoch, or a skipped unit's tokens). The stream is endless: iterate for as many steps as you
train. Samples are placed by arithmetic over the units' token counts
(:mod:`lakeloader.order.packing`), so the state is the samples delivered, the same on every
rank: any one rank's ``state_dict()`` resumes every rank, under any world size and any global
batch, and the global batches are the same under every world size and worker count.

A packed mixture draws each sample's source in the weights' proportions (the mixture's cursor,
counting samples); each source packs its own stream. Its batches hold ``mixture.source_key``
too: each sample's source.

User code and quarantine (:mod:`lakeloader.pipeline.packed`): a source's ``transform`` makes
the packing column of each row; the ``collate_fn`` gets the samples, the ``batch_transform`` (a
LakeDataset's, or ``Mixture(batch_transform=...)``) the packed batch; both in this process. A
unit skipped (``on_error="skip"``, ``validate``) gives padding in the place of its tokens; it is
in the state's ``quarantine``, merged across ranks at a save, known to later passes and resumes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from lakeloader.checkpoint.barrier import Position
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError
from lakeloader.io.reader import UnitReader
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import (
    Host,
    Node,
    decoding_setup,
    read_counts,
    unit_entries,
)
from lakeloader.nodes.streams import SourceStream
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.pipeline.collate import BatchTransform
from lakeloader.pipeline.packed import PackedIterator
from lakeloader.pipeline.packed_parts import (
    PackedSource,
    arena_layout,
    epoch_samples,
    sample_units,
)
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.pipeline.token_counts import token_counts
from lakeloader.recovery.mixture_resume import resume_mixture
from lakeloader.state.journal import DeliveredRun, StepRecord
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState, SourceRecord, WeightChange
from lakeloader.state.packed_state import PackedMixtureState, PackedState
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)

#: The name of a single dataset's only source, in the samples' cursor.
ONLY = "lake"


class PackingNode(Node):
    """Packed samples of a :class:`~lakeloader.LakeDataset` (see the module docstring).

    ``batch_size`` counts samples. With ``num_workers > 0``, worker processes decode the
    units (else this process's ``io_threads`` do); samples are cut, and the user's code run,
    in this process.

    Args:
        host: The loader.
        dataset: The lake, with a packing.
    """

    @property
    def what(self) -> str:
        """``"packed stream"``."""
        return "packed stream"

    dataset: Any  # a LakeDataset; a packed mixture's Mixture

    def __init__(self, host: Host, dataset: Any) -> None:
        super().__init__(host)
        self._counts: dict[Any, np.ndarray] = {}  # by the fingerprint of an epoch's dataset
        self._tokens = self._padding = 0
        self.record = StepRecord()
        self._init(dataset)

    def _init(self, dataset: Any) -> None:
        """Take the dataset in."""
        assert isinstance(dataset, LakeDataset) and dataset.packing is not None
        self._base = self.dataset = dataset
        self._check_column(dataset)
        self._reader = dataset.reader()
        self._config = self._packing_hash(dataset)
        self._streams = {ONLY: SourceStream(dataset, size=self._samples_of)}
        self._state = PackedState(dataset.fingerprint, self._config, 0)

    def _check_column(self, dataset: LakeDataset) -> None:
        column = self.dataset.packing.column
        if dataset.transform is None and column not in dataset.config.columns:
            raise KeyError(
                f"Packing column {column!r} is not among the dataset's columns "
                f"{list(dataset.config.columns)}: read it, or give a transform that makes it"
            )

    def _packing_hash(self, ds: LakeDataset) -> str:
        packing = self.dataset.packing if ds.packing is None else ds.packing
        return config_hash({**ds.config.to_dict(), "packing": packing.to_dict()})

    def _source(self, name: str, ds: LakeDataset, reader: UnitReader) -> PackedSource:
        """A source with its stream, its units' token counts and the quarantine so far."""
        stream = self._streams[name]
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
            self._counts[key] = np.array(epoch_samples(ds, self._counts_of(ds), packing))
        return int(self._counts[key])

    def placed(self, topology: Topology) -> None:
        """Nothing to do: the state is the same under every topology."""

    @property
    def epoch(self) -> int:
        """The epoch of the next sample (a followed lake's: of the last one, until known)."""
        stream, samples = self._streams[ONLY], self._state.samples
        at = samples if stream.covers(samples) else samples - 1
        return int(stream.locate(np.array([max(at, 0)]))[0][0])

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Not supported: a packed stream runs through its epochs by itself.

        Raises:
            TypeError: Always.
        """
        raise TypeError(
            "a packed stream is endless, running through its epochs by itself: iterate it for "
            "as many steps as you train, without set_epoch()"
        )

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from where the state stands."""
        samples = self._state.samples
        source = self._source(ONLY, self.dataset, self._reader)
        cursor, weights = MixCursor(samples, {ONLY: samples}), MixWeights.of({ONLY: 1.0})
        return self._begin([source], cursor, weights, 0, self.dataset.batch_transform)

    def _begin(
        self,
        sources: list[PackedSource],
        cursor: MixCursor,
        weights: MixWeights,
        seed: int,
        batch_transform: BatchTransform | None,
        source_key: str | None = None,
    ) -> Iterator[Any]:
        """A pass over ``sources``: this rank's :class:`PackedIterator`."""
        host, res, packing = self.host, self.host._res, self.dataset.packing
        host._close_iterator("a newer iter(loader)")
        assert packing is not None
        it = PackedIterator(
            sources,
            packing,
            cursor,
            weights,
            seed,
            host.topology,
            host.options,
            res.unit_folder(host.options.cache_dir, host.options.cache_bytes),
            host._ensure_pool() if host.options.num_workers else None,
            self._delivered,
            BatchRecipe(None, host.options.collate_fn, batch_transform),
            source_key,
        )
        res.iterator = it
        return it

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode the lake's units."""
        layout = arena_layout([self.dataset], self._reader)
        seed = self.dataset.config.seed
        return decoding_setup(self.host, [(self.dataset, self._reader, layout)], seed)

    def _delivered(
        self, cursor: MixCursor, skipped: list[tuple[QuarantineEntry, ...]], tokens: int, pads: int
    ) -> None:
        """The only place the position moves: a batch was handed over."""
        self._tokens, self._padding = self._tokens + tokens, self._padding + pads
        runs = []
        for name, stream in self._streams.items():
            first, stop = self._counted().get(name, 0), cursor.counts.get(name, 0)
            runs += stream.runs(first, stop, name, self.host.topology)
        self.record.step(runs)
        self._moved(cursor, [q for found in skipped for q in found])

    def _counted(self) -> Mapping[str, int]:
        """Samples each source delivered so far."""
        return {ONLY: self._state.samples}

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        stream = self._streams[ONLY]
        stream.forget_before(cursor.slot)
        at = stream.record(cursor.slot)  # a followed lake's: the increment it stands in
        self._state = dataclasses.replace(
            self._state, samples=cursor.slot, fingerprint=at.fingerprint, increment=at.increment,
            start=at.start,
        )  # fmt: skip
        self.add_quarantine(skipped)

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples delivered, less ``fetched_ahead`` global batches: the same on every rank.

        Raises:
            ValueError: If ``fetched_ahead`` steps were not delivered.
        """
        if fetched_ahead:
            back = fetched_ahead * self.host.global_batch_size
            if not 0 <= back <= self._state.samples:
                raise ValueError(
                    f"state_dict(fetched_ahead={fetched_ahead}): only "
                    f"{self._state.samples // self.host.global_batch_size} steps were delivered"
                )
            return dataclasses.replace(self._state, samples=self._state.samples - back).to_dict()
        return self._state.to_dict()

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from a state (any rank's; a list of every rank's is taken too).

        Raises:
            StateFormatError: If it is not a packed state of a known version.
            StateMismatchError: If it belongs to another snapshot or configuration.
        """
        self.host._close_iterator("load_state_dict()")
        given = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
        per_epoch = self._samples_of(self.dataset)
        states = [PackedState.from_dict(s, per_epoch) for s in given]
        saved = states[0].with_quarantine(q for s in states for q in s.quarantine)
        record = SourceRecord(saved.fingerprint, "", 0, saved.increment, saved.start)
        stream = SourceStream.resumed(self.dataset, record, self._samples_of)
        now = stream.record(saved.samples).fingerprint
        if (saved.fingerprint, saved.config) != (now, self._config):
            raise StateMismatchError(
                f"the packed state is of snapshot {saved.fingerprint} with configuration "
                f"{saved.config}; this loader reads {now} with {self._config}: resume with "
                "the same lake snapshot, order settings and packing"
            )
        self._streams, self._state = {ONLY: stream}, saved
        self.record.restored()

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: snapshot, packing, samples."""
        return self._state

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state, every rank's quarantine (from the barrier) merged in: no collective."""
        self.add_quarantine(quarantine)
        return self.state()

    def units_behind(self, runs: Iterable[DeliveredRun], reason: str) -> list[QuarantineEntry]:
        """The units whose tokens these runs' samples took, each of its source's epoch."""
        out, seq_len = [], self.dataset.packing.seq_len
        for r in runs:
            ds = self._streams[r.stream].dataset(r.epoch)
            out += unit_entries(ds, sample_units(ds, self._counts_of(ds), seq_len, r), reason)
        return out

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the state."""
        self._state = self._state.with_quarantine(entries)

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far, sorted; merged across ranks at saves."""
        return list(self.barrier_position().quarantine)

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshot a checkpoint pins."""
        return {"lake": self.dataset}

    def _readers_used(self) -> list[UnitReader]:
        return [self._reader]

    def stats(self) -> dict[str, int]:
        """What the readers did, and the tokens and padding this rank handed out."""
        return {
            **read_counts(self._readers_used()),
            "tokens": self._tokens,
            "padding": self._padding,
        }


class PackedMixtureNode(PackingNode):
    """Packed samples of a Mixture with a packing: each sample's source drawn by weight.

    ``batch_size`` counts samples. ``state_dict()`` is the samples' cursor (a mixture's state,
    the same on every rank); ``load_state_dict`` continues under any world size and batch,
    and new weights or sources.
    """

    @property
    def what(self) -> str:
        """``"packed mixture"``."""
        return "packed mixture"

    def _init(self, dataset: Any) -> None:
        """Take the mixture in."""
        assert isinstance(dataset, Mixture) and dataset.packing is not None
        self.mixture = self.dataset = dataset
        for ds in dataset.sources.values():
            self._check_column(ds)
        self._readers = {n: ds.reader() for n, ds in dataset.sources.items()}
        self._streams = {
            n: SourceStream(ds, size=self._samples_of) for n, ds in dataset.sources.items()
        }
        cursor = MixtureState(
            seed=dataset.seed,
            slot=0,
            counts={n: 0 for n in dataset.names},
            history=(WeightChange(0, dict(dataset.raw_weights)),),
            epoch=0,
            epoch_start=0,
            epoch_rows=dataset.epoch_rows,
            sources=self._records({}),
            topology=self._topology(),
        )
        self._mixed = PackedMixtureState(cursor)

    def _topology(self) -> dict[str, int]:
        """The run's shape as the state records it: rank 0's, so that every rank's is equal."""
        return {**self.host.topology.to_dict(), "rank": 0}

    def _records(self, counts: Mapping[str, int]) -> dict[str, SourceRecord]:
        """Each source's record at these counts ({}: where its stream is known from).

        Its snapshot (a followed lake's increment), packing and samples per epoch.
        """
        out = {}
        for name, stream in self._streams.items():
            at = stream.record(counts.get(name, stream.known[0][1]))
            out[name] = dataclasses.replace(at, config=self._packing_hash(stream.known[0][2]))
        return out

    @property
    def epoch(self) -> int:
        """0: each source runs through its own epochs (see ``state_dict()``)."""
        return 0

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        sources = [self.mixture.sources[n] for n in self.mixture.names]
        readers = [self._readers[n] for n in self.mixture.names]
        layout = arena_layout(sources, readers[0])
        return decoding_setup(
            self.host,
            [(ds, r, layout) for ds, r in zip(sources, readers, strict=True)],
            self.mixture.seed,
        )

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from where the cursor stands."""
        mix, at = self.mixture, self._mixed.mixture
        sources = [self._source(n, mix.sources[n], self._readers[n]) for n in mix.names]
        cursor, transform = MixCursor(at.slot, at.counts), mix.batch_transform
        return self._begin(sources, cursor, mix.weights, mix.seed, transform, mix.source_key)

    def _moved(self, cursor: MixCursor, skipped: list[QuarantineEntry]) -> None:
        for name, stream in self._streams.items():
            stream.forget_before(cursor.counts.get(name, 0))
        mixture = dataclasses.replace(
            self._mixed.mixture,
            slot=cursor.slot,
            counts=dict(cursor.counts),
            sources={**self._mixed.mixture.sources, **self._records(cursor.counts)},
        )
        self._mixed = PackedMixtureState(mixture)
        self.add_quarantine(skipped)

    def add_quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the cursor (entries name their files)."""
        mixture = self._mixed.mixture
        merged = tuple(merge(mixture.quarantine, entries))
        self._mixed = PackedMixtureState(dataclasses.replace(mixture, quarantine=merged))

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from a state (any rank's; a list of every rank's is taken too).

        Raises:
            StateFormatError: If it is not a packed mixture's state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one.
        """
        self.host._close_iterator("load_state_dict()")
        given = [state_dict] if isinstance(state_dict, Mapping) else list(state_dict)
        states = [PackedMixtureState.from_dict(s).mixture for s in given]
        saved = dataclasses.replace(
            states[0], quarantine=tuple(merge(*(s.quarantine for s in states)))
        )
        self._streams = {
            n: SourceStream.resumed(ds, saved.sources[n], self._samples_of)
            if n in saved.sources
            else SourceStream(ds, size=self._samples_of)
            for n, ds in self.mixture.sources.items()
        }
        resumed = resume_mixture(saved, self.mixture, self._records({}))
        for change in resumed.changes:
            logger.info("packed mixture resumed at sample %d: %s", resumed.state.slot, change)
        mixture = dataclasses.replace(resumed.state, topology=self._topology())
        self._mixed = PackedMixtureState(mixture)
        self.record.restored()

    def _counted(self) -> Mapping[str, int]:
        return self._mixed.mixture.counts

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: the samples' cursor."""
        return self._mixed.mixture

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source."""
        return dict(self.mixture.sources)

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The samples' cursor: plain types, the same on every rank."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return self._mixed.to_dict()

    def _readers_used(self) -> list[UnitReader]:
        return list(self._readers.values())
