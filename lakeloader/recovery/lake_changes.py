"""The recovery coordinator: map a saved position onto the lake and topology that exist now.

A saved position is ``(epoch, G)`` plus the snapshot it refers to; it does not depend on world
size, worker count or batch size (see docs/design.md), so mapping it onto a new topology needs
no reassignment table. What can break exactness is the lake itself: a file of the pinned
snapshot that is gone or was rewritten. These functions find such files, without listing the
lake or reading a footer, and apply the caller's policy; ``restore`` and ``pinned_dataset``
put a loader or a dataset back at a checkpoint accordingly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

import fsspec

from lakeloader.dataset import LakeDataset
from lakeloader.errors import LakeChangedError
from lakeloader.lake.discovery import version_token
from lakeloader.lake.snapshot import FileInfo, Snapshot
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.quarantine import QuarantineEntry

if TYPE_CHECKING:
    from lakeloader.checkpoint.manager import Checkpoint
    from lakeloader.loader import DataLoader

logger = logging.getLogger(__name__)

#: What to do when files of a checkpoint's snapshot are gone or rewritten and the rest of the
#: saved epoch needs them (files *added* since are never a problem: they join at the next
#: epoch boundary; and a checkpoint taken at an epoch's end needs no old file at all):
#: ``"error"``: refuse, listing each file with its old and new size and version (the default:
#: exactness cannot be kept).
#: ``"skip"``: finish the saved epoch on its pinned snapshot, skipping (quarantining) the units
#: of those files; the rows this costs are reported. Later epochs run on the lake as it is now.
#: ``"restart_epoch"``: take the lake as it is now and run the saved epoch again from its start
#: (rows delivered before the checkpoint in that epoch are delivered again: at least once).
LakeChangePolicy = Literal["error", "skip", "restart_epoch"]
POLICIES: Final = ("error", "skip", "restart_epoch")
#: Files checked at once (one metadata request each).
CHECK_THREADS = 32


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

    def describe(self, limit: int = 20) -> str:
        """A readable list of the differences (the first ``limit`` of each kind)."""
        lines = [f"  gone: {p}" for p in self.gone[:limit]]
        lines += [f"  changed: {p} ({was} -> {now})" for p, was, now in self.changed[:limit]]
        lines += [f"  added: {p}" for p in self.added[:limit]]
        hidden = sum(max(0, len(x) - limit) for x in (self.gone, self.changed, self.added))
        if hidden:
            lines.append(f"  ... and {hidden} more")
        return "\n".join(lines)


def _stamp(f: FileInfo) -> str:
    return f"size {f.size}, {f.version}"


def diff_snapshots(saved: Snapshot, current: Snapshot) -> LakeDiff:
    """Compare a pinned snapshot with a freshly listed one (pure)."""
    now = {f.path: f for f in current.files}
    was = {f.path: f for f in saved.files}
    gone = tuple(p for p in was if p not in now)
    changed = tuple(
        (p, _stamp(f), _stamp(now[p]))
        for p, f in was.items()
        if p in now and (f.size, f.version) != (now[p].size, now[p].version)
    )
    added = tuple(p for p in now if p not in was)
    return LakeDiff(gone, changed, added)


def check_files(fs: fsspec.AbstractFileSystem, files: Sequence[FileInfo]) -> LakeDiff:
    """Ask the store about each pinned file (one metadata request each, in parallel).

    This neither lists folders nor reads footers, so it stays cheap on object stores.
    """

    def probe(f: FileInfo) -> tuple[str, str | None]:
        try:
            info = fs.info(f.path)
        except FileNotFoundError:
            return f.path, None
        now = f"size {int(info.get('size') or 0)}, {version_token(info)}"
        return f.path, now

    fs.invalidate_cache()  # a cached listing would answer with the old size and version
    with ThreadPoolExecutor(max_workers=max(1, min(CHECK_THREADS, len(files)))) as pool:
        found = dict(pool.map(probe, files))
    gone = tuple(p for p, now in found.items() if now is None)
    changed = tuple(
        (f.path, _stamp(f), found[f.path] or "")
        for f in files
        if found[f.path] is not None and found[f.path] != _stamp(f)
    )
    return LakeDiff(gone, changed)


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


def enforce(diff: LakeDiff, policy: LakeChangePolicy, where: str, finished: bool) -> bool:
    """Apply a policy to a lake difference.

    Args:
        diff: The difference.
        policy: One of :data:`POLICIES`.
        where: What the difference is against (a checkpoint path), for messages.
        finished: Whether the saved position is at its epoch's end (then no old file is
            needed, and only the next epoch's lake matters).

    Returns:
        True when the saved position holds (resume it; with ``"skip"`` the caller skips
        :func:`lost_units`), False when the saved epoch must restart.

    Raises:
        LakeChangedError: Under ``"error"``, when files the rest of the epoch needs are gone
            or rewritten.
        ValueError: For an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"on_lake_change must be one of {POLICIES}, got {policy!r}")
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


