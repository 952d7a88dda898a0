"""Preemption: a SIGTERM becomes a clean stop at a step boundary, or an exit at the deadline."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

import lakeloader as ll
from tests.conftest import ROOT

CHILD = textwrap.dedent(
    """
    import logging, sys, time, lakeloader as ll
    logging.basicConfig(level=logging.WARNING)
    with ll.Preemption(deadline=float(sys.argv[1])) as preempt:
        print("ready", flush=True)
        step = 0
        while True:
            step += 1
            time.sleep(0.01)  # a training step
            if sys.argv[2] == "checks" and preempt.requested():
                print(f"saved at step {step}", flush=True)
                break
    print("after the block", flush=True)
    """
)


def _child(deadline: float, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(deadline), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_loop_that_checks_stops_at_the_next_step_and_exits_zero() -> None:
    proc = _child(30.0, "checks")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "saved at step" in out and out.endswith("after the block\n")
    assert "SIGTERM received: a checkpoint is saved at the next step boundary" in err


def test_a_loop_that_never_checks_exits_with_the_signal_status_at_the_deadline() -> None:
    proc = _child(0.5, "ignores")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: no checkpoint within the 0.5 s deadline" in err
    assert "after the block" not in out
    assert took < 10


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="deadline must be > 0"):
        ll.Preemption(deadline=0)
    with pytest.raises(ValueError, match="at least one signal"):
        ll.Preemption(signals=())


def test_a_deadline_that_fires_as_the_block_ends_cleanly_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timer thread may already run when the block ends: it neither re-sends the signal
    nor arms the last-resort ``os._exit``."""
    import os

    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    with ll.Preemption(deadline=30.0) as preempt:
        signal.raise_signal(signal.SIGTERM)  # caught: the deadline timer starts
        assert preempt.signalled == "SIGTERM"
    preempt._expire(signal.SIGTERM, time.monotonic())  # what a timer firing just now does
    assert sent == [] and not preempt._expired
