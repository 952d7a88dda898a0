"""Issue 32, item 1: ``loader.skip(steps=N)`` and ``loader.quarantine_step(step)``.

Every kind of source the loader reads (a lake, a mixture, a packed lake, a packed mixture),
with a unique id per row (per token, packed): a skip leaves out exactly the next ``N`` steps
of the uninterrupted run, on every rank, also when the state is taken before they are skipped
and resumed under another world size; a quarantined step's units give no row (no token) again,
in this epoch or a later one, and every other row still comes once an epoch; the audit reports
the skipped steps as skipped on request, and ``lakeloader inspect`` shows both.
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main as cli

ROWS_PER_GROUP = 10
KINDS = ("lake", "mixture", "packed", "packed-mixture")


def write_lake(root: Path, first: int, files: int = 3, groups: int = 4) -> None:
    root.mkdir(parents=True)
    for f in range(files):
        with pq.ParquetWriter(root / f"part-{f}.parquet", _schema()) as writer:
            for _ in range(groups):
                ids = np.arange(first, first + ROWS_PER_GROUP)
                writer.write_table(pa.table({"id": ids, "tok": [tokens(i) for i in ids]}))
                first += ROWS_PER_GROUP


def _schema() -> pa.Schema:
    return pa.schema([("id", pa.int64()), ("tok", pa.list_(pa.int64()))])


def tokens(i: int) -> list[int]:
    """Row ``i``'s tokens: 1 to 5 ids of its own (never 0, the padding)."""
    return [i * 8 + j + 1 for j in range(1 + i % 5)]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("requests")
    write_lake(root / "a", 0)
    write_lake(root / "b", 1000, files=2)
    return {"a": root / "a", "b": root / "b"}


def dataset(kind: str, lakes: dict[str, Path]) -> Any:
    packing = ll.Packing("tok", seq_len=8) if kind.startswith("packed") else None
    a = ll.LakeDataset(
        str(lakes["a"]), max_unit_rows=ROWS_PER_GROUP, packing=packing if kind == "packed" else None
    )
    if kind in ("lake", "packed"):
        return a
    b = ll.LakeDataset(str(lakes["b"]), max_unit_rows=ROWS_PER_GROUP)
    return ll.Mixture({"a": a, "b": b}, weights={"a": 2, "b": 1}, packing=packing)


def key(kind: str, batch: dict[str, Any]) -> list[int]:
    """What a batch holds: its ids, or its tokens (padding left out) for a packed stream."""
    if kind.startswith("packed"):
        flat = batch["input_ids"].reshape(-1)
        return flat[~batch["pad_mask"].reshape(-1)].tolist()
    return batch["id"].tolist()


def steps(kind: str, loader: ll.DataLoader, n: int, it: Iterator[Any] | None = None) -> list:
    """The next ``n`` batches' keys (a lake's pass may end first)."""
    it = iter(loader) if it is None else it
    out = []
    for _ in range(n):
        try:
            out.append(key(kind, next(it)))
        except StopIteration:
            break
    return out


def lockstep(kind: str, loaders: list[ll.DataLoader], n: int) -> list[list[int]]:
    """``n`` global steps of ranks in lockstep: each step's keys, all ranks', sorted."""
    its = [iter(loader) for loader in loaders]
    out = []
    for _ in range(n):
        out.append(
            sorted(
                x
                for it, loader in zip(its, loaders, strict=True)
                for x in steps(kind, loader, 1, it)[0]
            )
        )
    return out


def make(
    kind: str, lakes: dict[str, Path], batch: int, world: int = 1, rank: int = 0
) -> ll.DataLoader:
    return ll.DataLoader(dataset(kind, lakes), batch_size=batch, rank=rank, world_size=world)


@pytest.mark.parametrize("kind", KINDS)
def test_skip_leaves_out_exactly_the_next_steps(kind: str, lakes: dict[str, Path]) -> None:
    with make(kind, lakes, 6) as ref:
        expected = steps(kind, ref, 9)
    with make(kind, lakes, 6) as loader:
        it = iter(loader)
        got = steps(kind, loader, 3, it)
        loader.skip(steps=2)
        got += steps(kind, loader, 4, it)
        state = loader.state_dict()
    assert got == expected[:3] + expected[5:9]
    assert json.loads(state["requests"]) == {
        "delivered": 7,
        "pending": 0,
        "skips": [[3, 2]],
        "bad_steps": [],
    }


