"""A loader for fault-tolerant training with torchft: exact as replica groups come and go.

torchft trains with replica groups that may die and join between steps without restarting the
job; each step, its ``Manager`` forms a quorum of the groups taking part and commits the step
only if all of them finished it (``should_commit()``). :class:`FaultTolerantLoader` hands each
replica group its share of the global step that starts at the committed position: the step's
participants split ``participants x batch_size`` rows, in the lake's topology-independent
order. The position moves only when the step commits (the manager's committed-step count moves
past it); a step that does not commit is handed out again, re-sliced for whoever takes part
next. A group that joins receives the position from a healthy peer with the model (the loader
registers its state with the manager), so every committed row of an epoch is trained on exactly
once, with no process restarted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from lakeloader.dataset import LakeDataset
from lakeloader.errors import StateMismatchError
from lakeloader.ft.steps import Issued, epoch_over, step_stop
from lakeloader.loader import DataLoader

logger = logging.getLogger(__name__)

#: Key of the loader's state among the manager's state dicts (what a joining group receives).
STATE_KEY = "lakeloader"


class QuorumManager(Protocol):
    """What the loader uses of a ``torchft.Manager``."""

    def start_quorum(self) -> None:
        """Start the step's quorum."""

    def current_step(self) -> int:
        """Steps committed so far."""

    def num_participants(self) -> int:
        """Replica groups taking part in this step (waits for the quorum)."""

    def participating_rank(self) -> int | None:
        """This group's rank among them, or None (waits for the quorum)."""

    def is_participating(self) -> bool:
        """Whether this group's gradients count in this step."""

    def register_state_dict_fn(self, key: str, load_state_dict: Any, state_dict: Any) -> None:
        """Register state that a joining group receives from a healthy peer."""


