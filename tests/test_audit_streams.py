"""The audit per position stream: a mixture per source epoch, a ledger of per-partition packing.

Ledgers are written through the public writer (``Ledger.step`` with the runs of each step,
``mark``/``saved``/``resumed``, ``DeliveryJournal``) by a simulated loader that moves named
streams the way a mixture (one stream per source, sources of different sizes crossing their
epochs apart) and a packed stream of lakeloader's former per-partition packing (one stream per
partition, all moving ``G / C`` samples a step: ledgers it wrote still audit) move them,
through crashes and resumes under other topologies. Old single-lake ledgers (version 1 lines,
as lakeloader wrote them before streams) audit as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.audit.history import AuditReport, Span, audit
from lakeloader.audit.ledger import LEDGER_DIR, Ledger, read_entries
from lakeloader.audit.records import SaveEntry, StepEntry, dump_entry, parse_entry
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.cli.main import main as cli
from lakeloader.errors import CheckpointError
from lakeloader.io.retry import RetryPolicy
from lakeloader.state.journal import DeliveredRun, DeliveryJournal
from lakeloader.topology import Topology

#: Rows of each source's epoch: sizes that differ, small enough to cross epochs often.
SIZES = {"web": 23, "code": 10}
#: A packed stream's partitions and the samples of each partition's epoch.
PARTITIONS, SAMPLES = 4, 7
PACKED = {f"lake/p{p}": SAMPLES for p in range(PARTITIONS)}


def open_ledger(root: Path, attempt: str | None = None) -> Ledger:
    """A ledger of one attempt under a checkpoint root on the local disk."""
    store = CheckpointStore(fsspec.filesystem("file"), str(root), RetryPolicy())
    return Ledger(store, str(root), flush_seconds=0, attempt=attempt)


def audit_root(root: Path, head: tuple[int, str]) -> AuditReport:
    store = CheckpointStore(fsspec.filesystem("file"), str(root), RetryPolicy())
    entries, torn = read_entries(store, str(root))
    assert not torn
    return audit(entries, *head)


@dataclass
class Streams:
    """A simulated loader's position streams: what it delivered on each since the start.

    A stream's count runs over its epochs end to end (a mixture's source goes on into its
    next epoch within a step; a packed partition too).
    """

    sizes: Mapping[str, int]
    counts: dict[str, int] = field(default_factory=dict)

    def runs(self, takes: Mapping[str, int], topology: Topology) -> list[DeliveredRun]:
        """The runs of a step that takes ``takes[stream]`` positions of each stream."""
        out = []
        for stream, k in takes.items():
            size, count = self.sizes[stream], self.counts.get(stream, 0)
            stop = count + k
            while True:  # a run per epoch the step touches (an empty one if it takes none)
                epoch, at = divmod(count, size)
                end = min(stop, (epoch + 1) * size)
                out.append(DeliveredRun(epoch, at, end - epoch * size, size, topology, 1, stream))
                count = end
                if count >= stop:
                    break
            self.counts[stream] = stop
        return out


@dataclass(frozen=True)
class Attempt:
    """One run of the training program: its topology, its steps' takes, when it saves."""

    world: int
    batch: int
    takes: list[dict[str, int]]
    saves: frozenset[int]
    crash: bool


def simulate(root: Path, sizes: Mapping[str, int], attempts: list[Attempt]) -> Streams:
    """Write the ledger of ``attempts``; the streams stand where the head checkpoint does.

    A crashed attempt's steps after its last save are in its ledger; the next attempt
    resumes from the newest checkpoint (as ``CheckpointManager.load`` does). Every attempt
    but a crashed one ends with a save.
    """
    streams = Streams(sizes)
    step = 0
    head: tuple[int, str, dict[str, int]] = (-1, "", {})  # the newest save: step, attempt, counts
    for spec in attempts:
        ledger = open_ledger(root)
        if head[0] >= 0:
            ledger.resumed(head[0], head[1])
        topology = Topology(spec.world, 0, 0, spec.batch)
        for i, takes in enumerate(spec.takes):
            ledger.step(streams.runs(takes, topology))
            step += 1
            if i in spec.saves or (i == len(spec.takes) - 1 and not spec.crash):
                mark = ledger.mark(0, step, spec.world)
                ledger.saved(step, mark, 0, step)
                head = (step, ledger.attempt, dict(streams.counts))
        ledger.close()
        if spec.crash:  # back to the newest checkpoint
            streams.counts, step = dict(head[2]), max(head[0], 0)
    return streams


