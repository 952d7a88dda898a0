"""``PackedMixtureLoader``: what ``lakeloader.DataLoader(mixture)`` is for a packed Mixture.

Each source is packed on its own, one token stream per partition (:mod:`lakeloader.order.packing`);
a step is ``global batch / C`` rounds, each round one sample from every partition of one
source, the source of each round drawn in the weights' proportions by the mixture's cursor
(over rounds). Why rounds of sources and not the mixture's row sequence packed: a sample's
start depends on the lengths of every row before it in its stream, and a rank reads only its
partitions' rows; the mixture's row sequence interleaves every partition of every source, so
packing it would make every rank read every row. Rounds keep each rank on its partitions, every
rank's batch the same size, and the state O(sources x C). Batches are those of a
:class:`~lakeloader.packed_loader.PackedLoader` plus ``mixture.source_key``: each sample's source.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Position
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError
from lakeloader.io.reader import UnitReader
from lakeloader.loader import LOADER_FOR
from lakeloader.loader_args import check_stream_options, refuse_fetched_ahead
from lakeloader.mixture import Mixture
from lakeloader.order.mixture import MixCursor
from lakeloader.order.packing import owned_partitions, samples_per_partition
from lakeloader.packed_loader import PackedLoader
from lakeloader.pipeline.packed import PackedIterator, PackedSource
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.recovery.mixture_resume import records, resume_mixture
from lakeloader.state.loader_state import config_hash
from lakeloader.state.mixture_state import MixtureState, WeightChange
from lakeloader.state.packed_state import PackedMixtureState, PackedState, PartitionPosition
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)


class PackedMixtureLoader(PackedLoader):
    """Streams packed samples of a Mixture with a packing (see the module docstring).

    ``batch_size`` counts samples. ``state_dict()`` holds this rank's partitions of every
    source; ``load_state_dict`` takes the states of every rank (a list) and continues under any
    world size dividing ``C``, any batch size that ``C`` divides, and new weights or sources.
    """

    dataset: Any  # the Mixture

    def _init_dataset(self, dataset: LakeDataset | Mixture) -> None:
        assert isinstance(dataset, Mixture) and dataset.packing is not None
        check_stream_options(self.options, "a packed Mixture")
        self.mixture = self.dataset = dataset
        C = next(iter(dataset.sources.values())).config.num_partitions
        self._rounds = samples_per_partition(self.global_batch_size, C, self.world_size)
        self._owned = owned_partitions(C, self.world_size, self.rank)
        self._placed_at = (self.rank, self.world_size)
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
            topology=self.topology.to_dict(),
        )
        self._mixed = PackedMixtureState(cursor, {n: self._fresh(n) for n in dataset.names})
        self._res = LoaderResources(self)

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

    def _worker_setup(self) -> WorkerSetup:
        """Workers that decode every source's units (a task names its source by index)."""
        sources = [self.mixture.sources[n] for n in self.mixture.names]
        readers = [self._readers[n] for n in self.mixture.names]
        return self._decoding_setup(
            [(ds, r, RowLayout.of(r.schema)) for ds, r in zip(sources, readers, strict=True)],
            self.mixture.seed,
        )

    def _pass(self) -> Iterator[Any]:
        self._close_iterator("a newer iter(loader)")
        res = self._res
        unit_dir = res.unit_folder(self.options.cache_dir, self.options.cache_bytes)
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
            self.topology,
            self.options,
            unit_dir,
            self._ensure_pool() if self.num_workers else None,
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

    def load_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from the states of every rank of a run (a list; one state with one rank).

        Raises:
            StateFormatError: If a state is not a packed mixture's state of a known version.
            StateMismatchError: If a source or the seed differs from the saved one, or the
                states do not cover this rank's partitions of a source (named).
        """
        self._close_iterator("load_state_dict()")
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
        mixture = dataclasses.replace(resumed.state, topology=self.topology.to_dict())
        self._mixed = PackedMixtureState(mixture, sources)

    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks: the rounds' cursor."""
        return self._mixed.mixture

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint pins: one per source."""
        return dict(self.mixture.sources)

    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """The rounds' cursor and this rank's partitions of every source: plain types."""
        refuse_fetched_ahead(fetched_ahead, "a packed mixture")
        return self._mixed.to_dict()

    def _merged(self, states: Sequence[Mapping[str, Any]]) -> PackedMixtureState:  # type: ignore[override]
        return PackedMixtureState.merge([PackedMixtureState.from_dict(s) for s in states])

    def _positions(self) -> list[PartitionPosition]:
        return [x for s in self._mixed.sources.values() for x in s.partitions.values()]

    def _readers_used(self) -> list[UnitReader]:
        return list(self._readers.values())


LOADER_FOR["packed-mixture"] = PackedMixtureLoader
