"""``PackedLoader``: what ``lakeloader.DataLoader(dataset)`` is for a dataset with a packing.

Each batch is ``batch_size`` samples of ``seq_len`` tokens: ``input_ids``, ``position_ids``
(the token's position in its document) and ``pad_mask`` (True on padding, at the end of a
partition's epoch). The stream is endless: iterate for as many steps as you train.
``state_dict()`` holds this rank's partitions (O(C)); ``load_state_dict`` takes the states of
every rank (a list; one state is enough with one rank) and continues under any world size that
divides ``C`` and any batch size that ``C`` divides. How rows become samples, and why per
partition: :mod:`lakeloader.order.packing`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist

from lakeloader.cache.packed import RowLayout
from lakeloader.checkpoint.barrier import Position
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError, TopologyError
from lakeloader.io.reader import UnitReader
from lakeloader.loader import LOADER_FOR, DataLoader
from lakeloader.loader_args import check_stream_options, refuse_fetched_ahead
from lakeloader.loader_position import StatePosition
from lakeloader.mixture import Mixture
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import owned_partitions, samples_per_partition
from lakeloader.pipeline.packed import PackedIterator, PackedSource
from lakeloader.pipeline.resources import LoaderResources
from lakeloader.state.loader_state import config_hash
from lakeloader.state.packed_state import PackedState, PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.process import WorkerSetup

logger = logging.getLogger(__name__)

#: The name of a single dataset's only source, in the rounds' cursor.
ONLY = "lake"


class PackedLoader(StatePosition, DataLoader):
    """Streams packed samples of a :class:`~lakeloader.LakeDataset` (see the module docstring).

    ``batch_size`` counts samples. With ``num_workers > 0``, worker processes decode the
    rows (else this process's ``io_threads`` do); samples are cut in this process.
    """

    def _init_dataset(self, dataset: LakeDataset | Mixture) -> None:
        assert isinstance(dataset, LakeDataset) and dataset.packing is not None
        check_stream_options(self.options, "a packed dataset")
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
        self._per_partition = samples_per_partition(self.global_batch_size, C, self.world_size)
        self._base = self.dataset = dataset
        self._reader = dataset.reader()
        order = {**dataset.config.to_dict(), "packing": dataset.packing.to_dict()}
        self._config = config_hash(order)
        start = PartitionPosition(0, 0, 0)
        self._owned = owned_partitions(C, self.world_size, self.rank)
        self._placed_at = (self.rank, self.world_size)
        self._state = PackedState(
            dataset.fingerprint, self._config, C, 0, {p: start for p in self._owned}
        )
        self._res = LoaderResources(self)

    def _pass_steps(self) -> int:
        raise TypeError("a packed stream is endless: it has no len()")

    def _placed(self, topology: Topology) -> None:
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
        self._close_iterator("a pass on another topology")
        self._init_dataset(self.dataset)

    def _started(self) -> bool:
        """Whether a sample was delivered or a state loaded."""
        return bool(self._state.samples)

    @property
    def epoch(self) -> int:
        """The earliest epoch any of this rank's partitions is in."""
        return min(x.epoch for x in self._state.partitions.values())

    def set_epoch(self, epoch: int, *, restart: bool = False) -> None:
        """Not supported: each partition runs through its epochs by itself.

        Raises:
            TypeError: Always.
        """
        raise TypeError(
            "a packed stream is endless, its partitions running through their epochs by "
            "themselves: iterate it for as many steps as you train, without set_epoch()"
        )

    def _pass(self) -> Iterator[Any]:
        self._close_iterator("a newer iter(loader)")
        res = self._res
        unit_dir = res.unit_folder(self.options.cache_dir, self.options.cache_bytes)
        assert self.dataset.packing is not None
        samples = self._state.samples  # one round gives each partition one sample
        it = PackedIterator(
            [PackedSource(self.dataset, self._reader, dict(self._state.partitions))],
            self.dataset.packing,
            MixCursor(samples, {ONLY: samples}),
            MixWeights.of({ONLY: 1.0}),
            0,
            self._per_partition,
            self.topology,
            self.options,
            unit_dir,
            self._ensure_pool() if self.num_workers else None,
            self._delivered,
        )
        res.iterator = it
        return it

    def _worker_setup(self) -> WorkerSetup:
        """Workers that decode the lake's units."""
        layout = RowLayout.of(self._reader.schema)
        return self._decoding_setup(
            [(self.dataset, self._reader, layout)], self.dataset.config.seed
        )

    def _delivered(self, cursor: MixCursor, positions: list[dict[int, PartitionPosition]]) -> None:
        """The only place the position moves: a batch was handed over."""
        state = self._state
        self._state = PackedState(
            state.fingerprint, state.config, state.num_partitions, cursor.slot, positions[0]
        )

    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """This rank's partitions' positions: plain types, O(C / world size)."""
        refuse_fetched_ahead(fetched_ahead, "a packed stream")
        return self._state.to_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from the states of every rank of a run (a list, or one state of one rank).

        Raises:
            StateFormatError: If a state is not a packed state of a known version.
            StateMismatchError: If they belong to another snapshot, configuration or step, or
                do not cover this rank's partitions (the missing ones named).
        """
        self._close_iterator("load_state_dict()")
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
            return self.state_dict()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.state_dict())
        return self._merged(gathered).to_dict()

    def _merged(self, states: Sequence[Mapping[str, Any]]) -> PackedState:
        """The states of several ranks as one."""
        return PackedState.merge([PackedState.from_dict(s) for s in states])

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshot a checkpoint pins."""
        return {"lake": self.dataset}

    @property
    def quarantine(self) -> list[Any]:
        """Packed datasets skip no unit."""
        return []

    def _positions(self) -> list[PartitionPosition]:
        """Where this rank's partitions stand."""
        return list(self._state.partitions.values())

    def _readers_used(self) -> list[UnitReader]:
        return [self._reader]

    def stats(self) -> dict[str, int]:
        """Counters for tests and benchmarks (cumulative over the loader's life)."""
        it, counters = self._res.iterator, [r.counters for r in self._readers_used()]
        positions = self._positions()
        return {
            "units_decoded": sum(c.units_decoded for c in counters),
            "bytes_read": sum(c.bytes_read for c in counters),
            "requests": sum(c.requests for c in counters),
            "tokens": sum(x.tokens for x in positions),
            "padding": sum(x.padding for x in positions),
            "cache_bytes": it.cache_bytes() if it is not None else 0,
            "cache_peak_bytes": it.cache_peak_bytes() if it is not None else 0,
        }


LOADER_FOR["packed"] = PackedLoader
