"""Regressions of what randomized interrupt-and-restore runs broke around the core (issue 20).

Each test is the smallest case that hung, failed or leaked before: wide seeds with workers, a
failing ``worker_init_fn``, empty shares on the row path, ``torch.distributed.checkpoint``
with quarantine, a loader dropped mid-pass, error logs on normal passes, and numpy's generator
in workers.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed.checkpoint as dcp
from torch.utils.data import default_collate

import lakeloader as ll
from lakeloader.workers.process import worker_seed
from tests.conftest import LAYOUT_ROWS, layout_dataset, running

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")


def _ids(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b["id"].tolist()]


@pytest.mark.parametrize("seed", [1_700_000_000_000_000, -(2**63), 2**64 - 1])
def test_a_wide_seed_works_with_workers(lake: Path, seed: int) -> None:
    ds = ll.LakeDataset(lake, seed=seed, num_partitions=4, max_unit_rows=128)
    loader = ll.DataLoader(ds, batch_size=50, num_workers=2, timeout=60)
    try:
        assert sorted(_ids(list(loader))) == list(range(LAYOUT_ROWS))
        assert loader.stats()["worker_restarts"] == 0
    finally:
        loader.close()
    seeds = {worker_seed(seed, rank, w) for rank in range(4) for w in range(4)}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)


def test_a_seed_outside_64_bits_is_refused_at_once(lake: Path) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"):
        ll.LakeDataset(lake, seed=2**64 + 5)


def _init_raises(worker_id: int) -> None:
    raise ValueError(f"no accelerator for worker {worker_id}")


def _init_exits(worker_id: int) -> None:
    os._exit(3)


@pytest.mark.parametrize("workers_build", [False, True], ids=["decode", "build"])
def test_a_failing_worker_init_fn_reaches_the_loop(
    dataset: ll.LakeDataset, workers_build: bool
) -> None:
    collate = default_collate if workers_build else None
    loader = ll.DataLoader(
        dataset, batch_size=32, num_workers=2, worker_init_fn=_init_raises, collate_fn=collate
    )
    started = time.monotonic()
    with pytest.raises(ll.WorkerError, match="no accelerator for worker") as err:
        list(loader)
    assert "failed to start" in str(err.value) or "failed to start" in str(err.value.__cause__)
    assert time.monotonic() - started < 30
    assert loader.stats()["worker_restarts"] <= 2, "no respawn loop"
    loader.close()


def test_a_worker_that_keeps_dying_at_start_ends_in_an_error(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=32, num_workers=1, worker_init_fn=_init_exits)
    with pytest.raises(ll.WorkerError, match=r"died 3 times while starting \(last exit code 3\)"):
        list(loader)
    loader.close()


def _tag(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "tag": row["id"] * 2}


@pytest.fixture(scope="module")
def one_row(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one-row")
    pq.write_table(pa.table({"id": np.arange(1), "s": ["only"]}), root / "a.parquet")
    return root


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("how", ["transform", "collate_fn"])
def test_an_empty_share_has_the_structure_of_the_others(
    one_row: Path, workers: int, how: str
) -> None:
    kwargs: dict[str, Any] = {"transform": _tag} if how == "transform" else {}
    ds = ll.LakeDataset(one_row, **kwargs)
    collate = default_collate if how == "collate_fn" else None
    shares = [
        list(
            ll.DataLoader(
                ds, batch_size=4, rank=r, world_size=2, num_workers=workers, collate_fn=collate
            )
        )
        for r in range(2)
    ]
    (full,), (empty,) = shares
    assert full.keys() == empty.keys()
    assert full["id"].tolist() == [0] and empty["id"].shape == (0,)
    assert isinstance(empty["s"], list) and empty["s"] == []
    if how == "transform":
        assert full["tag"].tolist() == [0] and empty["tag"].dtype == full["tag"].dtype


def _reject_row_group_2(table: pa.Table) -> bool | str:
    return "row group 2" if 500 <= table.column("id")[0].as_py() < 550 else True


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_round_trips_a_state_with_quarantine_across_a_resize(
    own_lake: Path, tmp_path: Path
) -> None:
    ds = layout_dataset(own_lake, on_error="skip", validate=_reject_row_group_2)
    first = ll.DataLoader(ds, batch_size=40)
    it = iter(first)
    seen: list[int] = []
    while not first.quarantine:  # save once the rejected unit's step was delivered
        seen += _ids([next(it)])
    dcp.save({"loader": first}, checkpoint_id=str(tmp_path / "dcp"))
    saved = first.state_dict()
    first.close()
    second = ll.DataLoader(ds, batch_size=24)
    dcp.load({"loader": second}, checkpoint_id=str(tmp_path / "dcp"))
    assert second.state_dict()["quarantine"] == saved["quarantine"]
    assert second.state_dict()["position"] == saved["position"]
    rest = _ids(list(second))
    second.close()
    assert [q["reason"] for q in json.loads(saved["quarantine"])] == [
        "rejected by validate: row group 2"
    ]
    assert sorted(seen + rest) == sorted(set(range(LAYOUT_ROWS)) - set(range(500, 550)))


def test_a_version_1_state_still_loads(dataset: ll.LakeDataset) -> None:
    loader = ll.DataLoader(dataset, batch_size=16)
    next(iter(loader))
    state = loader.state_dict()
    old = {**state, "version": 1, "quarantine": json.loads(state["quarantine"])}
    fresh = ll.DataLoader(dataset, batch_size=16)
    fresh.load_state_dict(old)
    assert fresh.state_dict() == state
    loader.close()


@pytest.mark.parametrize("transform", [None, _tag], ids=["decode", "build"])
def test_dropping_a_loader_mid_pass_releases_workers_and_memory(lake: Path, transform: Any) -> None:
    ds = layout_dataset(lake, transform=transform)
    loader = ll.DataLoader(ds, batch_size=16, num_workers=2)
    it = iter(loader)
    next(it)
    next(it)
    pids = loader._pool.pids()  # type: ignore[union-attr]
    folders = [loader._res.unit_dir]  # this loader's (other tests' loaders may still live)
    assert folders[0] and all(pid is not None for pid in pids)
    del it, loader
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gc.collect()
        if not any(running(p) for p in pids if p) and not any(map(os.path.exists, folders)):
            break
        time.sleep(0.1)
    assert [p for p in pids if p and running(p)] == []
    assert [f for f in folders if os.path.exists(f)] == []


def test_normal_passes_log_no_error(
    dataset: ll.LakeDataset, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    loader = ll.DataLoader(dataset, batch_size=16, num_workers=2, cache_bytes=64 << 10)
    try:
        for _ in range(6):
            assert len(_ids(list(loader))) == LAYOUT_ROWS
    finally:
        loader.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def _draw(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "draw": int(np.random.randint(0, 2**62))}


def test_numpy_is_seeded_per_worker_and_reproducibly(lake: Path) -> None:
    ds = layout_dataset(lake, transform=_draw)

    def draws() -> dict[int, int]:
        loader = ll.DataLoader(ds, batch_size=25, num_workers=2)
        try:
            return {
                int(i): int(d)
                for b in loader
                for i, d in zip(b["id"].tolist(), b["draw"].tolist(), strict=True)
            }
        finally:
            loader.close()

    first = draws()
    assert len(first) == LAYOUT_ROWS
    assert len(set(first.values())) == LAYOUT_ROWS, "no two rows share a draw"
    assert draws() == first, "the same run draws the same numbers for the same rows"
