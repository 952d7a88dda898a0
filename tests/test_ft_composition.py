"""FaultTolerantLoader over every source a DataLoader takes, on a scripted in-process quorum.

Two replica groups (``a``, ``b``) take steps as a schedule says: both in lockstep, one alone
(fewer participants), a step that does not commit (its rows must come again, re-sliced), and
a group that comes back healing from its peer's state (torchft's heal: a group whose count of
committed steps is behind takes the state of one that is not). What the committed steps held
is checked against an uninterrupted one-rank DataLoader: each committed step holds exactly the
next slots of its order (a lake, a followed lake, a mixture), or each partition's samples
continue it (a packed stream). ``skip`` and ``quarantine_step`` go into the committed state: a
step rolled back and a re-slice carry them out alike. The real torchft run is tests/test_ft.py.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.cli.audit import run_audit
from lakeloader.cli.main import main as cli
from lakeloader.errors import StateMismatchError
from tests.composition_cases import (
    FOLLOW,
    PACKING,
    SEED,
    WINDOW,
    C,
    Lake,
    Lighthouse,
    ScriptedQuorum,
    append,
    build_lake,
    copy_lake,
)

B = 4  # rows (samples) per group per step
#: Who takes part in each step and whether it commits: both, ``a`` alone (fewer
#: participants), a step of ``a`` that does not commit, then both, ``b`` healing from ``a``.
SCHEDULE = (("ab", True), ("ab", True), ("a", True), ("a", False))
Schedule = Sequence[tuple[str, bool]]
Step = tuple[list[Any], int]  # a committed step: the shares in rank order, its global rows


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Lake]:
    root = tmp_path_factory.mktemp("ft-lakes")
    return {n: build_lake(root / n, n, "folder", False) for n in ("main", "code")}


def lake_dataset(lake: Lake, **kwargs: Any) -> ll.LakeDataset:
    return ll.LakeDataset(lake.uri, seed=SEED, num_partitions=C, window=WINDOW, **kwargs)


def mixture(lakes: dict[str, Lake]) -> ll.Mixture:
    sources = {n: lake_dataset(lake, columns=["id"]) for n, lake in lakes.items()}
    return ll.Mixture(sources, {"main": 2.0, "code": 1.0}, seed=SEED, epoch_rows=60)


class Quorum(ScriptedQuorum):
    """A scripted quorum that counts the quorums started."""

    started = 0

    def start_quorum(self) -> None:
        self.started += 1
        super().start_quorum()


class Groups:
    """Replica groups on one scripted lighthouse; steps taken as a schedule says."""

    def __init__(self, make: Callable[[ScriptedQuorum], ll.FaultTolerantLoader]) -> None:
        self.light = Lighthouse()
        self.quorums = {n: Quorum(self.light) for n in "ab"}
        self.loaders = {n: make(q) for n, q in self.quorums.items()}
        self.committed: list[Step] = []
        self.steps = 0
        self.taken: Counter[str] = Counter()  # shares handed to each group

    def step(self, who: str, commit: bool) -> bool:
        """One step; False once every group's pass is over.

        A group alone while the other is ahead would fork the run (torchft would go on from
        its older state, the other's committed steps lost with it): both take part then.
        """
        if max(self.quorums[n].step for n in who) < max(q.step for q in self.quorums.values()):
            who = "ab"
        # torchft heals a group that is behind from one that is not; the first member is
        # rank 0 and the healing peer, so the rank order changes as groups come and go
        members = sorted(who, key=lambda n: (-self.quorums[n].step, n))
        top = self.quorums[members[0]].step
        self.light.members = [self.quorums[n] for n in members]
        self.light.healing = {id(self.quorums[n]) for n in members if self.quorums[n].step < top}
        shares = [next(self.loaders[n], None) for n in members]
        if all(s is None for s in shares):
            return False
        assert None not in shares, f"step {self.steps}: the groups disagree on the pass's end"
        self.taken.update(members)
        rows = {self.loaders[n].step_rows for n in members}
        assert len(rows) == 1, f"step {self.steps}: the groups disagree on its rows {rows}"
        if commit:
            self.committed.append((shares, rows.pop()))
            for n in members:
                self.quorums[n].step += 1
        self.steps += 1
        return True

    def run(self, schedule: Schedule, max_steps: int = 200) -> None:
        """The schedule, then both groups until the end (or ``max_steps``)."""
        for who, commit in schedule:
            if not self.step(who, commit):
                return
        while self.steps < max_steps and self.step("ab", True):
            pass

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()


def drive(ds: Any, schedule: Schedule = SCHEDULE, *, max_steps: int = 200, **kwargs: Any) -> Groups:
    groups = Groups(lambda q: ll.FaultTolerantLoader(ds, q, B, **kwargs))
    try:
        groups.run(schedule, max_steps)
    finally:
        groups.close()
    return groups


def slots(ds: Any, passes: int = 1, **kwargs: Any) -> list[int]:
    """Row id of each slot of an uninterrupted one-rank run of ``passes`` passes."""
    out: list[int] = []
    with ll.DataLoader(ds, batch_size=1, **kwargs) as loader:
        for epoch in range(passes):
            loader.set_epoch(epoch)
            out += [int(b["id"][0]) for b in loader]
    return out


def check_slots(committed: Sequence[Step], ref: Sequence[int]) -> int:
    """Each committed step holds exactly the next slots of ``ref``; returns the slots used."""
    g = 0
    for n, (shares, rows) in enumerate(committed):
        ids = sorted(i for share in shares for i in share["id"].tolist())
        assert ids == sorted(ref[g : g + rows]), f"committed step {n}, slots [{g}, {g + rows})"
        g += rows
    return g


@pytest.mark.parametrize("drop_last", [False, True])
def test_lake_every_committed_row_once(lakes: dict[str, Lake], drop_last: bool) -> None:
    ds = lake_dataset(lakes["main"], columns=["id"])
    groups = drive(ds, drop_last=drop_last)
    ref = slots(ds)
    used = check_slots(groups.committed, ref)
    if drop_last:  # a tail too short for the last step's participants is dropped
        assert 0 <= len(ref) - used < 2 * B
    else:
        assert used == len(ref) == len(set(ref))
    assert groups.loaders["a"].epoch == 0 and groups.loaders["a"].position == used
    # the rolled back step (a alone) was handed out again, re-sliced for two
    assert [rows for _, rows in groups.committed[:4]] == [2 * B, 2 * B, B, 2 * B]


def test_a_pass_over_stays_over_until_set_epoch(lakes: dict[str, Lake]) -> None:
    ds = lake_dataset(lakes["main"], columns=["id"])
    groups = Groups(lambda q: ll.FaultTolerantLoader(ds, q, B))
    a, b = groups.quorums["a"], groups.quorums["b"]
    try:
        for who, commit in SCHEDULE:
            assert groups.step(who, commit)
        while groups.step("a", True):  # b is away while a finishes the epoch
            pass
        assert a.started == groups.taken["a"], "no quorum once the pass is over"
        assert not groups.step("b", True), "b heals from a at the epoch's end, and stops"
        assert b.started == groups.taken["b"] + 1 and b.step == a.step
        assert check_slots(groups.committed, slots(ds)) == len(ds)
        assert groups.loaders["b"].position == len(ds)
        for loader in groups.loaders.values():
            loader.set_epoch(0)  # the epoch it is in: kept as it stands
        assert not groups.step("ab", True), "the epoch stays over until set_epoch"
        for loader in groups.loaders.values():
            loader.set_epoch(1)
            assert loader.epoch == 1 and loader.position == 0
        first = len(groups.committed)
        groups.run([("b", True), ("ab", False)])  # then a heals from b
    finally:
        groups.close()
    assert check_slots(groups.committed[first:], slots(ds, 2)[len(ds) :]) == len(ds)


def test_followed_lake_with_a_file_appended_between_steps(
    lakes: dict[str, Lake], tmp_path: Path
) -> None:
    lake = copy_lake(lakes["main"], tmp_path / "followed")
    ds = lake_dataset(lake, columns=["id"], follow=FOLLOW)
    twin = lake_dataset(lake, columns=["id"], follow=FOLLOW)  # the reference's, increment 0
    groups = Groups(lambda q: ll.FaultTolerantLoader(ds, q, B))
    try:
        for who, commit in SCHEDULE[:2]:
            assert groups.step(who, commit)
        lake = append(lake, "main", "folder", 0)
        groups.run(SCHEDULE[2:])
    finally:
        groups.close()
    ref = slots(twin)
    assert len(ref) == len(lake.ids) == 91 + 12, "both increments"
    assert check_slots(groups.committed, ref) == len(ref)
    assert groups.loaders["a"].epoch == 1, "in the appended increment"


def test_mixture_committed_steps_follow_its_order(lakes: dict[str, Lake]) -> None:
    groups = drive(mixture(lakes))
    ref = slots(mixture(lakes), passes=2)
    used = check_slots(groups.committed, ref)
    assert 60 <= used < 60 + 2 * B, "one pass of epoch_rows, in full global batches"
    assert groups.loaders["b"].epoch == 0


@settings(max_examples=8, deadline=None)
@given(schedule=st.lists(st.tuples(st.sampled_from(["a", "b", "ab"]), st.booleans()), max_size=25))
def test_any_schedule_leaves_every_row_once(lakes: dict[str, Lake], schedule: Schedule) -> None:
    ds = lake_dataset(lakes["code"], columns=["id"])
    groups = drive(ds, schedule)
    assert check_slots(groups.committed, slots(ds)) == len(ds)


# ------------------------------------------------------------------ packed streams


def step_samples(shares: Sequence[Any]) -> list[bytes]:
    """A step's samples (tokens, positions, pad mask), each as bytes, sorted."""
    keys = ("input_ids", "position_ids", "pad_mask")
    whole = np.concatenate(
        [np.stack([np.asarray(s[k], np.int64) for k in keys], 1) for s in shares]
    )
    return sorted(sample.tobytes() for sample in whole)


def check_packed(committed: Sequence[Step], ds: ll.LakeDataset) -> None:
    """The committed steps' samples are the stream's, from the start, each once: step by step
    the next samples of the uninterrupted stream (one sample per step), whatever the number of
    groups (the global batch) of each step."""
    with ll.DataLoader(ds, batch_size=1) as loader:
        batches = iter(loader)
        for shares, _ in committed:
            got = step_samples(shares)
            assert got == sorted(b for _ in got for b in step_samples([next(batches)]))


def packed(lakes: dict[str, Lake]) -> ll.LakeDataset:
    return lake_dataset(lakes["main"], columns=["id", "tokens"], packing=PACKING)


def test_packed_stream_of_groups_that_keep_their_places(lakes: dict[str, Lake]) -> None:
    schedule = [("ab", True), ("ab", False), ("ab", True), ("ab", False)]
    groups = drive(packed(lakes), schedule, max_steps=12)
    assert len(groups.committed) == 10
    check_packed(groups.committed, packed(lakes))


def test_packed_stream_when_groups_come_and_go(lakes: dict[str, Lake]) -> None:
    groups = drive(packed(lakes), SCHEDULE, max_steps=8)
    check_packed(groups.committed, packed(lakes))


# ------------------------------------------------------------------ checkpoints


def inspected(root: str) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["inspect", root, "--json", "--no-lag"]) == 0
    info: dict[str, Any] = json.loads(out.getvalue())
    return info


