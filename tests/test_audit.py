"""The exactly-once audit: its proof over simulated runs (hypothesis), and ``lakeloader audit``.

Runs with real processes (a SIGKILLed rank, torchrun's restart, a resize to 2 ranks) are
audited in tests/test_torchrun.py.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.audit.history import Span, audit
from lakeloader.audit.records import Entry, SaveEntry, StartEntry, StepEntry
from lakeloader.cli.main import main as cli
from tests.conftest import double_a_step, layout_dataset

SPAN_KEYS = ("missing", "doubled", "unrecorded", "replayed", "uncommitted", "skipped")


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[Entry], int, str, int, int]:
    """A simulated run: attempts that resume from a checkpoint, deliver, save, and crash.

    Returns the entries, the head checkpoint (step, attempt), the epochs and the rows that the
    dead attempts delivered past their last checkpoint (replayed by the next).
    """
    num_rows = draw(st.integers(1, 200))
    epochs = draw(st.integers(1, 3))
    entries: list[Entry] = []
    epoch, position, step = 0, 0, 0
    resumed = (-1, "")
    replayed = 0
    a = 0
    while epoch < epochs:
        a += 1
        attempt = f"a{a}"
        world, batch = draw(st.integers(1, 4)), draw(st.integers(1, 16))
        entries.append(StartEntry(attempt, float(a), world, a - 1, *resumed, epoch, position))
        crash = draw(st.booleans()) and a < 6
        steps = draw(st.integers(1, 12))
        saved = (epoch, position, step, 0)
        for seq in range(1, steps + 1):
            if epoch >= epochs:
                break
            stop = min(position + world * batch, num_rows)
            step += 1
            entries.append(StepEntry(attempt, seq, epoch, position, stop, num_rows, world, batch))
            position = stop
            if position == num_rows:
                epoch, position = epoch + 1, 0
            if draw(st.booleans()) or not crash:
                entries.append(SaveEntry(attempt, step, seq, epoch, position))
                saved = (epoch, position, step, seq)
        if crash:  # the steps after the last save are lost; the next attempt resumes there
            lost = [e for e in entries if isinstance(e, StepEntry) and e.attempt == attempt]
            replayed += sum(e.stop - e.start for e in lost if e.seq > saved[3])
            epoch, position, step = saved[0], saved[1], saved[2]
            resumed = (saved[2], attempt if saved[3] else resumed[1])
            if not saved[3]:  # nothing saved: resume where this attempt resumed
                resumed = _previous(entries, attempt)
        else:
            resumed = (step, attempt)
    head_step, head_attempt = resumed
    return entries, head_step, head_attempt, epochs, replayed


def _previous(entries: list[Entry], attempt: str) -> tuple[int, str]:
    start = next(e for e in entries if isinstance(e, StartEntry) and e.attempt == attempt)
    return start.resumed_step, start.resumed_attempt


@settings(max_examples=200, deadline=None)
@given(runs())
def test_every_simulated_run_is_proven_exactly_once(
    run: tuple[list[Entry], int, str, int, int],
) -> None:
    entries, head_step, head_attempt, epochs, replayed = run
    report = audit(entries, head_step, head_attempt)
    assert report.ok, (report.problems, [e for e in report.epochs if not e.ok])
    assert [e.epoch for e in report.epochs] == list(range(epochs))
    assert all(e.complete and e.trained == e.num_rows for e in report.epochs)
    assert sum(s.stop - s.start for e in report.epochs for s in e.replayed) <= replayed
    assert not any(e.uncommitted for e in report.epochs)


@settings(max_examples=200, deadline=None)
@given(runs(), st.data())
def test_a_doubled_or_missing_step_is_caught(
    run: tuple[list[Entry], int, str, int, int], data: st.DataObject
) -> None:
    entries, head_step, head_attempt, _, _ = run
    steps = [e for e in entries if isinstance(e, StepEntry)]
    committed = [e for e in steps if _in_history(entries, e, head_step, head_attempt)]
    victim = data.draw(st.sampled_from(committed))
    if data.draw(st.booleans()):  # the head attempt delivered the step's rows once more
        last = max(e.seq for e in steps if e.attempt == head_attempt)
        again = StepEntry(
            head_attempt,
            last + 1,
            victim.epoch,
            victim.start,
            victim.stop,
            victim.num_rows,
            victim.world_size,
            victim.batch_size,
        )
        entries = [_moved(e, last + 1, head_step, head_attempt) for e in entries] + [again]
        found = "doubled"
    else:  # the step's entry lost: its rows were never trained on
        entries = [e for e in entries if e is not victim]
        found = "missing"
    report = audit(entries, head_step, head_attempt)
    assert not report.ok
    whole_epoch_gone = found == "missing" and any("no committed step" in p for p in report.problems)
    assert any(getattr(e, found) for e in report.epochs) or whole_epoch_gone


@settings(max_examples=60, deadline=None)  # quick: _in_history audits once a step
@given(runs(), st.data())
def test_consecutive_steps_delivered_again_are_one_doubled_span(
    run: tuple[list[Entry], int, str, int, int], data: st.DataObject
) -> None:
    entries, head_step, head_attempt, _, _ = run
    steps = [e for e in entries if isinstance(e, StepEntry)]
    committed = sorted(
        (e for e in steps if _in_history(entries, e, head_step, head_attempt)),
        key=lambda e: (e.epoch, e.start),
    )
    first = data.draw(st.integers(0, len(committed) - 1))
    epoch = committed[first].epoch
    last = data.draw(
        st.integers(first, max(i for i, e in enumerate(committed) if e.epoch == epoch))
    )
    seq = max(e.seq for e in steps if e.attempt == head_attempt)
    again = [  # the head attempt delivered steps first..last once more, in order
        StepEntry(head_attempt, seq + 1 + i, *_span_of(v))
        for i, v in enumerate(committed[first : last + 1])
    ]
    moved = seq + len(again)
    entries = [_moved(e, moved, head_step, head_attempt) for e in entries] + again
    report = audit(entries, head_step, head_attempt)
    span = Span(epoch, committed[first].start, committed[last].stop)
    assert [(e.epoch, e.doubled) for e in report.epochs if e.doubled] == [(epoch, (span,))]
    for e in report.epochs:  # every span list sorted and merged
        for key in SPAN_KEYS:
            spans = getattr(e, key)
            assert all(a.stop < b.start for a, b in itertools.pairwise(spans)), (key, spans)


def _span_of(step: StepEntry) -> tuple[int, int, int, int, int, int]:
    return (step.epoch, step.start, step.stop, step.num_rows, step.world_size, step.batch_size)


def _in_history(entries: list[Entry], step: StepEntry, head_step: int, head_attempt: str) -> bool:
    """Whether the audit misses ``step`` when its entry is dropped (it is in the history)."""
    return not audit([e for e in entries if e is not step], head_step, head_attempt).ok


def _moved(e: Entry, seq: int, head_step: int, head_attempt: str) -> Entry:
    """The head checkpoint's save entry, as if saved after step ``seq``."""
    if isinstance(e, SaveEntry) and (e.step, e.attempt) == (head_step, head_attempt):
        return SaveEntry(e.attempt, e.step, seq, e.epoch, e.position)
    return e


