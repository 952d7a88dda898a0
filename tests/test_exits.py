"""Every way out of a training loop leaves no process and no shared memory behind.

Each case runs a real training loop in a subprocess, at 0 and 2 workers, and ends it by
``break``, an exception, Ctrl-C (``SIGINT`` to the process group, as a terminal sends it) or
``SIGTERM``; afterwards neither its workers nor its ``/dev/shm`` folder may exist. Only the
training process reports a Ctrl-C.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import running

pytestmark = pytest.mark.slow  # processes killed by signals: not in the quick tier

SCRIPT = r"""
import os, sys, time, warnings
import lakeloader as ll
warnings.simplefilter("ignore")
lake, workers, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
loader = ll.DataLoader(ll.LakeDataset(lake, max_unit_rows=128), batch_size=8, num_workers=workers)
for step, batch in enumerate(loader):
    if step == 2:
        pids = loader._pool.pids() if loader._pool else []
        print("READY", *pids, flush=True)
        if mode == "break":
            break
        if mode == "exception":
            raise RuntimeError("the training step failed")
        for _ in range(600):  # a long step, computing: the test sends a signal meanwhile
            time.sleep(0.1)
print("DONE", flush=True)
"""


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["break", "exception", "sigint", "sigterm"])
def test_no_exit_leaves_anything_behind(lake: Path, workers: int, mode: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(lake), str(workers), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        cwd=Path(__file__).parents[1],
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == "READY", proc.stderr.read() if proc.stderr else ""
        workers_pids = [int(p) for p in line[1:]]
        assert len(workers_pids) == workers
        if mode == "sigint":
            os.killpg(proc.pid, signal.SIGINT)  # the whole group, as Ctrl-C does
        elif mode == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # Python ends a KeyboardInterrupt by SIGINT to itself, for the shell to see it
    expected = {"break": 0, "exception": 1, "sigint": -signal.SIGINT, "sigterm": 143}
    assert proc.returncode == expected[mode], err
    deadline = time.monotonic() + 5
    while any(map(running, workers_pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in workers_pids if running(p)] == []
    assert glob.glob(f"/dev/shm/lakeloader-{proc.pid}-*") == []
    if mode == "sigint":
        assert err.count("KeyboardInterrupt") == 1, err  # the training process's own, only
