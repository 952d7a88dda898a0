"""A packed stream of a followed lake: each increment is an epoch of samples, appended tokens
arrive once (no increment replayed), a pass that reaches past what the lake holds ends when it
gives no more, and a state resumes on a dataset made anew after more files were appended, under
another world size and batch, from rank 0's state alone: every token once."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import lakeloader as ll

FAST = ll.Follow(poll_interval=0.01, timeout=0.05)
EOS, L = 0, 8


class Lake:
    """A folder lake that grows: file ``k`` holds ``rows`` rows after the last, each row's
    tokens unique (``id * 32 + j + 1``, 0 to 12 of them)."""

    def __init__(self, root: Path) -> None:
        self.root, self.rows, self.files = root, 0, 0
        root.mkdir(parents=True)

    def add(self, rows: int) -> None:
        ids = range(self.rows, self.rows + rows)
        path = self.root / f"part-{self.files:04d}.parquet"
        table = pa.table({"tokens": [tokens_of(i) for i in ids]})
        pq.write_table(table, path.with_suffix(".tmp"), row_group_size=9)
        os.replace(path.with_suffix(".tmp"), path)
        stamp = 1_700_000_000 + self.files
        os.utime(path, (stamp, stamp))
        self.rows, self.files = self.rows + rows, self.files + 1

    def dataset(self, **kw: Any) -> ll.LakeDataset:
        packing = ll.Packing("tokens", L, eos_id=EOS)
        return ll.LakeDataset(
            self.root, follow=FAST, seed=4, num_partitions=3, packing=packing, **kw
        )


class DecodedBy:
    """A ``validate`` that logs the process that decodes each unit and the unit's first row
    (``pid row`` lines), and keeps every unit."""

    def __init__(self, log: Path) -> None:
        self.log = str(log)

    def __call__(self, table: pa.Table) -> bool:
        rows = [t // 32 for ts in table["tokens"].to_pylist() for t in ts[:1]]
        with open(self.log, "a") as fh:
            fh.write(f"{os.getpid()} {min(rows, default=-1)}\n")
        return True


def tokens_of(i: int) -> list[int]:
    return [i * 32 + j + 1 for j in range((i * 7) % 13)]


def take(loaders: list[ll.DataLoader]) -> list[Any]:
    """Every rank in lockstep until the pass ends: the tokens delivered (padding left out)."""
    out: list[Any] = []
    for shares in zip(*(iter(loader) for loader in loaders), strict=True):
        for b in shares:
            out += b["input_ids"][~b["pad_mask"]].tolist()
    return out


def test_appended_tokens_arrive_once_across_a_resume_on_a_dataset_made_anew(tmp_path: Path) -> None:
    lake = Lake(tmp_path / "lake")
    lake.add(40)
    loaders = [ll.DataLoader(lake.dataset(), batch_size=3, rank=r, world_size=2) for r in range(2)]
    seen = take(loaders)
    assert seen, "the first increment's samples"
    lake.add(30)  # increment 1
    seen += take(loaders)  # a new iter() goes on
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["increment"] is not None and state == loaders[1].state_dict()
    for loader in loaders:
        loader.close()
    lake.add(25)  # increment 2, there before the resumed dataset is made
    resumed = [ll.DataLoader(lake.dataset(), batch_size=2, rank=r, world_size=3) for r in range(3)]
    for loader in resumed:
        loader.load_state_dict(state)
    seen += take(resumed)
    for loader in resumed:
        loader.close()
    body = [t for t in seen if t != EOS]
    assert max(Counter(body).values()) == 1, "no token twice"
    want = [t for i in range(lake.rows) for t in tokens_of(i)]
    missing = sorted(set(want) - set(body))
    # what is left is the last increment's tail: less than a global step of samples
    assert len(missing) < 6 * L and all(t > 70 * 32 for t in missing), missing[:10]
    assert np.count_nonzero(np.array(seen) == EOS) <= lake.rows


def test_worker_processes_decode_a_followed_lakes_increments(tmp_path: Path) -> None:
    """With ``num_workers``, the workers decode every increment's units (its decoder, a reader
    of the increment's files, goes with each task), with the batches no worker gives."""

    def run(name: str, workers: int) -> tuple[list[Any], set[int]]:
        lake, log = Lake(tmp_path / name), tmp_path / f"{name}.log"
        lake.add(40)
        ds = lake.dataset(validate=DecodedBy(log))
        with ll.DataLoader(ds, batch_size=3, num_workers=workers) as loader:
            seen = take([loader])
            lake.add(30)  # increment 1
            seen += take([loader])
            pool = set(loader._pool.pids()) if loader._pool is not None else set()
        decoded = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
        assert {pid for pid, row in decoded if row >= 40}, "increment 1's units were decoded"
        assert {pid for pid, _ in decoded} == (pool or {os.getpid()})
        return seen, pool

    seen, pool = run("lake", 2)
    assert len(pool) == 2 and os.getpid() not in pool
    assert seen == run("alone", 0)[0]
    body = [t for t in seen if t != EOS]
    assert max(Counter(body).values()) == 1, "no token twice"
    want = {t for i in range(70) for t in tokens_of(i)}
    assert set(body) <= want and len(want - set(body)) < 3 * L, "increment 1's tokens arrived"


def test_a_pass_that_catches_up_with_the_lake_stops_its_threads(tmp_path: Path) -> None:
    """When a followed lake gives no more, the pass ends and closes (its token and io threads
    stop), as a mixture's does: they lived on until the next iter() or close()."""
    lake = Lake(tmp_path / "lake")
    lake.add(40)
    with ll.DataLoader(lake.dataset(), batch_size=3) as loader:
        before = set(threading.enumerate())
        it = iter(loader)  # held: not closed by being collected
        steps = sum(1 for _ in it)
        deadline = time.monotonic() + 5
        while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps > 0 and not left, left
        del it
