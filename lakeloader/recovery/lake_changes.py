"""The lake against a pinned snapshot: what is gone, rewritten or added, and the policy."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Literal

import fsspec

from lakeloader.errors import LakeChangedError
from lakeloader.lake.discovery import version_token
from lakeloader.lake.files import FileInfo
from lakeloader.lake.snapshot import Snapshot
from lakeloader.signals import main_thread_only
from lakeloader.state.quarantine import QuarantineEntry

logger = logging.getLogger(__name__)

#: What to do when files of a checkpoint's snapshot that the rest of the saved epoch needs are
#: gone or rewritten: ``"error"`` refuses, listing them; ``"skip"`` finishes the saved epoch
#: without their units; ``"restart_epoch"`` runs the saved epoch again on the lake of now (its
#: rows delivered before the checkpoint come again: at least once for that epoch).
LakeChangePolicy = Literal["error", "skip", "restart_epoch"]
POLICIES: Final = ("error", "skip", "restart_epoch")


@dataclass(frozen=True)
class LakeDiff:
    """How the live lake differs from a pinned snapshot.

    Attributes:
        gone: Paths of the snapshot that no longer exist.
        changed: ``(path, was, now)`` for files whose size or version token changed.
        added: Paths that exist now but are not in the snapshot (only known when the lake
            was listed again).
    """

    gone: tuple[str, ...] = ()
    changed: tuple[tuple[str, str, str], ...] = ()
    added: tuple[str, ...] = ()

    def describe(self) -> str:
        """A readable list of the differences (the first 20 of each kind)."""
        limit = 20
        lines = [f"  gone: {p}" for p in self.gone[:limit]]
        lines += [f"  changed: {p} ({was} -> {now})" for p, was, now in self.changed[:limit]]
        lines += [f"  added: {p}" for p in self.added[:limit]]
        hidden = sum(max(0, len(x) - limit) for x in (self.gone, self.changed, self.added))
        if hidden:
            lines.append(f"  ... and {hidden} more")
        return "\n".join(lines)


def _stamp(f: FileInfo) -> str:
    return f"size {f.size}, {f.version}"


def _diff(
    files: Sequence[FileInfo], now: Mapping[str, str | None], added: tuple[str, ...] = ()
) -> LakeDiff:
    """The pinned ``files`` against their stamps now, by path (None or absent: gone)."""
    gone = tuple(f.path for f in files if now.get(f.path) is None)
    changed = tuple(
        (f.path, _stamp(f), stamp)
        for f in files
        if (stamp := now.get(f.path)) is not None and stamp != _stamp(f)
    )
    return LakeDiff(gone, changed, added)


def diff_snapshots(saved: Snapshot, current: Snapshot) -> LakeDiff:
    """Compare a pinned snapshot with a freshly listed one (pure)."""
    now = {f.path: _stamp(f) for f in current.files}
    was = {f.path for f in saved.files}
    return _diff(saved.files, now, tuple(p for p in now if p not in was))


def check_files(fs: fsspec.AbstractFileSystem, files: Sequence[FileInfo]) -> LakeDiff:
    """Ask the store about each pinned file (one metadata request each, in parallel)."""

    def probe(f: FileInfo) -> tuple[str, str | None]:
        try:
            info = fs.info(f.path)
        except FileNotFoundError:
            return f.path, None
        return f.path, f"size {int(info.get('size') or 0)}, {version_token(info)}"

    fs.invalidate_cache()  # a cached listing would answer with the old size and version
    threads = max(1, min(32, len(files)))  # files checked at once
    with ThreadPoolExecutor(max_workers=threads, initializer=main_thread_only) as pool:
        found = dict(pool.map(probe, files))
    return _diff(files, found)


def lost_units(snapshot: Snapshot, diff: LakeDiff) -> tuple[QuarantineEntry, ...]:
    """Quarantine entries for every row group of the files gone or rewritten (pure)."""
    reasons = {p: "file gone since the checkpoint" for p in diff.gone}
    reasons.update(
        {p: f"file rewritten since the checkpoint ({was} -> {now})" for p, was, now in diff.changed}
    )
    return tuple(
        QuarantineEntry(f.path, rg, 0, rows, reasons[f.path])
        for f in snapshot.files
        if f.path in reasons
        for rg, rows in enumerate(f.row_group_rows)
    )


def check_policy(policy: str) -> None:
    """Refuse an unknown ``on_lake_change`` at once, whether or not the lake changed."""
    if policy not in POLICIES:
        raise ValueError(f"on_lake_change must be one of {POLICIES}, got {policy!r}")


def enforce(diff: LakeDiff, policy: LakeChangePolicy, where: str, finished: bool) -> bool:
    """Apply a policy to a lake difference against ``where`` (a checkpoint, for messages).

    ``finished``: the saved position is at its epoch's end, so no old file is needed.

    Returns:
        True when the saved position holds (resume it; with ``"skip"`` the caller skips
        :func:`lost_units`), False when the saved epoch must restart.

    Raises:
        LakeChangedError: Under ``"error"``, when files the rest of the epoch needs are gone
            or rewritten.
        ValueError: For an unknown policy.
    """
    check_policy(policy)
    if diff.added:
        logger.warning(
            "%d file(s) were added to the lake since %s; they join at the next epoch boundary:\n%s",
            len(diff.added),
            where,
            LakeDiff(added=diff.added).describe(),
        )
    if not (diff.gone or diff.changed) or finished:
        return True
    if policy == "error":
        raise LakeChangedError(
            f"the lake changed since {where}, and the rest of the saved epoch needs these "
            f"files, so its position cannot be resumed exactly:\n{diff.describe()}\n"
            "restore the files; or pass on_lake_change='skip' to skip their units for the "
            "rest of the epoch (counted as skipped), or 'restart_epoch' to run the saved "
            "epoch again on the lake as it is now"
        )
    if policy == "skip":
        logger.warning(
            "the lake changed since %s; the rest of the saved epoch skips the units of these "
            "files (on_lake_change='skip'):\n%s",
            where,
            diff.describe(),
        )
        return True
    logger.warning(
        "the lake changed since %s; restarting the saved epoch from its start "
        "(on_lake_change='restart_epoch'):\n%s",
        where,
        diff.describe(),
    )
    return False