def head_of(root: Path) -> tuple[int, str]:
    """The newest save entry's (step, attempt)."""
    store = CheckpointStore(fsspec.filesystem("file"), str(root), RetryPolicy())
    saves = [e for e in read_entries(store, str(root))[0] if isinstance(e, SaveEntry)]
    newest = max(saves, key=lambda e: e.step)
    return newest.step, newest.attempt


def assert_each_epoch_once(report: AuditReport, streams: Streams) -> None:
    """Every stream's epochs before the head's are complete, and its last reaches the head."""
    assert report.verdict == "exactly once", (report.problems, report.unverified)
    moved = {s for s, c in streams.counts.items() if c}
    assert {e.stream for e in report.epochs} == moved
    for stream in moved:
        epochs = [e for e in report.epochs if e.stream == stream]
        size, count = streams.sizes[stream], streams.counts[stream]
        full, part = divmod(count, size)
        assert [e.epoch for e in epochs] == list(range(full + (1 if part else 0)))
        assert [e.trained for e in epochs] == [size] * full + ([part] if part else [])
        assert all(not e.missing and not e.doubled and not e.unrecorded for e in epochs)


@st.composite
def attempts(draw: st.DrawFn, packed: bool) -> list[Attempt]:
    """Attempts that crash, resume on other topologies and save at random steps.

    A mixture's step draws its ``world x batch`` rows from web and code in any proportion; a
    packed step takes ``G / C`` samples of every partition (``world`` divides ``C x per``).
    """
    out = []
    for a in range(draw(st.integers(1, 4))):
        steps = range(draw(st.integers(1, 10)))
        if packed:
            per = draw(st.integers(1, 3))
            world = draw(st.sampled_from([1, 2, 4]))
            batch = PARTITIONS * per // world
            takes = [dict.fromkeys(PACKED, per) for _ in steps]
        else:
            world, batch = draw(st.integers(1, 3)), draw(st.integers(1, 6))
            webs = [draw(st.integers(0, world * batch)) for _ in steps]
            takes = [{"web": w, "code": world * batch - w} for w in webs]
        saves = frozenset(draw(st.sets(st.integers(0, len(takes) - 1))))
        out.append(Attempt(world, batch, takes, saves, crash=draw(st.booleans()) and a < 3))
    return [*out[:-1], replace(out[-1], crash=False)]


@pytest.mark.parametrize("packed", [False, True], ids=["mixture", "packing"])
@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_each_source_epoch_and_each_partition_is_proven(
    tmp_path_factory: pytest.TempPathFactory, packed: bool, data: st.DataObject
) -> None:
    sizes = PACKED if packed else SIZES
    root = tmp_path_factory.mktemp("packing" if packed else "mixture")
    streams = simulate(root, sizes, data.draw(attempts(packed)))
    head = head_of(root)
    report = audit_root(root, head)
    assert_each_epoch_once(report, streams)
    assert sum(link.steps for link in report.chain) == head[0], "a step of several runs: one"


def _mixture_run(root: Path) -> tuple[int, str]:
    """A mixture run of two attempts: 2 ranks x 4 rows, a crash, then 1 rank x 6 rows.

    Returns the head checkpoint (step, attempt).
    """
    world2 = [{"web": 5, "code": 3}, {"web": 6, "code": 2}, {"web": 4, "code": 4}] * 3
    world1 = [{"web": 4, "code": 2}, {"web": 6, "code": 0}, {"web": 1, "code": 5}] * 3
    simulate(
        root,
        SIZES,
        [
            Attempt(2, 4, world2, frozenset({3}), crash=True),
            Attempt(1, 6, world1, frozenset(), False),
        ],
    )
    return head_of(root)


