"""``examples/train_ddp.py`` under torchrun, with real processes on the loopback interface.

The sequence: a 3-rank run in which rank 1 SIGKILLs itself after step 13 (torchrun restarts the
group, which resumes from the checkpoint of step 10) and which stops at step 52, in the middle
of epoch 0; then the same checkpoint folder continued on 2 ranks (with a DataLoader worker each)
to the end of epoch 1. From the per-rank logs: every row id is trained on exactly once in each
epoch (records of an attempt past the step the next attempt resumed from were replayed, so they
do not count), and the steps after the restart have bit-identical losses to an uninterrupted
3-rank run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import TORCHRUN_ENV, torchrun_command

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"

ROWS = 4001  # 4001 = 125 x 32 + 1: on 2 ranks the last batch of an epoch leaves rank 1 empty
BATCH = 16  # per rank: global batches of 48 (3 ranks) and 32 (2 ranks); C = 16 divides both
SAVE_EVERY = 5
KILL_RANK, KILL_STEP = 1, 13  # attempt 0 only; the restart resumes from the save of step 10
STOP_STEP = 52  # the 3-rank run stops here, in epoch 0; the 2-rank run takes over
EPOCHS = 2
RUN_TIMEOUT = 180.0  # seconds for one torchrun launch


@dataclass
class Run:
    """One torchrun launch and what its ranks logged."""

    name: str
    log_dir: Path
    seconds: float

    def records(self, attempt: int, kind: str | None = None) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.log_dir.glob(f"rank*-attempt{attempt}.jsonl")):
            with path.open(encoding="utf-8") as fh:
                out += [json.loads(line) for line in fh]
        return [r for r in out if kind is None or r["type"] == kind]

    def attempts(self) -> list[int]:
        return sorted({int(p.stem.split("-attempt")[1]) for p in self.log_dir.glob("*.jsonl")})

    def resumed_from(self, attempt: int) -> int:
        """The checkpoint step all ranks of an attempt resumed from (0: a fresh start)."""
        steps = {r["step"] for r in self.records(attempt, "resume")}
        assert len(steps) <= 1, f"{self.name} attempt {attempt}: ranks resumed from {steps}"
        return steps.pop() if steps else 0


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kill_leftovers(log_dir: Path) -> None:
    """SIGKILL rank processes of this launch that outlived it (their pids are in the logs)."""
    for path in log_dir.glob("*.jsonl"):
        with path.open(encoding="utf-8") as fh:
            pids = [r["pid"] for r in map(json.loads, fh) if r["type"] == "start"]
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if SCRIPT.name.encode() in cmdline:
                os.kill(pid, signal.SIGKILL)


def torchrun(
    work: Path,
    name: str,
    nproc: int,
    *args: str,
    max_restarts: int = 0,
    kill: tuple[int, int] | None = None,
) -> Run:
    """Launch the example under torchrun (loopback only) and wait for it, cleaning up after."""
    log_dir = work / f"logs-{name}"
    cmd = torchrun_command(
        nproc,
        SCRIPT,
        "--lake",
        str(work / "lake"),
        "--log-dir",
        str(log_dir),
        "--batch-size",
        str(BATCH),
        "--save-every",
        str(SAVE_EVERY),
        "--epochs",
        str(EPOCHS),
        *args,
        max_restarts=max_restarts,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LL_KILL_")}
    env.update(TORCHRUN_ENV)
    if kill is not None:
        env.update(LL_KILL_RANK=str(kill[0]), LL_KILL_AT_STEP=str(kill[1]))
    output = work / f"{name}.out"
    start = time.monotonic()
    with output.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            returncode: int | None = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            returncode = None
            proc.terminate()  # torchrun passes SIGTERM on to its workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            _kill_leftovers(log_dir)
    seconds = time.monotonic() - start
    if returncode != 0:
        tail = output.read_text(errors="replace")[-6000:]
        pytest.fail(f"torchrun {name} ended with {returncode} after {seconds:.1f} s:\n{tail}")
    return Run(name, log_dir, seconds)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("torchrun")
    assert load_example().make_lake(root / "lake", ROWS) == ROWS
    return root


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
    resized = torchrun(
        work, "resized", 2, "--ckpt", str(work / "ckpt"), "--resume", "--num-workers", "1"
    )
    assert resized.attempts() == [0]
    assert {r["world_size"] for r in resized.records(0, "start")} == {2}
    assert resized.resumed_from(0) == STOP_STEP
    left = ROWS - STOP_STEP * 3 * BATCH
    final = STOP_STEP + math.ceil(left / (2 * BATCH)) + math.ceil(ROWS / (2 * BATCH))
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
    work: Path, restarted: Run
) -> None:
    reference = torchrun(
        work, "reference", 3, "--ckpt", str(work / "ckpt-ref"), "--max-steps", str(STOP_STEP)
    )
    assert reference.attempts() == [0]

    def by_rank_and_step(records: list[dict[str, Any]]) -> dict[tuple[int, int], tuple[Any, ...]]:
        return {
            (r["rank"], r["step"]): (r["epoch"], r["ids"], r["loss"], r["local_loss_sum"])
            for r in records
        }

    expected = by_rank_and_step(reference.records(0, "step"))
    assert len(expected) == 3 * STOP_STEP
    before = by_rank_and_step(restarted.records(0, "step"))
    after = by_rank_and_step(restarted.records(1, "step"))
    resumed = restarted.resumed_from(1)
    assert sorted({s for _, s in after}) == list(range(resumed + 1, STOP_STEP + 1))
    for got in (before, after):
        differ = sorted((s, r) for (r, s), v in got.items() if v != expected[(r, s)])
        assert not differ, f"(step, rank) pairs that differ from the reference: {differ[:10]}"
    print(
        f"\n{len(after)} rank-steps after the resume (steps {resumed + 1}..{STOP_STEP}) have "
        f"bit-identical losses to the uninterrupted run; torchrun {reference.seconds:.1f} s"
    )
