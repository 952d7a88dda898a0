"""Packed token streams: which rows each rank reads, and how tokens become samples (pure).

Packing cuts samples of ``seq_len`` tokens from the concatenated token lists of rows, so where
a sample starts depends on the lengths of every row before it. A rank cannot know the lengths
of rows it does not read, so the stream is not the epoch's whole row sequence but one stream per
canonical partition (:mod:`lakeloader.order.plan`): partition ``p``'s rows, in their shuffled
order, epoch after epoch, each epoch's last partial sample padded (and the padding counted).
Step ``t`` takes samples ``[t * k, (t + 1) * k)`` of every partition (``k = global batch / C``),
laid out partition-major, and rank ``r`` reads whole partitions,
``[r * C / W, (r + 1) * C / W)``: no row is read by two ranks, and the ranks' shares laid end to
end are the same global batch under any world size that divides ``C``. A partition's position
is three integers (epoch, row, token offset inside the row), so the state is O(C) however long
the run, and a resume in the middle of a document continues at its next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def samples_per_partition(global_batch: int, num_partitions: int, world_size: int) -> int:
    """Samples each partition gives each step (``k``), checking that the shapes fit.

    >>> samples_per_partition(16, 4, 2)
    4

    Raises:
        ValueError: If the world size does not divide ``C``, or ``C`` the global batch (with
            the sizes that would).
    """
    C, W = num_partitions, world_size
    if C % W:
        fits = [d for d in range(1, C + 1) if C % d == 0]
        raise ValueError(
            f"packing reads whole partitions per rank: world size {W} must divide "
            f"num_partitions={C} (world sizes that do: {fits}); build the LakeDataset with "
            f"num_partitions a multiple of {W}"
        )
    if global_batch % C:
        raise ValueError(
            f"packing takes the same number of samples from each of the C={C} partitions per "
            f"step: the global batch of {global_batch} samples must be a multiple of {C} "
            f"(batch_size a multiple of {C // W} with {W} rank(s))"
        )
    return global_batch // C


def owned_partitions(num_partitions: int, world_size: int, rank: int) -> range:
    """The partitions a rank reads: a contiguous block.

    >>> owned_partitions(8, 2, 1)
    range(4, 8)
    """
    per = num_partitions // world_size
    return range(rank * per, (rank + 1) * per)


@dataclass(frozen=True)
class Cut:
    """Tokens taken from consecutive rows.

    Attributes:
        tokens: The tokens, separators included.
        positions: Each token's position in its document.
        rows: Rows finished (their last token, or separator, taken).
        offset: Tokens taken from the row after them.
    """

    tokens: np.ndarray
    positions: np.ndarray
    rows: int
    offset: int


def separated(
    values: np.ndarray, offsets: np.ndarray, eos_id: int | None, ended: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows laid end to end with ``eos_id`` after each row that ``ended`` marks (all: None).

    A row left unmarked gets no separator: a skipped row comes as a row of no token, which
    moves a partition's row position but adds nothing to its stream.

    >>> v, o = separated(np.array([1, 2, 3]), np.array([0, 2, 2, 3]), 9, np.array([1, 0, 1], bool))
    >>> v.tolist(), o.tolist()
    ([1, 2, 9, 3, 9], [0, 3, 3, 5])
    """
    values = values[offsets[0] : offsets[-1]].astype(np.int64, copy=False)
    offsets = offsets - offsets[0]
    if eos_id is None:
        return values, offsets
    marks = np.ones(len(offsets) - 1, np.int64) if ended is None else ended.astype(np.int64)
    ends = offsets[1:] + np.cumsum(marks)  # where each row's separator (if any) ends
    out = np.full(int(ends[-1]) if len(ends) else 0, eos_id, dtype=np.int64)
    body = np.ones(len(out), dtype=bool)
    body[(ends - 1)[marks.astype(bool)]] = False
    out[body] = values
    return out, np.concatenate([[0], ends]).astype(np.int64)


def cut_tokens(values: np.ndarray, offsets: np.ndarray, offset: int, count: int) -> Cut:
    """Take up to ``count`` tokens from rows laid end to end, ``offset`` tokens into the first.

    Args:
        values: The rows' tokens end to end (separators in: :func:`separated`).
        offsets: ``rows + 1`` offsets into ``values``.
        offset: Tokens of the first row already taken.
        count: Tokens wanted; fewer come back when the rows run out.

    A row of no token (a skipped one) right after the last token taken counts as finished.

    >>> c = cut_tokens(np.array([1, 2, 3, 9, 4, 5, 9]), np.array([0, 4, 7]), 1, 4)
    >>> c.tokens.tolist(), c.positions.tolist(), c.rows, c.offset
    ([2, 3, 9, 4], [1, 2, 3, 0], 1, 1)
    """
    lengths = np.diff(offsets)
    ends = offsets[1:] - offsets[0]
    stop = min(offset + count, int(ends[-1]) if len(ends) else 0)
    if stop <= offset:
        return Cut(values[:0].astype(np.int64), np.zeros(0, np.int64), 0, offset)
    last = int(np.searchsorted(ends, stop - 1, side="right"))  # row of the last token taken
    rows = lengths[: last + 1]
    starts = ends[: last + 1] - rows
    stream = values[offsets[0] + offset : offsets[0] + stop].astype(np.int64)
    positions = np.arange(offset, stop, dtype=np.int64) - np.repeat(starts, rows)[offset:stop]
    done = int(np.searchsorted(ends, stop, side="right"))  # rows whose last token was taken
    left = stop - int(ends[done - 1]) if done else stop
    return Cut(stream, positions, done, left)


@dataclass(frozen=True)
class Block:
    """Samples cut at once from a partition's buffered rows, handed out one take at a time.

    One :func:`cut_tokens` of many samples costs about what one of a single sample does (a
    few array operations); a take is then two slices and a binary search for where it ends.

    Attributes:
        tokens: The block's tokens, separators included.
        positions: Each token's position in its document.
        ends: Where each buffered row ends, in tokens from the buffer's first row.
        first: Where the block starts, in the same tokens.
    """

    tokens: np.ndarray
    positions: np.ndarray
    ends: np.ndarray
    first: int

    @classmethod
    def cut(
        cls, values: np.ndarray, offsets: np.ndarray, offset: int, count: int, most: int
    ) -> Block | None:
        """Cut as many takes of ``count`` tokens as the rows hold, ``most`` at most.

        None when the rows hold fewer than ``count`` tokens past ``offset`` (the caller reads
        more rows, or ends the epoch).

        >>> b = Block.cut(np.arange(1, 8), np.array([0, 3, 7]), 1, 2, 8)
        >>> b.tokens.tolist(), b.positions.tolist()
        ([2, 3, 4, 5, 6, 7], [1, 2, 0, 1, 2, 3])
        >>> b.after(2), b.after(6)
        ((1, 0), (2, 0))
        """
        ends = offsets[1:] - offsets[0]
        takes = min((int(ends[-1]) - offset) // count if len(ends) else 0, most)
        if takes < 1:
            return None
        cut = cut_tokens(values, offsets, offset, takes * count)
        return cls(cut.tokens, cut.positions, ends, offset)

    def after(self, used: int) -> tuple[int, int]:
        """Rows finished and tokens into the next row once ``used`` of the block's are taken."""
        stop = self.first + used
        done = int(np.searchsorted(self.ends, stop, side="right"))
        return done, stop - (int(self.ends[done - 1]) if done else 0)
