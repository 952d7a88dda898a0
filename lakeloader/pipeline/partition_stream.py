"""One partition's token stream, read in chunks from its epochs' unit stores.

A :class:`PartitionStream` reads its partition's rows in chunks, ahead, through an
:class:`EpochReader` (the unit store and builder of one epoch, shared by the rank's partitions),
and hands out tokens; at the end of its epoch it pads its last sample and goes on with the next
epoch's rows (:mod:`lakeloader.order.packing` says why per partition). The reader gives each
row's token list, separator in: from the packing column, or from the row the source's
``transform`` made of it (in this process), with :func:`lakeloader.rng` drawing from the row's
slot seed (partition ``p``'s ``i``-th row of an epoch is slot ``p + i * C``,
:mod:`lakeloader.randomness`). A row of a unit skipped (``on_error="skip"``, ``validate``) has
no token and no separator: it adds nothing to the stream, but the partition's row position
counts it, so the position stays exact and a resume under another shape skips exactly it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from lakeloader.cache.arrays import Ragged
from lakeloader.errors import ColumnNotFoundError
from lakeloader.order.batches import BatchSpec, partition_specs
from lakeloader.order.packing import Block, cut_tokens, separated
from lakeloader.packing import Packing
from lakeloader.pipeline.collate import Transform
from lakeloader.pipeline.recipe import COLUMNS
from lakeloader.pipeline.rows import transform_rows
from lakeloader.pipeline.stores import Store
from lakeloader.randomness import slot_seeds
from lakeloader.state.packed_state import PartitionPosition
from lakeloader.state.quarantine import QuarantineEntry

#: Rows a partition reads at a time.
CHUNK_ROWS: Final = 1024
#: Chunks a partition has requested ahead of the one it reads.
AHEAD_CHUNKS: Final = 4
#: Takes cut at once from a partition's buffered rows (:class:`~lakeloader.order.packing.Block`).
CUT_AHEAD: Final = 32
#: Epochs in a row a partition may give no token in (each of its rows empty, or skipped: a
#: partition's epoch may be one quarantined unit) before it is refused as having none.
EMPTY_EPOCHS: Final = 16


class EpochReader:
    """One epoch's store, read by a rank's partitions in chunks.

    Args:
        store: The epoch's store (its units decoded in the workers, or in threads).
        transform: The source's row transform, or None.
    """

    def __init__(self, store: Store, transform: Transform | None = None) -> None:
        self._store = store
        self.plan = store.spec.plan
        self.sizes = np.diff(self.plan.starts)
        self._builder = store.builder
        self._transform = transform

    def request(self, part: int, start: int, rows: int) -> BatchSpec:
        """Ask for rows ``[start, start + rows)`` of a partition (decoded ahead)."""
        (spec,) = partition_specs(
            self.plan, np.zeros(1, np.int64), np.array([part]), np.array([start]), np.array([rows])
        )
        self._store.store.request(spec.positions)
        return spec

    def tokens(
        self, spec: BatchSpec, column: str, eos_id: int | None
    ) -> tuple[np.ndarray, np.ndarray, tuple[QuarantineEntry, ...]]:
        """The token lists of a requested run, separators in: values, offsets, units skipped.

        Every row of the run has its list; a row of a skipped unit has none (no separator).
        """
        builder = self._builder
        if self._transform is None:
            kind, columns = builder.build(spec)
            assert kind == COLUMNS
            values, offsets = _column_lists(columns[column], column)
            skipped, lost = builder.skipped[spec.step]
            kept = builder.screened(spec).kept if lost else None  # the rows left
        else:
            screened = builder.screened(spec)
            skipped, kept = screened.skipped, screened.kept
            C = self.plan.num_partitions
            slots = spec.slot_start + np.arange(spec.num_rows, dtype=np.int64) * C
            seeds = slot_seeds(
                self.plan.seed, self.plan.epoch, slots[kept] if kept is not None else slots
            )
            rows = transform_rows(builder.rows(screened), self._transform, seeds)
            values, offsets = _row_lists(rows, column)
        del builder.skipped[spec.step]  # reported here, with the run
        if kept is not None:  # the skipped rows: no token
            lengths = np.zeros(spec.num_rows, dtype=np.int64)
            lengths[kept] = np.diff(offsets)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64) + offsets[0]
        values, offsets = separated(values, offsets, eos_id, kept)
        return values, offsets, skipped

    def release(self, consumed: int) -> None:
        """Evict units every partition of this rank is past (``consumed``: fewest rows read)."""
        self._store.store.release(consumed * self.plan.num_partitions)


def _column_lists(value: Any, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A batch's list column of integers: values end to end, and offsets."""
    if isinstance(value, Ragged):
        return value.values.reshape(len(value.values)), value.offsets
    if isinstance(value, np.ndarray) and value.ndim == 2:  # a fixed-size list
        width = value.shape[1]
        return value.reshape(-1), np.arange(len(value) + 1, dtype=np.int64) * width
    raise TypeError(
        f"packing needs a list column of integers; {column!r} is {type(value).__name__} in "
        "the batch"
    )


def _row_lists(rows: Sequence[Any], column: str) -> tuple[np.ndarray, np.ndarray]:
    """Each transformed row's ``column`` (integers): values end to end, and offsets.

    Raises:
        ColumnNotFoundError: If a transformed row has no ``column``.
        TypeError: If it is not a 1-D list, array or tensor of integers.
    """
    lists = []
    for row in rows:
        try:
            value = row[column]
        except (KeyError, TypeError, IndexError):
            raise ColumnNotFoundError(
                f"the transform's row has no packing column {column!r} (it gave "
                f"{type(row).__name__} {list(row) if isinstance(row, dict) else ''}): return "
                "a dict holding the row's token ids under it"
            ) from None
        array = np.asarray(value)
        if array.size == 0:
            array = array.astype(np.int64).reshape(0)
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise TypeError(
                f"packing needs the transform's {column!r} to be a 1-D list, array or tensor "
                f"of integers; it gave {type(value).__name__} of dtype {array.dtype} and shape "
                f"{array.shape}"
            )
        lists.append(array)
    lengths = np.fromiter((len(a) for a in lists), dtype=np.int64, count=len(lists))
    values = np.concatenate(lists).astype(np.int64) if lists else np.zeros(0, np.int64)
    return values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


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
        #: Units found skipped since the last :meth:`take_skipped`.
        self.skipped: list[QuarantineEntry] = []
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
        pack = self._packing
        values, offsets, skipped = self._reader.tokens(
            self._pending.popleft(), pack.column, pack.eos_id
        )
        self.skipped += skipped
        self._top_up()
        self._values = np.concatenate([self._values, values])
        self._offsets = np.concatenate([self._offsets, self._offsets[-1] + offsets[1:]])
        return True

    def take(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The next ``count`` tokens (whole samples): tokens, positions, padding mask.

        Cut from a block of up to :data:`CUT_AHEAD` takes while the buffered rows hold them;
        the position moves take by take, as :meth:`_take_rows` moves it.
        """
        block = self._block
        if block is None or len(block.tokens) - self._used < count:
            self._drop_block()
            at = self.at
            block = Block.cut(self._values, self._offsets, at.offset, count, CUT_AHEAD)
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
            cut = cut_tokens(self._values, self._offsets, self.at.offset, need)
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
                if empty_epochs > EMPTY_EPOCHS:  # the first may be an epoch's tail
                    raise ValueError(
                        f"partition {self.part} of the lake has no {pack.column!r} token in "
                        f"{EMPTY_EPOCHS} epochs in a row (its rows are empty, or their units "
                        "skipped): packing cannot fill a sample from it"
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