def test_an_exact_mixture_run_crossing_epochs(tmp_path: Path) -> None:
    head = _mixture_run(tmp_path)
    report = audit_root(tmp_path, head)
    # attempt 1 saved after step 4: web 5+6+4+5 = 20, code 3+2+4+3 = 12 (epoch 1 of code
    # begun within step 4); attempt 2: web 33, code 21 more
    assert report.ok and report.verdict == "exactly once"
    web = [(e.epoch, e.trained, e.complete) for e in report.epochs if e.stream == "web"]
    code = [(e.epoch, e.trained, e.complete) for e in report.epochs if e.stream == "code"]
    assert web == [(0, 23, True), (1, 23, True), (2, 7, False)]
    assert code == [(0, 10, True), (1, 10, True), (2, 10, True), (3, 3, False)]
    assert [link.steps for link in report.chain] == [4, 9], "one count per step, not per run"
    assert [link.discarded for link in report.chain] == [5, 0]
    replayed = {e.stream: e.replayed for e in report.epochs if e.replayed}
    assert set(replayed) == {"web", "code"}, "the dead attempt's steps 5-9 were delivered again"


def test_a_doubled_run_and_a_missing_run_are_named_with_their_stream(tmp_path: Path) -> None:
    ledger = open_ledger(tmp_path)
    streams, t = Streams(SIZES), Topology(1, 0, 0, 8)
    for _ in range(4):  # web [0, 20) of epoch 0; code all of epoch 0 and [0, 2) of epoch 1
        ledger.step(streams.runs({"web": 5, "code": 3}, t))
    # a faulty loader: web delivers its last 5 rows again, code skips 2 rows
    again = DeliveredRun(0, 15, 20, 23, t, 1, "web")
    skipped = DeliveredRun(1, 4, 7, 10, t, 1, "code")
    ledger.step([again, skipped])
    ledger.saved(5, ledger.mark(0, 40, 1), 0, 40)
    ledger.close()
    report = audit_root(tmp_path, (5, ledger.attempt))
    assert report.verdict == "NOT exactly once"
    bad = {(e.stream, e.epoch): (e.missing, e.doubled) for e in report.epochs if not e.ok}
    assert bad == {
        ("web", 0): ((), (Span(0, 15, 20),)),
        ("code", 1): ((Span(1, 2, 4),), ()),
    }


def _mixture_checkpoint(tmp_path: Path) -> tuple[str, str]:
    """A real mixture's checkpoint of step 18 saved without a ledger: (root, its attempt)."""
    lakes = tmp_path / "lakes"
    for name, rows in SIZES.items():
        (lakes / name).mkdir(parents=True)
        pq.write_table(pa.table({"id": list(range(rows))}), lakes / name / "part-0.parquet")
    sources = {n: ll.LakeDataset(lakes / n, seed=1, num_partitions=2, window=8) for n in SIZES}
    loader = ll.DataLoader(ll.Mixture(sources, {"web": 0.6, "code": 0.4}, seed=3), batch_size=4)
    next(iter(loader))
    root = str(tmp_path / "ckpt")
    with ll.CheckpointManager(root, ledger=False) as manager:
        manager.save(18, loader)
        return root, manager.ledger.attempt