@pytest.mark.parametrize("kind", KINDS)
def test_a_skip_saved_before_it_is_done_is_done_after_a_resume_on_other_ranks(
    kind: str, lakes: dict[str, Path]
) -> None:
    """Two ranks of 6 ask to skip 3 steps; rank 0's state resumes three ranks of 4."""
    with make(kind, lakes, 12) as ref:
        expected = [sorted(s) for s in steps(kind, ref, 10)]
    two = [make(kind, lakes, 6, 2, r) for r in range(2)]
    got = lockstep(kind, two, 2)
    for loader in two:
        loader.skip(steps=3)
    state = two[0].state_dict()
    without_rank = [{k: v for k, v in t.state_dict().items() if k != "topology"} for t in two]
    assert without_rank[0] == without_rank[1], "the same on every rank"
    assert json.loads(state["requests"])["pending"] == 3
    for loader in two:
        loader.close()
    three = [make(kind, lakes, 4, 3, r) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    got += lockstep(kind, three, 5)
    for loader in three:
        loader.close()
    assert got == expected[:2] + expected[5:10]
    flat = [x for s in got for x in s]
    if not kind.startswith("packed"):  # the packed streams cross into their next epochs
        assert len(flat) == len(set(flat)), "no row twice"


def test_a_skip_past_the_end_of_a_pass_goes_on_in_the_next(lakes: dict[str, Path]) -> None:
    """120 rows at 25 a step: 5 steps an epoch; skipping 3 from step 3 ends epoch 0."""
    with make("lake", lakes, 25) as ref:
        epoch0, epoch1 = [key("lake", b) for b in ref], [key("lake", b) for b in ref]
    with make("lake", lakes, 25) as loader:
        it = iter(loader)
        got0 = steps("lake", loader, 3, it)
        loader.skip(steps=3)
        got0 += [key("lake", b) for b in it]
        got1 = [key("lake", b) for b in loader]
    assert got0 == epoch0[:3]
    assert got1 == epoch1[1:], "the third step skipped is epoch 1's first"


@pytest.mark.parametrize("kind", KINDS)
def test_a_quarantined_step_gives_none_of_its_units_again(
    kind: str, lakes: dict[str, Path]
) -> None:
    ids_of = unit_ids(lakes)
    with make(kind, lakes, 6) as loader:
        it = iter(loader)
        before = steps(kind, loader, 4, it)
        entries = loader.quarantine_step(3)
        with pytest.raises(ValueError, match=r"quarantine_step\(-1\).*last 64 steps"):
            loader.quarantine_step(-1)
        after = steps(kind, loader, 40, it)
        state, quarantine = loader.state_dict(), loader.quarantine
    assert entries and all(e.reason == "quarantine_step(3)" for e in entries)
    gone = {
        x
        for e in entries
        for x in ids_of[(Path(e.path).parent.name, Path(e.path).name, e.row_group)]
    }
    step3 = set(before[3]) if not kind.startswith("packed") else {t // 8 for t in before[3]}
    assert step3 <= gone, "the units behind the step, every rank's share"
    later = [x if not kind.startswith("packed") else x // 8 for s in after for x in s]
    assert not gone & set(later), "no row of a quarantined unit comes again"
    assert {(q.path, q.row_group) for q in quarantine} == {(e.path, e.row_group) for e in entries}
    # a loader resumed from the state (another world size) knows them too
    with make(kind, lakes, 3, 2, 1) as resumed:
        resumed.load_state_dict(state)
        again = [
            x if not kind.startswith("packed") else x // 8
            for s in steps(kind, resumed, 40)
            for x in s
        ]
    assert again and not gone & set(again)


def test_quarantine_step_in_a_lake_every_other_row_once_an_epoch(lakes: dict[str, Path]) -> None:
    ids_of = unit_ids(lakes)
    with make("lake", lakes, 8) as loader:
        it = iter(loader)
        epoch0 = steps("lake", loader, 5, it)
        entries = loader.quarantine_step(4)
        epoch0 += [key("lake", b) for b in it]
        epoch1 = [key("lake", b) for b in loader]
    gone = {x for e in entries for x in ids_of[("a", Path(e.path).name, e.row_group)]}
    every = set(range(120))
    rows0 = Counter(x for s in epoch0 for x in s)
    assert max(rows0.values()) == 1
    assert set(rows0) | gone == every, "epoch 0: every row but the quarantined units' rest"
    assert set(rows0) >= set(epoch0[4]), "the step itself was delivered"
    rows1 = Counter(x for s in epoch1 for x in s)
    assert max(rows1.values()) == 1 and set(rows1) == every - gone


def unit_ids(lakes: dict[str, Path]) -> dict[tuple[str, str, int], set[int]]:
    """Each row group's ids, by (lake, file name, row group)."""
    out = {}
    for name, root in lakes.items():
        for path in sorted(root.glob("*.parquet")):
            f = pq.ParquetFile(path)
            for g in range(f.num_row_groups):
                out[name, path.name, g] = set(f.read_row_group(g, ["id"])["id"].to_pylist())
    return out


@pytest.mark.parametrize("kind", ["lake", "mixture"])
def test_the_audit_reports_skipped_steps_and_inspect_shows_the_requests(
    kind: str, lakes: dict[str, Path], tmp_path: Path
) -> None:
    root = str(tmp_path / "ckpt")
    with make(kind, lakes, 6) as loader, ll.CheckpointManager(root) as manager:
        manager.attach(loader)
        it = iter(loader)
        steps(kind, loader, 3, it)
        loader.skip(steps=2)
        loader.quarantine_step(2)
        steps(kind, loader, 3, it)
        manager.save(6, loader)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["audit", root, "--json"]) == 0
    info = json.loads(out.getvalue())
    assert info["verdict"] == "exactly once"
    skipped = sum(b - a for e in info["epochs"] for a, b in e["skipped"])
    assert skipped == 2 * 6, "two steps of 6 rows, skipped on request, not missing"
    assert info["steps_skipped"] == {"done": 2, "pending": 0}
    assert info["quarantined_steps"] and all(
        q["reason"] == "quarantine_step(2)" for q in info["quarantined_steps"]
    )
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["audit", root]) == 0
    assert "skipped on request" in out.getvalue()
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["inspect", root]) == 0
    text = out.getvalue()
    assert "steps delivered" in text and "steps skipped on request" in text
    assert "quarantine_step(2)" in text


