"""A lake loader's position: its state, its restore, and the view derived from it.

:class:`LakePosition` is the part of :class:`~lakeloader.DataLoader` that reads and sets the
reader-state tracker's position: ``state_dict()`` and ``load_state_dict()`` (through the
recovery coordinator, the one way a position is restored), ``view()``, and what the
:class:`~lakeloader.CheckpointManager` calls on every kind of loader (``barrier_position()``,
``checkpoint_state()``, ``checkpoint_datasets()``, ``restore_checkpoint()``,
``observe_steps()``, ``workers_build``), which a Mixture's and a packed loader have too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lakeloader.checkpoint.barrier import Position
from lakeloader.checkpoint.layout import ROOT, Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.io.reader import UnitReader
from lakeloader.recovery.coordinator import RecoveryCoordinator, Resumption
from lakeloader.state.journal import DeliveredRun
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import ReaderStateTracker, ReaderView
from lakeloader.topology import Topology


class LakePosition:
    """State, restore and view of a loader over a lake (its tracker's position)."""

    dataset: Any
    _base: LakeDataset
    tracker: ReaderStateTracker
    _coordinator: RecoveryCoordinator

    def _close_iterator(self, ended_by: str) -> None:
        raise NotImplementedError

    def _shutdown_workers(self) -> None:
        raise NotImplementedError

    def _use_reader(self, reader: UnitReader) -> None:
        raise NotImplementedError

    def _follow_dataset(self, epoch: int) -> None:
        raise NotImplementedError

    def _placed(self, topology: Topology) -> None:
        raise NotImplementedError

    @property
    def topology(self) -> Topology:
        """The loader's topology now (``TorchNames.topology``)."""
        raise NotImplementedError

    def state_dict(self, *, fetched_ahead: int = 0) -> dict[str, Any]:
        """The position of the training loop: plain types, O(1) in the size of the lake.

        Args:
            fetched_ahead: Batches delivered that the training loop has not trained on yet
                (a framework that fetches ahead of its step, as Lightning does for a loader
                without ``len()``): the state stands before them, so that a resume gives
                them again. Up to the last 8 steps of the pass.

        Raises:
            ValueError: If fewer steps than ``fetched_ahead`` were delivered since the
                position was set, or they cross into another epoch of a followed lake.
        """
        epoch = self.tracker.before(fetched_ahead)[0]
        ds = self.dataset if epoch == self.tracker.epoch else self._epoch_dataset(epoch)
        return self.tracker.state(
            ds.fingerprint, ds.config.to_dict(), len(ds), back=fetched_ahead
        ).to_dict()

    def _epoch_dataset(self, epoch: int) -> LakeDataset:
        """The dataset an earlier epoch ran on (a followed lake's increments are not kept)."""
        if self._base.follow:
            raise ValueError(
                f"cannot stand before batches of increment {epoch} of a followed lake from "
                f"increment {self.tracker.epoch}: save states within an increment"
            )
        return self._base.for_epoch(epoch)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state taken under any world size, worker count or batch size.

        Raises:
            StateFormatError: If the dict is not a lakeloader state of a known version.
            StateMismatchError: If it belongs to another lake snapshot or configuration.
        """
        self._resume(self._coordinator.resume_state(state_dict, self._base))

    def _resume(self, resumption: Resumption) -> None:
        """Apply what the recovery coordinator decided (the one way a position is restored)."""
        self._close_iterator("load_state_dict() or CheckpointManager.load()")
        if resumption.dataset is not None:
            self._shutdown_workers()
            self._base = self.dataset = resumption.dataset
            self._use_reader(resumption.dataset.reader())
        if resumption.state is None:
            assert resumption.restart_epoch is not None
            self.tracker.set_epoch(resumption.restart_epoch, restart=True)
            return
        self._follow_dataset(resumption.state.epoch)
        ds = self.dataset  # the dataset that the saved epoch runs on here
        resumption.state.check_matches(ds.fingerprint, ds.config.to_dict())
        self.tracker.restore(resumption.state)

    # --------------------------------------------- what a CheckpointManager calls
    def barrier_position(self) -> Position:
        """What the checkpoint barrier compares across ranks (with this rank's quarantine)."""
        ds = self.dataset
        return self.tracker.state(ds.fingerprint, ds.config.to_dict(), len(ds))

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The state a checkpoint holds, with every rank's quarantine (from the barrier)."""
        self.tracker.merge_quarantine(quarantine)
        return self.state_dict()

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshot a checkpoint pins, by leaf path: the lake's, at the root."""
        return {ROOT: self.dataset}

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint, on the lake of now (see ``RecoveryCoordinator.resume``).

        Raises:
            StateFormatError: If it holds another kind of loader's state.
        """
        self._resume(coordinator.resume(ckpt, self.dataset))

    def observe_steps(self, observer: Callable[[DeliveredRun], None]) -> bool:
        """Tell ``observer`` of every step delivered (since the start or the last restore).

        Returns:
            True: a lake's loader records its steps (its tracker's journal).
        """
        self.tracker.attach(observer)
        return True

    @property
    def workers_build(self) -> bool:
        """Whether workers build batches (a transform or collate_fn) rather than decode."""
        return self.tracker.workers_build

    def view(self) -> ReaderView:
        """Where the position leaves every rank and worker (see :mod:`lakeloader.state.view`).

        Each rank's share of the next step, and what each worker of each rank builds or
        decodes first: files, row groups and row offsets, derived from the position alone
        (nothing is read, no worker is started).

        Raises:
            TypeError: For a mixture or a packed loader, whose position is its state_dict().

        Example:
            >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
            >>> from lakeloader import DataLoader, LakeDataset
            >>> tmp = tempfile.TemporaryDirectory(); path = f"{tmp.name}/a.parquet"
            >>> pq.write_table(pa.table({"id": range(10)}), path, row_group_size=5)
            >>> ds = LakeDataset(tmp.name, shuffle=False, max_unit_rows=5)
            >>> loader = DataLoader(ds, batch_size=4, num_workers=2)
            >>> next(iter(loader))["id"].tolist()
            [0, 1, 2, 3]
            >>> view = loader.view()
            >>> view.epoch, view.position, view.steps_remaining, view.ranks[0].rows
            (0, 4, 2, 4)
            >>> at = view.ranks[0].at; at.file == path, at.row_group, at.row_offset
            (True, 0, 4)
            >>> [(w.worker, w.role, w.at.row_group, w.at.row_offset) for w in view.workers]
            [(0, 'decode', 0, 0), (1, 'decode', 1, 0)]
            >>> loader.close(); tmp.cleanup()
        """
        tracker = getattr(self, "tracker", None)
        if not isinstance(tracker, ReaderStateTracker):
            raise TypeError(
                f"a {type(self).__name__} has no per-rank view: its position is its "
                "state_dict() (per source or per partition)"
            )
        self._placed(self.topology)  # the ranks of now, not those of the last pass
        # The dataset of the tracker's epoch (a loaded state's may start the next one); a
        # followed lake's next increment may not exist yet, so it keeps its own.
        ds = self.dataset if self._base.follow else self._base.for_epoch(tracker.epoch)
        return tracker.view(ds.plan(tracker.epoch), ds.snapshot)

    def steps_left(self) -> int:
        """Global steps left in the epoch under way, for the topology of now.

        With ``len(loader)``, where a framework stands in the epoch: ``len(loader) -
        steps_left()`` steps are done, whatever topology the position was saved under (0
        left: the epoch is over, the next pass begins the next one).

        Raises:
            TypeError: For a loader whose passes have no end (followed, packed, endless).
        """
        len(self)  # type: ignore[arg-type]  # no end, no steps left to count
        return self.view().steps_remaining

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far (``on_error="skip"``), sorted; merged across ranks at saves."""
        return list(self.tracker.quarantine)


class StatePosition:
    """What a CheckpointManager calls on a loader whose position is its ``state_dict()``.

    A Mixture's and a packed loader keep no tracker: a checkpoint restores them as
    ``load_state_dict`` does, and their steps are not recorded for the audit.
    """

    load_state_dict: Callable[[dict[str, Any]], None]

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Continue from a checkpoint's state, as ``load_state_dict`` does.

        Raises:
            StateFormatError: If it holds another kind of loader's state.
        """
        self.load_state_dict(dict(ckpt.state_dict))

    def observe_steps(self, observer: Callable[[DeliveredRun], None]) -> bool:
        """Nothing is told: this loader keeps no record of the steps it delivers (yet).

        Returns:
            False.
        """
        return False

    @property
    def workers_build(self) -> bool:
        """False: no worker process builds this loader's batches."""
        return False
