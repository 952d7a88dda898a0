"""Whole checkpoints of an FSDP2 model under torchrun: preempted by SIGTERM, resumed, resharded.

The sequence, all with ``examples/train_ddp.py --fsdp`` (FSDP2 ``fully_shard`` on a CPU mesh,
gloo): 3 ranks under ``--preemptible``, where rank 1 gets a SIGTERM after step 12: every rank
agrees at that step boundary, saves (DCP shards of model and optimizer, the loader, the
generators) and exits 0; 2 ranks of batch 24 (the same global batch of 48) load the shards of
3 and train to step 30, saving in the background (DCP's ``async_save``) every 5 steps. An
uninterrupted 3-rank run to step 30 is the reference: the preempted steps are bit-identical to
it, the resumed steps train on exactly its rows with nearly the same losses (the gradients are
summed over 2 ranks, not 3). A bit-identical resume at an unchanged topology is
tests/test_torchrun.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.torchrun_runs import Run, load_example, torchrun

pytestmark = pytest.mark.slow  # torchrun runs: not in the quick tier

ROWS = 2400  # 50 steps of 48: every run below stays inside epoch 0
TERM_RANK, TERM_STEP = 1, 12
FINAL_STOP = 30
DEVIATION = 1e-4  # largest relative loss deviation accepted after resharding 3 -> 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    work = tmp_path_factory.mktemp("fsdp")
    assert load_example().make_lake(work / "lake", ROWS) == ROWS
    ckpt = ["--ckpt", str(work / "ckpt"), "--fsdp", "--resume"]
    out = {
        "preempted": torchrun(
            work,
            "preempted",
            3,
            *ckpt,
            "--preemptible",
            "--save-every",
            "0",
            term=(TERM_RANK, TERM_STEP),
        ),
        "resharded": torchrun(
            work,
            "resharded",
            2,
            *ckpt,
            "--max-steps",
            str(FINAL_STOP),
            "--async-save",
            batch=24,
        ),
        "reference": torchrun(
            work,
            "reference",
            3,
            "--ckpt",
            str(work / "ckpt-ref"),
            "--fsdp",
            "--max-steps",
            str(FINAL_STOP),
        ),
    }
    return out


def _steps(run: Run) -> dict[tuple[int, int], tuple[Any, ...]]:
    return {(r["rank"], r["step"]): (r["ids"], r["loss"]) for r in run.records(0, "step")}


def test_sigterm_saves_at_the_next_step_on_every_rank_and_exits_cleanly(
    runs: dict[str, Run],
) -> None:
    preempted = runs["preempted"]
    assert [(r["rank"], r["step"]) for r in preempted.records(0, "term")] == [
        (TERM_RANK, TERM_STEP)
    ]
    assert sorted((r["rank"], r["step"]) for r in preempted.records(0, "preempted")) == [
        (rank, TERM_STEP) for rank in range(3)
    ], "every rank stops at the step boundary where the signal arrived"
    assert [r["step"] for r in preempted.records(0, "save")] == [TERM_STEP] * 3
    assert [r["step"] for r in preempted.records(0, "end")] == [TERM_STEP] * 3
    assert runs["resharded"].resumed_from(0) == TERM_STEP


def test_the_preempted_steps_are_bit_identical_to_an_uninterrupted_run(
    runs: dict[str, Run],
) -> None:
    reference = _steps(runs["reference"])
    preempted = _steps(runs["preempted"])
    assert sorted({s for _, s in preempted}) == list(range(1, TERM_STEP + 1))
    differ = sorted(key for key, v in preempted.items() if v != reference[key])
    assert not differ, f"(rank, step) pairs that differ from the reference: {differ[:10]}"


def test_shards_of_three_ranks_load_onto_two(runs: dict[str, Run]) -> None:
    resharded = runs["resharded"]
    assert resharded.resumed_from(0) == TERM_STEP
    mine: dict[int, list[int]] = {}
    theirs: dict[int, list[int]] = {}
    losses: dict[int, tuple[float, float]] = {}
    for r in resharded.records(0, "step"):
        mine.setdefault(r["step"], []).extend(r["ids"])
        losses[r["step"]] = (float.fromhex(r["loss"]), 0.0)
    for r in runs["reference"].records(0, "step"):
        if r["step"] in losses:
            theirs.setdefault(r["step"], []).extend(r["ids"])
            losses[r["step"]] = (losses[r["step"]][0], float.fromhex(r["loss"]))
    assert sorted(mine) == list(range(TERM_STEP + 1, FINAL_STOP + 1))
    assert {s: sorted(v) for s, v in mine.items()} == {s: sorted(v) for s, v in theirs.items()}
    deviation = max(abs(a - b) / abs(b) for a, b in losses.values())
    assert deviation < DEVIATION
    print(
        f"\nFSDP2: SIGTERM at step {TERM_STEP} saved on every rank; shards of 3 ranks loaded "
        f"onto 2: steps {TERM_STEP + 1}..{FINAL_STOP} on the same rows, largest relative loss "
        f"deviation {deviation:.2e}"
    )