def test_checkpoint_of_the_committed_state_and_its_audit(
    lakes: dict[str, Lake], tmp_path: Path
) -> None:
    ds, root = lake_dataset(lakes["main"], columns=["id"]), str(tmp_path / "ckpt")
    first = Groups(lambda q: ll.FaultTolerantLoader(ds, q, B))
    try:
        for who, commit in SCHEDULE:  # the last step, of a alone, does not commit
            assert first.step(who, commit)
        with ll.CheckpointManager(root) as ckpt:
            ckpt.save(3, first.loaders["a"])
        state = first.loaders["a"].state_dict()
    finally:
        first.close()
    assert state["position"] == 5 * B, "the committed steps only"
    saved = ll.CheckpointManager(root).read(3).state_dict
    assert (saved["epoch"], saved["position"]) == (0, 5 * B)
    info = inspected(root)
    assert (info["epoch"], info["position"], info["rows_dropped"]) == (0, 5 * B, 0)

    def resumed(q: ScriptedQuorum) -> ll.FaultTolerantLoader:
        q.step = 3
        loader = ll.FaultTolerantLoader(ds, q, B)
        ckpt.load(loader)
        return loader

    with ll.CheckpointManager(root) as ckpt:
        second = Groups(resumed)
        try:
            second.run([("ab", False), ("b", True)])
            ckpt.save(3 + len(second.committed), second.loaders["a"])
        finally:
            second.close()
    assert check_slots(first.committed + second.committed, slots(ds)) == len(ds)
    assert run_audit(root, {})[0].verdict == "exactly once"


