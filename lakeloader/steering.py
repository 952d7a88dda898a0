"""What the training loop asks of the order mid-run: skip steps, quarantine a step's units.

:class:`Steering` keeps what was asked (a record in the loader's state, the same on every
rank); :class:`Steered` is the pass iterator that carries it out (see docs/design.md), and
:class:`Endless` the one of ``endless=True``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from lakeloader.state.journal import DeliveredRun
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.requests import QUARANTINE_STEP, Requests

if TYPE_CHECKING:
    from lakeloader.nodes.base import Node

logger = logging.getLogger(__name__)

#: Delivered steps whose runs are kept for ``quarantine_step``.
STEPS_KEPT = 64

#: A step delivered: its number among the batches handed over in the run, and its runs.
Step = tuple[int, tuple[DeliveredRun, ...]]


class Steering:
    """The requests of one loader and the runs of its last steps (see the module docstring)."""

    def __init__(self) -> None:
        self.requests = Requests()
        #: ``(step, runs)`` of the last :data:`STEPS_KEPT` steps delivered.
        self.recent: deque[Step] = deque(maxlen=STEPS_KEPT)
        #: Passes begun again on request: a pass iterator of an older count begins again.
        self.restarts = 0
        #: Whether the loader was restored from a state (steps to come may be quarantined).
        self.restored_before = False
        #: Steps (numbers of the next delivery) before which steps were read and not handed
        #: over, in this process: a state cannot stand back over them.
        self.passed_over: deque[int] = deque(maxlen=STEPS_KEPT)

    def __getstate__(self) -> dict[str, Any]:
        """A copy keeps what was asked, not the runs of steps it did not deliver."""
        return {**self.__dict__, "recent": deque(maxlen=STEPS_KEPT)}

    def skip(self, steps: int) -> None:
        """Skip the next ``steps`` steps (see ``DataLoader.skip``, and the ValueError it raises)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"skip(steps=...) takes a number of steps >= 0, got {steps!r}")
        if steps:
            self.requests.ask_skip(steps)
            logger.info("%d steps to skip on request from step %d", steps, self.requests.delivered)

    def quarantine_step(self, root: Node, step: int) -> list[QuarantineEntry]:
        """Quarantine the units behind delivered ``step`` (see ``DataLoader.quarantine_step``)."""
        requests = self.requests
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"quarantine_step(step) takes a step number, got {step!r}")
        if step >= requests.delivered and self.restored_before:  # when it comes
            requests.bad_steps = tuple(sorted({*requests.bad_steps, (step, step)}))
            return []
        runs = dict(self.recent).get(step)
        if runs is None:
            kept = f"{self.recent[0][0]} to {self.recent[-1][0]}" if self.recent else "none"
            raise ValueError(
                f"quarantine_step({step!r}): this loader knows the units of its last "
                f"{STEPS_KEPT} steps delivered (with torchft: committed) since it began or was "
                f"restored ({kept}; the next is {requests.delivered}), and those to come once "
                "restored from a state: call it right after the step (with torchft: once it "
                "commits), or after restoring a checkpoint from before it"
            )
        entries = self.quarantined(root, runs, step)
        self.restarts += 1
        return entries

    @staticmethod
    def quarantined(root: Node, runs: tuple[DeliveredRun, ...], step: int) -> list[QuarantineEntry]:
        """Quarantine the units behind the runs of ``step`` and end the pass; the entries added."""
        known = root.quarantine
        found = root.units_behind(runs, f"{QUARANTINE_STEP}({step})")
        entries = [e for e in found if not any(q.covers(*e.key) for q in known)]
        root.add_quarantine(entries)
        logger.warning(
            "quarantine_step(%d): %d units quarantined for this and every later epoch",
            step,
            len(entries),
        )
        root.host._close_iterator(f"quarantine_step({step})")
        return entries

    def restored(self, state: Any) -> None:
        """Take the record of a state loaded (one written before records: nothing asked)."""
        self.requests = Requests.of_state(state)
        self.recent.clear()
        self.passed_over.clear()
        self.restored_before = True

    def state(self, fetched_ahead: int) -> str:
        """The record as a state holds it, ``fetched_ahead`` deliveries back.

        Raises:
            ValueError: If steps were skipped (or a bad step dropped) within those deliveries:
                the node's state would stand back over them as over delivered steps.
        """
        delivered = self.requests.delivered
        if fetched_ahead and any(at > delivered - fetched_ahead for at in self.passed_over):
            raise ValueError(
                f"state_dict(fetched_ahead={fetched_ahead}): steps were skipped on request "
                f"within the last {fetched_ahead} batches delivered; take the state before the "
                "skip, or once a batch delivered after it has been trained on"
            )
        return self.requests.back(fetched_ahead).to_json()


