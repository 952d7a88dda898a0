"""``LakeDataset``: a pinned Parquet lake plus the configuration that defines its order.

The dataset owns what every rank and worker must agree on (snapshot, units, seed, ``C``,
window, shuffle, columns) and nothing about topology, so several loaders (simulated ranks)
can share one dataset object.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import fsspec
import pyarrow.compute as pc

from lakeloader.dataset_checks import check_backfill, check_lengths_keys, checked_seed
from lakeloader.errors import ColumnNotFoundError
from lakeloader.follow import Follow
from lakeloader.io.reader import UnitReader
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.discovery import Paths
from lakeloader.lake.filtering import RowFilter, filtered, lake_schema
from lakeloader.lake.following import first_increment, next_increment
from lakeloader.lake.increments import SourceRequest
from lakeloader.lake.mirrors import MirrorSpec, open_mirrors
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.source import Source, as_source
from lakeloader.lake.tables.sources import delta_source, iceberg_source
from lakeloader.order.config import OrderConfig
from lakeloader.order.packing import packed_plan
from lakeloader.order.plan import (
    DEFAULT_MAX_UNIT_ROWS,
    DEFAULT_NUM_PARTITIONS,
    DEFAULT_WINDOW,
    EpochPlan,
    Units,
    make_units,
    plan_epoch,
)
from lakeloader.packing import Packing
from lakeloader.pipeline.collate import BatchTransform, ListFormat, ListKind, Transform
from lakeloader.state.loader_state import config_hash
from lakeloader.state.quarantine import ON_ERROR_CHOICES, OnError, QuarantineEntry, Validate

logger = logging.getLogger(__name__)

#: Epoch plans kept per dataset (the current epoch and a neighbour are enough).
PLAN_CACHE_EPOCHS = 4


class LakeDataset:
    """A Parquet lake, pinned, with a deterministic order of rows per epoch.

    Args:
        source: A folder, glob, file or list of them (local paths or any fsspec URL), or any
            :class:`~lakeloader.lake.source.Source`.
        columns: Columns to read, a name or a list (file and hive partition columns); None: all.
        storage_options: fsspec options (credentials, endpoint, ...).
        seed: Seed of the order.
        shuffle: Shuffle (True) or keep path order (False).
        num_partitions: Canonical partitions C; None means ``DEFAULT_NUM_PARTITIONS`` when
            shuffling and 1 (exact path order) when not.
        window: Rows shuffled together inside a partition.
        max_unit_rows: Split row groups larger than this into row ranges.
        transform: Called on each row (a dict) before collation, where batches are built:
            in the workers, or in the loader's process without workers. Inside it,
            :func:`lakeloader.rng` draws from the row's own seed (the same draws for the same
            row in the same epoch, whatever the topology or resume).
        batch_transform: Called on each collated batch (on the default path a dict of
            tensors and lists) where batches are built: in the workers, whose tensors come back
            through shared memory, or in a background thread without workers. Inside it,
            :func:`lakeloader.row_seeds` and :func:`lakeloader.row_rngs` are the rows'.
        list_format: How list columns of numbers reach a default batch: ``"jagged"`` (a
            ``torch.nested`` jagged tensor) or ``"padded"`` (``[B, max_len]`` padded with
            ``pad_value``, plus ``<name>_lengths``).
        pad_value: What pads short lists with ``list_format="padded"``.
        progress: Progress bar while reading footers (None: from 64 files on).
        snapshot: A pinned snapshot (from a checkpoint's manifest) to use instead of listing
            the lake and reading its footers.
        retry: How transient storage failures (a store down, resets, HTTP 500/502/503/504,
            throttling) are retried; the default retries with backoff for up to 5 minutes per
            request.
        on_error: ``"raise"`` (default) a :class:`~lakeloader.LakeDataError` naming the file
            and row group of a unit that cannot be read, or ``"skip"``: quarantine it (its rows
            are left out alike on every rank and after every resume, and counted).
        validate: A check of each decoded unit (an Arrow table): True or None keeps it; False
            or a reason rejects it (raised, or quarantined with ``on_error="skip"``).
        packing: A :class:`~lakeloader.Packing`: batches are fixed-length samples cut from the
            rows' token lists (see :mod:`lakeloader.order.packing`).
        filter: A ``pyarrow.compute.Expression`` over partition and data columns: only the
            rows where it is true are delivered. Row groups that partition values or
            statistics rule out are never fetched; the others are counted once, reading the
            filter's columns, when the dataset is made (see :mod:`lakeloader.lake.filtering`).
            Part of the order configuration: a state taken under another filter is refused.
        follow: ``True`` or a :class:`~lakeloader.Follow`: an endless dataset of a growing
            folder or Delta table, epoch ``k`` being the ``k``-th increment (what was appended
            after the one before; :mod:`lakeloader.lake.increments`). Resume it with a
            :class:`~lakeloader.CheckpointManager`, whose manifest pins the increment.
        mirrors: Other copies of the lake, each a URL or ``(url, storage_options)``: checked
            at once to hold the same files (sizes, footers), read from when the copy in use
            stays down past the retry deadline (:mod:`lakeloader.lake.mirrors`).
        backfill: With ``on_error="skip"``, every step keeps its size: it takes the rows that
            follow a quarantined unit's (:mod:`lakeloader.pipeline.backfill`). Part of the
            order configuration.

    Raises:
        LakeNotFoundError: If the source holds no data file.
        LakeDataError: If a footer cannot be read.
        SchemaMismatchError: If file schemas conflict.
        ColumnNotFoundError: If a requested column does not exist (a ``KeyError`` too).

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> tmp = tempfile.TemporaryDirectory(); root = tmp.name
        >>> pq.write_table(pa.table({"id": range(100)}), f"{root}/part-0.parquet")
        >>> ds = LakeDataset(root, seed=1)
        >>> len(ds), ds.config.num_partitions
        (100, 16)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        source: Source | Paths,
        *,
        columns: str | Sequence[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        num_partitions: int | None = None,
        window: int = DEFAULT_WINDOW,
        max_unit_rows: int = DEFAULT_MAX_UNIT_ROWS,
        transform: Transform | None = None,
        batch_transform: BatchTransform | None = None,
        list_format: ListKind = "jagged",
        pad_value: float = 0,
        progress: bool | None = None,
        snapshot: Snapshot | None = None,
        retry: RetryPolicy | None = None,
        on_error: OnError = "raise",
        validate: Validate | None = None,
        packing: Packing | None = None,
        filter: pc.Expression | None = None,
        follow: bool | Follow = False,
        mirrors: Sequence[MirrorSpec] = (),
        backfill: bool = False,
    ) -> None:
        self.source: Source = as_source(source)
        columns = [columns] if isinstance(columns, str) else columns  # a name is one column
        #: Token lists packed into fixed-length samples (a ``DataLoader`` then hands out
        #: samples: :mod:`lakeloader.nodes.packing`), or None.
        self.packing = packing
        self.storage_options = dict(storage_options or {})
        self.transform = transform
        self.batch_transform = batch_transform
        self.list_format = ListFormat(list_format, pad_value)
        self.retry = retry or RetryPolicy()
        if on_error not in ON_ERROR_CHOICES:
            raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
        self.on_error: OnError = on_error
        self.validate = validate
        #: Follow mode's settings, or None.
        self.follow = Follow.of(follow)
        if snapshot is None:
            request = SourceRequest(
                self.storage_options,
                None if columns is None else list(columns),
                progress,
                self.retry,
                on_error == "skip",
            )
            if self.follow is None:
                fs, snapshot = self.source.snapshot(request)
            else:
                fs, snapshot = first_increment(self.source, self.follow, request)
            pinned = False
        else:
            fs = self.source.filesystem(self.storage_options)
            request = SourceRequest(self.storage_options, None, progress, self.retry, False)
            pinned = True  # a checkpoint's: the mirrors may hold files added since
        self.fs: fsspec.AbstractFileSystem = fs
        #: The other copies of the lake.
        self.mirrors = open_mirrors(snapshot, fs, mirrors, request, pinned) if mirrors else ()
        #: The row filter, or None.
        self.row_filter = None if filter is None else RowFilter.of(filter, lake_schema(snapshot))
        snapshot, unreadable = self._filtered(fs, snapshot, progress)
        if num_partitions is None:
            num_partitions = DEFAULT_NUM_PARTITIONS if shuffle else 1
        self.config = OrderConfig(
            seed=checked_seed(seed),
            shuffle=bool(shuffle),
            num_partitions=int(num_partitions),
            window=int(window),
            max_unit_rows=int(max_unit_rows),
            columns=tuple(columns if columns is not None else snapshot.schema.names),
            filter=None if self.row_filter is None else self.row_filter.text,
            backfill=bool(backfill),
        )
        check_backfill(bool(backfill), on_error, packing, self.follow)
        if self.config.num_partitions < 1 or self.config.window < 1:
            raise ValueError(
                f"num_partitions and window must be >= 1, got {num_partitions} and {window}"
            )
        self.config_hash = config_hash(self.config.to_dict())
        self.snapshot: Snapshot
        self.units: Units
        self._pin(snapshot)
        if self.list_format.padded:
            check_lengths_keys(self.config.columns, snapshot.schema)
        #: Units of this snapshot known to be lost (files gone or rewritten since a
        #: checkpoint, under ``on_lake_change="skip"``; row groups the filter could not read,
        #: under ``on_error="skip"``): skipped like quarantined units.
        self.lost: tuple[QuarantineEntry, ...] = unreadable
        self._successor: tuple[int, LakeDataset] | None = None
        logger.info(
            "lake %s: %d files, %d row groups, %d units, %d rows, fingerprint %s",
            source,
            len(snapshot.files),
            snapshot.num_row_groups,
            len(self.units),
            snapshot.num_rows,
            snapshot.fingerprint,
        )

    @classmethod
    def from_delta(
        cls,
        uri: str | os.PathLike[str],
        *,
        version: int | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> LakeDataset:
        """A Delta Lake table version (extra ``delta``): its files from the table's log.

        Args:
            uri: The table's folder (a local path or ``s3://``, ``gs://``... URL).
            version: The table version; None takes the newest now. A checkpoint pins the
                version it read, and a resume finishes that epoch on it even after the table
                has moved on; later epochs run on the version this dataset was made with.
            storage_options: fsspec options (as for any ``LakeDataset``), also handed to
                ``deltalake`` in its own spelling (upper-case object_store keys pass as they
                are).
            **kwargs: Any other ``LakeDataset`` argument.

        Raises:
            LakeNotFoundError: If there is no Delta table at ``uri``, or not that version.
        """
        found, options = delta_source(uri, version, storage_options)
        return cls(found, storage_options=options, **kwargs)

    @classmethod
    def from_iceberg(
        cls,
        table: Any,
        *,
        snapshot_id: int | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> LakeDataset:
        """An Iceberg table snapshot (extra ``iceberg``): its files from the table's manifests.

        Args:
            table: A pyiceberg ``Table``, or the location of a table's metadata file (read as
                a static table).
            snapshot_id: The snapshot; None takes the current one. Pinned by checkpoints like
                a Delta version (see :meth:`from_delta`).
            storage_options: fsspec options, also handed to pyiceberg as its ``s3.*``
                properties; a ``Table``'s own FileIO properties serve when none are given.
            **kwargs: Any other ``LakeDataset`` argument.

        Raises:
            LakeNotFoundError: If the metadata or the snapshot cannot be found.
            LakeDataError: If the snapshot has equality deletes (refused, naming the table).
        """
        found, options = iceberg_source(table, snapshot_id, storage_options)
        return cls(found, storage_options=options, **kwargs)

    def _pin(self, snapshot: Snapshot) -> None:
        """Take ``snapshot`` as this dataset's files (only while the dataset is being made)."""
        unknown = [c for c in self.config.columns if c not in snapshot.schema.names]
        if unknown:
            raise ColumnNotFoundError.of(unknown, snapshot.column_names, self.source.describe())
        self.snapshot = snapshot
        self.units = make_units(
            [f.row_group_rows for f in snapshot.files], self.config.max_unit_rows
        )
        self._plan_cached = functools.lru_cache(maxsize=PLAN_CACHE_EPOCHS)(self._plan)

    def __len__(self) -> int:
        return self.snapshot.num_rows

    def packed(self, packing: Packing) -> LakeDataset:
        """A twin of this dataset packed by ``packing`` (a packed Mixture's source)."""
        twin = copy.copy(self)
        twin.packing = packing  # copied through __setstate__: its plan cache is its own
        return twin

    def __getitem__(self, index: object) -> None:
        """Refuse indexing: torch's own DataLoader would sample rows one by one.

        Raises:
            TypeError: Always, saying to use ``lakeloader.DataLoader``.
        """
        raise TypeError(
            "a LakeDataset is not indexed row by row: use lakeloader.DataLoader(dataset, "
            "batch_size=...), which plans the order, reads "
            "whole units and remembers the position (torch.utils.data.DataLoader cannot)"
        )

    def __repr__(self) -> str:
        return (
            f"LakeDataset({self.source!r}, rows={len(self)}, files={len(self.snapshot.files)}, "
            f"C={self.config.num_partitions}, window={self.config.window}, "
            f"shuffle={self.config.shuffle}, seed={self.config.seed})"
        )

    @property
    def fingerprint(self) -> str:
        """The pinned snapshot's fingerprint."""
        return self.snapshot.fingerprint

    def _plan(self, epoch: int) -> EpochPlan:
        c = self.config
        if self.packing is not None:  # units permuted, rows in file order
            return packed_plan(self.units, c.seed, epoch, c.shuffle)
        return plan_epoch(
            self.units,
            seed=c.seed,
            epoch=epoch,
            shuffle=c.shuffle,
            num_partitions=c.num_partitions,
            window=c.window,
        )

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of one epoch (cached for the last few epochs)."""
        return self._plan_cached(epoch)

    @property
    def grows_at(self) -> int | None:
        """The first epoch run on another dataset (see :meth:`followed_by`), or None."""
        return None if self._successor is None else self._successor[0]

    def pinned_to(self, snapshot: Snapshot) -> LakeDataset:
        """A twin of this dataset on another snapshot of the same lake (same settings, order).

        The recovery coordinator uses it to finish a checkpoint's epoch on the snapshot the
        checkpoint pinned. Neither dataset is changed.

        Raises:
            ColumnNotFoundError: If a selected column is not in ``snapshot``.
        """
        twin = copy.copy(self)
        twin._pin(snapshot)
        twin._successor, twin.lost = None, ()
        return twin

    def followed_by(
        self, epoch: int, successor: LakeDataset, lost: Sequence[QuarantineEntry] = ()
    ) -> LakeDataset:
        """A copy of this dataset whose epochs from ``epoch`` on run on ``successor``.

        The recovery coordinator uses it to finish a checkpoint's epoch on its pinned snapshot
        while files added since join at the next epoch boundary. Neither dataset is changed.

        Args:
            epoch: The first epoch of the successor.
            successor: The dataset of the later epochs (same order configuration).
            lost: Units of this snapshot that can no longer be read, to be skipped.

        Raises:
            ValueError: If the successor's order configuration differs.
        """
        if successor.config != self.config:
            raise ValueError(
                f"a successor dataset must have the same order configuration: {self.config} "
                f"here, {successor.config} there"
            )
        chained = copy.copy(self)
        chained._successor, chained.lost = (int(epoch), successor), tuple(lost)
        return chained

    def for_epoch(self, epoch: int) -> LakeDataset:
        """The dataset that epoch ``epoch`` runs on: this one, or its successor."""
        if self._successor is None and self.follow is not None:
            index = self.snapshot.increment.index if self.snapshot.increment else 0
            if epoch > index:  # waits for the next increment (CaughtUpError if none comes)
                now = self.snapshot.increment
                found = next_increment(self.source, self.follow, now, self.increment_request())
                self._successor = (index + 1, self.on_increment(*found))
        if self._successor is not None and epoch >= self._successor[0]:
            return self._successor[1].for_epoch(epoch)
        return self

    def increment_request(self) -> SourceRequest:
        """How this (followed) dataset asks its source for an increment."""
        assert self.follow is not None
        return SourceRequest(
            self.storage_options,
            list(self.config.columns),
            False,
            self.retry,
            self.on_error == "skip",
            self.follow.on_rewrite,
        )

    def on_increment(self, fs: fsspec.AbstractFileSystem, snapshot: Snapshot) -> LakeDataset:
        """A twin of this dataset on an increment's snapshot (its filter applied)."""
        found, unreadable = self._filtered(fs, snapshot, False)
        twin = self.pinned_to(found)
        twin.fs, twin.lost = fs, unreadable
        return twin

    def _filtered(
        self, fs: fsspec.AbstractFileSystem, snapshot: Snapshot, progress: bool | None
    ) -> tuple[Snapshot, tuple[QuarantineEntry, ...]]:
        """``snapshot`` with the filter's counts, and the row groups it could not read."""
        count = functools.partial(UnitReader, fs, retry=self.retry)
        return filtered(fs, snapshot, self.row_filter, progress, self.on_error, count)

    def reader(self) -> UnitReader:
        """A fresh unit reader (with its own counters) for the selected columns."""
        copies = [(m.fs, m.serving(self.snapshot)) for m in self.mirrors]
        served = [(fs, snapshot) for fs, snapshot in copies if snapshot is not None]
        c = self.config.columns
        return UnitReader(self.fs, self.snapshot, c, self.retry, self.row_filter, served)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_plan_cached")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._plan_cached = functools.lru_cache(maxsize=PLAN_CACHE_EPOCHS)(self._plan)
