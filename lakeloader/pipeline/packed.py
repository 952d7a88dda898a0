"""A packed stream for one rank: its partitions' rows read in order, cut into samples.

Each partition the rank owns (:mod:`lakeloader.order.packing`) is a :class:`PartitionStream`:
it reads its rows in chunks, ahead, through an :class:`EpochReader` (the unit store and builder
of one epoch, shared by the rank's partitions; its units are decoded in the DataLoader's
workers when it has them), and hands out tokens; at the end of its epoch
it pads its last sample and goes on with the next epoch's rows. :class:`PackedIterator` takes
``k`` samples of every partition per step and lays them out partition-major.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from lakeloader.cache.arrays import Ragged
from lakeloader.cache.packed import RowLayout
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.options import LoaderOptions
from lakeloader.order.batches import BatchSpec, partition_specs
from lakeloader.order.mixture import MixCursor, MixWeights
from lakeloader.order.packing import Block, cut_tokens, owned_partitions
from lakeloader.packing import Packing
from lakeloader.pipeline.recipe import COLUMNS, BatchRecipe
from lakeloader.pipeline.stores import Leaf, Store, Stores
from lakeloader.state.packed_state import PartitionPosition
from lakeloader.topology import Topology
from lakeloader.workers.pool import WorkerPool

#: Rows a partition reads at a time.
CHUNK_ROWS: Final = 1024
#: Chunks a partition has requested ahead of the one it reads.
AHEAD_CHUNKS: Final = 4
#: Takes cut at once from a partition's buffered rows (:class:`~lakeloader.order.packing.Block`).
CUT_AHEAD: Final = 32


class EpochReader:
    """One epoch's store, read by a rank's partitions in chunks.

    Args:
        store: The epoch's store (its units decoded in the workers, or in threads).
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self.plan = store.spec.plan
        self.sizes = np.diff(self.plan.starts)
        self._builder = store.builder

    def request(self, part: int, start: int, rows: int) -> BatchSpec:
        """Ask for rows ``[start, start + rows)`` of a partition (decoded ahead)."""
        (spec,) = partition_specs(
            self.plan, np.zeros(1, np.int64), np.array([part]), np.array([start]), np.array([rows])
        )
        self._store.store.request(spec.positions)
        return spec

    def tokens(self, spec: BatchSpec, column: str) -> tuple[np.ndarray, np.ndarray]:
        """The token lists of a requested run: values end to end, and offsets."""
        kind, columns = self._builder.build(spec)
        self._builder.skipped.pop(spec.step, None)
        assert kind == COLUMNS
        value = columns[column]
        if isinstance(value, Ragged):
            return value.values.reshape(len(value.values)), value.offsets
        if isinstance(value, np.ndarray) and value.ndim == 2:  # a fixed-size list
            width = value.shape[1]
            return value.reshape(-1), np.arange(len(value) + 1, dtype=np.int64) * width
        raise TypeError(
            f"packing needs a list column of integers; {column!r} is {type(value).__name__} in "
            "the batch"
        )

    def release(self, consumed: int) -> None:
        """Evict units every partition of this rank is past (``consumed``: fewest rows read)."""
        self._store.store.release(consumed * self.plan.num_partitions)


