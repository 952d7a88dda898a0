"""The exactly-once audit: the committed history of a run, proven epoch by epoch (pure).

The committed history is found backwards from the newest committed checkpoint (the *head*):
the steps its attempt delivered up to it, then, from that attempt's start, the steps of the
attempt it resumed from up to the checkpoint it resumed from, and so on to a fresh start. Each
epoch's committed steps must then tile its global positions ``[0, N)`` with neither gap nor
overlap; the order is a bijection from positions to rows, so that proves every row was
trained on exactly once. Steps outside the committed history are *replayed* where the history
covers their positions again (delivered after a checkpoint by an attempt that then died) and
*uncommitted* where it does not (delivered after the head: a resume will train on them again).

Where the history begins past the start of epoch 0 (a loader restored with
``load_state_dict`` rather than ``CheckpointManager.load``, a checkpoint saved without a
ledger, a start entry lost), the positions before it were not recorded: the audit proves the
rest and calls the run *unverified* before that point, a verdict of its own, never a row
missing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from lakeloader.audit.records import Entry, SaveEntry, StartEntry, StepEntry


@dataclass(frozen=True)
class Span:
    """Global positions ``[start, stop)`` of an epoch."""

    epoch: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Positions in the span."""
        return self.stop - self.start


@dataclass(frozen=True)
class EpochVerdict:
    """What the audit found in one epoch.

    Attributes:
        epoch: The epoch.
        num_rows: Its rows (N).
        trained: Rows of the committed history (each counted once per step).
        complete: Whether the committed history reaches the epoch's end.
        dropped: Rows of the epoch's end left out by ``drop_last`` (less than a step).
        missing: Positions the committed history skipped (an error).
        doubled: Positions it delivered twice (an error).
        unrecorded: Positions before the history begins (not an error: unverified).
        replayed: Positions delivered outside the committed history and again inside it.
        uncommitted: Positions delivered after the head checkpoint.
        topologies: ``(world size, batch size)`` of its committed steps, in order of use.
    """

    epoch: int
    num_rows: int
    trained: int
    complete: bool
    dropped: int
    missing: tuple[Span, ...]
    doubled: tuple[Span, ...]
    unrecorded: tuple[Span, ...]
    replayed: tuple[Span, ...]
    uncommitted: tuple[Span, ...]
    topologies: tuple[tuple[int, int], ...]

    @property
    def ok(self) -> bool:
        """No row missing or doubled."""
        return not self.missing and not self.doubled


@dataclass(frozen=True)
class AttemptLink:
    """One attempt's part of the committed history.

    Attributes:
        attempt: Its id.
        steps: Its committed steps.
        discarded: Its steps outside the committed history.
        resumed_step: The checkpoint it resumed from (-1: a fresh start).
        world_sizes: World sizes of its committed steps.
    """

    attempt: str
    steps: int
    discarded: int
    resumed_step: int
    world_sizes: tuple[int, ...]


