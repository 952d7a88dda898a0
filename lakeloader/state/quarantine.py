"""Quarantine: units that cannot be read, or that the user's validator rejects, skipped alike."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa

#: What a dataset does with a unit that fails to decode or is rejected by ``validate``.
OnError = Literal["raise", "skip"]
ON_ERROR_CHOICES: tuple[OnError, ...] = ("raise", "skip")
#: A user check of a decoded unit: True (or None) keeps it; False or a reason rejects it.
Validate = Callable[[pa.Table], "bool | str | None"]


@dataclass(frozen=True)
class QuarantineEntry:
    """A unit skipped for good.

    Attributes:
        path: The file (as the snapshot names it).
        row_start: First row of the unit in the row group.
        num_rows: Rows skipped.
        reason: Why: the decoding error, or the validator's verdict.
    """

    path: str
    row_group: int
    row_start: int
    num_rows: int
    reason: str

    @property
    def key(self) -> tuple[str, int, int, int]:
        """Identity of the unit (the reason aside)."""
        return (self.path, self.row_group, self.row_start, self.num_rows)

    def covers(self, path: str, row_group: int, row_start: int, num_rows: int) -> bool:
        """Whether this entry spans the whole of the given unit."""
        return (
            path == self.path
            and row_group == self.row_group
            and self.row_start <= row_start
            and row_start + num_rows <= self.row_start + self.num_rows
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain types for the state dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuarantineEntry:
        """Parse :meth:`to_dict`'s output."""
        return cls(
            str(d["path"]),
            int(d["row_group"]),
            int(d["row_start"]),
            int(d["num_rows"]),
            str(d["reason"]),
        )


def merge(*groups: Iterable[QuarantineEntry]) -> list[QuarantineEntry]:
    """Union of entries (one per unit), sorted by file, row group and row: the same on all ranks.

    An entry within another's rows (a piece of a unit quarantined whole) is left out.
    """
    unique = {e.key: e for group in groups for e in group}
    out: list[QuarantineEntry] = []
    for _, same in itertools.groupby(
        (unique[k] for k in sorted(unique)), key=lambda e: (e.path, e.row_group)
    ):
        group = list(same)
        out += [e for e in group if not any(o is not e and o.covers(*e.key) for o in group)]
    return out


def verdict(validate: Validate, table: pa.Table) -> str | None:
    """Run the user's validator: None to keep the unit, else the reason to reject it.

    >>> verdict(lambda t: t.num_rows > 0, pa.table({"x": [1]})) is None
    True
    >>> verdict(lambda t: "all NaN", pa.table({"x": [1]}))
    'all NaN'
    >>> verdict(lambda t: False, pa.table({"x": [1]}))
    'it returned False'
    """
    result = validate(table)
    if result is True or result is None:
        return None
    if result is False:
        return "it returned False"
    return str(result)


def drop_pieces(take: np.ndarray, sizes: Sequence[int], bad: Sequence[bool]) -> np.ndarray:
    """Row indices of a batch without the rows of quarantined pieces, renumbered.

    ``take`` indexes the concatenation of the pieces (of ``sizes`` rows each); the result
    indexes the concatenation of the pieces that are not ``bad``, in the same order.
    """
    sizes_a = np.asarray(sizes, dtype=np.int64)
    bad_a = np.asarray(bad, dtype=bool)
    old_base = np.concatenate([[0], np.cumsum(sizes_a)[:-1]]).astype(np.int64)
    kept_sizes = np.where(bad_a, 0, sizes_a)
    new_base = np.concatenate([[0], np.cumsum(kept_sizes)[:-1]]).astype(np.int64)
    piece = np.searchsorted(old_base, take, side="right") - 1
    keep = ~bad_a[piece]
    out: np.ndarray = take[keep] - old_base[piece[keep]] + new_base[piece[keep]]
    return out.astype(np.int64)
