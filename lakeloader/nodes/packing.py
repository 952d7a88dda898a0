"""Packed token streams as a source of batches: of a lake, or rounds of a mixture's sources.

Each batch is ``batch_size`` samples of ``seq_len`` tokens: ``input_ids``, ``position_ids``
(the token's position in its document) and ``pad_mask`` (True on padding, at the end of a
partition's epoch). The stream is endless: iterate for as many steps as you train. The state
holds this rank's partitions (O(C)); a restore takes the states of every rank (a list; one
state is enough with one rank) and continues under any world size that divides ``C`` and any
batch size that ``C`` divides. How rows become samples, and why per partition:
:mod:`lakeloader.order.packing`.

A packed mixture packs each source on its own, one token stream per partition; a step is
``global batch / C`` rounds, each round one sample from every partition of one source, the
source of each round drawn in the weights' proportions by the mixture's cursor (over rounds).
Why rounds of sources and not the mixture's row sequence packed: a sample's start depends on
the lengths of every row before it in its stream, and a rank reads only its partitions' rows;
the mixture's row sequence interleaves every partition of every source, so packing it would
make every rank read every row. Rounds keep each rank on its partitions, every rank's batch the
same size, and the state O(sources x C). Its batches hold ``mixture.source_key`` too: each
sample's source.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Position
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError, TopologyError
from lakeloader.io.reader import UnitReader
from lakeloader.loader_args import check_stream_options, refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import Host, Node, decoding_setup, read_counts
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import owned_partitions, samples_per_partition
from lakeloader.pipeline.packed import PackedIterator, PackedSource
from lakeloader.recovery.mixture_resume import records, resume_mixture
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState, WeightChange
from lakeloader.state.packed_state import PackedMixtureState, PackedState, PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)

#: The name of a single dataset's only source, in the rounds' cursor.
ONLY = "lake"


class PackingNode(Node):
    """Packed samples of a :class:`~lakeloader.LakeDataset` (see the module docstring).

    ``batch_size`` counts samples. With ``num_workers > 0``, worker processes decode the
    rows (else this process's ``io_threads`` do); samples are cut in this process.

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
        self._init(dataset)

    def _init(self, dataset: Any) -> None:
        """Take the dataset in, on the loader's topology of now."""
        assert isinstance(dataset, LakeDataset) and dataset.packing is not None
        check_stream_options(self.host.options, "a packed dataset")
        if dataset.transform or dataset.batch_transform:
            raise ValueError("a packed dataset takes no transform or batch_transform")
        if dataset.on_error != "raise":
            raise ValueError(
                "a packed dataset reads with on_error='raise' (skipping is not supported)"
            )
        column = dataset.packing.column
        if column not in dataset.config.columns:
            raise KeyError(
                f"Packing column {column!r} is not among the dataset's columns "
                f"{list(dataset.config.columns)}"
            )
        C = dataset.config.num_partitions
        self._per_partition = samples_per_partition(
            self.host.global_batch_size, C, self.host.topology.world_size
        )
        self._base = self.dataset = dataset
        self._reader = dataset.reader()
        order = {**dataset.config.to_dict(), "packing": dataset.packing.to_dict()}
        self._config = config_hash(order)
        start = PartitionPosition(0, 0, 0)
        self._owned = owned_partitions(C, self.host.topology.world_size, self.host.topology.rank)
        self._placed_at = (self.host.topology.rank, self.host.topology.world_size)
        self._state = PackedState(
            dataset.fingerprint, self._config, C, 0, {p: start for p in self._owned}
        )

    def placed(self, topology: Topology) -> None:
        """Take this rank's partitions of the topology a pass starts on.

        Raises:
            TopologyError: If samples were delivered under another rank or world size (the
                state holds the partitions of the rank it was made for).
        """
        placed = (topology.rank, topology.world_size)
        if placed == self._placed_at:
            return
        if self._started():
            raise TopologyError(
                f"this packed loader delivered samples as rank {self._placed_at[0]} of "
                f"{self._placed_at[1]} and is now rank {placed[0]} of {placed[1]}: make it "
                "after the process group is initialised, or pass rank= and world_size="
            )
        self.host._close_iterator("a pass on another topology")
        self._init(self.dataset)

    def _started(self) -> bool:
        """Whether a sample was delivered or a state loaded."""
        return bool(self._state.samples)

    @property
    def epoch(self) -> int:
        """The earliest epoch any of this rank's partitions is in."""
        return min(x.epoch for x in self._state.partitions.values())

    def set_epoch(self, epoch: int, restart: bool) -> None:
        """Not supported: each partition runs through its epochs by itself.

        Raises:
            TypeError: Always.
        """
        raise TypeError(
            "a packed stream is endless, its partitions running through their epochs by "
            "themselves: iterate it for as many steps as you train, without set_epoch()"
        )

    def begin(self) -> Iterator[Any]:
        """The endless stream of samples from where every partition of this rank stands."""
        self.host._close_iterator("a newer iter(loader)")
        res = self.host._res
        unit_dir = res.unit_folder(self.host.options.cache_dir, self.host.options.cache_bytes)
        assert self.dataset.packing is not None
        samples = self._state.samples  # one round gives each partition one sample
        it = PackedIterator(
            [PackedSource(self.dataset, self._reader, dict(self._state.partitions))],
            self.dataset.packing,
            MixCursor(samples, {ONLY: samples}),
            MixWeights.of({ONLY: 1.0}),
            0,
            self._per_partition,
            self.host.topology,
            self.host.options,
            unit_dir,
            self.host._ensure_pool() if self.host.options.num_workers else None,
            self._delivered,
        )
        res.iterator = it
        return it

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode the lake's units."""
        layout = RowLayout.of(self._reader.schema)
        seed = self.dataset.config.seed
        return decoding_setup(self.host, [(self.dataset, self._reader, layout)], seed)

    def _delivered(self, cursor: MixCursor, positions: list[dict[int, PartitionPosition]]) -> None:
        """The only place the position moves: a batch was handed over."""
        state = self._state
        self._state = PackedState(
            state.fingerprint, state.config, state.num_partitions, cursor.slot, positions[0]
        )

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """This rank's partitions' positions: plain types, O(C / world size)."""
        refuse_fetched_ahead(fetched_ahead, "a packed stream")
        return self._state.to_dict()

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from the states of every rank of a run (a list, or one state of one rank).

        Raises:
            StateFormatError: If a state is not a packed state of a known version.
            StateMismatchError: If they belong to another snapshot, configuration or step, or
                do not cover this rank's partitions (the missing ones named).
        """
        self.host._close_iterator("load_state_dict()")
        merged = self._merged([state_dict] if isinstance(state_dict, Mapping) else state_dict)
        if (merged.fingerprint, merged.config) != (self._state.fingerprint, self._config):
            raise StateMismatchError(
                f"the packed state is of snapshot {merged.fingerprint} with configuration "
                f"{merged.config}; this loader reads {self._state.fingerprint} with "
                f"{self._config}: resume with the same lake snapshot, order settings and packing"
            )
        missing = [p for p in self._owned if p not in merged.partitions]
        if missing:
            raise StateMismatchError(
                f"the state(s) given hold no position for partition(s) {missing} of this rank: "
                "pass the states of every rank of the saved run, as a list"
            )
        mine = {p: merged.partitions[p] for p in self._owned}
        self._state = PackedState(
            merged.fingerprint, merged.config, merged.num_partitions, merged.samples, mine
        )

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: snapshot, packing, samples."""
        return self._state

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """Every rank's partitions, merged: a collective under torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.state()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.state())
        return self._merged(gathered).to_dict()

    def _merged(self, states: Sequence[Mapping[str, Any]]) -> PackedState:
        """The states of several ranks as one."""
        return PackedState.merge([PackedState.from_dict(s) for s in states])

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshot a checkpoint pins."""
        return {"lake": self.dataset}

    def _positions(self) -> list[PartitionPosition]:
        """Where this rank's partitions stand."""
        return list(self._state.partitions.values())

    def _readers_used(self) -> list[UnitReader]:
        return [self._reader]

    def stats(self) -> dict[str, int]:
        """What the readers did, and the tokens and padding handed out by this rank."""
        positions = self._positions()
        return {
            **read_counts(self._readers_used()),
            "tokens": sum(x.tokens for x in positions),
            "padding": sum(x.padding for x in positions),
        }


class PackedMixtureNode(PackingNode):
    """Packed samples of a Mixture with a packing: rounds of its sources' packed streams.

    ``batch_size`` counts samples. ``state_dict()`` holds this rank's partitions of every
    source; ``load_state_dict`` takes the states of every rank (a list) and continues under any
    world size dividing ``C``, any batch size that ``C`` divides, and new weights or sources.
    """

    @property
    def what(self) -> str:
        """``"packed mixture"``."""
        return "packed mixture"

    def _init(self, dataset: Any) -> None:
        """Take the mixture in, on the loader's topology of now."""
        assert isinstance(dataset, Mixture) and dataset.packing is not None
        check_stream_options(self.host.options, "a packed Mixture")
        self.mixture = self.dataset = dataset
        C = next(iter(dataset.sources.values())).config.num_partitions
        self._rounds = samples_per_partition(
            self.host.global_batch_size, C, self.host.topology.world_size
        )
        self._owned = owned_partitions(C, self.host.topology.world_size, self.host.topology.rank)
        self._placed_at = (self.host.topology.rank, self.host.topology.world_size)
        self._readers = {n: ds.reader() for n, ds in dataset.sources.items()}
        cursor = MixtureState(
            seed=dataset.seed,
            slot=0,
            counts={n: 0 for n in dataset.names},
            history=(WeightChange(0, dict(dataset.raw_weights)),),
            epoch=0,
            epoch_start=0,
            epoch_rows=dataset.epoch_rows,
            sources=records(dataset),
            topology=self.host.topology.to_dict(),
        )
        self._mixed = PackedMixtureState(cursor, {n: self._fresh(n) for n in dataset.names})

    def _fresh(self, name: str) -> PackedState:
        """A source's partitions of this rank at their start."""
        ds = self.mixture.sources[name]
        start = PartitionPosition(0, 0, 0)
        return PackedState(
            ds.fingerprint,
            self._packing_hash(name),
            ds.config.num_partitions,
            0,
            {p: start for p in self._owned},
        )

    def _packing_hash(self, name: str) -> str:
        ds, packing = self.mixture.sources[name], self.mixture.packing
        assert packing is not None
        return config_hash({**ds.config.to_dict(), "packing": packing.to_dict()})

    @property
    def epoch(self) -> int:
        """0: each source's partitions run through their own epochs (see ``state_dict()``)."""
        return 0

    def _started(self) -> bool:
        return bool(self._mixed.mixture.slot)

    def worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        sources = [self.mixture.sources[n] for n in self.mixture.names]
        readers = [self._readers[n] for n in self.mixture.names]
        return decoding_setup(
            self.host,
            [(ds, r, RowLayout.of(r.schema)) for ds, r in zip(sources, readers, strict=True)],
            self.mixture.seed,
        )

    def begin(self) -> Iterator[Any]:
        """The endless stream of rounds from where every source's partitions stand."""
        self.host._close_iterator("a newer iter(loader)")
        res = self.host._res
        unit_dir = res.unit_folder(self.host.options.cache_dir, self.host.options.cache_bytes)
        names = self.mixture.names
        sources = [
            PackedSource(
                self.mixture.sources[n], self._readers[n], dict(self._mixed.sources[n].partitions)
            )
            for n in names
        ]
        state, packing = self._mixed.mixture, self.mixture.packing
        assert packing is not None
        it = PackedIterator(
            sources,
            packing,
            MixCursor(state.slot, state.counts),
            self.mixture.weights,
            self.mixture.seed,
            self._rounds,
            self.host.topology,
            self.host.options,
            unit_dir,
            self.host._ensure_pool() if self.host.options.num_workers else None,
            self._delivered,
            source_key=self.mixture.source_key,
        )
        res.iterator = it
        return it

    def _delivered(self, cursor: MixCursor, positions: list[dict[int, PartitionPosition]]) -> None:
        """The only place the position moves: a batch was handed over."""
        mixture = dataclasses.replace(
            self._mixed.mixture, slot=cursor.slot, counts=dict(cursor.counts)
        )
        sources = {
            name: dataclasses.replace(
                self._mixed.sources[name], samples=cursor.counts.get(name, 0), partitions=mine
            )
            for name, mine in zip(self.mixture.names, positions, strict=True)
        }
        self._mixed = PackedMixtureState(mixture, {**self._mixed.sources, **sources})

    def restore(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from the states of every rank of a run (a list; one state with one rank).

        Raises:
            StateFormatError: If a state is not a packed mixture's state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one, or the
                states do not cover this rank's partitions of a source (named).
        """
        self.host._close_iterator("load_state_dict()")
        merged = self._merged([state_dict] if isinstance(state_dict, Mapping) else state_dict)
        resumed = resume_mixture(merged.mixture, self.mixture)
        for change in resumed.changes:
            logger.info("packed mixture resumed at round %d: %s", resumed.state.slot, change)
        sources = dict(merged.sources)
        for name in self.mixture.names:
            if name not in sources:  # added: from its start
                sources[name] = self._fresh(name)
                continue
            saved = sources[name]
            missing = [p for p in self._owned if p not in saved.partitions]
            if missing or saved.config != self._packing_hash(name):
                raise StateMismatchError(
                    f"the state(s) of source {name!r} hold no position for partition(s) {missing} "
                    "of this rank, or another packing: pass the states of every rank of the "
                    "saved run, as a list, with the same packing"
                )
            mine = {p: saved.partitions[p] for p in self._owned}
            sources[name] = dataclasses.replace(saved, partitions=mine)
        mixture = dataclasses.replace(resumed.state, topology=self.host.topology.to_dict())
        self._mixed = PackedMixtureState(mixture, sources)

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: the rounds' cursor."""
        return self._mixed.mixture

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source."""
        return dict(self.mixture.sources)

    def state(self, fetched_ahead: int = 0) -> dict[str, Any]:
        """The rounds' cursor and this rank's partitions of every source: plain types."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return self._mixed.to_dict()

    def _merged(self, states: Sequence[Mapping[str, Any]]) -> PackedMixtureState:  # type: ignore[override]
        return PackedMixtureState.merge([PackedMixtureState.from_dict(s) for s in states])

    def _positions(self) -> list[PartitionPosition]:
        return [x for s in self._mixed.sources.values() for x in s.partitions.values()]

    def _readers_used(self) -> list[UnitReader]:
        return list(self._readers.values())
