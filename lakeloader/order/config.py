"""The order configuration of a dataset: everything that changes the order of its rows."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class OrderConfig:
    """Everything that changes the order of rows; hashed into every state.

    Attributes:
        seed: Seed of the unit permutation and of the window shuffles.
        shuffle: Shuffle units and windows (False: path order).
        num_partitions: Canonical partitions C (fixed for the life of a run).
        window: Rows shuffled together inside a partition.
        max_unit_rows: Row groups above this many rows are split into row ranges.
        columns: Columns read, in order.
        filter: The row filter's text (None: every row).
        backfill: A step takes the rows after a quarantined unit's, keeping its size.
    """

    seed: int
    shuffle: bool
    num_partitions: int
    window: int
    max_unit_rows: int
    columns: tuple[str, ...]
    filter: str | None = None
    backfill: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain types (columns as a list; no filter or backfill key unless set)."""
        d = asdict(self)
        d["columns"] = list(self.columns)
        for key, unset in (("filter", None), ("backfill", False)):
            if d[key] == unset:
                del d[key]  # the hashes of states taken before they existed stay valid
        return d
