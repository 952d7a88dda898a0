"""A rank of ``examples/train_torchtitan.py`` under torchrun, logging and killed on cue.

``python tests/torchtitan_child.py LOG_DIR ATTEMPT KILL_AT -- <the example's arguments>``:
runs the example's ``train`` with a step hook that appends one JSON line per step to
``LOG_DIR/rank{R}-attempt{A}.jsonl`` (``start`` with the pid and world size, then ``step``
with the step and each micro-batch's epoch and row ids, after the step's checkpoint), and on
rank 0 sends itself SIGKILL right after step ``KILL_AT`` (-1: never).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_torchtitan.py"


def main() -> None:
    log_dir, attempt, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = importlib.util.spec_from_file_location("train_torchtitan", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # its dataclasses look their module up
    spec.loader.exec_module(example)
    rank = int(os.environ["RANK"])
    log = (Path(log_dir) / f"rank{rank}-attempt{attempt}.jsonl").open("a")

    def write(kind: str, **fields: Any) -> None:
        log.write(json.dumps({"type": kind, "rank": rank, **fields}) + "\n")
        log.flush()

    def on_step(step: int, batches: list[tuple[int, list[int]]]) -> None:
        write("step", step=step, batches=batches)
        if step == kill_at and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    write("start", pid=os.getpid(), world_size=int(os.environ["WORLD_SIZE"]))
    last = example.train(example.parse_args(sys.argv[sys.argv.index("--") + 1 :]), on_step)
    write("end", step=last)


if __name__ == "__main__":
    main()