def test_audit_command_names_the_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, attempt = _mixture_checkpoint(tmp_path)
    assert cli(["audit", root]) == 2
    err = capsys.readouterr().err
    assert "over the sources 'code', 'web'" in err and "a mixture or a packed" not in err
    # the ledger of a run whose head is that checkpoint (the attempt that saved it)
    ledger = open_ledger(Path(root), attempt)
    streams, t = Streams(SIZES), Topology(2, 0, 0, 4)
    for k in range(18):
        ledger.step(streams.runs({"web": 5 + k % 2, "code": 3 - k % 2}, t))
    ledger.saved(18, ledger.mark(0, 144, 2), 0, 144)
    ledger.close()
    assert cli(["audit", root, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["verdict"] == "exactly once"
    assert {(e["stream"], e["epoch"]) for e in info["epochs"] if e["complete"]} >= {
        ("web", 0),
        ("code", 0),
    }
    assert cli(["audit", root]) == 0
    text = capsys.readouterr().out
    assert "stream" in text.splitlines()[3] and "every row exactly once" in text
    # a step of code delivered twice: named with its stream, and not located in a lake
    segment = Path(root) / LEDGER_DIR / attempt / "999999999999-doubled.jsonl"
    twice = StepEntry(attempt, 19, 2, 0, 3, 10, 2, 4, stream="code")
    moved = SaveEntry(attempt, 18, 19, 0, 144, streams={"web": (4, 7), "code": (4, 5)})
    segment.write_text(dump_entry(twice) + "\n" + dump_entry(moved) + "\n")
    assert cli(["audit", root]) == 1
    text = capsys.readouterr().out
    assert "ERROR stream code, epoch 2: positions [0, 3) trained on twice" in text


def test_a_journal_delivered_before_the_ledger_counts_each_step_once(tmp_path: Path) -> None:
    journal, streams, t = DeliveryJournal(), Streams(SIZES), Topology(1, 0, 0, 6)
    for k in range(10):  # web crosses its epoch at step 6, code at steps 4 and 8
        journal.record_step(streams.runs({"web": 4, "code": 2 + k % 2}, t))
    deliveries = journal.take_steps()
    assert len(deliveries) < 10, "consecutive steps merge stream by stream"
    ledger = open_ledger(tmp_path)
    for runs in deliveries:  # what the tracker's attach hands the ledger
        ledger.step(runs)
    ledger.saved(10, ledger.mark(0, 60, 1), 0, 60)
    ledger.close()
    report = audit_root(tmp_path, (10, ledger.attempt))
    assert_each_epoch_once(report, streams)
    assert [link.steps for link in report.chain] == [10]


def test_a_stream_a_start_entry_does_not_name(tmp_path: Path) -> None:
    # attempt a: only web moves in its first step (code's empty run is left out of the
    # ledger but named in the start entry); code begins at step 2
    ledger = open_ledger(tmp_path)
    streams, t = Streams(SIZES), Topology(1, 0, 0, 4)
    ledger.step([DeliveredRun(0, 0, 4, 23, t, 1, "web")])  # a loader that names only web
    streams.counts["web"] = 4
    ledger.step(streams.runs({"web": 2, "code": 2}, t))
    ledger.saved(2, ledger.mark(0, 8, 1), 0, 8)
    ledger.close()
    report = audit_root(tmp_path, (2, ledger.attempt))
    assert report.verdict == "exactly once", "code's first step begins at its start"
    # a ledger attached late: code's first recorded step begins past its start
    late = tmp_path / "late"
    ledger = open_ledger(late)
    ledger.step([DeliveredRun(0, 0, 4, 23, t, 1, "web")])
    ledger.step([DeliveredRun(0, 4, 6, 23, t, 1, "web"), DeliveredRun(0, 3, 5, 10, t, 1, "code")])
    ledger.saved(2, ledger.mark(0, 8, 1), 0, 8)
    ledger.close()
    report = audit_root(late, (2, ledger.attempt))
    assert report.verdict == "unverified" and report.ok
    assert any("stream 'code'" in u and "position 3" in u for u in report.unverified)


def test_a_save_before_any_step_of_a_resumed_mixture(tmp_path: Path) -> None:
    # attempt a saves at step 0 and at step 3; attempt b resumes and saves at once (before a
    # step, the ledger has seen no stream move: such a save names the loader's epoch and
    # position, as a single lake's), then goes on
    streams, t = Streams(SIZES), Topology(1, 0, 0, 8)
    first = open_ledger(tmp_path)
    first.saved(0, first.mark(0, 0, 1), 0, 0)
    for _ in range(3):
        first.step(streams.runs({"web": 5, "code": 3}, t))
    first.saved(3, first.mark(0, 24, 1), 0, 24)
    first.close()
    second = open_ledger(tmp_path)
    second.resumed(3, first.attempt)
    second.saved(3, second.mark(0, 24, 1), 0, 24)
    for _ in range(4):
        second.step(streams.runs({"web": 5, "code": 3}, t))
    second.saved(7, second.mark(0, 56, 1), 0, 56)
    second.close()
    report = audit_root(tmp_path, (7, second.attempt))
    assert_each_epoch_once(report, streams)
    assert "" not in {e.stream for e in report.epochs}
    # its first save as the head: it names no stream, and no single lake's stream is made up
    report = audit_root(tmp_path, (3, second.attempt))
    assert report.verdict == "exactly once", report.problems
    assert {(e.stream, e.trained) for e in report.epochs} == {("web", 15), ("code", 9)}


# ------------------------------------------------------------- old single-lake ledgers
#: A single lake's ledger as lakeloader wrote it before streams (version 1 lines): attempt a
#: delivers 5 steps of 8 rows of a 36-row epoch (a journal run of 2 steps first), saves at
#: step 3 and dies; attempt b resumes on 2 ranks of 3 rows and saves at step 7.
OLD_LEDGER = [
    '{"v": 1, "type": "start", "attempt": "a", "time": 1.0, "world_size": 1, "restart": 0, '
    '"resumed_step": -1, "resumed_attempt": "", "epoch": 0, "position": 0, "seq": 0, '
    '"index": 0}',
    '{"v": 1, "type": "step", "attempt": "a", "seq": 1, "epoch": 0, "start": 0, "stop": 16, '
    '"num_rows": 36, "world_size": 1, "batch_size": 8, "committed": true, "steps": 2}',
    '{"v": 1, "type": "step", "attempt": "a", "seq": 2, "epoch": 0, "start": 16, "stop": 24, '
    '"num_rows": 36, "world_size": 1, "batch_size": 8, "committed": true}',
    '{"v": 1, "type": "save", "attempt": "a", "step": 3, "seq": 2, "epoch": 0, '
    '"position": 24, "start": 0}',
    '{"v": 1, "type": "step", "attempt": "a", "seq": 3, "epoch": 0, "start": 24, "stop": 32, '
    '"num_rows": 36, "world_size": 1, "batch_size": 8, "committed": true}',
    '{"v": 1, "type": "start", "attempt": "b", "time": 2.0, "world_size": 2, "restart": 1, '
    '"resumed_step": 3, "resumed_attempt": "a", "epoch": 0, "position": 24, "seq": 0, '
    '"index": 0}',
    '{"v": 1, "type": "step", "attempt": "b", "seq": 1, "epoch": 0, "start": 24, "stop": 30, '
    '"num_rows": 36, "world_size": 2, "batch_size": 3, "committed": true}',
    '{"v": 1, "type": "step", "attempt": "b", "seq": 2, "epoch": 0, "start": 30, "stop": 36, '
    '"num_rows": 36, "world_size": 2, "batch_size": 3, "committed": true}',
    '{"v": 1, "type": "step", "attempt": "b", "seq": 3, "epoch": 1, "start": 0, "stop": 6, '
    '"num_rows": 36, "world_size": 2, "batch_size": 3, "committed": true}',
    '{"v": 1, "type": "step", "attempt": "b", "seq": 4, "epoch": 1, "start": 6, "stop": 12, '
    '"num_rows": 36, "world_size": 2, "batch_size": 3, "committed": false}',
    '{"v": 1, "type": "save", "attempt": "b", "step": 7, "seq": 4, "epoch": 1, '
    '"position": 6, "start": 0}',
]


def test_an_old_single_lake_ledger_audits_as_before(tmp_path: Path) -> None:
    entries = [parse_entry(line, "old.jsonl") for line in OLD_LEDGER]
    assert [dump_entry(e) for e in entries] == OLD_LEDGER, "a lake's entries are written as v1"
    assert all(getattr(e, "stream", "") == "" for e in entries)
    report = audit(entries, 7, "b")
    assert (report.ok, report.verdict, report.problems, report.unverified) == (
        True,
        "exactly once",
        (),
        (),
    )
    assert [(c.attempt, c.steps, c.discarded, c.world_sizes) for c in report.chain] == [
        ("a", 3, 1, (1,)),
        ("b", 3, 1, (2,)),
    ]
    assert [
        (e.stream, e.epoch, e.trained, e.complete, e.replayed, e.uncommitted, e.topologies)
        for e in report.epochs
    ] == [
        ("", 0, 36, True, (Span(0, 24, 32),), (), ((1, 8), (2, 3))),
        ("", 1, 6, False, (), (Span(1, 6, 12),), ((2, 3),)),
    ]
    # the same ledger whose head claims a position the steps do not reach: as before
    moved = [*entries[:-1], SaveEntry("b", 7, 4, 1, 9)]
    bad = audit(moved, 7, "b")
    assert bad.epochs[1].missing == (Span(1, 6, 9),) and bad.epochs[1].stream == ""


def test_a_ledger_of_a_later_version_is_refused() -> None:
    line = OLD_LEDGER[1].replace('"v": 1', '"v": 4')
    with pytest.raises(CheckpointError, match="version 4; this lakeloader reads versions 1 to 3"):
        parse_entry(line, "new.jsonl")
