"""A packed stream's parts: its sources, the steps it plans, and how its epochs are shaped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lakeloader.cache.packed import RowLayout
from lakeloader.dataset import LakeDataset
from lakeloader.errors import LakeDataError
from lakeloader.io.reader import UnitReader
from lakeloader.order.mixture import MixCursor
from lakeloader.order.packing import Share, TokenStream
from lakeloader.state.quarantine import QuarantineEntry

if TYPE_CHECKING:
    from lakeloader.nodes.streams import SourceStream


class PackedSource(NamedTuple):
    """A packed stream's source.

    Attributes:
        dataset: The dataset (its ``transform``, ``on_error`` and ``validate`` apply to its
            rows).
        stream: Its epochs (a followed lake's increments) and the samples each holds.
        counts_of: Tokens of each unit of an epoch's dataset, in path order
            (:mod:`~lakeloader.pipeline.token_counts`).
        known: Units already quarantined (from the state): screened without reading.
    """

    dataset: LakeDataset
    reader: UnitReader
    stream: SourceStream
    counts_of: Callable[[LakeDataset], np.ndarray]
    known: tuple[QuarantineEntry, ...] = ()


class PlannedStep(NamedTuple):
    """A step planned: the cursor after it, this rank's share, and the units the share needs.

    ``by_epoch``: the indices of the share's samples by (source, epoch); ``units``: the units
    they lie in, as (source, epoch, position).
    """

    after: MixCursor
    share: Share
    by_epoch: dict[tuple[int, int], np.ndarray]
    units: list[tuple[int, int, int]]


class StepCut(NamedTuple):
    """A step's samples cut from their units, and what its delivery tells the node."""

    cursor: MixCursor
    share: Share
    columns: dict[str, np.ndarray]
    skips: list[QuarantineEntry]
    tokens: int
    padding: int


def token_stream(dataset: LakeDataset, epoch: int, counts: np.ndarray, seq_len: int) -> TokenStream:
    """Where the tokens of ``epoch`` of ``dataset`` lie (``counts``: its units', path order)."""
    return TokenStream.of(counts[dataset.plan(epoch).order], dataset.config.num_partitions, seq_len)


def arena_layout(datasets: Sequence[LakeDataset], reader: UnitReader) -> RowLayout | None:
    """How rows are packed into the arena: None when a row transform takes rows one by one."""
    if any(ds.transform is not None for ds in datasets):
        return None
    return RowLayout.of(reader.schema)


def check_some_unit_left(dataset: LakeDataset, known: tuple[QuarantineEntry, ...]) -> None:
    """Refuse a packed source whose every unit is quarantined: it would give padding forever.

    Raises:
        LakeDataError: If ``known`` covers every unit of ``dataset``.
    """
    units, files = dataset.units, dataset.snapshot.files
    if len(known) < len(units) or not len(units):  # a unit has one entry: some are left
        return
    for f, rg, start, rows in zip(
        units.file_index, units.row_group, units.row_start, units.num_rows, strict=True
    ):
        path = files[int(f)].path
        if not any(k.covers(path, int(rg), int(start), int(rows)) for k in known):
            return
    raise LakeDataError(
        f"every unit of {dataset} is quarantined ({len(units)} units; the first: "
        f"{known[0].path}, row group {known[0].row_group}: {known[0].reason}), so packing has "
        "no token left to give: fix the data or the validate function, or leave the source out"
    )
