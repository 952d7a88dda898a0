"""How rows become the batch the training loop gets: a :class:`BatchRecipe` and its payloads.

A payload is what a builder hands back: ``(COLUMNS, arrays)``, which :func:`finish_payload`
turns into tensors, ``(COLLATED, batch)``, the batch as it is, or ``(READY, batch)``, a batch
a background thread finished (and pinned) ahead of delivery.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import default_collate

from lakeloader.cache.packed import Packed
from lakeloader.pipeline.collate import (
    BatchTransform,
    Collate,
    ListFormat,
    Transform,
    columns_to_tensors,
    gather_columns,
)
from lakeloader.pipeline.rows import gather_rows, transform_rows
from lakeloader.randomness import batch_seed, drawing, seed_globals

#: Tag of a payload in columnar form (numpy arrays to be turned into tensors).
COLUMNS: Final = "columns"
#: Tag of a payload that is already the batch.
COLLATED: Final = "collated"
#: Tag of a batch finished ahead in a background thread: tensors made, pinned if asked.
READY: Final = "ready"

#: A builder's answer: a tag and what it tags.
Payload = tuple[str, Any]


@dataclass(frozen=True)
class Sources:
    """A mixed batch's rows' sources and their row transforms.

    ``of``: each row's source's index, in batch order; ``transforms``: each source's (or None).
    """

    of: np.ndarray
    transforms: tuple[Transform | None, ...]


@dataclass(frozen=True)
class BatchRecipe:
    """What turns a step's rows into its batch.

    ``transform`` is called on each row (a dict), ``collate_fn`` (None: ``default_collate``)
    makes a batch of them, ``batch_transform`` is called on it; ``lists``: how list columns
    appear on the columnar path.
    """

    transform: Transform | None = None
    collate_fn: Collate | None = None
    batch_transform: BatchTransform | None = None
    lists: ListFormat = field(default_factory=ListFormat)

    @property
    def rows_path(self) -> bool:
        """Whether rows are made one by one (a transform or a collate_fn)."""
        return self.transform is not None or self.collate_fn is not None

    @property
    def user_code(self) -> bool:
        """Whether building a batch runs the user's code (anything but the default)."""
        return self.rows_path or self.batch_transform is not None


def build_payload(
    units: Sequence[Packed],
    take: np.ndarray,
    schema: pa.Schema,
    recipe: BatchRecipe,
    ready: Mapping[str, Any],
    seeds: np.ndarray,
    extra: Mapping[str, np.ndarray] | None = None,
    sources: Sources | None = None,
) -> Payload:
    """Build one batch from decoded units (in a worker, or in the loader's process).

    Args:
        units: The batch's units.
        take: Row indices into their concatenation, in batch order.
        schema: The batch's columns.
        recipe: How the batch is made.
        ready: Columns already gathered from the arena (columnar path only).
        seeds: Each row's seed (:func:`lakeloader.randomness.slot_seeds`), in batch order.
        extra: Columns computed, in batch order (a mixture's source of each row): in the
            batch, and in each row before its transform.
        sources: A mixed batch's rows' sources and their transforms, which replace the
            recipe's (None: one source).

    Returns:
        ``(COLUMNS, dict of arrays or lists)`` on the default path, else ``(COLLATED, batch)``.
    """
    extra = extra or {}
    transforms = sources.transforms if sources is not None else (recipe.transform,)
    if not recipe.rows_path and not any(transforms):
        columns = gather_columns(units, take, schema, ready)
        columns.update(extra)
        return columns_payload(columns, recipe, seeds)
    rows = gather_rows(units, take, schema)
    for name, values in extra.items():
        for row, value in zip(rows, values.tolist(), strict=True):
            row[name] = value
    seed_globals(batch_seed(seeds))
    of = sources.of if sources is not None else np.zeros(len(rows), dtype=np.int64)
    for index, transform in enumerate(transforms):
        if transform is not None:
            mine = np.flatnonzero(of == index)
            done = transform_rows([rows[i] for i in mine.tolist()], transform, seeds[mine])
            for i, row in zip(mine.tolist(), done, strict=True):
                rows[i] = row
    return rows_payload(rows, recipe, seeds)


def columns_payload(columns: dict[str, Any], recipe: BatchRecipe, seeds: np.ndarray) -> Payload:
    """A batch's columns, through the recipe's ``batch_transform`` if it has one."""
    if recipe.batch_transform is None:
        return COLUMNS, columns
    batch = columns_to_tensors(columns, recipe.lists)
    return _batch_transformed(batch, recipe.batch_transform, seeds)


def rows_payload(rows: list[Any], recipe: BatchRecipe, seeds: np.ndarray) -> Payload:
    """Transformed rows collated, then through the ``batch_transform`` if there is one.

    ``default_collate`` without a ``collate_fn``; no row gives ``[]`` (torch never collates
    none).
    """
    batch = (recipe.collate_fn or default_collate)(rows) if rows else []
    if recipe.batch_transform is None:
        return COLLATED, batch
    return _batch_transformed(batch, recipe.batch_transform, seeds)


def samples_payload(
    columns: dict[str, np.ndarray], recipe: BatchRecipe, seeds: np.ndarray
) -> Payload:
    """Packed samples through the user's code, in a worker or in the loader's process.

    The ``collate_fn`` gets one dict of tensors a sample; without one, the columns go on as
    they are (to the ``batch_transform`` if there is one). ``seeds``: each sample's.
    """
    if recipe.collate_fn is None:
        return columns_payload(columns, recipe, seeds)
    tensors = {name: torch.from_numpy(value) for name, value in columns.items()}
    samples = [{n: t[i] for n, t in tensors.items()} for i in range(len(seeds))]
    return rows_payload(samples, recipe, seeds)


def _batch_transformed(batch: Any, transform: BatchTransform, seeds: np.ndarray) -> Payload:
    seed_globals(batch_seed(seeds))
    with drawing(seeds):
        return COLLATED, transform(batch)


def finish_payload(payload: Payload, recipe: BatchRecipe) -> Any:
    """Turn a payload into the batch the training loop receives."""
    kind, value = payload
    return columns_to_tensors(value, recipe.lists) if kind == COLUMNS else value
