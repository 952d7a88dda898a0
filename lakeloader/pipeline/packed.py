"""A packed stream for one rank: its partitions' rows read in order, cut into samples.

Each partition the rank owns (:mod:`lakeloader.order.packing`) is a
:class:`~lakeloader.pipeline.partition_stream.PartitionStream` reading through the epochs' unit
stores (their units decoded in the DataLoader's workers when it has them).
:class:`PackedIterator` takes ``k`` samples of every partition per step and lays them out
partition-major.

The user's code: a source's row ``transform`` runs on each row before packing (the packing
column is read from the transformed row: a list, array or tensor of integers; see
:mod:`~lakeloader.pipeline.partition_stream`). The loader's ``collate_fn`` gets the
list of a rank's samples (each a dict of its 1-D tensors, a 0-d one for a mixture's source)
instead of the default stacking; the ``batch_transform`` gets the batch dict. Their seeds are
the samples': sample ``n`` of partition ``p`` of source ``name`` has
``slot_seeds(its dataset's seed, crc32(name), n * C + p)`` (``name`` is ``"lake"`` for one
lake), the same under any world size. Transforms run in the loader's process (workers decode).

Quarantine (``on_error="skip"``, ``validate``): a skipped unit's rows add no token, but the
partitions' row positions count them. The units skipped are reported with the batch whose
reads found them, and are known from then on to the epochs the stream opens (and, through
the state, to later passes and resumes): screened without reading.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lakeloader.cache.packed import RowLayout
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.options import LoaderOptions
from lakeloader.order.mixture import MixCursor, MixDraw, MixWeights
from lakeloader.order.packing import owned_partitions
from lakeloader.packing import Packing
from lakeloader.pipeline.partition_stream import EpochReader, PartitionStream
from lakeloader.pipeline.recipe import (
    COLUMNS,
    BatchRecipe,
    Payload,
    columns_payload,
    finish_payload,
    rows_payload,
)
from lakeloader.pipeline.stores import Leaf, Stores
from lakeloader.randomness import slot_seeds
from lakeloader.state.packed_state import PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool

#: The units each source found skipped in a step: one tuple per source.
Skips = list[tuple[QuarantineEntry, ...]]


@dataclass(frozen=True)
class PackedSource:
    """A packed stream's source: a dataset, its reader, where this rank's partitions stand.

    Attributes:
        dataset: The dataset (its ``transform``, ``on_error`` and ``validate`` apply to its
            rows).
        reader: Reads its units.
        positions: ``{partition: position}`` of the partitions this rank owns.
        known: Units already quarantined (from the state): screened without reading.
    """

    dataset: LakeDataset
    reader: UnitReader
    positions: dict[int, PartitionPosition]
    known: tuple[QuarantineEntry, ...] = ()


def arena_layout(datasets: Sequence[LakeDataset], reader: UnitReader) -> RowLayout | None:
    """How rows are packed into the arena: None when a row transform takes rows one by one."""
    if any(ds.transform is not None for ds in datasets):
        return None
    return RowLayout.of(reader.schema)


class PackedIterator:
    """Endless iterator over one rank's packed batches, from one source or a mixture's.

    A step is ``k = global batch / C`` rounds; a round takes one sample from every partition of
    one source, the source of each round drawn by the mixture's cursor (always the only source
    of a single dataset). A rank's batch is, for each partition it owns, its samples of the
    step's rounds in order: partition-major, whatever the world size.

    Args:
        sources: The sources, in the order the cursor's weights name them.
        packing: How samples are cut (the same for every source).
        cursor: Rounds drawn so far (in all, and from each source).
        weights: The weights of the sources' rounds.
        seed: The seed of the rounds' interleaving.
        rounds: Rounds per step (``k``).
        topology: The loader's topology.
        options: The loader's options.
        unit_dir: The loader's folder for decoded units.
        pool: The DataLoader's workers, which decode the rows; None: this process's threads.
        delivered: Told the cursor, every source's partitions and the units each source found
            skipped, after each batch handed over.
        recipe: The loader's ``collate_fn`` and the ``batch_transform`` (see the module
            docstring); a row transform is its source's.
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
        rounds: int,
        topology: Topology,
        options: LoaderOptions,
        unit_dir: str,
        pool: WorkerPool | None,
        delivered: Callable[[MixCursor, list[dict[int, PartitionPosition]], Skips], None],
        recipe: BatchRecipe,
        source_key: str | None = None,
    ) -> None:
        self._source_key, self._recipe = source_key, recipe
        self._packing, self._cursor, self._weights, self._seed = packing, cursor, weights, seed
        self._k = rounds
        self._delivered = delivered
        self._readers: dict[tuple[int, int], EpochReader] = {}
        self._stores = Stores(
            [
                Leaf(s.dataset, s.reader, s.known, BatchRecipe(lists=s.dataset.list_format))
                for s in sources
            ],
            options,
            Topology(1, 0, 0, options.batch_size),
            unit_dir,
            pool,
            arena_layout([s.dataset for s in sources], sources[0].reader),
            workers_decode=True,
        )
        self._closed = False

        def reader_of(source: int, epoch: int) -> EpochReader:
            if (source, epoch) not in self._readers:
                transform = sources[source].dataset.transform
                store = self._stores.get(source, epoch)
                self._readers[(source, epoch)] = EpochReader(store, transform)
            return self._readers[(source, epoch)]

        self._C = C = sources[0].dataset.config.num_partitions
        self._owned = list(owned_partitions(C, topology.world_size, topology.rank))
        #: Each source's seeds of its samples (see the module docstring).
        self._sample_keys = [
            (s.dataset.config.seed, zlib.crc32(name.encode()))
            for s, name in zip(sources, weights.names, strict=True)
        ]
        self._streams = [
            [
                PartitionStream(p, src.positions[p], packing, functools.partial(reader_of, i))
                for p in self._owned
            ]
            for i, src in enumerate(sources)
        ]

    def __iter__(self) -> PackedIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        L, k = self._packing.seq_len, self._k
        draw, cursor = self._cursor.take(self._weights, self._seed, k)
        rounds = draw.sources
        parts = len(self._owned)
        tokens = np.empty((parts, k, L), dtype=np.int64)
        positions = np.empty((parts, k, L), dtype=np.int64)
        pads = np.empty((parts, k, L), dtype=bool)
        for source, streams in enumerate(self._streams):
            mine = rounds == source
            count = int(mine.sum())
            for j, stream in enumerate(streams):
                if count:
                    t, q, m = stream.take(count * L)
                    tokens[j, mine], positions[j, mine] = t.reshape(count, L), q.reshape(count, L)
                    pads[j, mine] = m.reshape(count, L)
        columns = {
            "input_ids": tokens.reshape(-1, L),
            "position_ids": positions.reshape(-1, L),
            "pad_mask": pads.reshape(-1, L),
        }
        if self._source_key is not None:
            columns[self._source_key] = np.tile(rounds, parts)
        batch = finish_payload(self._payload(columns, draw), self._recipe)
        self._cursor = cursor
        skips = [self._skipped(source) for source in range(len(self._streams))]
        self._delivered(
            cursor, [{s.part: s.at for s in streams} for streams in self._streams], skips
        )
        self._release()
        return batch

    def _payload(self, columns: dict[str, np.ndarray], draw: MixDraw) -> Payload:
        """The batch through the user's code: the ``collate_fn`` and the ``batch_transform``."""
        recipe = self._recipe
        if not recipe.user_code:
            return COLUMNS, columns
        C, parts = self._C, len(self._owned)
        slots = draw.offsets[None, :] * C + np.asarray(self._owned)[:, None]  # partition-major
        of = np.broadcast_to(draw.sources, slots.shape)
        seeds = np.empty(slots.shape, dtype=np.uint64)
        for source, (seed, key) in enumerate(self._sample_keys):
            mine = of == source
            seeds[mine] = slot_seeds(seed, key, slots[mine])
        seeds = seeds.reshape(-1)
        if recipe.collate_fn is None:
            return columns_payload(columns, recipe, seeds)
        tensors = {name: torch.from_numpy(value) for name, value in columns.items()}
        samples = [{n: t[i] for n, t in tensors.items()} for i in range(parts * len(draw.sources))]
        return rows_payload(samples, recipe, seeds)

    def _skipped(self, source: int) -> tuple[QuarantineEntry, ...]:
        """The units a source's partitions found skipped since the last step.

        They are known from now on to the epochs the source opens (screened without reading).
        """
        found = tuple(q for s in self._streams[source] for q in s.skipped)
        for stream in self._streams[source]:
            stream.skipped.clear()
        if found:
            leaf = self._stores.leaves[source]
            self._stores.leaves[source] = leaf._replace(known=leaf.known + found)
        return found

    def _release(self) -> None:
        """Evict what every partition of this rank is past; close epochs all have left."""
        for source, epoch in list(self._readers):
            rows = [
                s.at.row if s.at.epoch == epoch else (0 if s.at.epoch < epoch else None)
                for s in self._streams[source]
            ]
            behind = [r for r in rows if r is not None]
            if not behind:
                del self._readers[(source, epoch)]
                self._stores.drop(source, epoch)
            else:
                self._readers[(source, epoch)].release(min(behind))

    def cache_bytes(self) -> int:
        """Bytes of decoded units held now."""
        return self._stores.held_bytes()

    def cache_peak_bytes(self) -> int:
        """Most bytes held at once by an epoch's store."""
        return self._stores.peak_bytes()

    def close(self, wait: bool = True, ended_by: str | None = None) -> None:
        """Stop decoding; drop every epoch's units (idempotent)."""
        self._closed = True
        self._readers.clear()
        self._stores.close(wait)