@dataclass(frozen=True)
class AuditReport:
    """The audit of a run's ledger.

    Attributes:
        head_step: The newest committed checkpoint's step.
        head_attempt: The attempt that saved it.
        chain: The attempts of the committed history, oldest first.
        epochs: Each epoch's verdict.
        problems: What contradicts exactly-once besides the epochs' missing and doubled
            positions (a history that loops, an epoch restarted on a changed lake, ...).
        unverified: What was not recorded, so neither proven nor refuted (the history
            begins past the start of epoch 0).
    """

    head_step: int
    head_attempt: str
    chain: tuple[AttemptLink, ...]
    epochs: tuple[EpochVerdict, ...]
    problems: tuple[str, ...] = field(default=())
    unverified: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Every row of the recorded history exactly once (whether or not it is whole)."""
        return not self.problems and all(e.ok for e in self.epochs)

    @property
    def verdict(self) -> str:
        """``"exactly once"``, ``"NOT exactly once"`` or ``"unverified"`` (part unrecorded)."""
        if not self.ok:
            return "NOT exactly once"
        return "unverified" if self.unverified else "exactly once"


def audit(entries: Iterable[Entry], head_step: int, head_attempt: str) -> AuditReport:
    """Prove (or refute) exactly-once delivery in the committed history ending at a checkpoint.

    Args:
        entries: Every ledger entry of the run, any order.
        head_step: The step of the newest committed checkpoint.
        head_attempt: The attempt that saved it.

    Example:
        >>> from lakeloader.audit.records import StartEntry, StepEntry, SaveEntry
        >>> a = [StartEntry("a", 0.0, 1, 0, -1, "", 0, 0)]
        >>> a += [StepEntry("a", i + 1, 0, 4 * i, 4 * i + 4, 12, 1, 4) for i in range(3)]
        >>> a += [SaveEntry("a", 1, 1, 0, 4)]   # a checkpoint after step 1, then a crash
        >>> b = [StartEntry("b", 1.0, 2, 1, 1, "a", 0, 4)]   # resumed on 2 ranks
        >>> b += [StepEntry("b", 1, 0, 4, 8, 12, 2, 2), StepEntry("b", 2, 0, 8, 12, 12, 2, 2)]
        >>> b += [SaveEntry("b", 3, 2, 0, 12)]
        >>> report = audit(a + b, 3, "b")
        >>> report.ok, report.epochs[0].trained, report.epochs[0].replayed
        (True, 12, (Span(epoch=0, start=4, stop=12),))
    """
    steps: dict[str, dict[int, StepEntry]] = defaultdict(dict)
    saves: dict[tuple[str, int], SaveEntry] = {}
    starts: dict[str, list[StartEntry]] = defaultdict(list)
    for e in entries:
        if isinstance(e, StepEntry):
            steps[e.attempt][e.seq] = e
        elif isinstance(e, SaveEntry):
            saves[(e.attempt, e.step)] = e
        else:
            starts[e.attempt].append(e)
    problems: list[str] = []
    unverified: list[str] = []
    committed: list[StepEntry] = []
    chain: list[AttemptLink] = []
    origin: tuple[int, int] | None = (0, 0)  # where the recorded history begins
    resumed_at: tuple[int, int] | None = None  # where the attempt after this one began
    attempt, step, seen = head_attempt, head_step, set()
    while True:
        save = saves.get((attempt, step))
        if (attempt, step) in seen:
            problems.append(f"the history loops back to the checkpoint of step {step} ({attempt})")
            break
        if save is None:
            origin = resumed_at
            where = f" (epoch {origin[0]}, position {origin[1]})" if origin else ""
            unverified.append(
                f"unverified before step {step}{where}: the ledger has no entry of its "
                f"checkpoint, saved by attempt {attempt or '(unknown)'} (with ledger=False, "
                "or by a lakeloader without a ledger)"
            )
            break
        seen.add((attempt, step))
        start = next((s for s in starts[attempt] if s.index == save.start), None)
        low = start.seq if start is not None else 0
        mine = [s for q, s in steps[attempt].items() if low < q <= save.seq and s.committed]
        committed += mine
        recorded = sum(s.steps for s in mine)
        chain.append(
            AttemptLink(
                attempt,
                recorded,
                sum(s.steps for s in steps[attempt].values()) - recorded,
                start.resumed_step if start is not None else -1,
                tuple(sorted({s.world_size for s in mine})),
            )
        )
        if start is None:
            first = min(mine, key=lambda s: (s.epoch, s.start), default=None)
            origin = (first.epoch, first.start) if first else (save.epoch, save.position)
            unverified.append(
                f"unverified before epoch {origin[0]}, position {origin[1]}: attempt {attempt} "
                "has no start entry (its first ledger segment is lost), so where it began is "
                "unknown"
            )
            break
        if start.resumed_step < 0:
            if (start.epoch, start.position) != (0, 0):
                origin = (start.epoch, start.position)
                first_step = save.step - recorded
                when = f"step {first_step} " if first_step >= 0 else ""
                unverified.append(
                    f"unverified before {when}(epoch {start.epoch}, position {start.position}):"
                    f" the ledger was attached late: attempt {attempt} began there without "
                    "CheckpointManager.load (a load_state_dict?), so the steps before are not "
                    "recorded; resume with CheckpointManager.load to keep the history whole"
                )
            break
        resumed_at = (start.epoch, start.position)
        attempt, step = start.resumed_attempt, start.resumed_step
    ids = {(s.attempt, s.seq) for s in committed}
    others = [s for a in steps.values() for s in a.values() if (s.attempt, s.seq) not in ids]
    head = saves.get((head_attempt, head_step))
    epochs = _verdicts(committed, others, (head.epoch, head.position) if head else None, origin)
    sizes: dict[int, set[int]] = defaultdict(set)
    for s in committed:
        sizes[s.epoch].add(s.num_rows)
    for epoch, rows in sorted(sizes.items()):
        if len(rows) > 1:
            problems.append(
                f"epoch {epoch}: its committed steps disagree on its rows ({sorted(rows)}): "
                "the epoch was restarted on a changed lake (on_lake_change='restart_epoch')"
            )
    if head is not None and origin is not None:
        present = {e.epoch for e in epochs}
        for epoch in range(origin[0], head.epoch + (1 if head.position else 0)):
            if epoch not in present:
                problems.append(f"epoch {epoch}: no committed step, yet the head is past it")
    return AuditReport(
        head_step,
        head_attempt,
        tuple(reversed(chain)),
        epochs,
        tuple(problems),
        tuple(unverified),
    )


def _verdicts(
    committed: list[StepEntry],
    others: list[StepEntry],
    head: tuple[int, int] | None,
    origin: tuple[int, int] | None,
) -> tuple[EpochVerdict, ...]:
    """Each epoch's verdict from its committed steps and the steps outside the history.

    ``head`` is where the head checkpoint stands (epoch, position): epochs before its epoch
    must be complete, and its epoch must reach exactly its position. ``origin`` is where the
    recorded history begins (epoch, position): the positions before it are unrecorded.
    """
    by_epoch: dict[int, list[StepEntry]] = defaultdict(list)
    for s in committed:
        by_epoch[s.epoch].append(s)
    last_epoch = max(by_epoch, default=-1)
    if head is not None and head[0] > last_epoch and last_epoch >= 0:
        last_epoch = head[0]  # the checkpoint stands past the last step's epoch
    out = []
    for epoch in sorted(by_epoch):
        mine = sorted(by_epoch[epoch], key=lambda s: (s.start, s.stop))
        begin = origin[1] if origin is not None and origin[0] == epoch else 0
        unrecorded = (Span(epoch, 0, begin),) if begin else ()
        reached, missing, doubled, covered = begin, [], [], []
        for s in mine:
            if s.start > reached:
                missing.append(Span(epoch, reached, s.start))
            elif s.start < reached:
                doubled.append(Span(epoch, s.start, min(reached, s.stop)))
            covered.append(Span(epoch, s.start, s.stop))
            reached = max(reached, s.stop)
        num_rows = mine[-1].num_rows
        tail = num_rows - reached
        last = max(mine, key=lambda s: s.stop)
        step_rows = last.world_size * last.batch_size  # drop_last drops less than a step
        later = epoch < last_epoch
        dropped = tail if later and 0 < tail < step_rows else 0
        if later and tail >= step_rows:
            missing.append(Span(epoch, reached, num_rows))
        if head is not None and epoch == head[0] and reached != head[1]:
            gap = Span(epoch, min(reached, head[1]), max(reached, head[1]))
            (missing if reached < head[1] else doubled).append(gap)
        outside = [Span(epoch, s.start, s.stop) for s in others if s.epoch == epoch]
        replayed, uncommitted = _split(outside, covered)
        topologies = tuple(dict.fromkeys((s.world_size, s.batch_size) for s in mine))
        out.append(
            EpochVerdict(
                epoch,
                num_rows,
                sum(s.stop - s.start for s in mine),
                later or tail == 0,
                dropped,
                tuple(missing),
                tuple(doubled),
                unrecorded,
                replayed,
                uncommitted,
                topologies,
            )
        )
    return tuple(out)


def _split(outside: list[Span], covered: list[Span]) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
    """Parts of ``outside`` inside the union of ``covered`` (replayed) and outside it."""
    union = _merge(covered)
    inside, beyond = [], []
    for span in _merge(outside):
        at = span.start
        for c in union:
            if c.stop <= at or c.start >= span.stop:
                continue
            if c.start > at:
                beyond.append(Span(span.epoch, at, c.start))
            inside.append(Span(span.epoch, max(at, c.start), min(span.stop, c.stop)))
            at = min(span.stop, c.stop)
        if at < span.stop:
            beyond.append(Span(span.epoch, at, span.stop))
    return tuple(inside), tuple(beyond)


def _merge(spans: list[Span]) -> list[Span]:
    """The union of spans of one epoch, as sorted disjoint spans."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1].stop:
            out[-1] = Span(s.epoch, out[-1].start, max(out[-1].stop, s.stop))
        else:
            out.append(s)
    return out
