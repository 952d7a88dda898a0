"""What becomes of a dead worker's unfinished work: one rule for decodes and batch builds.

Everything it owed goes again to its replacement; only the work it was doing when it died
counts as an attempt, and work that killed its worker :data:`MAX_ATTEMPTS` times is given up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

#: Times one piece of work may kill its worker before the loader gives up on it.
MAX_ATTEMPTS: Final = 3


@dataclass(frozen=True)
class Reassignment:
    """The outcome of one worker's death.

    Attributes:
        resend: Keys of the work to hand out again, in the order it was first handed out.
        given_up: ``(key, attempts)`` of the work that has killed its worker too often.
        attempts: The attempts of every key after this death (keys never blamed are absent).
    """

    resend: tuple[int, ...]
    given_up: tuple[tuple[int, int], ...]
    attempts: Mapping[int, int]


def reassign(
    owed: Sequence[int], building: int | None, attempts: Mapping[int, int]
) -> Reassignment:
    """Decide what becomes of the work a dead worker owed.

    Args:
        owed: Keys of the work it had been handed and not answered, in the order handed out
            (work answered or abandoned meanwhile must be left out by the caller).
        building: The key it was working on when it died, or None if it was idle.
        attempts: Attempts so far by key (1 is implied for a key not in it).

    Returns:
        The work to resend, the work given up, and the updated attempts.
    """
    after = dict(attempts)
    resend: list[int] = []
    given_up: list[tuple[int, int]] = []
    for key in owed:
        if key == building:
            tries = after.get(key, 1) + 1
            after[key] = tries
            if tries > MAX_ATTEMPTS:
                given_up.append((key, tries - 1))
                continue
        resend.append(key)
    return Reassignment(tuple(resend), tuple(given_up), after)
