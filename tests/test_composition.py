"""Issue 30's composition matrix: every pair of 17 features, exactly once and exact resume.

A pair's scenario runs on the small lakes of ``tests/composition_cases.py``: ranks in lockstep
for ``STEPS`` steps, a state (or a ``CheckpointManager`` checkpoint), a resume under another
topology (world size and batch size; 0 -> 2 workers with ``workers``) on datasets made anew,
then the rest of the epoch (a followed lake: until its appended files came; packing: every
source through epoch 0, its samples counted from the files). Every expected row (packed:
every source's epoch 0 holds every row's tokens) must then have come once, quarantined rows
not at all, and the sequence must be an uninterrupted one-rank run's (packed: a run of one
sample a step, each step's samples sorted as the loader sorts them), which must itself be
exactly once. ``torchft`` is two
replica groups of ``FaultTolerantLoader`` on a scripted quorum: a step of one participant, a
step that does not commit, a group healing from its peer's state.

The pairs that fail today carry the issue's words and the error they raise as a strict xfail:
a change that fixes one must remove its entry from ``FAILING_TODAY``.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lakeloader as ll
from lakeloader.cli.audit import run_audit
from lakeloader.cli.main import main as cli
from tests.composition_cases import (
    EOS,
    GLOBAL,
    PACKING,
    USER,
    Collector,
    Feats,
    Lake,
    Lakes,
    Lighthouse,
    Needs,
    ScriptedQuorum,
    allowed,
    appended,
    build_lake,
    increments,
    loader_kw,
    logged_pids,
    make_dataset,
    quarantined,
    row_tokens,
    run_to_end,
    sample_key,
    sources,
    stream_sizes,
    tokens_of,
)

FEATURES = ("lake", "mixture", "packing", "follow", "filter", "delta", "workers", "transform",
            "batch_transform", "collate_fn", "skip", "validate", "checkpoint_resize", "audit",
            "torchft", "drop_last", "inspect")  # fmt: skip
PAIRS = list(itertools.combinations(FEATURES, 2))

#: The pairs that fail today: issue 30's words and what they raise (AssertionError: a check
#: of this file). A fixed pair leaves the dict; so far mixture x workers and packing x
#: workers ("no worker process starts", fixed by 335b015, stage 3), mixture x transform,
#: batch_transform, collate_fn, skip and validate, packing x the same five, mixture x follow and
#: x audit, torchft x mixture, follow, skip, validate, checkpoint_resize, audit and inspect (the
#: torchft scenario's reference holds two passes of a mixture, a followed lake gets its files
#: appended before increment 0 ends, and a committed step spans the loader's step_rows), and
#: packing x torchft (packing's samples placed by arithmetic: any one group's state resumes
#: every group), packing x audit (a packed loader's steps recorded for the ledger) and packing
#: x follow (a packed stream of a followed lake's increments).
FAILING_TODAY: dict[frozenset[str], tuple[str, type[Exception]]] = {}
#: Pairs measured at 3 s or more (``pytest --durations=0`` on 2 busy cores).
SLOW: frozenset[frozenset[str]] = frozenset({frozenset({"packing", "follow"})})  # 6.1 s

STEPS = 5  # before the state is taken
MANAGED = frozenset({"checkpoint_resize", "audit", "inspect"})
#: What a reference run shares with a scenario: everything that decides the rows and order.
ORDER = frozenset({"mixture", "packing", "delta", "filter", "skip", "validate", "follow",
                   "drop_last"})  # fmt: skip
#: torchft: who takes part in each step, and whether it commits; then both groups, the second
#: healing from the first at the first of those steps.
SCHEDULE = (("ab", True), ("ab", True), ("a", True), ("a", False))

#: The whole matrix runs in CI (about 20 s on 2 cores): it is not in the quick tier.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::lakeloader.errors.CpuContentionWarning"),
]


def _marks(a: str, b: str) -> list[pytest.MarkDecorator]:
    pair = frozenset({a, b})
    marks = [pytest.mark.slow] if pair in SLOW else []
    if pair in FAILING_TODAY:
        why, error = FAILING_TODAY[pair]
        marks.append(pytest.mark.xfail(strict=True, raises=error, reason=f"issue 30: {why}"))
    return marks


@pytest.fixture(scope="module")
def lakes(tmp_path_factory: pytest.TempPathFactory) -> Lakes:
    root = tmp_path_factory.mktemp("composition")
    return {
        (name, table, damaged): build_lake(root / f"{name}-{table}-{damaged}", name, table, damaged)
        for name in ("main", "code")
        for table in ("folder", "delta")
        for damaged in (False, True)
    }


# ------------------------------------------------------------------ running a scenario


class Run:
    """What a scenario gave, and what it ran on."""

    def __init__(self, feats: Feats, srcs: dict[str, Lake]) -> None:
        self.got = Collector(feats)
        self.srcs = srcs  # the lakes, with their appended rows (follow)
        self.states: list[dict[str, Any]] = []  # every state taken
        self.verdict: str | None = None  # of lakeloader audit
        self.log: str | None = None  # where the validator logs the pids that decoded
        self.spans: list[int] = []  # torchft: global rows of each committed step


def topologies(feats: Feats) -> tuple[tuple[int, int], tuple[int, int]]:
    """(world size, batch size) before and after: packed, a world size that divides no
    stream count and a global batch of 12 samples after 8."""
    if "packing" in feats:
        return (2, GLOBAL // 2), (3, GLOBAL // 2)
    return (2, GLOBAL // 2), (1, GLOBAL)


def execute(feats: Feats, lakes: Lakes, tmp: Path) -> Run:
    run = Run(feats, sources(feats, lakes, tmp))
    got, root, (w1, b1), (w2, b2) = run.got, str(tmp / "ckpt"), *topologies(feats)
    with ExitStack() as stack:
        ds, kw = make_dataset(feats, run.srcs), loader_kw(feats, b1, False)
        first = [ll.DataLoader(ds, rank=r, world_size=w1, **kw) for r in range(w1)]
        its = [iter(stack.enter_context(x)) for x in first]
        for step in range(STEPS):
            got.add([next(it) for it in its])
            if step == 1 and "follow" in feats:
                run.srcs = appended(feats, run.srcs, 0)
        run.states = [x.state_dict() for x in first]
        if feats & MANAGED:
            with ll.CheckpointManager(root) as ckpt:
                ckpt.save(STEPS, first[0])
            if "inspect" in feats:
                check_inspect(root, run.states[0])
        for x in first:
            x.close()
        if "follow" in feats:
            run.srcs = appended(feats, run.srcs, 1)
        got.pids.clear()
        run.log = str(tmp / "decoded.log") if "workers" in feats else None
        ds, kw = make_dataset(feats, run.srcs, run.log), loader_kw(feats, b2, run.log is not None)
        second = [ll.DataLoader(ds, rank=r, world_size=w2, **kw) for r in range(w2)]
        manager = stack.enter_context(ll.CheckpointManager(root)) if feats & MANAGED else None
        state = run.states[-1 if "packing" in feats else 0]  # packed: any one rank's resumes all
        for x in second:
            stack.enter_context(x)
            if manager is not None:
                manager.load(x)
            else:
                x.load_state_dict(state)
        run_to_end([iter(x) for x in second], got, stream_sizes(feats, lakes))
        run.states += [x.state_dict() for x in second]
        if manager is not None and "audit" in feats:
            manager.save(len(got.batches), second[0])
            manager.close()
            run.verdict = run_audit(root, {})[0].verdict
    return run


def execute_ft(feats: Feats, lakes: Lakes, tmp: Path) -> Run:
    run, light, root = Run(feats, sources(feats, lakes, tmp)), Lighthouse(), str(tmp / "ckpt")
    run.log = str(tmp / "decoded.log") if "workers" in feats else None
    ds: Any = make_dataset(feats, run.srcs, run.log)  # FaultTolerantLoader refuses a Mixture
    kw = loader_kw(feats, GLOBAL // 2, run.log is not None)
    batch = kw.pop("batch_size")  # a group's rows a step
    with ExitStack() as stack:

        def group(step: int = 0) -> tuple[Any, ScriptedQuorum]:
            quorum = ScriptedQuorum(light, step)
            loader = ll.FaultTolerantLoader(ds, quorum, batch, **kw)
            stack.callback(loader.close)
            return loader, quorum

        groups, needs = {"a": group(), "b": group()}, stream_sizes(feats, lakes)
        for step in itertools.count():
            if needs is not None and run.got.done(needs):  # packed streams are endless
                break
            who, commit = SCHEDULE[step] if step < len(SCHEDULE) else ("ab", True)
            if "follow" in feats and step in (1, 2):  # both files, before increment 0 ends
                run.srcs = appended(feats, run.srcs, step - 1)
            light.members = [groups[n][1] for n in who]
            light.healing = {id(groups["b"][1])} if step == len(SCHEDULE) else set()
            shares = [next(groups[n][0], None) for n in who]
            if all(s is None for s in shares):
                break
            assert None not in shares, f"step {step}: the groups disagree on the epoch's end"
            if commit:
                run.got.add(shares)  # a followed lake's increment may end in a short step
                run.spans.append(groups[who[0]][0].step_rows)
                for n in who:
                    groups[n][1].step += 1
            run.states += [groups[n][0].state_dict() for n in who]
            if step == 2 and feats & MANAGED:  # a checkpoint, then every group starts anew
                ckpt = stack.enter_context(ll.CheckpointManager(root))
                ckpt.save(3, groups["a"][0])
                if "inspect" in feats:
                    check_inspect(root, groups["a"][0].state_dict())
                groups = {n: group(3) for n in "ab"}
                for loader, _ in groups.values():
                    ckpt.load(loader)
        if "audit" in feats:
            ckpt.save(len(run.spans), groups["a"][0])
            ckpt.close()
            run.verdict = run_audit(root, {})[0].verdict
    return run


# ------------------------------------------------------------------ checks


def walk(name: str, seq: list[int], epochs: list[frozenset[int]]) -> tuple[int, set[int]]:
    """Cut one source's ids into its epochs, in order: each must be whole before the next
    starts. Returns the epoch it ends in and that epoch's rows delivered."""
    e, seen = 0, set[int]()
    for n, i in enumerate(seq):
        if i in seen or i not in epochs[e]:
            missing = sorted(epochs[e] - seen)
            assert not missing, (
                f"{name}: row {i} ({n}th) {'again' if i in seen else 'is not'} in epoch {e}, "
                f"which lacks {len(missing)} rows {missing[:6]}"
            )
            e, seen = e + 1, set()
            assert e < len(epochs) and i in epochs[e], (
                f"{name}: row {i} ({n}th) is of no epoch due; epoch {e - 1} was whole"
                + (": increment 0 replayed" if e == 1 and len(epochs) == 2 else "")
            )
        seen.add(i)
    return e, seen


