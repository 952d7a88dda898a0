"""Warnings a user must act on reach them with no logging set up, once, from any thread or worker.

Each category is a ``LakeWarning``; the loader's log (the ``lakeloader`` logger, silent until
configured) keeps the details.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lakeloader as ll
from lakeloader import loader_args
from tests.conftest import LAYOUT_ROWS, ROOT, wait_dead

CATEGORIES = [
    ll.CacheBudgetWarning,
    ll.PartitionWarning,
    ll.CpuContentionWarning,
    ll.WorkerWarning,
    ll.StorageRetryWarning,
]


def test_every_category_is_a_lake_warning_and_exported() -> None:
    assert issubclass(ll.LakeWarning, UserWarning) and "LakeWarning" in ll.__all__
    for category in CATEGORIES:
        assert issubclass(category, ll.LakeWarning), category
        assert category.__name__ in ll.__all__
    from lakeloader.loader import PartitionWarning

    assert PartitionWarning is ll.PartitionWarning


#: A script that runs into three warnings in a process where nothing set up logging: more
#: workers than cores, workers asked of a mixture, a store (a port) refusing connections.
SCRIPT = r"""
import os, socket, sys, threading, time
import lakeloader as ll

os.cpu_count = lambda: 2  # the warning depends on the machine's cores otherwise
ds = ll.LakeDataset(sys.argv[1], seed=1)
loader = ll.DataLoader(ds, batch_size=100, num_workers=4)
next(iter(loader))
loader.close()
ranked = ll.DataLoader(ds, batch_size=3, rank=0, world_size=2)
next(iter(ranked))
ranked.close()
port = int(sys.argv[2])
def listen_later():
    time.sleep(0.5)
    server = socket.create_server(("127.0.0.1", port))
    time.sleep(2)
    server.close()
threading.Thread(target=listen_later).start()
policy = ll.RetryPolicy(deadline=30, initial_delay=0.05, max_delay=0.1)
policy.call(lambda: socket.create_connection(("127.0.0.1", port)).close(), f"tcp://127.0.0.1:{port}")
print("done")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_warnings_reach_stderr_without_any_logging_set_up(lake: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(lake), str(_free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr
    err = run.stderr
    assert "CpuContentionWarning: torch runs" in err and "DataLoader workers on 2 cores" in err
    assert "PartitionWarning: C=" in err and "do not divide the global batch of 6" in err
    assert err.count("StorageRetryWarning: transient storage error on tcp://127.0.0.1") == 1
    assert "ConnectionRefusedError" in err


@pytest.mark.parametrize(("cores", "warned"), [(2, True), (3, False)])
def test_cpu_contention_is_said_at_the_training_loop_when_cores_are_short(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch, cores: int, warned: bool
) -> None:
    """One torch thread and two workers: too many for two cores, enough for three."""
    loader_args._warn_cpu_contention.cache_clear()
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = ll.DataLoader(dataset, batch_size=64, num_workers=2)
        next(iter(loader))
        loader.close()
    loader_args._warn_cpu_contention.cache_clear()
    hints = [w for w in seen if w.category is ll.CpuContentionWarning]
    assert len(hints) == warned
    if warned:
        assert hints[0].filename == __file__, "attributed to the training loop's line"
        assert "1 intra-op threads beside 2 DataLoader workers on 2 cores" in str(hints[0].message)


def test_a_replaced_worker_is_warned_of_from_the_loaders_thread(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=16, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    ids = [i for b in itertools.islice(it, 5) for i in b["id"].tolist()]
    victim = loader._pool.pids()[0]  # type: ignore[union-attr]
    with pytest.warns(ll.WorkerWarning, match=rf"pid {victim}\) died with exit code -9") as rec:
        os.kill(victim, signal.SIGKILL)
        wait_dead(victim)
        ids += [i for b in it for i in b["id"].tolist()]
    loader.close()
    assert sorted(ids) == list(range(LAYOUT_ROWS))
    died = [w for w in rec if w.category is ll.WorkerWarning]
    assert len(died) == 1 and "out-of-memory killer" in str(died[0].message)


def _warns_in_worker(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] % 100 == 0:
        warnings.warn(f"row {row['id']} says hello from a worker", ll.StorageRetryWarning, 1)
    return row


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_lake_warning_in_a_worker_process_is_issued_in_the_loaders(
    lake: Path, context: str
) -> None:
    ds = ll.LakeDataset(lake, shuffle=False, transform=_warns_in_worker)
    loader = ll.DataLoader(ds, batch_size=50, num_workers=2, multiprocessing_context=context)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        assert sum(len(batch["id"]) for batch in loader) == LAYOUT_ROWS
        loader.close()
    forwarded = [w for w in seen if w.category is ll.StorageRetryWarning]
    texts = sorted(str(w.message) for w in forwarded)
    assert texts == sorted(f"row {i} says hello from a worker" for i in range(0, LAYOUT_ROWS, 100))
    assert all(w.filename == __file__ for w in forwarded), "where the worker issued it"


def _refusing_port() -> tuple[int, Any]:
    """A loopback port nobody listens on yet, and a way to start listening on it."""
    port = _free_port()

    def listen() -> socket.socket:
        return socket.create_server(("127.0.0.1", port))

    return port, listen


def test_a_retry_storm_warns_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    """Eight requests to a port that refuses, each retried many times: one warning an outage."""
    port, listen = _refusing_port()
    policy = ll.RetryPolicy(deadline=30, initial_delay=0.02, max_delay=0.05)
    errors: list[BaseException] = []

    def request(i: int) -> None:
        try:
            policy.call(
                lambda: socket.create_connection(("127.0.0.1", port)).close(),
                f"tcp://127.0.0.1:{port}/{i}",
            )
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    def retried() -> set[str]:
        return {r.args[0] for r in caplog.records if "transient storage error" in r.getMessage()}

    def outage() -> None:
        caplog.clear()
        threads = [threading.Thread(target=request, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(retried()) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a few more retries each
        server = listen()
        for t in threads:
            t.join()
        server.close()
        assert len(retried()) == 8, "every request was retried (and logged), each URL apart"
        assert len(caplog.records) > 16, "several retries each"

    with (
        caplog.at_level(logging.WARNING, logger="lakeloader"),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")  # Python's own once-per-place rule out of the way
        outage()
        outage()  # a second outage is warned of again
    assert not errors, errors
    said = [w for w in seen if w.category is ll.StorageRetryWarning]
    assert len(said) == 2, [str(w.message) for w in said]
    assert "ConnectionRefusedError" in str(said[0].message)
    assert "retried for up to 30 s" in str(said[0].message)


def test_a_retry_warning_points_at_the_code_that_asked_for_the_read() -> None:
    """``RetryPolicy.call``'s warning names its caller's line (where a filter or a user looks)."""
    failures = iter([ConnectionResetError("reset by peer")])

    def flaky() -> bytes:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return b"ok"

    policy = ll.RetryPolicy(initial_delay=0.001, max_delay=0.001)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        assert policy.call(flaky, "tcp://127.0.0.1/x") == b"ok"
    [warning] = [w for w in seen if w.category is ll.StorageRetryWarning]
    assert (warning.filename, warning.lineno) == (__file__, line)
