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

User code and quarantine (:mod:`lakeloader.pipeline.packed`): a source's ``transform`` makes
the packing column of each row; the ``collate_fn`` gets the samples, the ``batch_transform`` (a
LakeDataset's, or ``Mixture(batch_transform=...)``) the packed batch; both in this process. A
unit skipped (``on_error="skip"``, ``validate``) adds no token, the row positions counting its
rows; it is in the state's ``quarantine`` (a packed mixture's rounds' cursor's), merged across
ranks at a save, known to later passes and resumes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from lakeloader.checkpoint.barrier import Position
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError, TopologyError
from lakeloader.io.reader import UnitReader
from lakeloader.loader_args import refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.nodes.base import Host, Node, decoding_setup, read_counts
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import owned_partitions, samples_per_partition
from lakeloader.pipeline.collate import BatchTransform
from lakeloader.pipeline.packed import PackedIterator, PackedSource, Skips, arena_layout
from lakeloader.pipeline.recipe import BatchRecipe
from lakeloader.recovery.mixture_resume import records, resume_mixture
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState, WeightChange
from lakeloader.state.packed_state import PackedMixtureState, PackedState, PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry, merge
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)

#: The name of a single dataset's only source, in the rounds' cursor.
ONLY = "lake"


class PackingNode(Node):
    """Packed samples of a :class:`~lakeloader.LakeDataset` (see the module docstring).

    ``batch_size`` counts samples. With ``num_workers > 0``, worker processes decode the
    rows (else this process's ``io_threads`` do); samples are cut, and the user's code run,
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
        self._init(dataset)

    def _init(self, dataset: Any) -> None:
        """Take the dataset in, on the loader's topology of now."""
        assert isinstance(dataset, LakeDataset) and dataset.packing is not None
        column = dataset.packing.column
        if dataset.transform is None and column not in dataset.config.columns:
            raise KeyError(
                f"Packing column {column!r} is not among the dataset's columns "
                f"{list(dataset.config.columns)}: read it, or give a transform that makes it"
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
        state, samples = self._state, self._state.samples  # a round: a sample of each partition
        source = PackedSource(self.dataset, self._reader, dict(state.partitions), state.quarantine)
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
        """A pass over ``sources``: the :class:`PackedIterator` of this rank's partitions."""
        host, res, packing = self.host, self.host._res, self.dataset.packing
        host._close_iterator("a newer iter(loader)")
        assert packing is not None
        it = PackedIterator(
            sources,
            packing,
            cursor,
            weights,
            seed,
            self._per_partition,
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
        self, cursor: MixCursor, positions: list[dict[int, PartitionPosition]], skipped: Skips
    ) -> None:
        """The only place the position moves: a batch was handed over."""
        self._state = dataclasses.replace(
            self._state, samples=cursor.slot, partitions=positions[0]
        ).with_quarantine(skipped[0])

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
        self._state = dataclasses.replace(merged, partitions=mine)

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: snapshot, packing, samples."""
        return self._state

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """Every rank's partitions and quarantine, merged: a collective under torch.distributed.

        ``quarantine`` (every rank's, from the barrier) is merged into this rank's first.
        """
        self._quarantine(quarantine)
        if not (dist.is_available() and dist.is_initialized()):
            return self.state()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.state())
        return self._merged(gathered).to_dict()

    def _quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the state."""
        self._state = self._state.with_quarantine(entries)

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far, sorted; merged across ranks at saves."""
        return list(self.barrier_position().quarantine)

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
        self.mixture = self.dataset = dataset
        C = next(iter(dataset.sources.values())).config.num_partitions
        self._per_partition = samples_per_partition(
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
        layout = arena_layout(sources, readers[0])
        return decoding_setup(
            self.host,
            [(ds, r, layout) for ds, r in zip(sources, readers, strict=True)],
            self.mixture.seed,
        )

    def begin(self) -> Iterator[Any]:
        """The endless stream of rounds from where every source's partitions stand."""
        mix, at, known = self.mixture, self._mixed, self._mixed.mixture.quarantine
        sources = [
            PackedSource(mix.sources[n], self._readers[n], dict(at.sources[n].partitions), known)
            for n in mix.names
        ]
        cursor, transform = MixCursor(at.mixture.slot, at.mixture.counts), mix.batch_transform
        return self._begin(sources, cursor, mix.weights, mix.seed, transform, mix.source_key)

    def _delivered(
        self, cursor: MixCursor, positions: list[dict[int, PartitionPosition]], skipped: Skips
    ) -> None:
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
        self._quarantine(q for found in skipped for q in found)

    def _quarantine(self, entries: Iterable[QuarantineEntry]) -> None:
        """Add units skipped for good to the rounds' cursor (entries name their files)."""
        mixture = self._mixed.mixture
        merged = tuple(merge(mixture.quarantine, entries))
        mixture = dataclasses.replace(mixture, quarantine=merged)
        self._mixed = dataclasses.replace(self._mixed, mixture=mixture)

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