@pytest.mark.parametrize("next_epoch", [False, True])
def test_checkpoint_resumed_on_a_lake_that_grew(
    lakes: dict[str, Lake], tmp_path: Path, next_epoch: bool
) -> None:
    """The saved epoch ends on its snapshot across re-slices; the new file joins after it."""
    lake, root = copy_lake(lakes["code"], tmp_path / "lake"), str(tmp_path / "ckpt")
    first = Groups(lambda q: ll.FaultTolerantLoader(lake_dataset(lake), q, B))
    try:
        for who, commit in SCHEDULE[:2]:
            assert first.step(who, commit)
        with ll.CheckpointManager(root) as ckpt:
            ckpt.save(2, first.loaders["a"])
    finally:
        first.close()
    grown = append(lake, "code", "folder", 0)
    ds = lake_dataset(lake)

    def resumed(q: ScriptedQuorum) -> ll.FaultTolerantLoader:
        q.step = 2
        loader = ll.FaultTolerantLoader(ds, q, B)
        with ll.CheckpointManager(root) as ckpt:
            ckpt.load(loader)
        return loader

    second = Groups(resumed)
    try:
        second.run(SCHEDULE[2:])
        pinned = first.committed + second.committed
        assert check_slots(pinned, slots(lake_dataset(lakes["code"]))) == 56
        if next_epoch:
            for loader in second.loaders.values():
                loader.set_epoch(1)
            epoch = len(second.committed)
            second.run(SCHEDULE[2:])
            grew = check_slots(second.committed[epoch:], slots(ds, 2)[len(ds) :])
            assert grew == len(grown.ids) == 56 + 12
    finally:
        second.close()


