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


def cut_tokens(
    values: np.ndarray, offsets: np.ndarray, offset: int, count: int, eos_id: int | None
) -> Cut:
    """Take up to ``count`` tokens from rows laid end to end, ``offset`` tokens into the first.

    Args:
        values: The rows' tokens end to end.
        offsets: ``rows + 1`` offsets into ``values``.
        offset: Tokens of the first row already taken (separator counted last).
        count: Tokens wanted; fewer come back when the rows run out.
        eos_id: A separator after each row, or None.

    >>> c = cut_tokens(np.array([1, 2, 3, 4, 5]), np.array([0, 3, 5]), 1, 4, eos_id=9)
    >>> c.tokens.tolist(), c.positions.tolist(), c.rows, c.offset
    ([2, 3, 9, 4], [1, 2, 3, 0], 1, 1)
    """
    lengths = np.diff(offsets) + (eos_id is not None)
    ends = np.cumsum(lengths)
    first = offset
    stop = min(first + count, int(ends[-1]) if len(ends) else 0)
    if stop <= first:
        return Cut(values[:0].astype(np.int64), np.zeros(0, np.int64), 0, offset)
    last = int(np.searchsorted(ends, stop - 1, side="right"))  # row of the last token taken
    rows = lengths[: last + 1]
    starts = ends[: last + 1] - rows
    if eos_id is None:
        stream = values[offsets[0] : offsets[last + 1]].astype(np.int64)
    else:
        stream = np.full(int(ends[last]), eos_id, dtype=np.int64)
        body = np.ones(len(stream), dtype=bool)
        body[ends[: last + 1] - 1] = False
        stream[body] = values[offsets[0] : offsets[last + 1]]
    positions = np.arange(len(stream), dtype=np.int64) - np.repeat(starts, rows)
    done = int(np.searchsorted(ends, stop, side="right"))  # rows whose last token was taken
    left = stop - int(ends[done - 1]) if done else stop
    return Cut(stream[first:stop], positions[first:stop], done, left)


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
        cls,
        values: np.ndarray,
        offsets: np.ndarray,
        offset: int,
        count: int,
        most: int,
        eos_id: int | None,
    ) -> Block | None:
        """Cut as many takes of ``count`` tokens as the rows hold, ``most`` at most.

        None when the rows hold fewer than ``count`` tokens past ``offset`` (the caller reads
        more rows, or ends the epoch).

        >>> b = Block.cut(np.arange(1, 8), np.array([0, 3, 7]), 1, 2, 8, eos_id=0)
        >>> b.tokens.tolist(), b.positions.tolist()
        ([2, 3, 0, 4, 5, 6, 7, 0], [1, 2, 3, 0, 1, 2, 3, 4])
        >>> b.after(2), b.after(6), b.after(8)
        ((0, 3), (1, 3), (2, 0))
        """
        ends = np.cumsum(np.diff(offsets) + (eos_id is not None))
        takes = min((int(ends[-1]) - offset) // count if len(ends) else 0, most)
        if takes < 1:
            return None
        cut = cut_tokens(values, offsets, offset, takes * count, eos_id)
        return cls(cut.tokens, cut.positions, ends, offset)

    def after(self, used: int) -> tuple[int, int]:
        """Rows finished and tokens into the next row once ``used`` of the block's are taken."""
        stop = self.first + used
        done = int(np.searchsorted(self.ends, stop, side="right"))
        return done, stop - (int(self.ends[done - 1]) if done else 0)
