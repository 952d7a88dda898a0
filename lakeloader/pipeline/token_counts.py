"""How many tokens each unit of a packed lake holds: from the footers, or counted once.

When the footers can say is given in docs/design.md (Packed streams); a count read runs the
unit's transform with epoch 0's row seeds.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from lakeloader.errors import LakeDataError
from lakeloader.io.fetch import column_chunks, read_footer, url_of
from lakeloader.io.per_file import per_file
from lakeloader.pipeline.rows import row_lists, to_rows, transform_rows
from lakeloader.pipeline.unit_tokens import arrow_lists
from lakeloader.randomness import slot_seeds

if TYPE_CHECKING:
    from lakeloader.dataset import LakeDataset

logger = logging.getLogger(__name__)


def token_counts(ds: LakeDataset) -> np.ndarray:
    """Tokens (separators included) of each unit of ``ds``, in the units' path order."""
    footers = None if ds.transform is not None or ds.row_filter is not None else _footers(ds)
    if footers is not None:
        return footers
    logger.info("counting the tokens of %d units of %s (a pass over the column)", len(ds.units), ds)
    return _counted(ds)


def _footers(ds: LakeDataset) -> np.ndarray | None:
    """The counts from the footers, or None where they cannot say."""
    assert ds.packing is not None
    units, files, column = ds.units, ds.snapshot.files, ds.packing.column
    groups = list(zip(units.file_index.tolist(), units.row_group.tolist(), strict=True))
    whole = units.num_rows.tolist() == [files[f].row_group_rows[g] for f, g in groups]
    if units.row_start.any() or not whole or any(f.deleted for f in files):
        return None

    def of_file(index: int) -> list[int] | None:
        info = files[index]
        if not info.row_group_rows:
            return []
        meta = read_footer(ds.fs, info.path, info.size, ds.retry, version=info.version)
        out = []
        for rg in range(meta.num_row_groups):
            chunks = column_chunks(meta, rg, {info.physical_name(column)})
            if len(chunks) != 1:
                return None  # a partition column, or a nested type: counted
            stats = chunks[0].statistics
            if stats is None or not stats.has_null_count:
                return None
            out.append(chunks[0].num_values - stats.null_count)
        return out

    found = per_file(ds.fs, of_file, range(len(files)))
    if any(f is None for f in found):
        return None
    counts = [c or [] for c in found]
    values = np.array([counts[f][g] for f, g in groups], dtype=np.int64)
    out: np.ndarray = values + units.num_rows * (ds.packing.eos_id is not None)
    return out


def _counted(ds: LakeDataset) -> np.ndarray:
    """The counts, each unit read once (its transform run on its rows)."""
    assert ds.packing is not None
    units, reader, packing = ds.units, ds.reader(), ds.packing
    plan = ds.plan(0)
    starts = np.empty(len(units), dtype=np.int64)
    starts[plan.order] = plan.offsets[: len(units)]  # a packed plan: one piece per unit

    def count(u: int) -> int:
        rows = int(units.num_rows[u])
        try:
            table = reader.read(
                int(units.file_index[u]), int(units.row_group[u]), int(units.row_start[u]), rows
            )
        except LakeDataError:
            if ds.on_error == "skip":
                return 0  # skipped again when read: no token
            raise
        if ds.transform is not None:
            seeds = slot_seeds(ds.config.seed, 0, starts[u] + np.arange(len(table), dtype=np.int64))
            try:
                lists = transform_rows(to_rows(table), ds.transform, seeds)
            except Exception as exc:  # the user's own error, told where it came from
                path = url_of(ds.fs, ds.snapshot.files[int(units.file_index[u])].path)
                note = (
                    f"lakeloader: raised by the row transform counting the tokens of {path} row "
                    f"group {int(units.row_group[u])} (rows from {int(units.row_start[u])})"
                )
                getattr(exc, "add_note", logger.error)(note)  # Python 3.10: logged
                raise
            _, offsets = row_lists(lists, packing.column)
        else:  # a null list holds no token
            _, offsets = arrow_lists(table.column(packing.column), packing.column)
        return int(offsets[-1] - offsets[0]) + len(table) * (packing.eos_id is not None)

    counted = per_file(ds.fs, count, range(len(units)), "counting tokens", unit="unit", threads=16)
    return np.asarray(counted, dtype=np.int64)


def check_count(ds: LakeDataset, unit: int, got: int, expected: int, epoch: int) -> None:
    """Refuse a unit whose tokens differ from its count.

    Raises:
        LakeDataError: Naming the file, the row group, both counts and what to do.
    """
    if got == expected:
        return
    units = ds.units
    info = ds.snapshot.files[int(units.file_index[unit])]
    raise LakeDataError(
        f"{url_of(ds.fs, info.path)} row group {int(units.row_group[unit])} (rows from "
        f"{int(units.row_start[unit])}) gave {got} tokens in epoch {epoch} where its count said "
        f"{expected}: packing places samples by these counts, so a row transform must give the "
        "same tokens every epoch (whatever lakeloader.rng draws) and the file must not change"
    )
