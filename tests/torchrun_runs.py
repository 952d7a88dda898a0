"""Launching ``examples/train_ddp.py`` under torchrun and reading what its ranks logged."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import TORCHRUN_ENV, torchrun_command

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"
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
    term: tuple[int, int] | None = None,
    batch: int = 16,
    save_every: int = 5,
    epochs: int = 2,
) -> Run:
    """Launch the example under torchrun (loopback only) and wait for it, cleaning up after.

    ``kill`` and ``term`` are ``(rank, step)``: that rank sends itself SIGKILL or SIGTERM after
    that step of attempt 0. The run must end with status 0.
    """
    log_dir = work / f"logs-{name}"
    cmd = torchrun_command(
        nproc,
        SCRIPT,
        "--lake",
        str(work / "lake"),
        "--log-dir",
        str(log_dir),
        "--batch-size",
        str(batch),
        "--save-every",
        str(save_every),
        "--epochs",
        str(epochs),
        *args,
        max_restarts=max_restarts,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LL_KILL_", "LL_TERM_"))}
    env.update(TORCHRUN_ENV)
    if kill is not None:
        env.update(LL_KILL_RANK=str(kill[0]), LL_KILL_AT_STEP=str(kill[1]))
    if term is not None:
        env.update(LL_TERM_RANK=str(term[0]), LL_TERM_AT_STEP=str(term[1]))
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
