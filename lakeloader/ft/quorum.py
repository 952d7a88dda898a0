"""What :class:`~lakeloader.ft.loader.FaultTolerantLoader` uses of torchft, and a step in flight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lakeloader.state.journal import DeliveredRun
from lakeloader.steering import Step


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


@dataclass(frozen=True)
class Issued:
    """A step handed to the training loop, not yet known to have committed.

    Attributes:
        at_step: The committed-step count when it was handed out; it committed once the
            count is past it.
        after: The DataLoader's state after it (the committed state if it commits).
        over: Whether the pass is over after it.
        runs: Its global spans, for the ledger (none unless this group was participant 0).
        step: Its number and runs (every group's: ``quarantine_step`` of it, once committed).
    """

    at_step: int
    after: dict[str, Any]
    over: bool
    runs: tuple[DeliveredRun, ...]
    step: Step
