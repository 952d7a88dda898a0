"""A step's decoded units, once quarantined units are left out: which path each column takes.

Pure. Columns every unit has in the arena (packed, or as string views) are gathered with one
row copy; the others take the Arrow path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lakeloader.cache.decode import Held, UnitRef
from lakeloader.cache.packed import RowLayout
from lakeloader.order.batches import BatchSpec
from lakeloader.order.plan import EpochPlan
from lakeloader.state.quarantine import QuarantineEntry, drop_pieces


@dataclass(frozen=True)
class Screened:
    """A step's decoded units and row indices once quarantined units are left out.

    Attributes:
        refs: The units the Arrow path takes its columns from (empty when it has none);
            ``take`` indexes their concatenation.
        rows: Arena row of each batch row, for ``names`` (the packed columns every unit of
            the step has) and ``views`` (the string and binary columns every unit has views of).
        lost: This rank's rows of the step that the ``skipped`` (quarantined) units held.
        kept: Which of the step's rows (in batch order) remain, or None: all of them.
    """

    refs: list[UnitRef]
    take: np.ndarray
    rows: np.ndarray | None
    names: tuple[str, ...]
    views: tuple[str, ...]
    skipped: tuple[QuarantineEntry, ...]
    lost: int
    kept: np.ndarray | None = None


def screen(
    spec: BatchSpec,
    held: Sequence[Held],
    plan: EpochPlan,
    layout: RowLayout | None,
    num_columns: int,
    use_views: bool = True,
    whole: bool = False,
) -> Screened:
    """Screen one step: ``held`` is what the store holds for each unit of ``spec.positions``.

    ``layout`` is None when there is no arena; without ``use_views`` string columns take the
    Arrow path, not their views in the arena. ``whole``: keep the units and rows for the Arrow
    path even when every column is in the arena (a mixture's part, whose other parts may need
    a column that this one has packed).
    """
    refs = [h for h in held if isinstance(h, UnitRef)]
    skipped: tuple[QuarantineEntry, ...] = ()
    take, inverse, row = spec.take, spec.inverse, spec.row
    keep = None
    if len(refs) < len(held):
        skipped = tuple(h for h in held if isinstance(h, QuarantineEntry))
        bad = [isinstance(h, QuarantineEntry) for h in held]
        take = drop_pieces(take, plan.piece_rows(spec.positions).tolist(), bad)
        keep = ~np.asarray(bad, dtype=bool)[inverse]
        inverse, row = inverse[keep], row[keep]
    lost = spec.num_rows - len(take)
    names = by_all(refs, layout.names, "packed") if layout is not None else ()
    views: tuple[str, ...] = ()
    if use_views and layout is not None and names:
        views = by_all(refs, layout.views, "views")
    rows = None
    if names:
        starts = [h.start if isinstance(h, UnitRef) else -1 for h in held]
        rows = np.asarray(starts, dtype=np.int64)[inverse] + row
    if len(names) + len(views) == num_columns and not whole:  # nothing left for the Arrow path
        refs, take = [], take[:0]
    return Screened(refs, take, rows, names, views, skipped, lost, keep)


def by_all(refs: Sequence[UnitRef], full: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """The columns of ``full`` that every unit has as ``kind`` ("packed" or "views")."""
    have = [getattr(r, kind) for r in refs]
    # a unit's columns are some of ``full`` (each once): as many as ``full`` means all of them,
    # the usual case, answered with ``full`` itself (mixed_steps._common compares with ``is``)
    if all(len(h) == len(full) for h in have):
        return full
    common = set(full).intersection(*have)
    return tuple(n for n in full if n in common)
