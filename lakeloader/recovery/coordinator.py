"""The recovery coordinator: a saved position onto the lake and topology of now; dead workers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.errors import LakeChangedError, StateMismatchError
from lakeloader.lake.following import increment_at
from lakeloader.lake.increments import Increment
from lakeloader.lake.manifest import from_manifest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.tables.sources import checkpoint_source
from lakeloader.recovery.lake_changes import (
    LakeChangePolicy,
    LakeDiff,
    check_files,
    check_policy,
    diff_snapshots,
    enforce,
    lost_units,
)
from lakeloader.recovery.reassign import Reassignment, reassign
from lakeloader.state.formats import LAKE, read
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.mixture_state import SourceRecord


@dataclass(frozen=True)
class Resumption:
    """How a loader continues from a saved state.

    Attributes:
        state: The saved position to take, or None when the saved epoch runs again from its
            start (``on_lake_change="restart_epoch"``).
        restart_epoch: The epoch to run again from its start, when ``state`` is None.
        dataset: The dataset to run on from now on, or None to keep the loader's own.
    """

    state: LoaderState | None
    restart_epoch: int | None = None
    dataset: LakeDataset | None = None


@dataclass(frozen=True)
class SourceResumption:
    """Where a mixture's (or a packed stream's) source goes on, on the lake of now.

    Attributes:
        dataset: What its stream reads from ``epoch`` on (the checkpoint's pinned snapshot for
            the rest of the saved epoch, then the lake of now).
        epoch: The epoch its stream is known from.
        start: The offset of that epoch's first row in its stream.
    """

    dataset: LakeDataset
    epoch: int
    start: int


class RecoveryCoordinator:
    """Maps saved positions onto the lake and topology of now; decides on dead workers' work.

    Args:
        on_lake_change: ``"error"``, ``"skip"`` or ``"restart_epoch"``
            (:data:`~lakeloader.recovery.lake_changes.LakeChangePolicy`); checked here,
            whether or not the lake changed.

    Raises:
        ValueError: For an unknown policy.

    Example:
        >>> RecoveryCoordinator().reassign([3, 4], building=3, attempts={}).resend
        (3, 4)
    """

    def __init__(self, on_lake_change: LakeChangePolicy = "error") -> None:
        check_policy(on_lake_change)
        self.on_lake_change: LakeChangePolicy = on_lake_change

    def resume_state(self, state: Any, dataset: LakeDataset) -> Resumption:
        """The resumption of a bare state (``DataLoader.load_state_dict``) on ``dataset``.

        ``state``: a lake's state, or a list of every rank's of one step.

        A followed lake's goes on in the increment it names, found again by its marks.

        Raises:
            StateFormatError: If the dict is not a lakeloader state of a known version.
            StateMismatchError: If it belongs to another snapshot or configuration than the
                dataset that its epoch runs on, or the lake no longer holds its increment.
        """
        saved = read(state, LAKE)
        if dataset.follow is None or saved.increment is None:
            return _checked(saved, dataset)
        base = on_increment(dataset, saved.increment)
        saved.check_matches(base.fingerprint, base.config.to_dict())
        return Resumption(saved, dataset=base)

    def resume(self, ckpt: Checkpoint, live: LakeDataset) -> Resumption:
        """The resumption of a checkpoint on the lake that ``live`` sees now.

        When the snapshots differ, files added since join at the next epoch boundary (the
        saved epoch finishes on the pinned snapshot, later epochs run on ``live``); files gone
        or rewritten go by the policy.

        Raises:
            LakeChangedError: Under ``"error"``, when the rest of the epoch needs changed files.
            StateMismatchError: If the order configuration differs.
        """
        saved = ckpt.state
        follow = live.follow is not None  # the increment pinned, later ones from its mark
        if not follow and saved.fingerprint == live.fingerprint:
            return _checked(saved, live)
        saved.check_matches(saved.fingerprint, live.config.to_dict())
        if follow and ckpt.snapshot.increment is None:
            raise StateMismatchError(
                f"{ckpt.path} was taken without follow=, and this dataset follows its lake: "
                "load it into a dataset made without follow="
            )
        diff = _lake_diff(ckpt.snapshot, live)
        if not enforce(diff, self.on_lake_change, ckpt.path, saved.at_epoch_end):
            return Resumption(None, saved.epoch, live.pinned_to(ckpt.snapshot) if follow else None)
        pinned = _finish_on_pinned(live.pinned_to(ckpt.snapshot), live, saved, diff)
        return Resumption(saved, dataset=pinned)

    def resume_source(
        self,
        ckpt: Checkpoint,
        name: str,
        live: LakeDataset,
        record: SourceRecord,
        count: int,
        size: Callable[[LakeDataset], int] = len,
        config: str | None = None,
        exact: bool = False,
    ) -> SourceResumption | None:
        """Where a source of a stream goes on, when its lake changed since the checkpoint.

        ``record`` is what the checkpoint's state says of the source, ``count`` its rows (or
        samples: ``size`` gives an epoch's) delivered, ``config`` what its record's
        configuration is on ``live`` (None: its order's hash). As for one lake, the saved epoch
        finishes on the snapshot pinned as leaf ``name``; under ``"restart_epoch"`` it runs
        again from ``count`` on the lake of now. A source of another configuration is left to
        the caller's check of its record. ``exact``: files gone or rewritten are refused
        whatever the policy (a packed stream's samples are cut by the files' token counts).

        Returns:
            None when the source is not a lake that changed (a followed lake's increments are
            found by their marks): its stream resumes from its record.

        Raises:
            LakeChangedError: Under ``"error"``, when the rest of the epoch needs changed files;
                with ``exact``, when any pinned file is gone or rewritten.
        """
        if record.increment is not None or live.follow is not None:
            return None
        while live.grows_at is not None:  # a twin of an earlier resume: the lake of now is last
            live = live.for_epoch(live.grows_at)
        if record.fingerprint == live.fingerprint or name not in ckpt.manifests:
            return None
        if record.config != (live.config_hash if config is None else config):
            return None  # refused with both sides named when the record is checked
        pinned = live.pinned_to(from_manifest(ckpt.manifests[name], live.config.columns))
        where = f"{ckpt.path} (source {name!r})"
        diff = _lake_diff(pinned.snapshot, live)
        if exact and (diff.gone or diff.changed):
            raise LakeChangedError(
                f"the lake changed since {where}, and a packed stream's samples are cut by its "
                f"files' token counts, so its saved epoch cannot go on without them as they "
                f"were, whatever on_lake_change says:\n{diff.describe()}\nrestore the files, or "
                "start the packed stream afresh on the lake as it is now"
            )
        epoch, position = replace(record, rows=record.rows or size(pinned)).where(count)
        start = count - position
        if not enforce(diff, self.on_lake_change, where, position == 0):
            return SourceResumption(live, epoch, count)
        if position == 0:  # the saved epoch is over: the next runs on the lake of now
            return SourceResumption(live, epoch, start)
        pinned = pinned.followed_by(epoch + 1, live, lost_units(pinned.snapshot, diff))
        return SourceResumption(pinned, epoch, start)

    def pinned_dataset(self, ckpt: Checkpoint, settings: dict[str, Any]) -> LakeDataset:
        """The dataset of a checkpoint's pinned snapshot, with the lake's changes applied.

        ``settings`` are :class:`LakeDataset` arguments that do not change the order. Each
        pinned file is checked with one metadata request (no listing, no footers).

        Raises:
            LakeChangedError: Under ``"error"``, when the rest of the epoch needs changed files.
        """
        saved = ckpt.state
        kwargs = {**saved.config, **settings}  # the order config's keys are LakeDataset's
        if isinstance(kwargs.get("filter"), str):
            raise ValueError(
                f"{ckpt.path} was taken with filter {kwargs['filter']}: pass the same "
                "pyarrow expression as filter= (an expression is not stored, only its text)"
            )
        source, kwargs["storage_options"] = checkpoint_source(
            ckpt.source, ckpt.snapshot.table, kwargs.get("storage_options")
        )
        pinned = LakeDataset(source, snapshot=ckpt.snapshot, **kwargs)
        diff = check_files(pinned.fs, pinned.snapshot.files)
        if not (diff.gone or diff.changed):
            return pinned
        if not enforce(diff, self.on_lake_change, ckpt.path, saved.at_epoch_end):
            return LakeDataset(source, **kwargs)
        return _finish_on_pinned(pinned, LakeDataset(source, **kwargs), saved, diff)

    @staticmethod
    def reassign(
        owed: Sequence[int], building: int | None, attempts: Mapping[int, int]
    ) -> Reassignment:
        """What a dead worker's unfinished work becomes (:mod:`lakeloader.recovery.reassign`)."""
        return reassign(owed, building, attempts)


def _lake_diff(pinned: Snapshot, live: LakeDataset) -> LakeDiff:
    """What changed in the lake that ``live`` sees since the ``pinned`` snapshot."""
    if live.snapshot.table is None and live.follow is None:
        return diff_snapshots(pinned, live.snapshot)
    # a table's old version keeps files that its newer versions no longer list; a followed
    # lake lists its newest increment, not the pinned one
    return check_files(live.fs, pinned.files)


def on_increment(dataset: LakeDataset, marks: list[Any]) -> LakeDataset:
    """The followed lake's increment that ``marks`` (``Increment.to_list()``) name, found again.

    Raises:
        StateMismatchError: If the lake no longer holds that increment.
    """
    increment = Increment.from_list(marks)
    if dataset.snapshot.increment == increment:
        return dataset
    return dataset.on_increment(
        *increment_at(dataset.source, increment, dataset.increment_request())
    )


def _checked(saved: LoaderState, dataset: LakeDataset) -> Resumption:
    """Resume ``saved`` as it is, once it is known to belong to the dataset of its epoch."""
    current = dataset.for_epoch(saved.epoch)
    saved.check_matches(current.fingerprint, current.config.to_dict())
    return Resumption(saved)


def _finish_on_pinned(
    pinned: LakeDataset, live: LakeDataset, saved: LoaderState, diff: LakeDiff
) -> LakeDataset:
    """``pinned`` for the saved epoch (without the lost units), ``live`` after it.

    A followed lake's ``pinned`` finds the increments after it by their marks itself.
    """
    lost = () if saved.at_epoch_end else lost_units(pinned.snapshot, diff)
    if live.follow is not None:
        pinned.lost = tuple(lost)
        return pinned
    return pinned.followed_by(saved.epoch + 1, live, lost)