class Steered:
    """``iter(loader)``: a pass that carries out its loader's requests (see the module docstring).

    The pass begins at the first ``next()``, not at ``iter()``: ``iter()`` costs nothing
    (frameworks call it to test a loader), and a ``set_epoch`` before the first batch moves the
    pass it will begin. Other attributes (``num_steps``, ...) are the pass's, which asking for
    begins.

    Args:
        begin: Readies the loader for the pass (at the first ``next()``).
        start: Begins the pass (again, after a ``quarantine_step``).
    """

    def __init__(
        self,
        steering: Steering,
        root: Node,
        begin: Callable[[], None],
        start: Callable[[], Iterator[Any]],
    ) -> None:
        self._steering, self._root, self._start = steering, root, start
        self._begin: Callable[[], None] | None = begin  # None once the pass has begun
        self._restarts = steering.restarts
        self._pass: Iterator[Any] = iter(())

    def _restart(self) -> Iterator[Any]:
        """Begin the pass (readying the loader the first time), or begin it again."""
        if self._begin is not None:
            self._begin()
        self._restarts = self._steering.restarts
        self._pass, self._begin = self._start(), None
        return self._pass

    def _begun(self) -> Iterator[Any]:
        return self._pass if self._begin is None else self._restart()

    def __iter__(self) -> Steered:
        return self

    def __next__(self) -> Any:
        steering, root = self._steering, self._root
        if self._begin is not None or self._restarts != steering.restarts:
            self._restart()
        requests = steering.requests
        while requests.skip_due or requests.bad_step() is not None:
            bad = None if requests.skip_due else requests.bad_step()  # named before it came
            steering.passed_over.append(requests.delivered)
            root.mark_skipping(True)  # through the pipeline, not handed over
            try:
                next(self._pass)
            finally:
                root.mark_skipping(False)
            if bad is None:
                requests.skipped_one()
                continue
            requests.dropped()
            steering.quarantined(root, root.last_runs(), bad)
            self._pass = self._start()
        batch = next(self._pass)
        steering.recent.append((requests.delivered, root.last_runs()))
        requests.delivered_one()
        return batch

    @property
    def num_steps(self) -> int | None:
        """The batches the pass delivers from here (None: not known), less the skips due."""
        steps: int | None = getattr(self._begun(), "num_steps", None)
        return None if steps is None else max(0, steps - self._steering.requests.pending)

    def __getattr__(self, name: str) -> Any:
        if name == "num_steps":  # its property raised AttributeError: begin once, not twice
            raise AttributeError(name)
        return getattr(self._begun(), name)


class Endless:
    """One iterator over pass after pass: when a pass ends, the next begins.

    Args:
        start_pass: Starts the next pass (the loader's own, which moves to the next epoch
            when the one under way is over).

    Example:
        >>> passes = iter([[1, 2], [3], [4, 5]])
        >>> it = Endless(lambda: iter(next(passes, [])))
        >>> [next(it) for _ in range(5)]
        [1, 2, 3, 4, 5]
        >>> next(it)  # two passes in a row with nothing in them: the source is spent
        Traceback (most recent call last):
        ...
        StopIteration
    """

    def __init__(self, start_pass: Callable[[], Iterator[Any]]) -> None:
        self._start_pass = start_pass
        self._pass = start_pass()

    def __iter__(self) -> Endless:
        return self

    def __next__(self) -> Any:
        for _ in range(2):  # an epoch that delivers nothing, then one more try
            try:
                return next(self._pass)
            except StopIteration:
                self._pass = self._start_pass()
        return next(self._pass)  # a third empty pass ends it (an empty lake, a spent stream)
