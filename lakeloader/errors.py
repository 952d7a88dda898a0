"""Exceptions raised by lakeloader.

Every error says what went wrong, where (file, row group, key) and what to do about it, so
that a failure deep inside a DataLoader worker is actionable from the training log alone.
"""

from __future__ import annotations


class LakeError(Exception):
    """Base class of every error lakeloader raises on purpose."""


class LakeNotFoundError(LakeError):
    """The source names no Parquet file (an empty folder, a glob that matches nothing)."""


class SchemaMismatchError(LakeError):
    """Two files of a lake have schemas that cannot be unified into one."""


class LakeDataError(LakeError):
    """A Parquet file, or one of its row groups, cannot be read or decoded.

    Raised in the training process (never as a bare worker traceback), with the file's URL,
    the row group when one is concerned, and pyarrow's own error chained and quoted. With
    ``on_error="skip"`` the unit is quarantined instead (see ``LakeDataset``).
    """


class StoreUnavailableError(LakeError):
    """The store kept failing transiently (down, refusing, 5xx) past the retry deadline."""


class StoreAccessError(LakeError, PermissionError):
    """The store refused access (wrong or missing credentials, or no permission)."""


class StateMismatchError(LakeError):
    """A saved state belongs to another lake snapshot or another configuration."""


class StateFormatError(LakeError):
    """A saved state is malformed or has a format version this library cannot read."""


class WorkerError(LakeError):
    """A DataLoader worker failed, kept dying on the same work, or stopped answering.

    When the work itself raised, the worker's traceback is in the message.
    """


class NullValuesError(LakeError, ValueError):
    """A column whose type maps to an integer, boolean or date/time tensor holds nulls."""


class LakeChangedError(LakeError):
    """Files of a pinned snapshot are gone or were rewritten since a checkpoint."""


class CheckpointError(LakeError):
    """A checkpoint cannot be saved or no usable checkpoint can be loaded."""


class LakeWarning(UserWarning):
    """Base class of every warning lakeloader issues (each one a subclass).

    Warnings are what a user should act on, and reach them without any logging set up;
    ``warnings.filterwarnings("ignore", category=lakeloader.LakeWarning)`` silences them all.
    """


class CacheBudgetWarning(LakeWarning):
    """One step's decoded pieces alone exceed ``cache_bytes``: the loader holds them anyway.

    A step draws rows from about ``C`` pieces (one per canonical partition), each decoded
    whole, so the cache cannot go below what they hold, whatever the budget.
    """


class PartitionWarning(LakeWarning):
    """``C`` does not divide the global batch: exact, but ranks re-read each other's units."""


class CpuContentionWarning(LakeWarning):
    """torch's intra-op threads and the DataLoader workers together exceed the CPU cores."""


class WorkerWarning(LakeWarning):
    """A DataLoader worker died and was replaced, or ``num_workers`` starts no process."""


class StorageRetryWarning(LakeWarning):
    """The store failed transiently and requests are retried (said once per outage)."""
