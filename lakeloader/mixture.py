"""``Mixture``: several lakes drawn from in set proportions, as one dataset of the loader.

Which source each global slot draws from, and how each source runs through its own epochs,
is in docs/design.md and :mod:`lakeloader.order.mixture`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from lakeloader.dataset import LakeDataset
from lakeloader.dataset_checks import checked_seed
from lakeloader.errors import ColumnNotFoundError, SchemaMismatchError
from lakeloader.order.mixture import MixWeights
from lakeloader.packing import Packing
from lakeloader.pipeline.collate import BatchTransform


class Mixture:
    """Weighted sources, each a :class:`~lakeloader.LakeDataset`, drawn from deterministically.

    Args:
        sources: ``{name: dataset}``. The datasets' columns must agree in name and type (a
            batch holds rows of every source); their order settings (seed, shuffle, C, window)
            are their own.
        weights: ``{name: weight}`` for the same names: positive numbers, normalised to shares.
        seed: Seed of the interleaving of sources (each source's order has its own seed).
        epoch_rows: Rows in one pass over the mixture (one ``for batch in loader``); None: as
            many as the sources hold together. The sources' own epochs are apart from it.
            A pass is rounded up to whole global batches: it is ``ceil(epoch_rows /
            global_batch)`` steps, every batch full (``drop_last`` or not). The rows that fill
            its last batch past ``epoch_rows`` are the mixture's next draws, not repeats, and
            the next pass starts after them: no row is lost or repeated across passes, but a
            pass delivers up to ``global_batch - 1`` rows more than ``epoch_rows``.
        source_key: The batch's key of the source index of each row (an int64 tensor indexing
            :attr:`names`).
        packing: A :class:`~lakeloader.Packing`: each source is packed on its own and the
            mixture draws each sample's source in the weights' proportions (see
            :mod:`lakeloader.order.packing`); ``batch_size`` then counts samples.
        batch_transform: Called on each mixed batch (after the ``collate_fn``), as a
            LakeDataset's is; None: the sources' own, when they all give the same one. Each
            source's ``transform``, ``on_error`` and ``validate`` apply to its own rows.

    Raises:
        ColumnNotFoundError: If ``packing`` names a column the sources do not read, unless
            every source has a transform (the column is then read from the transformed rows).
        ValueError: If the names of ``sources`` and ``weights`` differ, a weight is not a
            positive number, a source has no row, ``source_key`` names a column, or the
            sources give different batch_transforms.
        TypeError: If a source is not a LakeDataset.
        SchemaMismatchError: If the sources' columns differ (names both sides).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> import lakeloader as ll
        >>> tmp = tempfile.TemporaryDirectory()
        >>> for name, first in (("web", 0), ("code", 1000)):
        ...     _ = __import__("os").makedirs(f"{tmp.name}/{name}")
        ...     pq.write_table(pa.table({"id": range(first, first + 100)}),
        ...                    f"{tmp.name}/{name}/part-0.parquet")
        >>> mix = ll.Mixture({n: ll.LakeDataset(f"{tmp.name}/{n}") for n in ("web", "code")},
        ...                  {"web": 0.75, "code": 0.25})
        >>> mix.names, len(mix)
        (('code', 'web'), 200)
        >>> batch = next(iter(ll.DataLoader(mix, batch_size=8)))
        >>> sorted(batch), batch["source"].tolist().count(1) >= 5
        (['id', 'source'], True)

        A pass of 20 rows in global batches of 8 is three full batches, 24 rows:

        >>> short = ll.Mixture(mix.sources, {"web": 0.75, "code": 0.25}, epoch_rows=20)
        >>> loader = ll.DataLoader(short, batch_size=8, drop_last=True)
        >>> [len(b["id"]) for b in loader], len(loader)
        ([8, 8, 8], 3)
        >>> state = loader.state_dict()  # the next pass starts at slot 24, after those rows
        >>> state["slot"], state["epoch_rows"], sum(state["counts"].values())
        (24, 20, 24)
        >>> loader.close(); tmp.cleanup()
    """

    def __init__(
        self,
        sources: Mapping[str, LakeDataset],
        weights: Mapping[str, float],
        *,
        seed: int = 0,
        epoch_rows: int | None = None,
        source_key: str = "source",
        packing: Packing | None = None,
        batch_transform: BatchTransform | None = None,
    ) -> None:
        if set(sources) != set(weights):
            raise ValueError(
                f"a mixture needs one weight per source: sources {sorted(sources)}, weights "
                f"{sorted(weights)}"
            )
        self.weights = MixWeights.of(weights)
        #: The sources' names, sorted: the order of source indices in batches and states.
        self.names: tuple[str, ...] = self.weights.names
        for name in self.names:
            if not isinstance(sources[name], LakeDataset):
                raise TypeError(
                    f"mixture source {name!r} must be a lakeloader.LakeDataset, got "
                    f"{type(sources[name]).__name__}"
                )
            if len(sources[name]) == 0:
                raise ValueError(f"mixture source {name!r} has no rows to draw from")
            if sources[name].config.backfill:
                raise ValueError(
                    f"mixture source {name!r} has backfill=True, which keeps a lake loader's "
                    "steps whole; a mixture's steps do not take it: leave it out"
                )
            if sources[name].packing is not None:
                raise ValueError(
                    f"mixture source {name!r} has its own packing: give packing= to the "
                    "Mixture (every source is then packed alike), not to its sources"
                )
        self.sources: dict[str, LakeDataset] = {n: sources[n] for n in self.names}
        self.raw_weights: dict[str, float] = {n: float(weights[n]) for n in self.names}
        self.seed = checked_seed(seed)
        total = sum(len(ds) for ds in self.sources.values())
        self.epoch_rows = total if epoch_rows is None else int(epoch_rows)
        if self.epoch_rows < 1:
            raise ValueError(f"epoch_rows must be a positive number of rows, got {epoch_rows}")
        self.schema = _common_schema(self.sources)
        if source_key in self.schema.names:
            raise ValueError(
                f"source_key={source_key!r} is also a column of the sources: pass another "
                "source_key= to Mixture(...)"
            )
        self.source_key = source_key
        self.packing = packing
        if packing is not None:
            made = all(ds.transform is not None for ds in self.sources.values())  # a tokenizer's
            if packing.column not in self.schema.names and not made:
                raise ColumnNotFoundError(
                    f"Packing column {packing.column!r} is not among the sources' columns "
                    f"{self.schema.names}: pass Packing(column=...) one of them"
                )
            self.sources = {n: ds.packed(packing) for n, ds in self.sources.items()}
        self.batch_transform = _one_batch_transform(self.sources, batch_transform)

    def with_sources(self, sources: Mapping[str, LakeDataset]) -> Mixture:
        """A twin of this mixture with these sources in place of some (the same settings).

        The recovery coordinator's: a source whose lake changed since a checkpoint reads its
        saved epoch from the pinned snapshot (``LakeDataset.followed_by``).
        """
        twin = copy.copy(self)
        twin.sources = {**self.sources, **sources}
        return twin

    def __len__(self) -> int:
        """Rows in one pass over the mixture (``epoch_rows``)."""
        return self.epoch_rows

    def rows(self) -> list[int]:
        """Rows of one epoch of each source, in the order of :attr:`names`."""
        return [len(self.sources[n]) for n in self.names]

    def describe(self) -> dict[str, Any]:
        """The sources as plain data: fingerprint, order configuration and rows of each."""
        return {
            name: {"fingerprint": ds.fingerprint, "config": ds.config_hash, "rows": len(ds)}
            for name, ds in self.sources.items()
        }

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:g}" for n, w in self.raw_weights.items())
        return f"Mixture({parts}, rows={self.epoch_rows}, seed={self.seed})"


def _one_batch_transform(
    sources: Mapping[str, LakeDataset], given: BatchTransform | None
) -> BatchTransform | None:
    """The batch_transform of the mixed batches: the one given, or the sources' common one."""
    theirs = {name: ds.batch_transform for name, ds in sources.items() if ds.batch_transform}
    if not theirs:
        return given
    first = next(iter(theirs.values()))
    if given is None and len(theirs) == len(sources) and all(t is first for t in theirs.values()):
        return first
    raise ValueError(
        f"mixture sources {sorted(theirs)} have their own batch_transform, of "
        f"{len(sources)} sources: a batch mixes every source's rows, so give one "
        "batch_transform to Mixture(batch_transform=...) and none to the sources"
    )


def _common_schema(sources: Mapping[str, LakeDataset]) -> pa.Schema:
    """The columns every source reads (the same names and types), or an error naming both."""
    (first, ds), *rest = sources.items()
    schema = ds.reader().schema
    for name, other in rest:
        theirs = other.reader().schema
        if theirs.names != schema.names or not theirs.equals(schema):
            raise SchemaMismatchError(
                f"mixture sources {first!r} and {name!r} read different columns: {first!r} "
                f"has {_fields(schema)}, {name!r} has {_fields(theirs)}. A batch holds rows "
                "of every source: give each LakeDataset the same columns= with the same types"
            )
    return schema


def _fields(schema: pa.Schema) -> str:
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "]"
