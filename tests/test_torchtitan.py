"""torchtitan 0.3.0's CheckpointManager with an endless lake loader (examples/train_torchtitan.py).

Two ranks (torchrun, gloo, CPU) train with 2 micro-batches a step, torchtitan's
``CheckpointManager`` saving every 5 steps through ``torch.distributed.checkpoint``; rank 0 is
SIGKILLed at step 12; two ranks resume (``checkpointer.load(step=-1)``) from step 10 and rank 0
is killed at step 22; one process resumes from step 20 and trains to the end of epoch 1. Every
row of both epochs is trained exactly once (steps after the checkpoint a resume started from
were replayed and are dropped), and the checkpoint holds the loader's state once, under one
key, whatever the number of ranks.

torchtitan 0.3.0 is no dependency of the test extra: its requirements pin fsspec<=2026.2.0
(through datasets), which s3fs and gcsfs of the test extra refuse. Where it is not installed,
the fixture installs torchtitan and the four packages its checkpoint, dataloader and optimizer
modules import (pinned, without their dependencies) into a folder of the test's own, which the
ranks find on PYTHONPATH: the real torchtitan, never a stand-in.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LAYOUT, LAYOUT_ROWS, write_lake
from tests.test_accelerate import kept, launch, records, tally

pytestmark = pytest.mark.slow

CHILD = Path(__file__).resolve().with_name("torchtitan_child.py")
BATCH, ACCUM = 25, 2  # 100 rows a step on 2 ranks (15 steps an epoch), 50 on 1


#: What examples/train_torchtitan.py imports of torchtitan needs, beside torch (pinned).
TORCHTITAN = ("torchtitan==0.3.0", "tyro==1.0.17", "docstring_parser==0.18.0",
              "torchdata==0.11.0", "spmd_types==0.2.3")  # fmt: skip


def _torchtitan(folder: Path) -> str:
    """A PYTHONPATH entry where torchtitan imports ("" where it is installed already)."""
    if importlib.util.find_spec("torchtitan") is not None:
        return ""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(folder), *TORCHTITAN],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    return str(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("torchtitan")
    path = _torchtitan(work / "site")
    write_lake(work / "lake", LAYOUT)
    (work / "logs").mkdir()
    logs = str(work / "logs")

    def example(steps: int) -> list[str]:
        return ["--", "--lake", str(work / "lake"), "--dump", str(work / "dump"),
                "--steps", str(steps), "--batch-size", str(BATCH), "--accum", str(ACCUM),
                "--interval", "5"]  # fmt: skip

    launch(work, CHILD, 2, logs, "0", "12", *example(30), killed=True, path=path)
    launch(work, CHILD, 2, logs, "1", "22", *example(30), killed=True, path=path)
    # from step 20 (epoch 1 after 500 rows): 1000 rows at 50 a step end epoch 1 at step 40
    launch(work, CHILD, 1, logs, "2", "-1", *example(40), path=path)
    return work


def _batches(steps: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    return [(epoch, ids) for r in steps for epoch, ids in r["batches"]]


def test_every_row_of_every_epoch_once_after_a_sigkill_and_resumes_on_2_then_1_process(
    runs: Path,
) -> None:
    logs = runs / "logs"
    first = {a: min(r["step"] for r in records(logs, a, "step")) for a in range(3)}
    assert first == {0: 1, 1: 11, 2: 21}, "resumed from the checkpoints of steps 10 and 20"
    assert [r["world_size"] for r in records(logs, 2, "start")] == [1]
    assert [r["step"] for r in records(logs, 2, "end")] == [40]
    whole = {"trained": LAYOUT_ROWS, "missing": 0, "doubled": 0}
    two = tally(_batches(kept(logs, {0: 10, 1: None})), 2)[0]  # epoch 0 ended in attempt 1
    print(f"torchtitan, epoch 0 after the SIGKILL and the resume on 2 ranks: {two}")
    assert two == whole
    final = tally(_batches(kept(logs, {0: 10, 1: 20, 2: None})), 3)
    print(f"torchtitan, epochs after the second SIGKILL and the resume on 1 process: {final}")
    assert final == {0: whole, 1: whole, 2: {"trained": 0, "missing": LAYOUT_ROWS, "doubled": 0}}


def test_the_checkpoint_holds_the_loaders_state_once_under_one_key(runs: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    for step in (10, 20, 35):  # saved by 2 ranks, 2 ranks, 1 process
        folder = runs / "dump" / "checkpoint" / f"step-{step}"
        keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        assert sorted(k for k in keys if k.startswith("dataloader")) == ["dataloader.lakeloader"]
