"""Worker processes that die: SIGKILL at random points, and a batch that kills every worker."""

from __future__ import annotations

import logging
import os
import random
import re
import signal
from pathlib import Path
from typing import Any

import pytest

import lakeloader as ll
from tests.conftest import LAYOUT_ROWS, wait_dead

KILLS = 20


def _kill_self_on_row_7(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return row


def _kill_always_on_row_7(table: Any) -> bool:
    if 7 in table.column("id").to_pylist():
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def test_twenty_workers_killed_at_random_points(
    dataset: ll.LakeDataset, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(1234)
    loader = ll.DataLoader(dataset, batch_size=24, num_workers=3, prefetch_factor=3)
    steps = len(loader)
    kill_at = sorted(rng.sample(range(1, steps - 1), KILLS))
    reference = [b["id"].tolist() for b in ll.DataLoader(dataset, batch_size=24)]
    seen: list[list[int]] = []
    victims = []
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        for step, batch in enumerate(loader):
            seen.append(batch["id"].tolist())
            if step in kill_at:
                pid = rng.choice(loader._pool.pids())  # type: ignore[union-attr]
                os.kill(pid, signal.SIGKILL)
                wait_dead(pid)  # dead (a zombie until the pool reaps it), so surely noticed
                victims.append(pid)
    ids = [i for b in seen for i in b]
    lost = LAYOUT_ROWS - len(set(ids))
    doubled = len(ids) - len(set(ids))
    assert (lost, doubled) == (0, 0)
    assert seen == reference, "same batches, same order as a run without kills"
    assert loader.stats()["worker_restarts"] == KILLS, (victims, len(set(victims)))
    warned = {
        int(r.message.split("(pid ")[1].split(")")[0])
        for r in caplog.records
        if "died with exit code" in r.message
    }
    assert warned == set(victims), "every death is reported with the worker's pid"


@pytest.mark.parametrize(
    ("kills", "what"),
    [
        ({"transform": _kill_self_on_row_7}, "step 0 of epoch 0 killed its worker 3 times"),
        ({"validate": _kill_always_on_row_7}, "killed its worker 3 times"),
    ],
    ids=["building a batch", "decoding a unit"],
)
def test_work_that_keeps_killing_its_worker_fails_with_its_units(
    lake: Path, kills: dict[str, Any], what: str
) -> None:
    ds = ll.LakeDataset(lake, shuffle=False, **kills)
    loader = ll.DataLoader(ds, batch_size=10, num_workers=2)
    with pytest.raises(ll.WorkerError) as err:
        list(loader)
    message = str(err.value)
    assert what in message
    assert "file-0000.parquet, row group 0, rows [0, 300)" in message
    assert loader.state_dict()["position"] == 0
    loader.close()


class _KillOnce:
    """A validate that SIGKILLs its worker the first time it sees the unit holding row 7.

    The marker file is how the fresh worker knows it has been done (processes share no memory).
    """

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self, table: Any) -> bool:
        if 7 in table.column("id").to_pylist() and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return True


@pytest.mark.parametrize("workers", [1, 3])
def test_a_worker_killed_while_decoding_has_its_unit_decoded_again(
    lake: Path, tmp_path: Path, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    """On the tensor path workers decode units: a death mid-decode loses and doubles nothing."""
    reference = [b["id"].tolist() for b in ll.DataLoader(ll.LakeDataset(lake, seed=3), 32)]
    ds = ll.LakeDataset(lake, seed=3, validate=_KillOnce(tmp_path / "killed"))
    loader = ll.DataLoader(ds, batch_size=32, num_workers=workers)
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        seen = [b["id"].tolist() for b in loader]
    assert (tmp_path / "killed").exists(), "the unit with row 7 was decoded by a worker"
    assert seen == reference
    assert loader.stats()["worker_restarts"] == 1
    assert any(
        re.search(r"decoding [1-9]\d* unit\(s\) it held again", r.message) for r in caplog.records
    )
    loader.close()


def test_a_replacement_worker_ends_on_sigterm(dataset: ll.LakeDataset) -> None:
    """A worker forked by the receiving thread (signals blocked there) still obeys SIGTERM.

    Otherwise multiprocessing's exit handler, which terminates daemon children and joins
    them, waits for it forever (a test run hung at exit this way).
    """
    loader = ll.DataLoader(dataset, batch_size=24, num_workers=2)
    it = iter(loader)
    next(it)
    victim = loader._pool.pids()[0]  # type: ignore[union-attr]
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    wait_dead(victim)
    next(it)
    replacement = loader._pool.pids()[0]  # type: ignore[union-attr]
    assert replacement not in (None, victim)
    os.kill(replacement, signal.SIGTERM)
    wait_dead(replacement, "SIGTERM")
    rest = [b["id"].tolist() for b in it]
    assert loader.stats()["worker_restarts"] == 2
    assert len(rest) == len(loader) - 2
    loader.close()