def test_an_attempt_that_loads_again_and_saves_at_once() -> None:
    # attempt a: 4 steps of 4 rows, a checkpoint after step 2; it then loads that checkpoint
    # again (rolling steps 3-4 back) and saves at once, before delivering a step
    entries: list[Entry] = [StartEntry("a", 0.0, 1, 0, -1, "", 0, 0, 0, 0)]
    entries += [StepEntry("a", q, 0, 4 * (q - 1), 4 * q, 40, 1, 4) for q in range(1, 5)]
    entries += [SaveEntry("a", 2, 2, 0, 8, 0)]
    entries += [StartEntry("a", 1.0, 1, 0, 2, "a", 0, 8, 4, 1), SaveEntry("a", 3, 4, 0, 8, 1)]
    report = audit(entries, 3, "a")
    assert report.ok, report
    assert report.epochs[0].trained == 8, "steps 1-2, not the rolled-back 3-4"
    assert report.epochs[0].uncommitted == (Span(0, 8, 16),)


@pytest.mark.parametrize("async_save", [False, True])
def test_audit_command_on_a_crash_and_a_resize(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], async_save: bool
) -> None:
    ckpt_dir = str(tmp_path / "ckpt")
    # attempt 1: one rank, batch 32, a checkpoint after step 5 (written in the background
    # while steps 6-8 are delivered, with async_save), killed after step 8
    first = ll.DataLoader(layout_dataset(own_lake), batch_size=32)
    dead = ll.CheckpointManager(ckpt_dir, ledger_flush_seconds=0, async_save=async_save)
    dead.attach(first)
    for step, _ in enumerate(first, 1):
        if step == 5:
            dead.save(step, first)
        if step == 8:
            break
    dead.wait()
    dead.ledger.wait()  # what a crash leaves: the segments written so far, no close
    # attempt 2: two ranks of batch 24 resume from step 5 and finish epochs 0 and 1
    ranks = [
        ll.DataLoader(layout_dataset(own_lake), batch_size=24, rank=r, world_size=2)
        for r in range(2)
    ]
    with ll.CheckpointManager(ckpt_dir) as ckpt:
        for loader in ranks:
            ckpt.load(loader)
        step = 5
        for epoch in (0, 1):
            for loader in ranks:
                loader.set_epoch(epoch)
            for _ in zip(*ranks, strict=True):
                step += 1
            ckpt.save(step, ranks[0])
    assert cli(["audit", ckpt_dir, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and [e["epoch"] for e in info["epochs"]] == [0, 1]
    rows = len(layout_dataset(own_lake))
    assert all(e["trained"] == rows and e["complete"] for e in info["epochs"])
    assert info["epochs"][0]["replayed"] == [[160, 256]], "steps 6-8 of the dead attempt"
    assert [c["world_sizes"] for c in info["chain"]] == [[1], [2]]
    assert cli(["audit", ckpt_dir]) == 0
    text = capsys.readouterr().out
    assert "every row exactly once" in text and "1x32" in text and "2x24" in text
    # a ledger that says a step of epoch 1 was trained on twice
    start, stop = double_a_step(tmp_path / "ckpt", 1)
    assert cli(["audit", ckpt_dir]) == 1
    text = capsys.readouterr().out
    errors = [line for line in text.splitlines() if line.startswith("ERROR")]
    assert errors == [f"ERROR epoch 1: positions [{start}, {stop}) trained on twice"]
    assert "row group" in text and "NOT exactly once" in text
    dead.close()
