"""``examples/train_ddp.py`` under torchrun, with real processes on the loopback interface.

The sequence: a 3-rank run in which rank 1 SIGKILLs itself after step 13 (torchrun restarts the
group, which resumes from the checkpoint of step 10: loader, DCP shards of model and optimizer,
generators) and which stops at step 52, in the middle of epoch 0; then the same checkpoint
folder continued on 2 ranks of batch 24 (the same global batch of 48, with a DataLoader worker
each) to the end of epoch 1. From the per-rank logs: every row id is trained on exactly once in
each epoch (records of an attempt past the step the next attempt resumed from were replayed,
so they do not count); the steps after the restart have bit-identical losses to an
uninterrupted 3-rank run, and the steps after the resize train on the same rows as that run,
with losses within a stated deviation (the gradients are summed over 2 ranks, not 3).
``lakeloader audit`` proves the same from the checkpoints' ledger, and fails on a ledger in
which a step was doubled.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lakeloader.cli.main import main as cli
from tests.conftest import double_a_step
from tests.torchrun_runs import Run, load_example, torchrun

pytestmark = pytest.mark.slow  # torchrun runs: not in the quick tier

ROWS = 4001  # 4001 = 83 x 48 + 17: on 2 ranks the last batch of an epoch leaves rank 1 empty
BATCH = 16  # per rank on 3 ranks: global batches of 48
RESIZED_BATCH = 24  # per rank on 2 ranks: the same global batch of 48
SAVE_EVERY = 5
KILL_RANK, KILL_STEP = 1, 13  # attempt 0 only; the restart resumes from the save of step 10
STOP_STEP = 52  # the 3-rank run stops here, in epoch 0; the 2-rank run takes over
EPOCHS = 2
FINAL_STEP = 2 * math.ceil(ROWS / (3 * BATCH))  # both epochs at 48 rows a step: 168
RESIZE_DEVIATION = 1e-4  # largest relative loss deviation accepted after the resize


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchrun")
    assert load_example().make_lake(root / "lake", ROWS) == ROWS
    return root


_RESIZED: dict[Path, Run] = {}


def _resized(work: Path) -> Run:
    """The checkpoint folder of ``restarted`` continued on 2 ranks of batch 24 (run once)."""
    if work not in _RESIZED:
        _RESIZED[work] = torchrun(
            work,
            "resized",
            2,
            "--ckpt",
            str(work / "ckpt"),
            "--resume",
            "--num-workers",
            "1",
            batch=RESIZED_BATCH,
        )
    return _RESIZED[work]


@pytest.fixture(scope="module")
def reference(work: Path) -> Run:
    """The same training, uninterrupted, on 3 ranks to the end of epoch 1."""
    return torchrun(work, "reference", 3, "--ckpt", str(work / "ckpt-ref"))


@pytest.fixture(scope="module")
def restarted(work: Path) -> Run:
    """3 ranks; rank 1 SIGKILLed after step 13 of attempt 0; stops at step 52 (in epoch 0)."""
    return torchrun(
        work,
        "restarted",
        3,
        "--ckpt",
        str(work / "ckpt"),
        "--resume",
        "--max-steps",
        str(STOP_STEP),
        max_restarts=1,
        kill=(KILL_RANK, KILL_STEP),
    )


def test_restart_then_resize_trains_on_every_row_once_per_epoch(work: Path, restarted: Run) -> None:
    # (a) the kill, the restart and the resume
    assert restarted.attempts() == [0, 1]
    kills = restarted.records(0, "kill")
    assert [(k["rank"], k["step"]) for k in kills] == [(KILL_RANK, KILL_STEP)]
    last_step = SAVE_EVERY * (KILL_STEP // SAVE_EVERY)
    assert restarted.resumed_from(1) == last_step
    assert {r["rank"] for r in restarted.records(1, "resume")} == {0, 1, 2}
    assert [r["step"] for r in restarted.records(1, "end")] == [STOP_STEP] * 3

    # (b) the same checkpoint folder, continued on 2 ranks with one DataLoader worker each
    resized = _resized(work)
    assert resized.attempts() == [0]
    assert {r["world_size"] for r in resized.records(0, "start")} == {2}
    assert resized.resumed_from(0) == STOP_STEP
    final = FINAL_STEP
    assert [(r["step"], r["epoch"]) for r in resized.records(0, "end")] == [(final, 1)] * 2

    # (c) every row once per epoch: drop what an attempt did past the next one's resume step
    segments = [(restarted, 0), (restarted, 1), (resized, 0)]
    kept: list[dict[str, Any]] = []
    replayed: set[int] = set()
    for i, (run, attempt) in enumerate(segments):
        limit = math.inf
        if i + 1 < len(segments):
            nxt_run, nxt_attempt = segments[i + 1]
            limit = nxt_run.resumed_from(nxt_attempt)
        for r in run.records(attempt, "step"):
            if r["step"] <= limit:
                kept.append(r)
            else:
                replayed.add(r["step"])
    per_step = Counter(r["step"] for r in kept)
    assert sorted(per_step) == list(range(1, final + 1))
    assert all(n == (3 if s <= STOP_STEP else 2) for s, n in per_step.items())
    figures = []
    for epoch in range(EPOCHS):
        ids = Counter(i for r in kept if r["epoch"] == epoch for i in r["ids"])
        lost = ROWS - len(ids)
        doubled = sum(1 for n in ids.values() if n > 1)
        figures.append(f"epoch {epoch}: {sum(ids.values())} rows, lost {lost}, doubled {doubled}")
        assert sorted(ids) == list(range(ROWS)) and doubled == 0, figures[-1]
    print(
        f"\nkills {len(kills)}, restarts {len(restarted.attempts()) - 1}, "
        f"resumed from step {last_step} after the kill at {KILL_STEP} "
        f"(replayed steps {sorted(replayed)}), resized 3 -> 2 ranks at step {STOP_STEP}, "
        f"{final} steps; {'; '.join(figures)}; torchrun {restarted.seconds:.1f} s "
        f"(with the restart) + {resized.seconds:.1f} s (resized)"
    )


def test_losses_after_the_restart_are_bit_identical_to_an_uninterrupted_run(
    work: Path, restarted: Run, reference: Run
) -> None:
    assert reference.attempts() == [0]
    expected = _by_rank_and_step(reference.records(0, "step"))
    assert len(expected) == 3 * FINAL_STEP
    before = _by_rank_and_step(restarted.records(0, "step"))
    after = _by_rank_and_step(restarted.records(1, "step"))
    resumed = restarted.resumed_from(1)
    assert sorted({s for _, s in after}) == list(range(resumed + 1, STOP_STEP + 1))
    for got in (before, after):
        differ = sorted((s, r) for (r, s), v in got.items() if v != expected[(r, s)])
        assert not differ, f"(step, rank) pairs that differ from the reference: {differ[:10]}"
    print(
        f"\n{len(after)} rank-steps after the resume (steps {resumed + 1}..{STOP_STEP}) have "
        f"bit-identical losses to the uninterrupted run; torchrun {reference.seconds:.1f} s"
    )


def test_after_the_resize_the_same_rows_and_nearly_the_same_losses(
    work: Path, restarted: Run, reference: Run
) -> None:
    resized = _resized(work)
    mine = _global_steps(resized.records(0, "step"))
    theirs = _global_steps(reference.records(0, "step"))
    assert sorted(mine) == list(range(STOP_STEP + 1, FINAL_STEP + 1))
    deviation = 0.0
    for step, (ids, loss) in mine.items():
        ref_ids, ref_loss = theirs[step]
        assert ids == ref_ids, f"step {step}: other rows than the uninterrupted run"
        deviation = max(deviation, abs(loss - ref_loss) / abs(ref_loss))
    assert deviation < RESIZE_DEVIATION
    print(
        f"\nafter the resize 3 -> 2 ranks: {len(mine)} steps on the same rows as the "
        f"uninterrupted run, largest relative loss deviation {deviation:.2e}"
    )


def test_audit_proves_the_run_and_catches_a_doubled_step(
    work: Path, restarted: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _resized(work)
    assert cli(["audit", str(work / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(e["epoch"], e["trained"], e["complete"]) for e in info["epochs"]] == [
        (0, ROWS, True),
        (1, ROWS, True),
    ]
    assert [c["world_sizes"] for c in info["chain"]] == [[3], [3], [2]]
    (replayed,) = info["epochs"][0]["replayed"]
    first = SAVE_EVERY * (KILL_STEP // SAVE_EVERY) * 3 * BATCH
    assert replayed[0] == first and replayed[1] >= KILL_STEP * 3 * BATCH, replayed
    doubled = tmp_path / "ckpt"
    shutil.copytree(work / "ckpt", doubled)
    start, stop = double_a_step(doubled, 1)
    assert cli(["audit", str(doubled)]) == 1
    assert f"ERROR epoch 1: positions [{start}, {stop}) trained on twice" in capsys.readouterr().out
    print(f"\naudit: exactly once over 3 attempts; replayed positions {replayed}")


def _by_rank_and_step(records: list[dict[str, Any]]) -> dict[tuple[int, int], tuple[Any, ...]]:
    return {
        (r["rank"], r["step"]): (r["epoch"], r["ids"], r["loss"], r["local_loss_sum"])
        for r in records
    }


def _global_steps(records: list[dict[str, Any]]) -> dict[int, tuple[list[int], float]]:
    """Per global step: the sorted row ids of all ranks, and the step's loss."""
    out: dict[int, tuple[list[int], float]] = {}
    for r in records:
        ids, _ = out.get(r["step"], ([], 0.0))
        out[r["step"]] = (sorted(ids + r["ids"]), float.fromhex(r["loss"]))
    return out
