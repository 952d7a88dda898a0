"""Checks of a dataset's arguments against each other and its schema, saying what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from lakeloader.cache.arrays import is_ragged_type
from lakeloader.pipeline.collate import ListFormat


def check_lengths_keys(columns: Sequence[str], schema: pa.Schema) -> None:
    """Raise if a padded list column's ``<name>_lengths`` key is a column of the batch too."""
    for name in columns:
        key = ListFormat.lengths_of(name)
        if is_ragged_type(schema.field(name).type) and key in columns:
            raise ValueError(
                f"list_format='padded' puts the lengths of list column {name!r} under "
                f"{key!r}, which is a column of the lake too: leave one of them out with "
                "columns=[...], or use list_format='jagged'"
            )


def checked_seed(seed: int) -> int:
    """``seed`` as an int, raising if states and checkpoints cannot keep it (64 bits)."""
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(
            f"seed must be an integer in [-2**63, 2**64) (it is kept in states and "
            f"checkpoints as a 64-bit integer), got {seed}"
        )
    return int(seed)


def check_backfill(backfill: bool, on_error: str, packing: Any, follow: Any) -> None:
    """Raise if ``backfill=True`` is asked where it cannot apply, saying what to do."""
    if not backfill:
        return
    if on_error != "skip":
        raise ValueError(
            "backfill=True fills in for the rows of quarantined units, and units are quarantined "
            f"only with on_error='skip' (got on_error={on_error!r}): pass on_error='skip'"
        )
    if packing is not None:
        raise ValueError(
            "backfill=True keeps row batches whole; packed samples keep their length already "
            "(a quarantined unit's tokens become padding): leave backfill out with packing="
        )
    if follow is not None:
        raise ValueError(
            "backfill=True is not supported with follow= (a followed lake's steps carry into "
            "the next increment): leave one of them out"
        )