class FaultTolerantLoader:
    """Steps of a lake for torchft replica groups: the position moves only on commit.

    Args:
        dataset: The lake (a :class:`LakeDataset`; mixtures, packing and followed lakes are
            not supported here).
        manager: The replica group's ``torchft.Manager``. Use ``use_async_quorum=False``: an
            asynchronous quorum can count a healing group among a step's participants while
            zeroing its gradients, which would drop its rows (the loader refuses that step).
        batch_size: Rows per replica group per step.
        start_quorum: Start the step's quorum in ``next()`` (then call the inner optimizer's
            ``zero_grad`` and ``manager.should_commit()`` yourself). With torchft's
            ``Optimizer`` wrapper, whose ``zero_grad`` starts the quorum, pass False and call
            ``zero_grad`` before ``next()``.
        drop_last: Drop a short last step of an epoch.
        **loader_kwargs: Other :class:`~lakeloader.DataLoader` arguments (``num_workers``,
            ``collate_fn``, ...).

    A group's share of a step it does not take part in (a group still healing) is rank 0's:
    its gradients are zeroed by torchft, so it trains on nothing.
    """

    def __init__(
        self,
        dataset: LakeDataset,
        manager: QuorumManager,
        batch_size: int,
        *,
        start_quorum: bool = True,
        drop_last: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        if getattr(dataset, "loader_kind", None) != "lake":
            raise ValueError(
                "FaultTolerantLoader takes a LakeDataset (not a Mixture, packed or followed lake)"
            )
        for name in ("rank", "world_size"):
            if name in loader_kwargs:
                raise ValueError(f"{name} comes from the manager's quorum; do not pass it")
        self.dataset = dataset
        self.manager = manager
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._start_quorum = start_quorum
        self._kwargs = dict(loader_kwargs, drop_last=drop_last, batch_size=batch_size)
        template = DataLoader(dataset, rank=0, world_size=1, **self._kwargs)
        self._template = template.state_dict()
        template.close()
        self.num_rows = len(dataset)
        self.epoch = 0
        #: The committed position of the epoch (global rows).
        self.position = 0
        self._issued: Issued | None = None
        self._inner: DataLoader | None = None
        self._inner_key: tuple[int, int, int] | None = None
        self._inner_iter: Iterator[Any] | None = None
        self._lock = threading.Lock()  # torchft asks for the state from its quorum thread
        #: The last step's participants, this group's rank among them (None: not taking
        #: part), and the step's global rows.
        self.participants = 0
        self.participating_rank: int | None = None
        self.step_rows = 0
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    # -------------------------------------------------------------------- epochs
    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` from its start, unless the position is inside that epoch already."""
        with self._lock:
            if epoch != self.epoch:
                self.epoch, self.position, self._issued = int(epoch), 0, None

    def __iter__(self) -> FaultTolerantLoader:
        return self

    def __next__(self) -> Any:
        """Settle the last step, then hand out this group's share of the next one.

        Raises:
            StopIteration: When the epoch's rows are all in committed steps.
            RuntimeError: If torchft counts this group in a step whose gradients it zeroes.
        """
        with self._lock:
            self._settle(self.manager.current_step())
            if self.position >= self.num_rows:
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
            if epoch_over(
                self.position, self.num_rows, participants, self.batch_size, self.drop_last
            ):
                self.position = self.num_rows
                raise StopIteration
            batch = self._take(participants, 0 if rank is None else rank)
            self._issued = Issued(
                self.manager.current_step(), participants, self.epoch, self.position
            )
            self.participants, self.participating_rank = participants, rank
            stop = step_stop(self.position, self.num_rows, participants, self.batch_size)
            self.step_rows = stop - self.position
        return batch

    def _settle(self, step: int) -> None:
        """Move the position past the issued step if it committed (the count moved past it)."""
        issued = self._issued
        if issued is not None and step > issued.at_step:
            if step > issued.at_step + 1:
                raise RuntimeError(
                    f"the manager committed {step - issued.at_step} steps since this loader "
                    f"handed one out (at step {issued.at_step}): take one batch per step"
                )
            self.position = step_stop(
                issued.start, self.num_rows, issued.participants, self.batch_size
            )
        self._issued = None

    def _take(self, participants: int, rank: int) -> Any:
        """This group's share of the step at the position, for ``participants`` groups."""
        key = (self.epoch, participants, rank)
        inner = self._inner
        if inner is None or key != self._inner_key or inner.tracker.position != self.position:
            if inner is not None:
                logger.info(
                    "step at epoch %d position %d: %d participant(s), this group rank %d "
                    "(was %s): re-sliced from the committed position",
                    self.epoch,
                    self.position,
                    participants,
                    rank,
                    self._inner_key,
                )
                inner.close()
            inner = DataLoader(self.dataset, rank=rank, world_size=participants, **self._kwargs)
            inner.load_state_dict(self._state(self.epoch, self.position))
            self._inner, self._inner_key, self._inner_iter = inner, key, iter(inner)
        assert self._inner_iter is not None
        return next(self._inner_iter)

    # --------------------------------------------------------------------- state
    def _state(self, epoch: int, position: int) -> dict[str, Any]:
        return {
            **self._template,
            "epoch": epoch,
            "position": position,
            "rows_dropped": 0,
        }

    def state_dict(self) -> dict[str, Any]:
        """The committed position (a lakeloader state) and the committed-step count it is at.

        Safe to call from torchft's quorum thread: a step handed out and committed since is
        counted in.
        """
        with self._lock:
            step = self.manager.current_step()
            position = self.position
            issued = self._issued
            if issued is not None and step > issued.at_step:
                position = step_stop(
                    issued.start, self.num_rows, issued.participants, self.batch_size
                )
            return {**self._state(self.epoch, position), "ft_step": step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a peer's committed position (a joining group heals with it).

        Raises:
            StateMismatchError: If the state belongs to another lake snapshot or order.
        """
        for key in ("fingerprint", "config_hash", "num_rows"):
            if state.get(key) != self._template.get(key):
                raise StateMismatchError(
                    f"the peer's loader state has {key} {state.get(key)!r}, this loader "
                    f"{self._template.get(key)!r}: every replica group must read the same lake "
                    "with the same order configuration"
                )
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            at_step = int(state["ft_step"])
            issued = self._issued
            if issued is not None:  # handed out before the state arrived: count it from there
                self._issued = Issued(at_step, issued.participants, self.epoch, self.position)
        logger.info(
            "loader state from a peer: epoch %d, position %d, at step %d",
            self.epoch,
            self.position,
            at_step,
        )

    def close(self) -> None:
        """Stop the current step's loader (its workers)."""
        if self._inner is not None:
            self._inner.close()
            self._inner = self._inner_iter = None
