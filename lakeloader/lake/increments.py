"""Increments of a growing lake: what follow mode takes in, one epoch each.

Increment ``k + 1`` is what was appended after increment ``k``'s :class:`Mark`: for a folder,
files listed with a later modification time (written once, under new names); for a table, the
next commit or snapshot that appends rows.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lakeloader.errors import LakeChangedError
from lakeloader.follow import OnRewrite
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.discovery import DiscoveredFile

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Mark:
    """Where an increment ends: a time (ns) and path for a folder, a version for a table.

    >>> Mark(5, "b") > Mark(5, "a") > Mark(4, "z")
    True
    """

    position: int
    path: str = ""


@dataclass(frozen=True)
class Increment:
    """Which increment a snapshot is: what comes after one mark, up to another.

    ``index`` is the epoch it is delivered as; ``after`` None is the first increment.
    """

    index: int
    upto: Mark
    after: Mark | None = None

    def to_list(self) -> list[Any]:
        """Plain data (for states and manifests).

        >>> Increment(2, Mark(9, "b"), Mark(5, "a")).to_list()
        [2, 9, 'b', 5, 'a']
        """
        after = [] if self.after is None else [self.after.position, self.after.path]
        return [self.index, self.upto.position, self.upto.path, *after]

    @classmethod
    def from_list(cls, value: list[Any]) -> Increment:
        """Parse :meth:`to_list`'s data (an increment without ``after`` has 3 items).

        >>> Increment.from_list([2, 9, "b", 5, "a"]).after
        Mark(position=5, path='a')
        """
        index, position, path, *after = value
        start = Mark(int(after[0]), str(after[1])) if after else None
        return cls(int(index), Mark(int(position), str(path)), start)


@dataclass(frozen=True)
class SourceRequest:
    """What a source is asked for a snapshot or an increment with.

    Attributes:
        columns: The columns read (None: all).
        progress: Progress bar while reading footers (None: from 64 files on).
        skip_unreadable: Leave out files whose footer cannot be read.
        on_rewrite: What a rewrite of data already taken in does (see ``Follow``).
        upto: The last mark to take (another rank's increment); None: all there is now.
    """

    storage_options: dict[str, Any]
    columns: list[str] | None
    progress: bool | None
    retry: RetryPolicy
    skip_unreadable: bool
    on_rewrite: OnRewrite = "skip"
    upto: Mark | None = None


def rewritten(where: str, on_rewrite: OnRewrite) -> None:
    """Apply the rewrite policy to a commit or snapshot that rewrote data (``where`` names it).

    Raises:
        LakeChangedError: Under ``"error"`` (``"skip"`` logs a warning).
    """
    if on_rewrite == "error":
        raise LakeChangedError(
            f"{where} rewrites data already in the table; follow mode takes in only appends: "
            "pass Follow(on_rewrite='skip') to leave such changes out"
        )
    logger.warning("%s rewrites data: left out (on_rewrite='skip')", where)


def listed_ns(info: dict[str, Any]) -> int | None:
    """A listing entry's modification time in nanoseconds (local, S3 or GCS), or None.

    >>> listed_ns({"mtime": 1.5}), listed_ns({"LastModified": dt.datetime(1970, 1, 1, 0, 0, 2,
    ...     tzinfo=dt.timezone.utc)})
    (1500000000, 2000000000)
    """
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        if isinstance(value, dt.datetime):
            return int(value.timestamp() * 1e9)
        return int(float(value) * 1e9)
    return None


def newer_files(
    found: Sequence[tuple[DiscoveredFile, int]], after: Mark | None, upto: Mark | None = None
) -> tuple[list[DiscoveredFile], Mark | None]:
    """The files after ``after`` up to ``upto`` (None: no bound), by path, and their largest mark.

    >>> f = [(DiscoveredFile("a", ()), 10), (DiscoveredFile("b", ()), 20)]
    >>> [d.path for d in newer_files(f, Mark(10, "a"))[0]], newer_files(f, None)[1]
    (['b'], Mark(position=20, path='b'))
    >>> newer_files(f, None, Mark(10, "a"))[1]
    Mark(position=10, path='a')
    """
    marked = [(Mark(ns, d.path), d) for d, ns in found]
    new = [
        (m, d) for m, d in marked if (after is None or m > after) and (upto is None or m <= upto)
    ]
    if not new:
        return [], None
    return sorted((d for _, d in new), key=lambda d: d.path), max(m for m, _ in new)
