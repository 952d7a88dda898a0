"""The delivery journal: the runs of steps a loader delivered, until the audit ledger attaches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from lakeloader.topology import Topology


def epoch_runs(
    first: int, stop: int, rows: int, stream: str, topology: Topology
) -> list[DeliveredRun]:
    """Offsets ``[first, stop)`` of a stream of epochs of ``rows`` each, as runs epoch by epoch.

    >>> [(r.epoch, r.start, r.stop) for r in epoch_runs(3, 9, 4, "lake", Topology(1, 0, 0, 2))]
    [(0, 3, 4), (1, 0, 4), (2, 0, 1)]
    """
    out = []
    while first < stop:
        epoch = first // rows
        base, end = epoch * rows, min(stop, (epoch + 1) * rows)
        out.append(DeliveredRun(epoch, first - base, end - base, rows, topology, stream=stream))
        first = end
    return out


@dataclass(frozen=True)
class DeliveredRun:
    """Consecutive steps of one epoch of one stream under one topology.

    Attributes:
        start: The global position before the first step.
        stop: The global position after the last step.
        num_rows: Rows in the epoch.
        stream: The position stream it moves, a leaf path as in ``checkpoint_datasets()``:
            ``""`` one lake's global rows, a mixture's source name, ``"lake"`` a packed lake's
            samples (``"<source>/p<partition>"`` in ledgers of the older per-partition packing).
        skipped: Skipped on request (``DataLoader.skip``): its positions moved, its rows
            were not handed to the training loop.
    """

    epoch: int
    start: int
    stop: int
    num_rows: int
    topology: Topology
    steps: int = 1
    stream: str = ""
    skipped: bool = False

    def continued_by(self, stop: int, run: DeliveredRun) -> bool:
        """Whether ``run`` extends this run, which has reached ``stop``."""
        mine = (stop, self.stream, self.epoch, self.num_rows, self.topology, self.skipped)
        return mine == (run.start, run.stream, run.epoch, run.num_rows, run.topology, run.skipped)


#: What a ledger records as one delivery: the runs of one step (or of consecutive steps, from
#: the journal), one or two per stream it moved.
Runs: TypeAlias = Sequence[DeliveredRun]


class DeliveryJournal:
    """The runs of steps delivered since the loader began or was restored.

    The open delivery is its first step's runs and their stops: a lake's step costs a few
    comparisons (it is recorded in every ``next()``).

    Example:
        >>> from lakeloader.topology import Topology
        >>> t = Topology(2, 0, 0, 4)
        >>> j = DeliveryJournal()
        >>> for g, stop in ((0, 8), (8, 16), (16, 30)):   # three steps of a lake
        ...     j.record_step([DeliveredRun(0, g, stop, 30, t)])
        >>> j.record_step([DeliveredRun(1, 0, 8, 30, t)])
        >>> [[(r.epoch, r.start, r.stop, r.steps) for r in runs] for runs in j.take_steps()]
        [[(0, 0, 30, 3)], [(1, 0, 8, 1)]]
        >>> for a, b in ((0, 5), (5, 9)):   # two steps of a mixture of web and code
        ...     j.record_step([DeliveredRun(0, a, b, 20, t, stream="web"),
        ...                    DeliveredRun(0, 2 * a, 2 * b, 40, t, stream="code")])
        >>> [[(r.stream, r.start, r.stop, r.steps) for r in runs] for runs in j.take_steps()]
        [[('web', 0, 9, 2), ('code', 0, 18, 2)]]
    """

    def __init__(self) -> None:
        self._steps_runs: list[tuple[DeliveredRun, ...]] = []
        self._open: tuple[DeliveredRun, ...] = ()  # the open delivery's first step
        self._stops: list[int] = []
        self._steps = 0

    def record_step(self, runs: Sequence[DeliveredRun]) -> None:
        """A step was delivered: its runs (one step each), one per stream it moved."""
        opened = self._open
        if len(runs) == 1 == len(opened) and opened[0].continued_by(self._stops[0], runs[0]):
            self._stops[0] = runs[0].stop  # a lake's step, most of the time
            self._steps += 1
            return
        if len(runs) != len(opened) or not all(
            a.continued_by(stop, b) for a, stop, b in zip(opened, self._stops, runs, strict=True)
        ):
            self._close()
            self._open = tuple(runs)
        self._stops = [r.stop for r in runs]
        self._steps += 1

    def _close(self) -> None:
        if self._open:
            self._steps_runs.append(
                tuple(
                    replace(r, stop=stop, steps=self._steps)
                    for r, stop in zip(self._open, self._stops, strict=True)
                )
            )
        self._open, self._stops, self._steps = (), [], 0

    def take_steps(self) -> list[tuple[DeliveredRun, ...]]:
        """The deliveries recorded so far, each the runs of its steps; empty afterwards."""
        self._close()
        taken, self._steps_runs = self._steps_runs, []
        return taken


class StepRecord:
    """The runs of the steps a node delivered: to the audit ledger, or journaled until then.

    A copy of the loader keeps neither.
    """

    def __init__(self) -> None:
        self.observer: Callable[[Runs], None] | None = None
        self.journal = DeliveryJournal()
        #: Whether the steps delivered now are skipped on request (``DataLoader.skip``).
        self.skipping = False
        #: The runs of the last step delivered.
        self.last: tuple[DeliveredRun, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {"observer": None, "journal": DeliveryJournal(), "skipping": False, "last": ()}

    def step(self, runs: Sequence[DeliveredRun]) -> None:
        """A step was handed over, moving these runs."""
        if self.skipping:
            runs = [replace(r, skipped=True) for r in runs]
        self.last = tuple(runs)
        if self.observer is not None:
            self.observer(self.last)
        else:
            self.journal.record_step(runs)

    def attach(self, observer: Callable[[Runs], None]) -> None:
        """Tell ``observer`` of every step from now on, and first of those journaled."""
        if self.observer == observer:  # the same bound method
            return
        for runs in self.journal.take_steps():
            observer(runs)
        self.observer = observer

    def restored(self) -> None:
        """The position was set: what was delivered before is not this attempt's history."""
        self.journal.take_steps()