def test_skip_refuses_what_is_not_a_count(lakes: dict[str, Path]) -> None:
    with make("lake", lakes, 4) as loader:
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(
                ValueError, match=r"skip\(steps=\.\.\.\) takes a number of steps >= 0"
            ):
                loader.skip(steps=bad)  # type: ignore[arg-type]


def test_a_state_written_before_requests_loads_as_nothing_asked(lakes: dict[str, Path]) -> None:
    with make("lake", lakes, 4) as loader:
        steps("lake", loader, 2)
        state = loader.state_dict()
    del state["requests"]
    with make("lake", lakes, 4) as resumed:
        resumed.load_state_dict(state)
        assert json.loads(resumed.state_dict()["requests"])["delivered"] == 0


CHILD = """
import json, os, signal, sys
import lakeloader as ll
lake, ckpt = sys.argv[1], sys.argv[2]
loader = ll.DataLoader(ll.LakeDataset(lake, max_unit_rows=10), batch_size=6)
manager = ll.CheckpointManager(ckpt)
it = iter(loader)
got = [sorted(next(it)["id"].tolist()) for _ in range(3)]
loader.quarantine_step(2)
loader.skip(steps=2)
manager.save(3, loader)
manager.wait()
print(json.dumps(got), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_requests_survive_a_sigkill_and_a_resume_on_two_ranks(
    lakes: dict[str, Path], tmp_path: Path
) -> None:
    """A process asks both, saves, is SIGKILLed; two ranks resume from its checkpoint."""
    ckpt = tmp_path / "ckpt"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(lakes["a"]), str(ckpt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    before = json.loads(child.stdout)
    with make("lake", lakes, 6) as ref:
        it = iter(ref)
        expected = [sorted(key("lake", next(it))) for _ in range(3)]
        ref.quarantine_step(2)
        ref.skip(steps=2)
        expected += [sorted(key("lake", b)) for b in it]
    ranks = [make("lake", lakes, 3, 2, r) for r in range(2)]
    for loader in ranks:
        ll.CheckpointManager(str(ckpt)).load(loader)
    after = [
        sorted(a + b) for a, b in zip(*([key("lake", x) for x in r] for r in ranks), strict=True)
    ]
    for loader in ranks:
        loader.close()
    assert before == expected[:3]
    assert after == expected[3:], "the skip and the quarantine carried through the kill"
    assert json.loads(ranks[0].state_dict()["requests"])["skips"] == [[3, 2]]


@pytest.mark.parametrize("kind", KINDS)
def test_requests_with_worker_processes(kind: str, lakes: dict[str, Path]) -> None:
    """With 2 workers: the same steps skipped, and a quarantined step's units gone."""
    with make(kind, lakes, 6) as ref:
        expected = steps(kind, ref, 8)
    ds = dataset(kind, lakes)
    with ll.DataLoader(ds, batch_size=6, num_workers=2) as loader:
        it = iter(loader)
        got = steps(kind, loader, 2, it)
        loader.skip(steps=3)
        got += steps(kind, loader, 3, it)
        entries = loader.quarantine_step(4)
        after = steps(kind, loader, 20, it)
    assert got == expected[:2] + expected[5:8]
    gone = {(Path(e.path).parent.name, Path(e.path).name, e.row_group) for e in entries}
    ids_of = unit_ids(lakes)
    bad = {i for g in gone for i in ids_of[g]}
    rows = [x if not kind.startswith("packed") else x // 8 for s in after for x in s]
    assert entries and rows and not bad & set(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_quarantined_after_restoring_from_before_it_is_dropped_when_it_comes(
    kind: str, lakes: dict[str, Path]
) -> None:
    """The loss spiked at step 6; the run restores a state of step 3 on two ranks."""
    with make(kind, lakes, 6) as first:
        it = iter(first)
        original = steps(kind, first, 3, it)
        state = first.state_dict()
        original += steps(kind, first, 5, it)
        behind = first.quarantine_step(6)  # what the units behind step 6 are
    ranks = [make(kind, lakes, 3, 2, r) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
        assert loader.quarantine_step(6) == [], "its units are known when it comes"
    assert json.loads(ranks[0].state_dict()["requests"])["bad_steps"] == [[6, 6]]
    again = lockstep(kind, ranks, 12)
    after = json.loads(ranks[0].state_dict()["requests"])
    quarantine = ranks[0].quarantine
    for loader in ranks:
        loader.close()
    assert again[:3] == [sorted(s) for s in original[3:6]], "steps 3 to 5 come again the same"
    gone = {(e.path, e.row_group) for e in behind}
    assert {(q.path, q.row_group) for q in quarantine} == gone
    ids_of = unit_ids(lakes)
    bad = {
        i for e in behind for i in ids_of[Path(e.path).parent.name, Path(e.path).name, e.row_group]
    }
    rows = [x if not kind.startswith("packed") else x // 8 for s in again[3:] for x in s]
    assert rows and not bad & set(rows), "step 6 and the rest of its units never come"
    assert after["bad_steps"] == [] and after["delivered"] == 3 + 12


def test_a_state_fetched_ahead_of_a_skip_gives_those_batches_then_skips(
    lakes: dict[str, Path],
) -> None:
    """Lightning's order: batch 2 was fetched ahead when the loop asked to skip 2 steps."""
    with make("lake", lakes, 6) as ref:
        expected = steps("lake", ref, 8)
    with make("lake", lakes, 6) as loader:
        it = iter(loader)
        got = steps("lake", loader, 3, it)  # steps 0 and 1 trained, 2 fetched ahead
        loader.skip(steps=2)
        state = loader.state_dict(fetched_ahead=1)
        got += steps("lake", loader, 3, it)
        loader.state_dict(fetched_ahead=3)  # stands right after the skipped steps: fine
        with pytest.raises(ValueError, match=r"fetched_ahead=4\): steps were skipped"):
            loader.state_dict(fetched_ahead=4)  # would stand back over them
    assert got == expected[:3] + expected[5:8]
    with make("lake", lakes, 6) as resumed:
        resumed.load_state_dict(state)
        assert steps("lake", resumed, 4) == expected[2:3] + expected[5:8]


def test_two_bad_steps_named_after_a_restore_are_both_dropped(lakes: dict[str, Path]) -> None:
    with make("lake", lakes, 6) as first:
        it = iter(first)
        steps("lake", first, 3, it)
        state = first.state_dict()
        original = steps("lake", first, 6, it)  # steps 3 to 8
    ids_of = unit_ids(lakes)
    with make("lake", lakes, 6) as resumed:
        with pytest.raises(ValueError, match=r"quarantine_step\(5\).*those to come once"):
            resumed.quarantine_step(5)  # not restored: a step to come is refused
        resumed.load_state_dict(state)
        resumed.quarantine_step(6)
        resumed.quarantine_step(7)
        again = steps("lake", resumed, 6)
        quarantine = resumed.quarantine
    assert again[:3] == original[:3]
    units = {("a", Path(q.path).name, q.row_group) for q in quarantine}
    assert {q.reason for q in quarantine} == {"quarantine_step(6)", "quarantine_step(7)"}
    bad = {i for u in units for i in ids_of[u]}
    assert set(original[3]) | set(original[4]) <= bad, "the units behind both bad steps"
    assert not bad & {x for s in again[3:] for x in s}
