"""Accelerate 1.15 with ``lakeloader.integrations.accelerate.prepare``: real processes.

Two ranks (torchrun, gloo, CPU) train with gradient accumulation 2, save with
``accelerator.save_state``, rank 0 is SIGKILLed mid-epoch; two ranks resume with
``accelerator.load_state`` (and the ``skip_first_batches`` call of Accelerate's examples), and
are killed again; one process resumes and finishes. Every row of both epochs is trained exactly
once (steps after the checkpoint a resume started from were replayed and are dropped). The
gradient-accumulation steps of an epoch of an odd number of steps equal those of torch's
DataLoader under the same Accelerator, and batches reach the device through their own
``.to()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    LAYOUT,
    LAYOUT_ROWS,
    ROOT,
    TORCHRUN_ENV,
    torchrun_command,
    write_lake,
)

pytestmark = pytest.mark.slow

CHILD = Path(__file__).resolve().with_name("accelerate_child.py")
BATCH = 30  # 25 steps an epoch on 2 ranks (odd), 50 on 1
EPOCHS = 2


def launch(
    work: Path, child: Path, nproc: int, *args: str, killed: bool = False, path: str = ""
) -> None:
    """torchrun ``child``; it must end with status 0, or by the SIGKILL it was told to send.

    Ranks that outlive their torchrun are SIGKILLed (their pids are in the ``start`` records
    of ``work/logs``); the children import this checkout's lakeloader (PYTHONPATH), and what
    is in ``path`` if given.
    """
    out = work / "torchrun.out"
    env = {
        **os.environ,
        **TORCHRUN_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path])),
    }
    with out.open("ab") as fh:
        proc = subprocess.run(
            torchrun_command(nproc, child, *args), stdout=fh, stderr=subprocess.STDOUT,
            env=env, cwd=work, timeout=240, check=False,
        )  # fmt: skip
    for record in records(work / "logs", "*", "start"):
        try:
            cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
        except OSError:
            continue
        if child.name.encode() in cmdline:
            os.kill(record["pid"], signal.SIGKILL)
    if (proc.returncode != 0) != killed:
        pytest.fail(f"torchrun {args} ended with {proc.returncode}:\n{out.read_text()[-5000:]}")


def records(log_dir: Path, attempt: Any, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of every rank of an attempt (``*``: of all), of one ``kind`` or all."""
    out = []
    for path in sorted(log_dir.glob(f"rank*-attempt{attempt}.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in out if kind is None or r["type"] == kind]


def tally(batches: Iterable[tuple[int, list[int]]], epochs: int) -> dict[int, dict[str, int]]:
    """Per epoch: rows trained, and rows missing and doubled against the lake's rows."""
    out = {}
    for epoch in range(epochs):
        seen = Counter(i for e, ids in batches if e == epoch for i in ids)
        out[epoch] = {
            "trained": sum(seen.values()),
            "missing": sum(1 for i in range(LAYOUT_ROWS) if i not in seen),
            "doubled": sum(n - 1 for n in seen.values() if n > 1),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three launches: 2 ranks killed after step 22 (saved at 20), 2 ranks resumed and
    killed after step 38 (saved at 35), 1 process resumed to the end."""
    pytest.importorskip("accelerate")
    work = tmp_path_factory.mktemp("accelerate")
    write_lake(work / "lake", LAYOUT)
    common = ["--lake", str(work / "lake"), "--log-dir", str(work / "logs")]
    common += ["--ckpt", str(work / "ckpt"), "--batch-size", str(BATCH), "--epochs", str(EPOCHS)]
    (work / "logs").mkdir()
    start = time.monotonic()
    launch(work, CHILD, 2, "train", *common, "--attempt", "0", "--save-at", "10", "20",
           "--kill-at", "22", killed=True)  # fmt: skip
    launch(work, CHILD, 2, "train", *common, "--attempt", "1", "--save-at", "35",
           "--kill-at", "38", killed=True)  # fmt: skip
    launch(work, CHILD, 1, "train", *common, "--attempt", "2")
    print(f"accelerate runs: {time.monotonic() - start:.1f} s")
    return work / "logs"


def kept(runs: Path, cuts: dict[int, int | None]) -> list[dict[str, Any]]:
    """Step records of the attempts in ``cuts``, each up to the checkpoint the next resumed
    from (the steps after it were replayed)."""
    return [
        r
        for attempt, cut in cuts.items()
        for r in records(runs, attempt, "step")
        if cut is None or r["step"] <= cut
    ]


def _batches(steps: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    return [(r["epoch"], r["ids"]) for r in steps]


def test_every_row_of_every_epoch_once_after_a_sigkill_and_resumes_on_2_then_1_process(
    runs: Path,
) -> None:
    assert records(runs, 0, "resume") == []
    assert [r["step"] for r in records(runs, 1, "resume")] == [20, 20]
    assert [r["step"] for r in records(runs, 2, "resume")] == [35]
    assert [r["world_size"] for r in records(runs, 2, "start")] == [1]
    assert [r["step"] for r in records(runs, 0, "kill")] == [22]
    assert [r["step"] for r in records(runs, 1, "kill")] == [38]
    rows_left = LAYOUT_ROWS - 10 * 2 * BATCH  # epoch 1 after step 35: 10 steps of 2 ranks
    assert [r["step"] for r in records(runs, 2, "end")] == [35 + rows_left // BATCH]
    whole = {"trained": LAYOUT_ROWS, "missing": 0, "doubled": 0}
    two = tally(_batches(kept(runs, {0: 20, 1: None})), EPOCHS)[0]  # epoch 0 ended in attempt 1
    print(f"accelerate, epoch 0 after the SIGKILL and the resume on 2 ranks: {two}")
    assert two == whole
    final = tally(_batches(kept(runs, {0: 20, 1: 35, 2: None})), EPOCHS)
    print(f"accelerate, epochs after the second SIGKILL and the resume on 1 process: {final}")
    assert final == {0: whole, 1: whole}


def test_the_last_batch_of_each_pass_ends_the_dataloader_and_syncs_gradients(runs: Path) -> None:
    # 25 steps an epoch on 2 ranks, 50 on 1: epoch 0 ends at step 25 (attempt 1), epoch 1 at
    # step 65 (attempt 2, one process); attempt 0 was killed inside epoch 0
    for attempt, last in ((0, set()), (1, {25}), (2, {35 + 30})):
        steps = records(runs, attempt, "step")
        assert {r["step"] for r in steps if r["end"]} == last, attempt
        assert all(r["sync"] for r in steps if r["end"])
        assert {r["device"] for r in steps} == {"cpu"}
    # a resumed attempt counts accumulation from its start: steps 21-25 sync at 22, 24, 25
    synced = [r["step"] for r in records(runs, 1, "step") if r["rank"] == 0 and r["sync"]]
    assert synced[:3] == [22, 24, 25]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("accelerate")
    work = tmp_path_factory.mktemp("accumulate")
    write_lake(work / "lake", LAYOUT)
    (work / "logs").mkdir()
    where = ["--lake", str(work / "lake"), "--log-dir", str(work / "logs")]
    launch(work, CHILD, 2, "accumulate", *where, "--batch-size", str(BATCH))
    out: dict[str, Any] = json.loads((work / "logs" / "accumulate-rank0.json").read_text())
    return out


def test_gradient_accumulation_steps_an_epoch_as_with_torchs_loader(
    accumulated: dict[str, Any],
) -> None:
    lake, torch_ = accumulated["lake"], accumulated["torch"]
    assert lake["len"] == torch_["len"] == 25  # an odd number of steps on 2 ranks
    counts = {
        name: [sum(e["syncs"]) for e in run["epochs"]]
        for name, run in (("lake", lake), ("torch", torch_))
    }
    print(f"optimizer steps an epoch with gradient accumulation 2 (25 batches): {counts}")
    assert counts["lake"] == counts["torch"] == [13, 13]
    for epoch in lake["epochs"]:
        assert epoch["steps"] == 25
        assert epoch["ends"] == [False] * 24 + [True]
        assert epoch["syncs"] == [i % 2 == 1 for i in range(24)] + [True]


def test_batches_reach_the_device_through_their_own_to(accumulated: dict[str, Any]) -> None:
    assert accumulated["placed_True"] == [accumulated["device"]]
    assert accumulated["placed_False"] == ["None"]
