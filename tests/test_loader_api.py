"""The DataLoader surface: torch's arguments and meanings, errors, counters, state checks."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

import lakeloader as ll
from tests.conftest import LAYOUT_ROWS, roundtrip, wait_dead, write_lake


def _pid_row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "pid": os.getpid()}


def _slow_row(row: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.05)
    return row


def _failing_row(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] == 42:
        raise ValueError("row 42 is cursed")
    return row


def _touch_init(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()  # set before the init, as torch's workers do
    assert info is not None and info.seed == torch.initial_seed()
    name = f"w{worker_id}-{info.id}-{info.num_workers}-{os.getpid()}"
    Path(os.environ["LL_TEST_INIT_DIR"], name).touch()


def test_default_batch_is_a_dict_of_tensors_with_file_dtypes(dataset: ll.LakeDataset) -> None:
    batch = next(iter(ll.DataLoader(dataset, batch_size=16)))
    assert set(batch) == {"id", "x", "s", "label"}
    assert batch["id"].dtype == torch.int64 and batch["x"].dtype == torch.float32
    assert batch["label"].dtype == torch.int32
    assert isinstance(batch["s"], list) and batch["s"][0] == f"row-{batch['id'][0].item()}"
    assert torch.equal(batch["x"], (batch["id"] * 0.5).float())


def test_collate_fn_receives_row_dicts(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=8, collate_fn=lambda rows: rows)
    rows = next(iter(loader))
    assert isinstance(rows, list) and len(rows) == 8
    assert set(rows[0]) == {"id", "x", "s", "label"} and isinstance(rows[0]["id"], int)


def test_transform_runs_in_the_workers(lake: Path) -> None:
    ds = ll.LakeDataset(lake, transform=_pid_row, num_partitions=4)
    batches = list(ll.DataLoader(ds, batch_size=100, num_workers=2))
    pids = {p for b in batches for p in b["pid"].tolist()}
    assert os.getpid() not in pids and len(pids) >= 1
    # default_collate over the transformed rows: same ids as without the transform
    plain = ll.DataLoader(ll.LakeDataset(lake, num_partitions=4), batch_size=100)
    assert [b["id"].tolist() for b in batches] == [b["id"].tolist() for b in plain]


def test_worker_init_fn_and_persistent_workers(
    dataset: ll.LakeDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LL_TEST_INIT_DIR", str(tmp_path))
    loader = ll.DataLoader(
        dataset, batch_size=48, num_workers=2, worker_init_fn=_touch_init, persistent_workers=True
    )
    for _ in range(2):
        assert sum(b["id"].numel() for b in loader) == LAYOUT_ROWS
    started = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir())
    assert started == ["w0-0-2", "w1-1-2"], "persistent workers start once, each runs the init"
    loader.close()


def test_workers_restart_each_epoch_when_not_persistent(
    dataset: ll.LakeDataset, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LL_TEST_INIT_DIR", str(tmp_path))
    loader = ll.DataLoader(dataset, batch_size=48, num_workers=2, worker_init_fn=_touch_init)
    for _ in range(2):
        list(loader)
    assert len(list(tmp_path.iterdir())) == 4


def test_spawn_context(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=100, num_workers=1, multiprocessing_context="spawn")
    ref = ll.DataLoader(dataset, batch_size=100)
    assert [b["id"].tolist() for b in loader] == [b["id"].tolist() for b in ref]


def _slow_unit(table: Any) -> bool:
    time.sleep(2)
    return True


@pytest.mark.parametrize("slow", [{"transform": _slow_row}, {"validate": _slow_unit}])
def test_timeout(lake: Path, slow: dict[str, Any]) -> None:
    """A batch (transform) or a unit (decoding in the workers) that takes too long."""
    ds = ll.LakeDataset(lake, num_partitions=4, **slow)
    loader = ll.DataLoader(ds, batch_size=64, num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError, match=r"timed out after 0\.5 seconds"):
        next(iter(loader))
    loader.close()


def test_worker_exception_names_the_step_and_keeps_the_traceback(lake: Path) -> None:
    ds = ll.LakeDataset(lake, transform=_failing_row, shuffle=False)
    loader = ll.DataLoader(ds, batch_size=10, num_workers=2)
    with pytest.raises(ll.WorkerError, match=r"(?s)step 4 of epoch 0.*row 42 is cursed"):
        list(loader)
    assert loader.state_dict()["position"] == 40, "the failed batch was never delivered"
    loader.close()


def test_killed_worker_is_replaced_and_nothing_is_lost(
    dataset: ll.LakeDataset, caplog: pytest.LogCaptureFixture
) -> None:
    loader = ll.DataLoader(dataset, batch_size=16, num_workers=2, prefetch_factor=4)
    it = iter(loader)
    ids = [i for b in itertools.islice(it, 5) for i in b["id"].tolist()]
    victim = loader._pool.pids()[0]  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        os.kill(victim, signal.SIGKILL)
        wait_dead(victim)  # dead, so the next step notices (a busy machine is slow to kill)
        ids += [i for b in it for i in b["id"].tolist()]
    assert sorted(ids) == list(range(LAYOUT_ROWS))
    assert loader.stats()["worker_restarts"] == 1
    assert any(
        f"pid {victim}" in r.message and "died with exit code" in r.message for r in caplog.records
    )


def test_partition_warning_once_with_advice(dataset: ll.LakeDataset) -> None:
    with pytest.warns(ll.PartitionWarning, match="num_partitions=3") as record:
        loader = ll.DataLoader(dataset, batch_size=3, rank=0, world_size=2)  # C=4, 6 a step
        list(loader)
        list(loader)
    assert len([w for w in record if w.category is ll.PartitionWarning]) == 1


@pytest.mark.parametrize("batch_size", [None, 6, 1000])
def test_no_warning_on_defaults_or_with_one_rank(
    dataset: ll.LakeDataset, batch_size: int | None
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        kwargs = {} if batch_size is None else {"batch_size": batch_size}
        loader = ll.DataLoader(dataset, **kwargs)  # torch's default batch_size=1, one rank
        assert sum(len(b["id"]) for b in loader) == LAYOUT_ROWS


@pytest.mark.parametrize("bad", [64.5, True, "64", 0])
def test_a_batch_size_that_is_not_a_positive_int_is_refused(
    dataset: ll.LakeDataset, bad: object
) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        ll.DataLoader(dataset, batch_size=bad)  # type: ignore[arg-type]


def test_torch_s_own_dataloader_says_to_use_lakeloader_s(dataset: ll.LakeDataset) -> None:
    with pytest.raises(TypeError, match=r"use lakeloader\.DataLoader"):
        next(iter(torch.utils.data.DataLoader(dataset, batch_size=4)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_budget_below_one_steps_pieces_warns_once_and_stays_exact(
    dataset: ll.LakeDataset, num_workers: int
) -> None:
    reference = [b["id"].tolist() for b in ll.DataLoader(dataset, batch_size=16)]
    small = ll.DataLoader(dataset, batch_size=16, num_workers=num_workers, cache_bytes=4096)
    with pytest.warns(ll.CacheBudgetWarning, match=r"cache_bytes=4\.0 KiB") as record:
        seen = [b["id"].tolist() for b in small]
    assert seen == reference
    assert len([w for w in record if w.category is ll.CacheBudgetWarning]) == 1
    warned = next(w for w in record if w.category is ll.CacheBudgetWarning)
    assert "max_unit_rows" in str(warned.message) and "up to 128 rows each" in str(warned.message)
    assert warned.filename == __file__  # the user's line that asked for the batch


def test_no_budget_warning_when_a_step_fits(dataset: ll.LakeDataset) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ll.CacheBudgetWarning)
        rows = sum(len(b["id"]) for b in ll.DataLoader(dataset, batch_size=16))
    assert rows == LAYOUT_ROWS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampler": [1, 2]}, "sampler is not supported"),
        ({"batch_sampler": [[1]]}, "batch_sampler is not supported"),
        ({"shuffle": False}, "pass shuffle= to LakeDataset"),
        ({"generator": torch.Generator()}, "LakeDataset\\(seed="),
        ({"batch_size": None}, "batch_size must be a positive integer"),
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"batch_size": -2}, "batch_size must be a positive integer, got -2"),
        ({"prefetch_factor": 2}, "need num_workers > 0"),
        ({"persistent_workers": True}, "need num_workers > 0"),
        ({"rank": 3, "world_size": 2}, "rank 3 is not in"),
        ({"in_order": False}, "in_order=False"),
        ({"multiprocessing_context": "bogus"}, "'bogus' is not a start method here: use one of"),
        ({"collate_fn": 3}, "collate_fn must be callable or None, got 3"),
        ({"worker_init_fn": "f"}, "worker_init_fn must be callable or None, got 'f'"),
    ],
)
def test_unsupported_or_invalid_arguments(
    dataset: ll.LakeDataset, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ll.DataLoader(dataset, **{"batch_size": 4, **kwargs})


def test_rank_and_world_size_from_the_environment(
    dataset: ll.LakeDataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    loader = ll.DataLoader(dataset, batch_size=4)
    assert (loader.rank, loader.world_size) == (1, 3)
    assert len(loader) == -(-LAYOUT_ROWS // 12)


def test_len_counts_steps(dataset: ll.LakeDataset) -> None:
    assert len(ll.DataLoader(dataset, batch_size=64)) == -(-LAYOUT_ROWS // 64)
    assert len(ll.DataLoader(dataset, batch_size=64, drop_last=True)) == LAYOUT_ROWS // 64


def test_pin_memory_without_an_accelerator_warns(dataset: ll.LakeDataset) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: pinning is real here")
    with pytest.warns(UserWarning, match="pin_memory=True but no accelerator"):
        ll.DataLoader(dataset, batch_size=4, pin_memory=True)


def test_read_amplification_with_four_workers(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=48, num_workers=4)
    rows = sum(b["id"].numel() for b in loader)
    stats = loader.stats()
    assert rows == LAYOUT_ROWS == stats["rows_delivered"]
    assert stats["units_decoded"] == dataset.plan(loader.epoch).num_pieces, "each unit once"
    assert stats["bytes_read"] > 0 and stats["cache_bytes"] == 0


def test_each_rank_decodes_a_unit_at_most_once(dataset: ll.LakeDataset) -> None:
    loaders = [ll.DataLoader(dataset, batch_size=12, rank=r, world_size=4) for r in range(4)]
    for shares in zip(*loaders, strict=True):
        assert len(shares) == 4
    decoded = [loader.stats()["units_decoded"] for loader in loaders]
    assert all(0 < d <= len(dataset.units) for d in decoded)
    assert sum(decoded) < 2 * len(dataset.units), "ranks mostly read disjoint units when C | B"


def test_loader_is_stateful(dataset: ll.LakeDataset) -> None:
    assert isinstance(ll.DataLoader(dataset, batch_size=4), Stateful)


def test_state_of_another_lake_is_refused(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    write_lake(tmp_path, [[10, 20]])
    other = ll.LakeDataset(tmp_path, seed=7, num_partitions=4, window=64, max_unit_rows=128)
    state = ll.DataLoader(other, batch_size=4).state_dict()
    with pytest.raises(ll.StateMismatchError) as err:
        ll.DataLoader(dataset, batch_size=4).load_state_dict(state)
    assert other.fingerprint in str(err.value) and dataset.fingerprint in str(err.value)


def test_state_of_another_config_shows_both_values(lake: Path, dataset: ll.LakeDataset) -> None:
    other = ll.LakeDataset(lake, seed=8, num_partitions=4, window=64, max_unit_rows=128)
    state = roundtrip(ll.DataLoader(other, batch_size=4).state_dict())
    with pytest.raises(ll.StateMismatchError, match=r"'seed': \(8, 7\)"):
        ll.DataLoader(dataset, batch_size=4).load_state_dict(state)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda s: {"hello": 1}, "not a lakeloader state"),
        (lambda s: {**s, "version": 99}, "of version 99 is not supported"),
        (lambda s: {**s, "position": "x"}, "malformed"),
        (lambda s: {k: v for k, v in s.items() if k != "epoch"}, "malformed"),
        (lambda s: {**s, "quarantine": [{"path": "a.parquet"}]}, "malformed"),
    ],
)
def test_malformed_states_are_refused(dataset: ll.LakeDataset, mutate: Any, match: str) -> None:
    loader = ll.DataLoader(dataset, batch_size=4)
    with pytest.raises(ll.StateFormatError, match=match):
        loader.load_state_dict(mutate(loader.state_dict()))


def test_unit_folders_of_dead_processes_are_swept(dataset: ll.LakeDataset, tmp_path: Path) -> None:
    stale = tmp_path / "lakeloader-999999999-abc"  # above any pid_max: a dead process
    stale.mkdir()
    (stale / "e0-p1.arrow").write_bytes(b"x" * 100)
    mine = tmp_path / f"lakeloader-{os.getpid()}-live"
    mine.mkdir()
    loader = ll.DataLoader(dataset, batch_size=48, num_workers=1, cache_dir=str(tmp_path))
    assert sum(b["id"].numel() for b in loader) == LAYOUT_ROWS
    assert not stale.exists() and mine.exists()
    assert [p.name for p in tmp_path.iterdir()] == [mine.name], "the loader cleans up after itself"
