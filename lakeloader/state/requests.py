"""What the training loop asked of the order mid-run: steps counted, steps skipped on request."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Final

from lakeloader.errors import StateFormatError

#: The key of the record in a loader's state.
REQUESTS_KEY: Final = "requests"
#: The prefix of the reason of a unit quarantined by ``quarantine_step``.
QUARANTINE_STEP: Final = "quarantine_step"


@dataclass(frozen=True)
class Skip:
    """One ``skip(steps=...)``.

    Attributes:
        at: Steps delivered when it was asked (the step it skips from).
    """

    at: int
    steps: int


@dataclass(eq=False)
class Requests:
    """The steps a loader delivered and skipped on request over the run (mutable, like a tracker).

    Example:
        >>> r = Requests()
        >>> r.delivered_one(); r.ask_skip(3); r.skipped_one()
        >>> r.delivered, r.pending, r.skips, r.skip_due, r.back(1).skip_due
        (1, 2, (Skip(at=1, steps=3),), True, False)
        >>> Requests.of_state({REQUESTS_KEY: r.to_json()}).to_json() == r.to_json()
        True
    """

    #: Steps delivered to the training loop over the run (the next step's number).
    delivered: int = 0
    #: Steps still to skip (the next ones the loader would deliver).
    pending: int = 0
    #: Every skip asked, in order.
    skips: tuple[Skip, ...] = ()
    #: Steps not delivered yet (after a restore from before them) whose units are to be
    #: quarantined when they come (``quarantine_step``): ``(number it comes as, number it
    #: was named by)``, sorted (a dropped step's number is taken by the next batch).
    bad_steps: tuple[tuple[int, int], ...] = ()

    def delivered_one(self) -> None:
        """A step was handed to the training loop."""
        self.delivered += 1

    @property
    def skip_due(self) -> bool:
        """Whether the next step is to be skipped: a skip is pending and its step has come.

        A skip applies from the step it was asked at; a state that stands before steps
        delivered after it (``state_dict(fetched_ahead=...)``) gives them again first.
        """
        if not self.pending:
            return False
        done = self.skipped
        for skip in self.skips:
            if done < skip.steps:
                return self.delivered >= skip.at
            done -= skip.steps
        return True

    def bad_step(self) -> int | None:
        """The number the next step was named by in a ``quarantine_step``, if it is a bad one."""
        if not self.bad_steps:  # asked at every step: nothing to walk in the usual case
            return None
        return next((named for at, named in self.bad_steps if at == self.delivered), None)

    def dropped(self) -> None:
        """The next step (a bad one) was dropped: the batch after it takes its number."""
        step = self.delivered
        self.bad_steps = tuple((at - (at > step), n) for at, n in self.bad_steps if at != step)

    def skipped_one(self) -> None:
        """A step was skipped on request."""
        self.pending -= 1

    def ask_skip(self, steps: int) -> None:
        """Skip the next ``steps`` steps."""
        self.pending += steps
        self.skips = (*self.skips, Skip(self.delivered, steps))

    def back(self, steps: int) -> Requests:
        """The record as it stood ``steps`` deliveries ago (``state_dict(fetched_ahead=...)``)."""
        return replace(self, delivered=self.delivered - steps)

    @property
    def skipped(self) -> int:
        """Steps skipped on request so far."""
        return sum(s.steps for s in self.skips) - self.pending

    def to_json(self) -> str:
        """The record as the state holds it."""
        return json.dumps(
            {
                "delivered": self.delivered,
                "pending": self.pending,
                "skips": [[s.at, s.steps] for s in self.skips],
                "bad_steps": [list(b) for b in self.bad_steps],
            },
            separators=(",", ":"),
        )

    @classmethod
    def of_state(cls, state: Any) -> Requests:
        """The record in a state (of a list of ranks' states, the first's: they are equal).

        A state written before the record existed has none: nothing was asked.

        Raises:
            StateFormatError: If it is not such a record.
        """
        first = state[0] if isinstance(state, list | tuple) and state else state
        value = first.get(REQUESTS_KEY) if hasattr(first, "get") else None
        if value is None:
            return cls()
        try:
            data = json.loads(value)
            skips = tuple(Skip(int(at), int(n)) for at, n in data["skips"])
            bad = tuple((int(at), int(named)) for at, named in data.get("bad_steps", ()))
            return cls(int(data["delivered"]), int(data["pending"]), skips, bad)
        except (TypeError, ValueError, KeyError) as exc:
            raise StateFormatError(
                f"malformed {REQUESTS_KEY!r} in a lakeloader state ({exc!r}): expected the JSON "
                'of {"delivered": n, "pending": n, "skips": [[at, steps], ...], '
                '"bad_steps": [[at, named], ...]}'
            ) from exc