def restore(loader: DataLoader, ckpt: Checkpoint, policy: LakeChangePolicy) -> None:
    """Put a loader at a checkpoint's position, on the lake its dataset sees now.

    When the loader's snapshot is not the checkpoint's, the difference decides: files added
    since join at the next epoch boundary (the saved epoch finishes on the pinned snapshot,
    then the loader moves on to its own dataset); files gone or rewritten go by ``policy``.

    Raises:
        LakeChangedError: Under ``"error"``, when the rest of the epoch needs changed files.
        StateMismatchError: If the order configuration differs.
    """
    saved = LoaderState.from_dict(ckpt.state)
    live = loader.dataset
    if saved.fingerprint != live.fingerprint:
        diff = diff_snapshots(ckpt.snapshot, live.snapshot)
        if not enforce(diff, policy, ckpt.path, saved.at_epoch_end):
            saved.check_matches(saved.fingerprint, live.config.to_dict())
            loader.set_epoch(saved.epoch, restart=True)
            return
        pinned = LakeDataset(ckpt.context["source"], snapshot=ckpt.snapshot, **_settings(live))
        _hand_over(pinned, live, saved, diff)
        loader.rebase(pinned)
    loader.load_state_dict(ckpt.state)


def pinned_dataset(
    ckpt: Checkpoint, policy: LakeChangePolicy, settings: dict[str, Any]
) -> LakeDataset:
    """The dataset of a checkpoint's pinned snapshot, with the lake's changes applied.

    Each pinned file is checked with one metadata request (no listing, no footers).

    Args:
        ckpt: The checkpoint.
        policy: What to do with files gone or rewritten.
        settings: :class:`LakeDataset` arguments that do not change the order.

    Raises:
        LakeChangedError: Under ``"error"``, when the rest of the epoch needs changed files.
    """
    saved = LoaderState.from_dict(ckpt.state)
    kwargs = {**saved.config, **settings}  # the order config's keys are LakeDataset's
    source = ckpt.context["source"]
    pinned = LakeDataset(source, snapshot=ckpt.snapshot, **kwargs)
    diff = check_files(pinned.fs, pinned.snapshot.files)
    if not (diff.gone or diff.changed):
        return pinned
    if not enforce(diff, policy, ckpt.path, saved.at_epoch_end):
        return LakeDataset(source, **kwargs)
    _hand_over(pinned, LakeDataset(source, **kwargs), saved, diff)
    return pinned


def _hand_over(pinned: LakeDataset, live: LakeDataset, saved: LoaderState, diff: LakeDiff) -> None:
    """Finish the saved epoch on ``pinned`` (without lost units), later epochs on ``live``."""
    lost = () if saved.at_epoch_end else lost_units(pinned.snapshot, diff)
    pinned.hand_over(saved.epoch + 1, live, lost)


def _settings(ds: LakeDataset) -> dict[str, Any]:
    """A dataset's arguments, so that a pinned twin orders and reads rows alike."""
    return {
        **ds.config.to_dict(),
        "storage_options": ds.storage_options,
        "transform": ds.transform,
        "retry": ds.retry,
        "on_error": ds.on_error,
        "validate": ds.validate,
    }