class PartitionStream:
    """One partition's tokens, epoch after epoch (see the module docstring).

    Args:
        part: The partition.
        at: Where it stands.
        packing: How samples are cut.
        reader_of: The :class:`EpochReader` of an epoch.
    """

    def __init__(
        self,
        part: int,
        at: PartitionPosition,
        packing: Packing,
        reader_of: Callable[[int], EpochReader],
    ) -> None:
        self.part, self.at, self._packing, self._reader_of = part, at, packing, reader_of
        #: The next epoch: its reader, chunks requested ahead, and the next row to request.
        self._following: tuple[int, EpochReader, deque[BatchSpec], int] | None = None
        self._start_epoch(at.epoch, at.row)

    def _start_epoch(self, epoch: int, row: int) -> None:
        following, self._following = self._following, None
        if following is not None and following[0] == epoch and row == 0:
            _, self._reader, self._pending, self._fetch = following  # requested ahead
        else:
            self._reader = self._reader_of(epoch)
            self._fetch = row  # the next row to request
            self._pending = deque()
        self._size = int(self._reader.sizes[self.part])
        self._values = np.zeros(0, dtype=np.int64)
        self._offsets = np.zeros(1, dtype=np.int64)
        self._block: Block | None = None  # cut from the buffer, which starts at its first row
        self._used = 0  # the block's tokens taken
        self._block_row = row  # the row the buffer starts at while a block is cut
        self._top_up()

    def _top_up(self) -> None:
        """Keep :data:`AHEAD_CHUNKS` chunks requested, into the next epoch's first rows.

        The next epoch's chunks are requested once this epoch's last rows are: the partition
        crosses into it without waiting for its first row group to decode.
        """
        while len(self._pending) < AHEAD_CHUNKS and self._fetch < self._size:
            rows = min(CHUNK_ROWS, self._size - self._fetch)
            self._pending.append(self._reader.request(self.part, self._fetch, rows))
            self._fetch += rows
        if self._fetch < self._size or len(self._pending) >= AHEAD_CHUNKS:
            return
        if self._following is None:
            self._following = (self.at.epoch + 1, self._reader_of(self.at.epoch + 1), deque(), 0)
        epoch, reader, pending, fetch = self._following
        size = int(reader.sizes[self.part])
        while len(self._pending) + len(pending) < AHEAD_CHUNKS and fetch < size:
            rows = min(CHUNK_ROWS, size - fetch)
            pending.append(reader.request(self.part, fetch, rows))
            fetch += rows
        self._following = (epoch, reader, pending, fetch)

    def _pull(self) -> bool:
        """Read the next chunk into the buffer; False when the epoch's rows are all read."""
        if not self._pending:
            return False
        values, offsets = self._reader.tokens(self._pending.popleft(), self._packing.column)
        self._top_up()
        self._values = np.concatenate([self._values, values[offsets[0] : offsets[-1]]])
        self._offsets = np.concatenate(
            [self._offsets, self._offsets[-1] + offsets[1:] - offsets[0]]
        )
        return True

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``count`` tokens (whole samples): tokens, positions, padding mask.

        Cut from a block of up to :data:`CUT_AHEAD` takes while the buffered rows hold them;
        the position moves take by take, as :meth:`_take_rows` moves it.
        """
        block = self._block
        if block is None or len(block.tokens) - self._used < count:
            self._drop_block()
            pack = self._packing
            at = self.at
            block = Block.cut(self._values, self._offsets, at.offset, count, CUT_AHEAD, pack.eos_id)
            if block is None:
                return self._take_rows(count)
            self._block, self._used, self._block_row = block, 0, at.row
        a, self._used = self._used, self._used + count
        done, offset = block.after(self._used)
        at = self.at
        self.at = PartitionPosition(
            at.epoch, self._block_row + done, offset, at.tokens + count, at.padding
        )
        return block.tokens[a : self._used], block.positions[a : self._used], np.zeros(count, bool)

    def _drop_block(self) -> None:
        """Trim the buffer to the position (the rows the block's takes finished)."""
        if self._block is None:
            return
        self._block = None
        self._trim(self.at.row - self._block_row)

    def _take_rows(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`take` from the rows, reading more and crossing into the next epoch."""
        pack, parts, need, empty_epochs = self._packing, [], count, 0
        while need:
            cut = cut_tokens(self._values, self._offsets, self.at.offset, need, pack.eos_id)
            if len(cut.tokens) < need and self._pull():
                continue
            self._advance(cut)
            got = len(cut.tokens)
            parts.append((cut.tokens, cut.positions, np.zeros(got, dtype=bool)))
            need -= got
            if need:  # the epoch is over: pad its last sample, go on with the next epoch
                pad = -(count - need) % pack.seq_len  # to the end of the sample under way
                parts.append(_padding(pad, pack.pad_id))
                need -= pad
                self.at = PartitionPosition(
                    self.at.epoch + 1, 0, 0, self.at.tokens, self.at.padding + pad
                )
                empty_epochs = 0 if got else empty_epochs + 1
                if empty_epochs > 1:
                    raise ValueError(
                        f"partition {self.part} of the lake has no {pack.column!r} token in "
                        "an epoch: packing cannot fill a sample from it"
                    )
                self._start_epoch(self.at.epoch, 0)
        tokens, positions, pads = (np.concatenate(x) for x in zip(*parts, strict=True))
        return tokens, positions, pads

    def _trim(self, done: int) -> None:
        """Drop the buffer's first ``done`` rows (finished)."""
        start = self._offsets[done]
        self._values = self._values[start:]
        self._offsets = self._offsets[done:] - start

    def _advance(self, cut: Any) -> None:
        """Take ``cut`` out of the buffer and move the position past it."""
        done = cut.rows
        self._trim(done)
        self.at = PartitionPosition(
            self.at.epoch,
            self.at.row + done,
            cut.offset,
            self.at.tokens + len(cut.tokens),
            self.at.padding,
        )


def _padding(count: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.full(count, pad_id, dtype=np.int64),
        np.zeros(count, dtype=np.int64),
        np.ones(count, dtype=bool),
    )


@dataclass(frozen=True)
class PackedSource:
    """A packed stream's source: a dataset, its reader, where this rank's partitions stand.

    Attributes:
        dataset: The dataset.
        reader: Reads its units.
        positions: ``{partition: position}`` of the partitions this rank owns.
    """

    dataset: LakeDataset
    reader: UnitReader
    positions: dict[int, PartitionPosition]


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
        delivered: Told the cursor and every source's partitions after each batch handed over.
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
        delivered: Callable[[MixCursor, list[dict[int, PartitionPosition]]], None],
        source_key: str | None = None,
    ) -> None:
        self._source_key = source_key
        self._packing, self._cursor, self._weights, self._seed = packing, cursor, weights, seed
        self._k = rounds
        self._delivered = delivered
        self._readers: dict[tuple[int, int], EpochReader] = {}
        self._stores = Stores(
            [
                Leaf(s.dataset, s.reader, (), BatchRecipe(lists=s.dataset.list_format))
                for s in sources
            ],
            options,
            Topology(1, 0, 0, options.batch_size),
            unit_dir,
            pool,
            RowLayout.of(sources[0].reader.schema),
            workers_decode=True,
        )
        self._closed = False

        def reader_of(source: int, epoch: int) -> EpochReader:
            if (source, epoch) not in self._readers:
                self._readers[(source, epoch)] = EpochReader(self._stores.get(source, epoch))
            return self._readers[(source, epoch)]

        C = sources[0].dataset.config.num_partitions
        self._owned = list(owned_partitions(C, topology.world_size, topology.rank))
        self._streams = [
            [
                PartitionStream(p, src.positions[p], packing, functools.partial(reader_of, i))
                for p in self._owned
            ]
            for i, src in enumerate(sources)
        ]

    def __iter__(self) -> PackedIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
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
        self._cursor = cursor
        self._delivered(cursor, [{s.part: s.at for s in streams} for streams in self._streams])
        self._release()
        batch = {
            "input_ids": torch.from_numpy(tokens.reshape(-1, L)),
            "position_ids": torch.from_numpy(positions.reshape(-1, L)),
            "pad_mask": torch.from_numpy(pads.reshape(-1, L)),
        }
        if self._source_key is not None:
            batch[self._source_key] = torch.from_numpy(np.tile(rounds, parts))
        return batch

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