def check_rows(run: Run, feats: Feats) -> None:
    """Every expected row once, epoch by epoch; quarantined rows and no other left out
    (drop_last: less than a global batch, the rows dropped counted)."""
    ids, short = run.got.ids, "drop_last" in feats
    assert len(ids) == len(set(ids)) or "mixture" in feats, "a row came twice"
    for name, lake in run.srcs.items():
        epochs = increments(lake, name, feats)
        e, seen = walk(name, [i for i in ids if (i >= 1000) == (name == "code")], epochs)
        if "mixture" in feats:
            continue  # a pass ends inside the sources' epochs
        missing = epochs[-1] - seen
        assert e == len(epochs) - 1 and (len(missing) < GLOBAL if short else not missing), (
            f"epoch {e} of {len(epochs)} lacks {sorted(missing)}"
        )
        if short and not feats & {"follow", "torchft"}:  # followed: the tail is carried
            slots = len([i for i in lake.ids if i % 3 or "filter" not in feats])
            dropped = run.states[-1]["rows_dropped"]
            assert dropped == slots % GLOBAL and len(missing) <= dropped, (dropped, missing)
    if "mixture" in feats and not feats & {"skip", "validate", "torchft"}:
        assert len(ids) == len(run.got.batches) * GLOBAL, "a mixture's batches are full"


