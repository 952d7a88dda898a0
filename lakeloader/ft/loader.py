"""A loader for fault-tolerant training with torchft: exact as replica groups come and go.

:class:`FaultTolerantLoader` is one :class:`~lakeloader.DataLoader` re-sliced per quorum, whose
state moves only when a step commits (see docs/design.md); it takes whatever a DataLoader takes
(a lake, a followed lake, a Mixture, a packed stream) with the same arguments. Limits: groups
following a lake list it themselves at each increment's end and must see the same new files; a
group cannot ``quarantine_step`` a step committed before it joined.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from lakeloader.checkpoint.barrier import Stand
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError
from lakeloader.ft.quorum import Issued, QuorumManager
from lakeloader.loader import DataLoader
from lakeloader.loader_args import RootViews, has_len
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.journal import DeliveredRun, DeliveryJournal
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.requests import Requests
from lakeloader.steering import Step
from lakeloader.topology import Topology

logger = logging.getLogger(__name__)

#: Key of the loader's state among the manager's state dicts (what a joining group receives).
STATE_KEY = "lakeloader"
#: Keys the loader adds to the DataLoader's state: the committed-step count it stands at, and
#: whether the pass (a lake's epoch, a mixture's pass) is over at it.
STEP_KEY, OVER_KEY = "ft_step", "ft_pass_over"


class FaultTolerantLoader(RootViews):
    """Steps of any DataLoader source for torchft replica groups: state moves only on commit.

    Args:
        dataset: What to read, as :class:`~lakeloader.DataLoader` takes it (any source;
            see the module docstring for the limits).
        manager: The replica group's ``torchft.Manager``. Use ``use_async_quorum=False``: an
            asynchronous quorum can count a healing group among a step's participants while
            zeroing its gradients, which would drop its rows (the loader refuses that step).
        batch_size: Rows (packed: samples) per replica group per step.
        start_quorum: Start the step's quorum in ``next()`` (then call the inner optimizer's
            ``zero_grad`` and ``manager.should_commit()`` yourself). With torchft's
            ``Optimizer`` wrapper, whose ``zero_grad`` starts the quorum, pass False and call
            ``zero_grad`` before ``next()``.
        **loader_kwargs: Other :class:`~lakeloader.DataLoader` arguments; ``rank`` and
            ``world_size`` come from each step's quorum.

    Attributes:
        participants: The last step's participants.
        participating_rank: This group's rank among them (None: not taking part).
        step_rows: The last step's global rows (samples, packed).
        root: The DataLoader's root node: ``dataset``, ``tracker``, ``view()``, ``quarantine``
            and ``workers_build`` tell of it where the last step left it, committed or not.

    Raises:
        ValueError: If ``rank`` or ``world_size`` is passed.

    ``next()`` raises StopIteration at the end of a pass (a lake's epoch, a mixture's pass)
    until :meth:`set_epoch` moves on, and once at the end of a followed lake's rows. A group
    that does not take part in a step reads rank 0's share, and torchft zeroes its gradients.
    """

    def __init__(
        self,
        dataset: Any,
        manager: QuorumManager,
        batch_size: int,
        *,
        start_quorum: bool = True,
        **loader_kwargs: Any,
    ) -> None:
        for name in ("rank", "world_size"):
            if name in loader_kwargs:
                raise ValueError(f"{name} comes from the manager's quorum; do not pass it")
        self.manager = manager
        self.batch_size = batch_size
        self._start_quorum = start_quorum
        self._lock = threading.Lock()  # torchft asks for the state from its quorum thread
        self._runs: list[DeliveredRun] = []  # the global spans of the step being taken
        #: The one DataLoader, re-placed on each step's slice (its rank among participants).
        self._inner = DataLoader(dataset, batch_size, rank=0, world_size=1, **loader_kwargs)
        self.root = self._inner.root
        self._inner.observe_steps(self._runs.extend)
        #: The DataLoader's state after the last committed step, and the state it stands at.
        self._committed: dict[str, Any] = self._inner.state_dict()
        self._at: dict[str, Any] | None = self._committed
        self._it: Iterator[Any] | None = None
        self._taken = 0  # steps taken from ``_it``
        self._over = False  # the pass is over at the committed state
        self._issued: Issued | None = None
        #: The last step committed, put back (once) by the next roll back if a barrier's
        #: roll back dropped it.
        self._kept: Step | None = None
        self._observer: Callable[..., None] | None = None  # the ledger's Ledger.step
        self._journal = DeliveryJournal()  # steps committed before an observer came
        self.participants = 0
        self.participating_rank: int | None = None
        self.step_rows = 0
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    def __iter__(self) -> FaultTolerantLoader:
        return self

    def __next__(self) -> Any:
        """Settle the last step, then hand out this group's share of the next one.

        Raises:
            StopIteration: When the pass is over at the committed state.
            RuntimeError: If torchft counts this group in a step whose gradients it zeroes.
            StateMismatchError: If the committed state (a peer's) is not of this dataset.
        """
        with self._lock:
            self._settle(rollback=True)
            if self._over:
                raise StopIteration
        if self._start_quorum:
            self.manager.start_quorum()
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        if rank is not None and not self.manager.is_participating():
            raise RuntimeError(
                f"torchft counts this replica group as participant {rank} of {participants} "
                f"at step {self.manager.current_step()} but zeroes its gradients (it is "
                "healing under use_async_quorum=True): the rows of its share would be lost. "
                "Construct the torchft Manager with use_async_quorum=False"
            )
        with self._lock:
            if self._over:  # a peer's state, received at the quorum, ends the pass
                raise StopIteration
            it = self._placed(participants, 0 if rank is None else rank)
            self._runs.clear()
            try:
                batch = next(it)
            except StopIteration:
                self._it = None
                self._over = has_len(self._inner)
                raise
            self._taken += 1
            self._at = self._inner.state_dict()
            steps = getattr(it, "num_steps", None)  # None: a pass whose end is not known
            over = steps is not None and self._taken >= steps
            runs = tuple(self._runs) if rank == 0 else ()  # the ledger's: once per step
            step = (Requests.of_state(self._at).delivered - 1, self._inner.root.last_runs())
            self._issued = Issued(self.manager.current_step(), self._at, over, runs, step)
            self.participants, self.participating_rank = participants, rank
            self.step_rows = sum(r.stop - r.start for r in step[1])
        return batch

    def _placed(self, participants: int, rank: int) -> Iterator[Any]:
        """The DataLoader placed on this slice, standing at the committed state; its iterator."""
        inner = self._inner
        was = (inner.rank, inner.world_size)
        if was != (rank, participants):
            logger.info("re-sliced: rank %d of %d groups (was %d of %d)", rank, participants, *was)
            inner.close()  # its pass, and its workers, were of the other slice
            inner._reslice(rank, participants)
            self._at = None  # the committed state is restored on the new slice
            self._at_committed(f"rank {rank} of {participants} groups")
        else:
            self._at_committed()
        if self._it is None:
            self._it, self._taken = iter(self._inner), 0
        return self._it

    def _at_committed(self, where: str = "the rolled back step's slice") -> None:
        """Make the DataLoader stand at the committed state (see ``DataLoader._roll_back``)."""
        if self._at is self._committed:
            return
        try:
            self._inner._roll_back(self._committed, self._kept)
        except StateMismatchError as exc:
            raise StateMismatchError(
                f"the committed state cannot be restored at {where}: {exc}. Every replica "
                "group must read the same dataset with the same settings"
            ) from exc
        self._at, self._it, self._kept = self._committed, None, None

    def _settle(self, *, rollback: bool) -> None:
        """Commit the issued step if the count moved past it; else (``rollback``) drop it."""
        issued = self._issued
        if issued is None:
            return
        step = self.manager.current_step()
        if step > issued.at_step + 1:
            raise RuntimeError(
                f"the manager committed {step - issued.at_step} steps since this loader "
                f"handed one out (at step {issued.at_step}): take one batch per step"
            )
        if step > issued.at_step:
            self._committed, self._over, self._kept = issued.after, issued.over, issued.step
        elif not rollback:
            return  # it may commit yet
        self._record(issued.runs, committed=step > issued.at_step)
        self._issued = None

    def _record(self, runs: Sequence[DeliveredRun], *, committed: bool) -> None:
        """Tell the observer of a settled step, or keep it (if committed) until one comes."""
        if runs and self._observer is not None:
            self._observer(tuple(runs), committed=committed)
        elif runs and committed:
            self._journal.record_step(runs)

    @property
    def epoch(self) -> int:
        """The epoch (a mixture's pass, a followed lake's increment) of the committed state."""
        epoch = self._committed.get("epoch")
        return self._inner.epoch if epoch is None else int(epoch)

    @property
    def position(self) -> int | None:
        """The committed state's ``position`` (a lake's global rows of its epoch), or None."""
        position = self._committed.get("position")
        return None if position is None else int(position)

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` from its start, unless the committed state is in that epoch already.

        Raises:
            TypeError: For a packed stream (it runs through its epochs by itself).
        """
        with self._lock:
            self._settle(rollback=True)
            if epoch == self.epoch:
                return
            self._at_committed()
            self._inner.set_epoch(epoch)
            self._committed = self._at = self._inner.state_dict()
            self._it, self._over = None, False

    def skip(self, steps: int) -> None:
        """Skip the rows of the next ``steps`` global steps (see ``DataLoader.skip``).

        The request goes into the committed state. Every group asks the same, between steps.

        Raises:
            ValueError: If ``steps`` is not an int >= 0.
        """
        with self._lock:
            self._settle(rollback=True)
            self._at_committed()
            self._inner.skip(steps)
            self._committed = self._at = self._inner.state_dict()

    def quarantine_step(self, step: int) -> list[QuarantineEntry]:
        """Quarantine the units behind committed ``step`` (see ``DataLoader.quarantine_step``).

        ``step`` counts the committed batches from 0. A step to come, once restored from a
        checkpoint before it, is dropped as it comes. The quarantine goes into the committed
        state. Every group asks the same.

        Raises:
            ValueError: If ``step`` is not an int, or neither one of the last 64 committed nor
                to come.
        """
        with self._lock:
            self._settle(rollback=True)
            self._at_committed()
            entries = self._inner.quarantine_step(step)
            if step >= Requests.of_state(self._committed).delivered:  # to come: end its pass
                self._inner._close_iterator(f"quarantine_step({step})")  # (a delivered one's is)
            self._committed = self._at = self._inner.state_dict()
            self._it = None
            return entries

    def state_dict(self) -> dict[str, Any]:
        """The committed state, with the committed-step count it stands at (``ft_step``).

        Safe to call from torchft's quorum thread: a step handed out and committed since is
        counted in.
        """
        with self._lock:
            step = self.manager.current_step()
            state, over = self._committed, self._over
            issued = self._issued
            if issued is not None and step > issued.at_step:
                state, over = issued.after, issued.over
            return {**state, STEP_KEY: step, OVER_KEY: over}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's committed state (a joining group heals with it).

        A step handed out before it is dropped, as not committed. The state is restored into
        the DataLoader at the next step (see :meth:`__next__`).
        """
        state = dict(state)
        step, over = state.pop(STEP_KEY, None), bool(state.pop(OVER_KEY, False))
        with self._lock:
            if self._issued is not None:
                self._record(self._issued.runs, committed=False)
                self._issued = None
            self._committed, self._over = state, over
        logger.info("loader state from a peer, at step %s (pass over: %s)", step, over)

    def barrier_position(self) -> Stand:
        """The committed position, as the checkpoint barrier compares it across ranks."""
        with self._lock:
            self._settle(rollback=False)
            self._at_committed()
            return self._inner.barrier_position()

    def checkpoint_state(self, quarantine: Iterable[QuarantineEntry] = ()) -> dict[str, Any]:
        """The committed state as a checkpoint holds it (a DataLoader's), quarantine merged."""
        with self._lock:
            self._settle(rollback=False)
            self._at_committed()
            self._committed = self._at = self._inner.checkpoint_state(quarantine)
            return self._committed

    def checkpoint_datasets(self) -> dict[str, LakeDataset]:
        """The snapshots a checkpoint of the committed state pins, by leaf path."""
        with self._lock:
            self._at_committed()
            return self._inner.checkpoint_datasets()

    def restore_checkpoint(self, ckpt: Checkpoint, coordinator: RecoveryCoordinator) -> None:
        """Make a checkpoint's state the committed one (see ``DataLoader.restore_checkpoint``).

        Raises:
            StateFormatError: If it holds another kind of loader's state.
        """
        with self._lock:
            self._inner.restore_checkpoint(ckpt, coordinator)
            self._committed = self._at = self._inner.state_dict()
            self._it, self._issued, self._over = None, None, False
            self._kept = None  # the steps before the checkpoint are not known
            self._journal.take_steps()  # what came before is not this attempt's history

    def observe_steps(self, observer: Callable[..., None]) -> None:
        """Tell ``observer`` of every step once it is settled: ``observer(runs, committed=)``.

        A step is told once, by the group that was participant 0 of its quorum (its global
        span is the same for every group); the steps committed before are told first.
        """
        with self._lock:
            self._observer = observer
            for runs in self._journal.take_steps():
                observer(runs)

    @property
    def topology(self) -> Topology:
        """The last step's slice: this group's rank among its participants, and their count."""
        return self._inner.topology

    @property
    def rank(self) -> int:
        """This group's rank in the last step's slice (0 before the first)."""
        return self._inner.rank

    @property
    def world_size(self) -> int:
        """The last step's participants (1 before the first)."""
        return self._inner.world_size

    @property
    def drop_last(self) -> bool:
        """The DataLoader's ``drop_last`` (a short last step of a pass is not taken)."""
        return self._inner.drop_last

    def stats(self) -> dict[str, int]:
        """The DataLoader's counters (see ``DataLoader.stats``)."""
        return self._inner.stats()

    def close(self) -> None:
        """Stop the DataLoader's workers and threads."""
        with self._lock:
            self._inner.close()
            self._it = None

    def __enter__(self) -> FaultTolerantLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
