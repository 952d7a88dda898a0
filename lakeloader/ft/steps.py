"""The arithmetic of fault-tolerant steps (pure): how far a committed step moves the position.

A step taken by ``participants`` replica groups of ``batch_size`` rows each covers the global
positions ``[G, G + participants x batch_size)`` of the epoch, cut at its end; with
``drop_last`` a step that would be short is not taken at all (the epoch is over). The position
moves only when the step commits, so what it moves by depends only on the participant count of
that step, never on which replica took which share.
"""

from __future__ import annotations

from dataclasses import dataclass


def step_stop(position: int, num_rows: int, participants: int, batch_size: int) -> int:
    """The position after a committed step.

    >>> step_stop(0, 100, 3, 16), step_stop(96, 100, 3, 16), step_stop(40, 100, 2, 16)
    (48, 100, 72)
    """
    if participants < 1 or batch_size < 1:
        raise ValueError(
            f"participants ({participants}) and batch_size ({batch_size}) must be >= 1"
        )
    return min(position + participants * batch_size, num_rows)


def epoch_over(
    position: int, num_rows: int, participants: int, batch_size: int, drop_last: bool
) -> bool:
    """Whether no step is left in the epoch for this many participants.

    >>> epoch_over(96, 100, 3, 16, False), epoch_over(96, 100, 3, 16, True)
    (False, True)
    """
    left = num_rows - position
    return left <= 0 or (drop_last and left < participants * batch_size)


@dataclass(frozen=True)
class Issued:
    """A step handed to the training loop, not yet known to have committed.

    Attributes:
        at_step: The replica group's committed-step count when it was handed out; the step
            committed once the count is past it.
        participants: Replica groups taking part in it.
        epoch: Its epoch.
        start: The position it starts at.
    """

    at_step: int
    participants: int
    epoch: int
    start: int