def check_packed(run: Run, feats: Feats, needs: Needs | None) -> None:
    """Per source, its epoch 0 (its first samples, as many as the files make: ``needs``; a
    followed lake: all it gave) holds every row's tokens once, each at its place in its row,
    rows whole and ended by an eos where a sample holds them side by side, and the rest of the
    samples padding; a quarantined row's tokens come nowhere."""
    samples, srcs = np.stack(run.got.samples), np.asarray(run.got.sources)
    for s, (name, lake) in enumerate(run.srcs.items()):  # a Mixture's indices: names' order
        mine = samples[srcs == s]
        if needs is not None:
            assert len(mine) >= sum(needs[s]), f"{name}: {len(mine)} of {sum(needs[s])} samples"
            mine = mine[: sum(needs[s])]
        keep, real = allowed(lake, feats), mine[:, 2] == 0
        tokens, positions = mine[:, 0][real], mine[:, 1][real]
        body = tokens != EOS
        got, want = Counter(tokens[body].tolist()), Counter(t for i in keep for t in tokens_of(i))
        assert got == want, (
            f"{name}: tokens twice {sorted(t for t, n in got.items() if n > 1)[:6]}, missing "
            f"{sorted(want - got)[:6]}, not due {sorted(got - want)[:6]}"
        )
        assert np.array_equal(positions[body], (tokens[body] - 1) % 16), f"{name}: positions"
        eos = int((~body).sum())
        assert eos == len(keep), f"{name}: {eos} eos, {len(keep)} rows"
        padding = len(mine) * PACKING.seq_len - sum(row_tokens(i) for i in keep)
        assert int((~real).sum()) == padding, f"{name}: {int((~real).sum())} padding, {padding} due"
        for sample in mine:  # neighbours: a row's next token, or its eos, or the next row
            for (t0, p0, pad0), (t1, p1, pad1) in itertools.pairwise(sample.T.tolist()):
                if pad0 or pad1:
                    continue
                if t1 == EOS:
                    ok = t0 != EOS and p1 == p0 + 1 == len(tokens_of((t0 - 1) // 16))
                else:
                    ok = (t0 == EOS and p1 == 0) or (t0 == t1 - 1 and p1 == p0 + 1)
                assert ok, f"{name}: ({t0} at {p0}) then ({t1} at {p1}) in {sample.tolist()}"
    # quarantined or filtered out: nowhere in the run
    banned = {t for lake in run.srcs.values() for i in lake.ids - allowed(lake, feats)
              for t in tokens_of(i)}  # fmt: skip
    assert not banned & set(samples[:, 0][samples[:, 2] == 0].tolist()), "a row not due came"


def quarantine_found(state: Any) -> set[tuple[str, int]]:
    """(file name, row group) of the quarantine entries anywhere in a state."""
    if isinstance(state, list):
        return set().union(set(), *(quarantine_found(x) for x in state))
    if not isinstance(state, dict):
        return set()
    found = set()
    for key, value in state.items():
        if key == "quarantine":
            entries = json.loads(value) if isinstance(value, str) else value
            found |= {(Path(q["path"]).name, q["row_group"]) for q in entries}
        else:
            found |= quarantine_found(value)
    return found


def check_delivery(run: Run, feats: Feats, lakes: Lakes) -> None:
    """Exactly once, and the quarantine in the states."""
    if "packing" in feats:
        check_packed(run, feats, stream_sizes(feats, lakes))
    else:
        check_rows(run, feats)
    if feats & {"skip", "validate"}:
        want = set().union(*(quarantined(lake, feats) for lake in run.srcs.values()))
        assert quarantine_found(run.states) == want, "the states' quarantine"


def packed_order(ref: Collector, spans: list[int], needs: Needs) -> list[int]:
    """The reference's samples (one a step) in steps of ``spans`` samples, each step's sorted
    by source, epoch, stream and index in it (a source's samples are its offsets in order)."""
    drawn: Counter[int] = Counter()
    keys = []
    for s in ref.sources:
        keys.append((s, *sample_key(needs[s], drawn[s])))
        drawn[s] += 1
    order: list[int] = []
    for span in spans:
        assert len(order) + span <= len(keys), f"the reference ends at {len(keys)} samples"
        order += sorted(range(len(order), len(order) + span), key=keys.__getitem__)
    return order


def check_same_sequence(run: Run, ref: Collector, feats: Feats, lakes: Lakes) -> None:
    """The same ids in the same batches as the uninterrupted run (packing: the same global
    samples, its one a step cut into this run's steps); under torchft, whose global batches
    change size, each committed step holds its slots' rows (``ref`` then has a slot a step)."""
    got = run.got
    if "packing" in feats:
        needs = stream_sizes(feats, lakes)
        spans = [len(b) for b in got.batches]
        if "torchft" in feats:
            assert spans == run.spans, f"committed steps' samples {spans}, step_rows {run.spans}"
        if needs is None:  # a followed lake: each step the next samples, in some order
            g = 0
            for n, span in enumerate(spans):
                mine = sorted(x.tobytes() for x in got.samples[g : g + span])
                want = sorted(x.tobytes() for x in ref.samples[g : g + span])
                assert mine == want, f"step {n}: not the samples [{g}, {g + span}) of the stream"
                g += span
            return
        order = packed_order(ref, spans, needs)
        assert got.sources == [ref.sources[i] for i in order], "the samples' sources"
        for n, (mine, i) in enumerate(zip(got.samples, order, strict=True)):
            assert np.array_equal(mine, ref.samples[i]), f"sample {n}: {mine} != {ref.samples[i]}"
        return
    if "torchft" in feats:
        g = 0
        for n, (span, ids) in enumerate(zip(run.spans, got.batches, strict=True)):
            want = {i for slot in ref.batches[g : g + span] for i in slot}
            assert set(ids) == want, f"committed step {n}, slots [{g}, {g + span}): {ids}"
            g += span
        return
    first = next(
        (n for n, (x, y) in enumerate(zip(got.ids, ref.ids, strict=False)) if x != y), None
    )
    assert got.ids == ref.ids, f"differs from the uninterrupted run at {first} of {len(ref.ids)}"


def check_workers(run: Run, feats: Feats) -> None:
    """Worker processes did the work: built the batches (user code), else decoded units."""
    assert run.log is not None
    pids = run.got.pids if any(f in feats for f in USER) else logged_pids(run.log)
    assert pids and os.getpid() not in pids, (
        f"decoded or built in the training process ({os.getpid()}): pids {sorted(pids)}"
    )


def check_inspect(root: str, state: dict[str, Any]) -> None:
    """``lakeloader inspect``'s positions are the state's."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli(["inspect", root, "--json", "--no-lag"]) == 0
    info = json.loads(out.getvalue())
    if state.get("kind") == "packed":  # the samples delivered: STEPS global batches
        assert info["samples"] == state["samples"] == STEPS * GLOBAL, (info, state)
    elif "slot" in state:
        assert info["slot"] == state["slot"]
        assert {s["source"]: s["drawn"] for s in info["sources"]} == state["counts"]
    else:
        got = (info["epoch"], info["position"], info["rows_dropped"])
        assert got == (state["epoch"], state["position"], state["rows_dropped"])


@pytest.fixture(scope="module")
def references(
    lakes: Lakes, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Feats], tuple[Feats, Run]]:
    """The uninterrupted run (one rank, 0 workers) of a scenario's order, once per order (a
    torchft scenario's in batches of one row, slot by slot; a packed one's in batches of one
    sample, through every source's epoch 0 and two global batches more)."""
    cache: dict[Feats, Run] = {}
    root = tmp_path_factory.mktemp("references")

    def get(feats: Feats) -> tuple[Feats, Run]:
        packed, ft = "packing" in feats, "torchft" in feats and "packing" not in feats
        key = (feats & (ORDER - {"drop_last"})) | {"torchft"} if ft else feats & ORDER
        if key not in cache:
            run = Run(key, sources(key, lakes, root / "-".join(sorted(key) or ["lake"])))
            ds = make_dataset(key, run.srcs)
            if "follow" in key:  # increment 0 is pinned: both appends make the next
                run.srcs = appended(key, appended(key, run.srcs, 0), 1)
            extra, batch = 2 * GLOBAL if packed else 0, 1 if ft or packed else GLOBAL
            with ll.DataLoader(ds, **loader_kw(key, batch, False)) as loader:
                # torchft's last step of a mixture's pass is a whole global batch past
                # epoch_rows: its slots are the next pass's
                for _ in range(2 if ft and "mixture" in key else 1):
                    run_to_end([iter(loader)], run.got, stream_sizes(key, lakes), extra)
                run.states = [loader.state_dict()]
            cache[key] = run
        return key, cache[key]

    return get


@pytest.mark.parametrize(
    ("a", "b"), [pytest.param(a, b, marks=_marks(a, b), id=f"{a}-{b}") for a, b in PAIRS]
)
def test_pair(
    a: str,
    b: str,
    lakes: Lakes,
    references: Callable[[Feats], tuple[Feats, Run]],
    tmp_path: Path,
) -> None:
    feats = frozenset({a, b}) - {"lake"}
    key, ref = references(feats)
    check_delivery(ref, key, lakes)  # the uninterrupted run is exactly once too
    run = (execute_ft if "torchft" in feats else execute)(feats, lakes, tmp_path)
    check_delivery(run, feats, lakes)
    check_same_sequence(run, ref.got, feats, lakes)
    if "workers" in feats:
        check_workers(run, feats)
    if "audit" in feats:
        assert run.verdict == "exactly once"
