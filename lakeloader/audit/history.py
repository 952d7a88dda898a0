"""The exactly-once audit: the committed history of a run, proven epoch by epoch (pure)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from lakeloader.audit.records import Entry, SaveEntry, Stands, StartEntry, StepEntry


def epoch_name(stream: str, epoch: int) -> str:
    """How reports name an epoch of a stream ("epoch 2", "stream web, epoch 2")."""
    return f"stream {stream}, epoch {epoch}" if stream else f"epoch {epoch}"


def _at(stands: Stands) -> str:
    """Where streams stood, in words ("web: epoch 0, position 4; ...", a single lake's unnamed)."""
    return "; ".join(
        (f"{s}: " if s else "") + f"epoch {e}, position {p}" for s, (e, p) in stands.items()
    )


@dataclass(frozen=True)
class Span:
    """Global positions ``[start, stop)`` of an epoch."""

    epoch: int
    start: int
    stop: int


@dataclass(frozen=True)
class EpochVerdict:
    """What the audit found in one epoch.

    Its span lists are sorted and merged (spans that touch or overlap are one span).

    Attributes:
        trained: Rows of the committed history (each counted once per step).
        complete: Whether the committed history reaches the epoch's end.
        dropped: Rows of the epoch's end left out by ``drop_last`` (less than a step).
        missing: Positions the committed history skipped (an error).
        doubled: Positions it delivered twice (an error).
        unrecorded: Positions before the history begins (not an error: unverified).
        replayed: Positions delivered outside the committed history and again inside it.
        uncommitted: Positions delivered after the head checkpoint.
        topologies: ``(world size, batch size)`` of its committed steps, in order of use.
        stream: The stream whose epoch it is (``""``: a single lake's).
        skipped: Positions of the committed history skipped on request (``DataLoader.skip``):
            accounted for, not trained on (``trained`` leaves them out).
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
    stream: str = ""
    skipped: tuple[Span, ...] = ()

    @property
    def ok(self) -> bool:
        """No row missing or doubled."""
        return not self.missing and not self.doubled


@dataclass(frozen=True)
class AttemptLink:
    """One attempt's part of the committed history.

    Attributes:
        discarded: Its steps outside the committed history.
        resumed_step: The checkpoint it resumed from (-1: a fresh start).
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
        head_step: The newest committed checkpoint's step (``head_attempt`` saved it).
        chain: The attempts of the committed history, oldest first.
        epochs: Each epoch's verdict, stream by stream (in order of their names).
        problems: What contradicts exactly-once besides the epochs' missing and doubled
            positions (a history that loops, an epoch restarted on a changed lake, ...).
        unverified: What was not recorded, so neither proven nor refuted (the history
            begins past the start of epoch 0).
    """

    head_step: int
    head_attempt: str
    chain: tuple[AttemptLink, ...]
    epochs: tuple[EpochVerdict, ...]
    problems: tuple[str, ...] = ()
    unverified: tuple[str, ...] = ()

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

    ``entries`` are every ledger entry of the run, in any order; ``head_step`` is the step of
    the newest committed checkpoint, saved by ``head_attempt``.
    """
    steps: dict[str, list[StepEntry]] = defaultdict(list)
    saves: dict[tuple[str, int], SaveEntry] = {}
    starts: dict[str, list[StartEntry]] = defaultdict(list)
    for e in entries:
        if isinstance(e, StepEntry):
            steps[e.attempt].append(e)
        elif isinstance(e, SaveEntry):
            saves[(e.attempt, e.step)] = e
        else:
            starts[e.attempt].append(e)
    every = [s for mine in steps.values() for s in mine]
    head = saves.get((head_attempt, head_step))
    streams = _streams(every, head)
    problems: list[str] = []
    unverified: list[str] = []
    committed: list[StepEntry] = []
    chain: list[AttemptLink] = []
    # where the recorded history begins (None: unknown), and where the attempt after this began
    origin: Stands | None = dict.fromkeys(streams, (0, 0))
    resumed_at: Stands | None = None
    attempt, step, seen = head_attempt, head_step, set()
    while True:
        save = saves.get((attempt, step))
        if (attempt, step) in seen:
            problems.append(f"the history loops back to the checkpoint of step {step} ({attempt})")
            break
        if save is None:
            origin = resumed_at
            where = f" ({_at(origin)})" if origin else ""
            unverified.append(
                f"unverified before step {step}{where}: the ledger has no entry of its "
                f"checkpoint, saved by attempt {attempt or '(unknown)'} (with ledger=False, "
                "or by a lakeloader without a ledger)"
            )
            break
        seen.add((attempt, step))
        start = next((s for s in starts[attempt] if s.index == save.start), None)
        low = start.seq if start is not None else 0
        mine = [s for s in steps[attempt] if low < s.seq <= save.seq and s.committed]
        committed += mine
        recorded = _count(mine)
        resumed = start.resumed_step if start is not None else -1
        sizes = tuple(sorted({s.world_size for s in mine}))
        chain.append(
            AttemptLink(attempt, recorded, _count(steps[attempt]) - recorded, resumed, sizes)
        )
        if start is None:
            origin = dict(save.streams)
            for s in sorted(mine, key=lambda s: (s.epoch, s.start), reverse=True):
                origin[s.stream] = (s.epoch, s.start)  # each stream's first step
            unverified.append(
                f"unverified before {_at(origin)}: attempt {attempt} has no start entry (its "
                "first ledger segment is lost), so where it began is unknown"
            )
            break
        if start.resumed_step < 0:
            origin = dict(start.streams)
            if any(stand != (0, 0) for stand in origin.values()):
                first_step = save.step - recorded
                when = f"step {first_step} " if first_step >= 0 else ""
                unverified.append(
                    f"unverified before {when}({_at(origin)}): the ledger was attached late: "
                    f"attempt {attempt} began there without CheckpointManager.load (a "
                    "load_state_dict?), so the steps before are not recorded; resume with "
                    "CheckpointManager.load to keep the history whole"
                )
            break
        resumed_at = dict(start.streams)
        attempt, step = start.resumed_attempt, start.resumed_step
    ids = {id(s) for s in committed}
    others = [s for s in every if id(s) not in ids]
    epochs: list[EpochVerdict] = []
    for stream in streams:
        mine = [s for s in committed if s.stream == stream]
        began = _began(stream, origin, mine, unverified)
        stand = head.streams.get(stream) if head is not None else None
        verdicts, found = _verdicts(
            stream, mine, [s for s in others if s.stream == stream], stand, began
        )
        problems += found
        epochs += verdicts
    return AuditReport(
        head_step,
        head_attempt,
        tuple(reversed(chain)),
        tuple(epochs),
        tuple(problems),
        tuple(unverified),
    )


def _streams(steps: list[StepEntry], head: SaveEntry | None) -> list[str]:
    """The streams of the steps and of the head (``""`` only if a step names it, or alone)."""
    found = {s.stream for s in steps} | (set(head.streams) if head is not None else set())
    if "" in found and len(found) > 1 and not any(s.stream == "" for s in steps):
        found.discard("")
    return sorted(found)


def _count(steps: list[StepEntry]) -> int:
    """The steps that entries stand for (the runs of one step share its ``seq``)."""
    per: dict[int, int] = {}
    for s in steps:
        per[s.seq] = max(per.get(s.seq, 0), s.steps)
    return sum(per.values())


def _began(
    stream: str, origin: Stands | None, committed: list[StepEntry], unverified: list[str]
) -> tuple[int, int] | None:
    """Where the recorded history of ``stream`` begins (epoch, position), or None.

    A stream that ``origin`` does not name begins at its first committed step (the positions
    before it are unverified).
    """
    if origin is None or stream in origin:
        return None if origin is None else origin[stream]
    first = min(((s.epoch, s.start) for s in committed), default=None)
    if first is not None and first != (0, 0):
        unverified.append(
            f"unverified before {_at({stream: first})}: the ledger does not say where stream "
            f"{stream!r} stood when the recorded history began"
        )
    return first


def _verdicts(
    stream: str,
    committed: list[StepEntry],
    others: list[StepEntry],
    head: tuple[int, int] | None,
    origin: tuple[int, int] | None,
) -> tuple[list[EpochVerdict], list[str]]:
    """Each epoch's verdict from a stream's steps, and what else contradicts exactly-once.

    The verdicts come from the stream's committed steps and its steps outside the history; the
    problems are what contradicts exactly-once besides missing and doubled positions.
    ``head`` and ``origin`` are where the head checkpoint stands and where the recorded history
    begins (epoch, position): the head's epoch must reach exactly its position, and every
    epoch from the origin's to the head's must have a committed step.
    """
    by_epoch: dict[int, list[StepEntry]] = defaultdict(list)
    for s in committed:
        by_epoch[s.epoch].append(s)
    last_epoch = max(by_epoch, default=-1)
    if head is not None and head[0] > last_epoch and last_epoch >= 0:
        last_epoch = head[0]  # the checkpoint stands past the last step's epoch
    out, problems = [], []
    for epoch in sorted(by_epoch):
        mine = sorted(by_epoch[epoch], key=lambda s: (s.start, s.stop))
        rows = sorted({s.num_rows for s in mine})
        if len(rows) > 1:
            problems.append(
                f"{epoch_name(stream, epoch)}: its committed steps disagree on its rows "
                f"({rows}): the epoch was restarted on a changed lake "
                "(on_lake_change='restart_epoch')"
            )
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
                sum(s.stop - s.start for s in mine if not s.skipped),
                later or tail == 0,
                dropped,
                tuple(_merge(missing)),  # a run doubled by steps one after another, or
                tuple(_merge(doubled)),  # by them and by the head's position, is one span
                unrecorded,
                replayed,
                uncommitted,
                topologies,
                stream,
                tuple(_merge([Span(epoch, s.start, s.stop) for s in mine if s.skipped])),
            )
        )
    if head is not None and origin is not None:
        for epoch in range(origin[0], head[0] + (1 if head[1] else 0)):
            if epoch not in by_epoch:
                problems.append(
                    f"{epoch_name(stream, epoch)}: no committed step, yet the head is past it"
                )
    return out, problems


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
    """The union of spans of one epoch, as sorted spans that neither overlap nor touch."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start <= out[-1].stop:
            out[-1] = Span(s.epoch, out[-1].start, max(out[-1].stop, s.stop))
        else:
            out.append(s)
    return out
