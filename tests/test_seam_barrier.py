"""``confirm_same_position`` under a real gloo process group of two processes.

Two spawned processes join a gloo group through a FileStore (loopback only) and call the
barrier once per scenario, in the same order, each with its own state; every outcome is
written back for the tests to compare. Scenarios that raise come before one that must agree
again, which proves no rank was left waiting in a collective.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as tmp

from lakeloader.checkpoint.barrier import Stand, confirm_same_position
from lakeloader.errors import CheckpointError
from lakeloader.state.quarantine import QuarantineEntry

WORLD_SIZE = 2
DEADLINE = 60.0  # seconds for the whole group (it takes about three)
A = QuarantineEntry("a.parquet", 0, 0, 10, "bad page")
B = QuarantineEntry("b.parquet", 2, 5, 5, "all NaN")
#: What each rank brings to the barrier: its entries, and a state where it differs.
MINE = {0: [A], 1: [B, A]}

Outcome = tuple[str, Any]  # ("returned", value) or ("raised", message)


def _state(
    position: int = 96,
    epoch: int = 3,
    fingerprint: str = "f" * 32,
    quarantine: tuple[QuarantineEntry, ...] = (),
) -> Stand:
    return Stand(fingerprint, "c" * 16, epoch, position, quarantine)


def _agree(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(quarantine=tuple(MINE[rank])), None


def _other_position(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(position=96 + 48 * rank), None


def _other_epoch(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(epoch=3 + rank), None


def _other_lake(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(fingerprint="f" * 32 if rank == 0 else "e" * 32), None


def _failed_on_rank_1(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(), CheckpointError("disk full") if rank == 1 else None


def _failed_everywhere(rank: int) -> tuple[Stand, CheckpointError | None]:
    return _state(), CheckpointError(f"disk {rank} full")


SCENARIOS: dict[str, Callable[[int], tuple[Stand, CheckpointError | None]]] = {
    "agree": _agree,
    "other_position": _other_position,
    "other_epoch": _other_epoch,
    "other_lake": _other_lake,
    "failed_on_rank_1": _failed_on_rank_1,
    "failed_everywhere": _failed_everywhere,
    "agree_again": _agree,
}


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: join the group, run every scenario in order, write the outcomes."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs stay on loopback
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=DEADLINE / 2),
    )
    outcomes: dict[str, Outcome] = {}
    try:
        for name, scenario in SCENARIOS.items():
            state, error = scenario(rank)
            try:
                outcomes[name] = ("returned", confirm_same_position(state, error))
            except CheckpointError as exc:
                outcomes[name] = ("raised", str(exc))
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pickle").write_bytes(pickle.dumps(outcomes))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Outcome]]:
    """Each rank's outcome of each scenario, by rank."""
    folder = tmp_path_factory.mktemp("barrier")
    args = (str(folder / "store"), str(folder))
    group = tmp.start_processes(
        _rank_main, args=args, nprocs=WORLD_SIZE, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE
    try:
        while not group.join(timeout=1.0):
            assert time.monotonic() < deadline, "the two ranks did not finish in time"
    finally:
        for process in group.processes:
            if process.is_alive():
                process.kill()
    return [pickle.loads((folder / f"rank{r}.pickle").read_bytes()) for r in range(WORLD_SIZE)]


def test_without_a_process_group_there_is_nothing_to_confirm() -> None:
    assert not dist.is_initialized()
    assert confirm_same_position(_state(), None) is None
    assert confirm_same_position(_state(), CheckpointError("disk full")) is None


def test_agreeing_ranks_all_get_every_rank_s_entries(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for rank in range(WORLD_SIZE):
        assert outcomes[rank]["agree"] == ("returned", [A, B, A])  # in rank order, unmerged


@pytest.mark.parametrize(
    ("scenario", "ranks_at"),
    [
        (
            "other_position",
            ["ranks [0] at epoch 3, position 96", "ranks [1] at epoch 3, position 144"],
        ),
        ("other_epoch", ["ranks [0] at epoch 3, position 96", "ranks [1] at epoch 4, position 96"]),
        ("other_lake", ["ranks [0] at epoch 3, position 96", "ranks [1] at epoch 3, position 96"]),
    ],
)
def test_disagreeing_ranks_all_raise_naming_ranks_and_positions(
    outcomes: list[dict[str, Outcome]], scenario: str, ranks_at: list[str]
) -> None:
    messages = []
    for rank in range(WORLD_SIZE):
        kind, message = outcomes[rank][scenario]
        assert kind == "raised", f"rank {rank} did not raise"
        assert message.startswith("ranks disagree on the loader position, refusing to save")
        for part in ranks_at:
            assert part in message
        messages.append(message)
    assert messages[0] == messages[1]  # every rank says the same


def test_a_previous_failure_on_one_rank_raises_on_the_others(
    outcomes: list[dict[str, Outcome]],
) -> None:
    """The failed rank gets the entries back: its caller raises its own error then."""
    assert outcomes[0]["failed_on_rank_1"] == (
        "raised",
        "the previous background save failed on rank(s) [(1, 'disk full')]",
    )
    assert outcomes[1]["failed_on_rank_1"] == ("returned", [])


def test_when_every_rank_failed_each_is_left_to_raise_its_own(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for rank in range(WORLD_SIZE):
        assert outcomes[rank]["failed_everywhere"] == ("returned", [])


def test_the_group_is_still_in_step_after_the_failures(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for rank in range(WORLD_SIZE):
        assert outcomes[rank]["agree_again"] == ("returned", [A, B, A])
