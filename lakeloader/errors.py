"""Exceptions and warnings raised by lakeloader: each says what, where and what to do."""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from collections.abc import Sequence

#: This package's folder: frames under it are lakeloader's own, not the user's.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: Columns a ColumnNotFoundError lists at most (the closest to the missing ones first).
SHOWN_COLUMNS = 20


class LakeError(Exception):
    """Base class of every error lakeloader raises on purpose."""


class LakeNotFoundError(LakeError):
    """The source names no Parquet file (an empty folder, a glob that matches nothing)."""


class ColumnNotFoundError(LakeError, KeyError):
    """A column asked for is not in the lake (a ``KeyError`` too, as a missing key is).

    Its message is one line, unlike a plain ``KeyError``'s (the quoted repr of its text).

    Example:
        >>> err = ColumnNotFoundError.of(["lable"], ["id", "x", "label"], "/data/lake")
        >>> print(err)  # doctest: +NORMALIZE_WHITESPACE
        column 'lable' is not in the lake /data/lake (did you mean 'label'?); its columns,
        closest first: 'label', 'id', 'x'. Pass columns= names among them (None reads every
        column)
        >>> isinstance(err, KeyError)
        True
    """

    @classmethod
    def of(
        cls, missing: Sequence[str], available: Sequence[str], lake: object
    ) -> ColumnNotFoundError:
        """The error for ``missing`` columns of ``lake``, whose columns are ``available``."""

        def closeness(name: str) -> float:
            return max(difflib.SequenceMatcher(None, m, name).ratio() for m in missing)

        ranked = sorted(available, key=closeness, reverse=True)  # stable: ties keep their order
        shown = ", ".join(map(repr, ranked[:SHOWN_COLUMNS]))
        if len(ranked) > SHOWN_COLUMNS:
            shown += f" and {len(ranked) - SHOWN_COLUMNS} more"
        guesses = [g for m in missing for g in difflib.get_close_matches(m, available, n=1)]
        guess = f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
        what = ", ".join(map(repr, missing))
        subject = f"column {what} is" if len(missing) == 1 else f"columns {what} are"
        return cls(
            f"{subject} not in the lake {lake}{guess}; its columns, closest first: {shown}. "
            "Pass columns= names among them (None reads every column)"
        )

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


class TopologyError(LakeError, RuntimeError):
    """This process's place in the run (rank, world size) cannot be told when it is needed."""


class CheckpointError(LakeError):
    """A checkpoint cannot be saved or no usable checkpoint can be loaded."""


class LakeWarning(UserWarning):
    """Base class of every warning lakeloader issues (each one a subclass).

    Warnings are what a user should act on, and reach them without any logging set up;
    ``warnings.filterwarnings("ignore", category=lakeloader.LakeWarning)`` silences them all.
    """


class CacheBudgetWarning(LakeWarning):
    """One step's decoded pieces alone exceed ``cache_bytes``: the loader holds them anyway."""


class PartitionWarning(LakeWarning):
    """``C`` does not divide the global batch: exact, but ranks re-read each other's units."""


class CpuContentionWarning(LakeWarning):
    """torch's intra-op threads and the DataLoader workers together exceed the CPU cores."""


class WorkerWarning(LakeWarning):
    """A DataLoader worker died and was replaced."""


class StorageRetryWarning(LakeWarning):
    """The store failed transiently and requests are retried (said once per outage)."""


class MirrorWarning(LakeWarning):
    """A copy of the lake (``mirrors=``) is down: left out at open, or reads moved off it."""


def warn_user(message: str, category: type[LakeWarning]) -> None:
    """Warn, attributed to the first frame outside lakeloader (the user's line that led here)."""
    level, frame = 2, sys._getframe(1)  # 2: the caller of this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back  # type: ignore[assignment]
    warnings.warn(message, category, stacklevel=level)