def test_checkpoint_of_a_mixture(lakes: dict[str, Lake], tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    first = Groups(lambda q: ll.FaultTolerantLoader(mixture(lakes), q, B))
    try:
        for who, commit in SCHEDULE:
            assert first.step(who, commit)
        with ll.CheckpointManager(root) as ckpt:
            ckpt.save(3, first.loaders["a"])
            loader = ll.FaultTolerantLoader(mixture(lakes), ScriptedQuorum(Lighthouse(), 3), B)
            ckpt.load(loader)
    finally:
        first.close()
    state = first.loaders["a"].state_dict()
    assert loader.state_dict()["slot"] == state["slot"] == 5 * B
    assert inspected(root)["slot"] == 5 * B
    loader.close()


# ------------------------------------------------------------------ what is refused


def test_a_group_counted_while_its_gradients_are_zeroed_is_refused(
    lakes: dict[str, Lake],
) -> None:
    class Healing(ScriptedQuorum):
        def is_participating(self) -> bool:
            return False

    light = Lighthouse()
    quorum = Healing(light)
    light.members = [quorum]
    loader = ll.FaultTolerantLoader(lake_dataset(lakes["main"]), quorum, B)
    with pytest.raises(RuntimeError, match="use_async_quorum=False"):
        next(loader)
    with pytest.raises(ValueError, match="rank comes from the manager"):
        ll.FaultTolerantLoader(lake_dataset(lakes["main"]), quorum, B, rank=0)


def test_a_peer_state_of_another_lake_is_refused_at_the_next_step(
    lakes: dict[str, Lake],
) -> None:
    light = Lighthouse()
    quorum = ScriptedQuorum(light)
    light.members = [quorum]
    other = ll.FaultTolerantLoader(lake_dataset(lakes["code"]), ScriptedQuorum(light), B)
    loader = ll.FaultTolerantLoader(lake_dataset(lakes["main"]), quorum, B)
    loader.load_state_dict(other.state_dict())
    with pytest.raises(StateMismatchError, match="Every replica group must read the same"):
        next(loader)


# ---------------------------------------------- skip and quarantine_step (issues 30, 32)


def ft_groups(ds: Any) -> Groups:
    return Groups(lambda q: ll.FaultTolerantLoader(ds, q, B))


def committed_ids(groups: Groups, since: int = 0) -> list[int]:
    """The ids of the committed steps from ``since``, step after step (each step's sorted)."""
    out: list[int] = []
    for shares, _ in groups.committed[since:]:
        out += sorted(i for share in shares for i in share["id"].tolist())
    return out


@pytest.mark.parametrize("kind", ["lake", "mixture"])
def test_skip_leaves_out_the_next_steps_through_a_rollback_and_a_re_slice(
    kind: str, lakes: dict[str, Lake]
) -> None:
    ds = lake_dataset(lakes["main"]) if kind == "lake" else mixture(lakes)
    ref = slots(ds)
    groups = ft_groups(ds)
    try:
        for who, commit in SCHEDULE:  # a re-slice, a rolled back step, a group healing
            groups.step(who, commit)
        before = sum(rows for _, rows in groups.committed)
        for loader in groups.loaders.values():
            loader.skip(2)
            assert json.loads(loader.state_dict()["requests"])["pending"] == 2
        groups.step("a", False)  # the step that skips is rolled back: skipped again
        groups.run((), max_steps=200)
    finally:
        groups.close()
    ids = committed_ids(groups)
    assert sorted(ids[:before]) == sorted(ref[:before])
    n = len(SCHEDULE) - 1  # committed steps before the request
    gap = 2 * groups.committed[n][1]  # two steps of the slice that took them (both groups)
    assert sorted(ids[before:]) == sorted(ref[before + gap :])
    assert len(ids) == len(set(ids)) == len(ref) - gap


def unit_ids(entries: list[ll.QuarantineEntry]) -> set[int]:
    """The ids of the rows the entries name."""
    out: set[int] = set()
    for e in entries:
        group = pq.ParquetFile(e.path).read_row_group(e.row_group, ["id"])["id"].to_pylist()
        out.update(group[e.row_start : e.row_start + e.num_rows])
    return out


def test_quarantine_step_of_a_committed_step_taken_on_another_slice(
    lakes: dict[str, Lake], tmp_path: Path
) -> None:
    ds = lake_dataset(lakes["main"])
    ref = slots(ds)
    groups = ft_groups(ds)
    try:
        for who, commit in SCHEDULE:  # steps 0, 1 on two groups; 2 on one; 3 rolled back
            groups.step(who, commit)
        step_1 = set(committed_ids(groups)[B * 2 : B * 4])
        found = [loader.quarantine_step(1) for loader in groups.loaders.values()]
        assert found[0] == found[1] and found[0]
        assert all(e.reason == "quarantine_step(1)" for e in found[0])
        bad = unit_ids(found[0])
        assert step_1 <= bad
        for loader in groups.loaders.values():
            assert set(map(str, found[0])) <= set(map(str, loader.tracker.quarantine))
        with pytest.raises(ValueError, match=r"quarantine_step\(99\)"):
            groups.loaders["a"].quarantine_step(99)
        for bad_step in (True, 1.0, "1"):  # True == 1: it named step 1 before
            with pytest.raises(ValueError, match="takes a step number"):
                groups.loaders["a"].quarantine_step(bad_step)  # type: ignore[arg-type]
        done = len(groups.committed)
        groups.run((("a", True), ("ab", False)), max_steps=200)
        rest = committed_ids(groups, done)
        for loader in groups.loaders.values():
            loader.set_epoch(1)
        second = len(groups.committed)
        groups.run((), max_steps=400)
        epoch_1 = committed_ids(groups, second)
    finally:
        groups.close()
    first = committed_ids(groups, 0)[: sum(r for _, r in groups.committed[:done])]
    epoch_0 = first + rest
    assert not (set(rest) & bad) and not (set(epoch_1) & bad)
    assert len(epoch_0) == len(set(epoch_0)) and set(epoch_0) == set(ref) - (bad - set(first))
    assert sorted(epoch_1) == sorted(set(ref) - bad)


def test_quarantine_of_a_step_to_come_ends_the_pass_under_way(
    lakes: dict[str, Lake], tmp_path: Path
) -> None:
    """Its pass is begun again with the step left out: the one under way lets its units go."""
    ds, cache, ckpt = lake_dataset(lakes["main"]), tmp_path / "cache", tmp_path / "ckpt"
    cache.mkdir()
    make = lambda q: ll.FaultTolerantLoader(ds, q, B, cache_dir=str(cache))  # noqa: E731
    groups = Groups(make)
    try:
        groups.run((("ab", True), ("ab", True)), max_steps=2)
        with ll.CheckpointManager(ckpt) as manager:
            manager.save(2, groups.loaders["a"])
    finally:
        groups.close()
    groups = Groups(make)
    try:
        for name, loader in groups.loaders.items():
            groups.quorums[name].step = 2
            with ll.CheckpointManager(ckpt) as manager:
                manager.load(loader)
        groups.step("ab", True)
        assert len(list(cache.iterdir())) == 2  # each group's pass holds its units' folder
        for loader in groups.loaders.values():
            assert loader.quarantine_step(5) == []  # to come: left out as it comes
        assert list(cache.iterdir()) == []
    finally:
        groups.close()


def test_backfilled_steps_keep_their_size_as_groups_come_and_go(
    lakes: dict[str, Lake], tmp_path: Path
) -> None:
    """A damaged row group under ``backfill=True``: every committed step whole, rows once."""
    lake = build_lake(tmp_path / "damaged", "main", "folder", True)
    ds = lake_dataset(lake, columns=["id"], on_error="skip", backfill=True)
    groups = drive(ds)
    bad = set().union(*(lake.groups[g] for g in lake.damaged))
    ids = committed_ids(groups)
    sizes = [sum(len(s["id"]) for s in shares) for shares, _ in groups.committed]
    wanted = [len(shares) * B for shares, _ in groups.committed]
    assert bad and sizes[:-1] == wanted[:-1]  # every step but the last whole, quarantine or not
    assert len(ids) == len(set(ids)) and set(ids) == lake.ids - bad


def test_a_loader_closes_as_a_context_and_has_the_dataloader_s_counters(
    lakes: dict[str, Lake],
) -> None:
    light = Lighthouse()
    quorum = Quorum(light)
    light.members = [quorum]
    ds = lake_dataset(lakes["main"], on_error="skip")
    with ll.FaultTolerantLoader(ds, quorum, B, num_workers=1) as loader:
        assert len(next(loader)["id"]) == B
        assert loader.stats()["units_decoded"] > 0 and loader.quarantine == []
        pool = loader._inner._pool
        assert pool is not None and pool.num_workers == 1
    assert loader._inner._pool is None, "the with block closed its workers"
