"""A packed loader saved the torchtitan way: each rank hands its ``state_dict()`` to
``torch.distributed.checkpoint`` under one key (DCP keeps one copy of a key every rank
writes), 2 real processes on gloo; 3 processes load it back and continue, every sample the
uninterrupted run's (issue 31: per-rank DCP saves, any one rank's state resumes every rank)."""

from __future__ import annotations

import json
import os
import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp

import lakeloader as ll

pytestmark = pytest.mark.slow  # real processes

KEY, BEFORE, AFTER, GLOBAL = "dataloader.lakeloader", 7, 9, 12
DEADLINE = 240.0


class Stateful:
    """The loader as torchtitan's dataloaders hand it to DCP: one JSON string under one key."""

    def __init__(self, loader: ll.DataLoader) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        return {KEY: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(json.loads(state[KEY]))


def dataset(lake: str) -> ll.LakeDataset:
    return ll.LakeDataset(lake, seed=2, packing=ll.Packing("tokens", 16, eos_id=0))


def _rank(rank: int, world: int, folder: str, load: bool) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init = f"file://{folder}/store-{world}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=DEADLINE / 2))  # fmt: skip
    try:
        loader = ll.DataLoader(dataset(f"{folder}/lake"), batch_size=GLOBAL // world)
        holder = Stateful(loader)
        if load:  # the template's leaf is a string: any saved string replaces it
            state = holder.state_dict()
            dcp.load(state, checkpoint_id=f"{folder}/ckpt")
            holder.load_state_dict(state)
        it = iter(loader)
        got = [next(it)["input_ids"].numpy() for _ in range(AFTER if load else BEFORE)]
        if not load:
            dcp.save(holder.state_dict(), checkpoint_id=f"{folder}/ckpt")
        Path(folder, f"{world}-{rank}.pickle").write_bytes(pickle.dumps((got, loader.state_dict())))
        loader.close()
    finally:
        dist.destroy_process_group()


def launch(world: int, folder: Path, load: bool) -> None:
    group = tmp.start_processes(
        _rank, args=(world, str(folder), load), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE
    try:
        while not group.join(timeout=1.0):
            assert time.monotonic() < deadline, f"{world} ranks did not finish in time"
    finally:
        for process in group.processes:
            if process.is_alive():
                process.kill()


def test_per_rank_dcp_saves_resume_on_another_world_size(tmp_path: Path) -> None:
    (tmp_path / "lake").mkdir()
    rows = [[i * 100 + j + 1 for j in range(i % 23)] for i in range(800)]
    pq.write_table(pa.table({"tokens": rows}), tmp_path / "lake" / "a.parquet", row_group_size=60)
    launch(2, tmp_path, load=False)
    launch(3, tmp_path, load=True)
    before = [pickle.loads((tmp_path / f"2-{r}.pickle").read_bytes()) for r in range(2)]
    after = [pickle.loads((tmp_path / f"3-{r}.pickle").read_bytes()) for r in range(3)]
    assert before[0][1] == before[1][1], "the same state on every rank"
    assert all(a[1] == after[0][1] for a in after) and after[0][1]["samples"] == GLOBAL * 16
    got = [np.concatenate([r[0][t] for r in before]) for t in range(BEFORE)]
    got += [np.concatenate([r[0][t] for r in after]) for t in range(AFTER)]
    ref = ll.DataLoader(dataset(str(tmp_path / "lake")), batch_size=GLOBAL)
    it = iter(ref)
    want = [next(it)["input_ids"].numpy() for _ in range(BEFORE + AFTER)]
    ref.close()
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"step {t}"
