"""Transforms, batch transforms and array columns: exact order, exact resume, and draws per row.

``lakeloader.rng()`` in a ``transform`` and ``lakeloader.row_rngs()`` in a ``batch_transform``
must give each row the same draws in an epoch whatever the world size, workers, batch size or
resume; a worker SIGKILLed on the batch_transform path must change no draw and lose no row.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import lakeloader as ll
from tests.conftest import (
    GLOBAL_BATCH,
    LAYOUT,
    LAYOUT_ROWS,
    ROOT,
    global_batches,
    layout_dataset,
    make_loaders,
    roundtrip,
    run_epoch,
    wait_dead,
)

pytestmark = pytest.mark.filterwarnings("ignore::lakeloader.PartitionWarning")

#: (world size, workers, batch size per rank) that the draws must not depend on.
TOPOLOGIES = [(1, 0, 64), (3, 2, 7), (3, 0, 64), (1, 2, 7)]


def draw_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "draw": int(ll.rng().integers(2**62)), "u": float(np.random.rand())}


def draw_batch(batch: dict[str, Any]) -> dict[str, Any]:
    draws = [int(g.integers(2**62)) for g in ll.row_rngs()]
    seeds = ll.row_seeds()
    assert len(seeds) == len(batch["id"]) == len(draws)
    return {"id": batch["id"] * 1, "draw": torch.tensor(draws), "u": torch.rand(len(draws))}


def _draws(ds: ll.LakeDataset, world: int, workers: int, batch: int, epochs: int = 1) -> dict:
    """Row id -> draw, over ``epochs`` epochs (keyed by (epoch, id)), checking exactly-once."""
    loaders = make_loaders(ds, world, batch_size=batch, num_workers=workers)
    out: dict[tuple[int, int], int] = {}
    try:
        for epoch in range(epochs):
            for shares in zip(*(iter(lo) for lo in loaders), strict=True):
                for share in shares:
                    for i, d in zip(_ints(share["id"]), _ints(share["draw"]), strict=True):
                        assert (epoch, i) not in out, f"row {i} twice in epoch {epoch}"
                        out[epoch, i] = d
    finally:
        for lo in loaders:
            lo.close()
    assert len(out) == epochs * LAYOUT_ROWS
    return out


def _ints(value: Any) -> list[int]:
    return value.tolist() if isinstance(value, torch.Tensor) else list(value)


@pytest.fixture(scope="module")
def row_draws(lake: Path) -> dict:
    return _draws(layout_dataset(lake, transform=draw_row), 1, 0, 48, epochs=2)


@pytest.mark.parametrize(("world", "workers", "batch"), TOPOLOGIES)
@pytest.mark.parametrize("kind", ["transform", "batch_transform"])
def test_draws_belong_to_the_row(
    lake: Path, row_draws: dict, world: int, workers: int, batch: int, kind: str
) -> None:
    fn = {"transform": draw_row, "batch_transform": draw_batch}[kind]
    ds = layout_dataset(lake, **{kind: fn})
    assert _draws(ds, world, workers, batch) == {k: v for k, v in row_draws.items() if k[0] == 0}


def test_draws_differ_between_rows_and_epochs(row_draws: dict) -> None:
    first = [row_draws[0, i] for i in range(LAYOUT_ROWS)]
    second = [row_draws[1, i] for i in range(LAYOUT_ROWS)]
    assert len(set(first)) == LAYOUT_ROWS
    assert sum(a == b for a, b in zip(first, second, strict=True)) == 0


def test_rng_outside_a_transform_says_where_it_belongs() -> None:
    with pytest.raises(RuntimeError, match="inside the dataset's transform or batch_transform"):
        ll.rng()


@pytest.mark.parametrize("kind", ["transform", "batch_transform"])
@pytest.mark.parametrize(
    ("before", "after", "at"), [((1, 0, 48), (3, 2, 7), 5), ((3, 2, 16), (1, 0, 64), 17)]
)
def test_draws_survive_resume_on_another_topology(
    lake: Path, row_draws: dict, kind: str, before: tuple, after: tuple, at: int
) -> None:
    fn = {"transform": draw_row, "batch_transform": draw_batch}[kind]
    ds = layout_dataset(lake, **{kind: fn})
    world, workers, batch = before
    loaders = make_loaders(ds, world, batch_size=batch, num_workers=workers)
    seen: dict[int, int] = {}
    for shares in itertools.islice(zip(*(iter(lo) for lo in loaders), strict=False), at):
        for share in shares:
            seen.update(zip(_ints(share["id"]), _ints(share["draw"]), strict=True))
    state = roundtrip(loaders[0].state_dict())
    for lo in loaders:
        lo.close()
    world, workers, batch = after
    loaders = make_loaders(ds, world, batch_size=batch, num_workers=workers)
    for lo in loaders:
        lo.load_state_dict(state)
    for shares in zip(*(iter(lo) for lo in loaders), strict=True):
        for share in shares:
            for i, d in zip(_ints(share["id"]), _ints(share["draw"]), strict=True):
                assert i not in seen, f"row {i} delivered twice"
                seen[i] = d
    for lo in loaders:
        lo.close()
    assert seen == {i: row_draws[0, i] for i in range(LAYOUT_ROWS)}


def _global_torch_draws(ds: ll.LakeDataset, workers: int, stop: int | None = None) -> list:
    loader = ll.DataLoader(ds, batch_size=GLOBAL_BATCH, num_workers=workers)
    out = [b["u"].tolist() for b in itertools.islice(loader, stop)]
    loader.close()
    return out


def test_global_generators_are_seeded_per_batch(lake: Path) -> None:
    # torch.rand / np.random in the user's code: the same batches draw the same numbers with
    # other workers and after a resume (not per row: that is what lakeloader.rng() is for).
    for kind, fn in (("transform", draw_row), ("batch_transform", draw_batch)):
        ds = layout_dataset(lake, **{kind: fn})
        plain = _global_torch_draws(ds, 0)
        assert plain == _global_torch_draws(ds, 2), kind
        loader = ll.DataLoader(ds, batch_size=GLOBAL_BATCH, num_workers=2)
        head = [b["u"].tolist() for b in itertools.islice(loader, 4)]
        state = loader.state_dict()
        loader.close()
        again = ll.DataLoader(ds, batch_size=GLOBAL_BATCH, num_workers=0)
        again.load_state_dict(state)
        assert head + [b["u"].tolist() for b in again] == plain, kind


# --- exact order and resume through transforms and array columns -------------------------


def keep_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "emb": row["emb"], "n": len(row["tok"])}


def scale_batch(batch: dict[str, Any]) -> dict[str, Any]:
    return {"id": batch["id"], "emb": batch["emb"] * 2, "tok": batch["tok"]}


@pytest.fixture(scope="module")
def array_layout_lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``LAYOUT`` lake with array columns derived from each row's id."""
    root = tmp_path_factory.mktemp("array-layout")
    next_id = 0
    for i, groups in enumerate(LAYOUT):
        schema = pa.schema(
            [("id", pa.int64()), ("emb", pa.list_(pa.float32(), 3)), ("tok", pa.list_(pa.int32()))]
        )
        with pq.ParquetWriter(root / f"file-{i:04d}.parquet", schema) as writer:
            for n in groups:
                ids = np.arange(next_id, next_id + n)
                emb = [[j, j + 0.5, -j] for j in ids]
                tok = [[j] * (j % 5) for j in ids]
                writer.write_table(pa.table({"id": ids, "emb": emb, "tok": tok}, schema=schema))
                next_id += n
    return root


def _check_arrays(batch: dict[str, Any], scale: float) -> None:
    ids = batch["id"].to(torch.float32)
    want = torch.stack([ids, ids + 0.5, -ids], dim=1) * scale
    assert torch.equal(batch["emb"], want)
    if "tok" in batch:
        for i, row in zip(batch["id"].tolist(), batch["tok"].unbind(), strict=True):
            assert row.tolist() == [i] * (i % 5)
    if "n" in batch:
        assert batch["n"].tolist() == [i % 5 for i in batch["id"].tolist()]


VARIANTS = {
    "arrays": ({}, 1.0),
    "transform": ({"transform": keep_row}, 1.0),
    "batch_transform": ({"batch_transform": scale_batch}, 2.0),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("workers", [0, 2])
def test_same_order_and_exact_resume_through_transforms(
    array_layout_lake: Path, reference: list[list[int]], variant: str, workers: int
) -> None:
    kwargs, scale = VARIANTS[variant]
    ds = layout_dataset(array_layout_lake, **kwargs)
    assert run_epoch(ds, 3, batch_size=GLOBAL_BATCH // 3, num_workers=workers) == reference
    for at in (1, len(reference) // 2, len(reference) - 1):
        loaders = make_loaders(ds, 2, batch_size=GLOBAL_BATCH // 2, num_workers=workers)
        head = []
        for shares in itertools.islice(zip(*(iter(lo) for lo in loaders), strict=False), at):
            for share in shares:
                _check_arrays(share, scale)
            head.append([i for s in shares for i in s["id"].tolist()])
        state = roundtrip(loaders[1].state_dict())
        for lo in loaders:
            lo.close()
        resumed = make_loaders(ds, 4, batch_size=GLOBAL_BATCH // 4, num_workers=2 - workers)
        for lo in resumed:
            lo.load_state_dict(state)
        tail = list(global_batches(resumed))
        for lo in resumed:
            lo.close()
        assert head + tail == reference, (variant, workers, at)


def test_killed_worker_on_batch_transform_path_changes_no_draw(lake: Path, row_draws: dict) -> None:
    ds = layout_dataset(lake, batch_transform=draw_batch)
    loader = ll.DataLoader(ds, batch_size=24, num_workers=2, prefetch_factor=3)
    seen: dict[int, int] = {}
    kills = 0
    for step, batch in enumerate(loader):
        for i, d in zip(_ints(batch["id"]), _ints(batch["draw"]), strict=True):
            assert i not in seen, f"row {i} twice"
            seen[i] = d
        if step in (3, 20, 41):
            pid = loader._pool.pids()[step % 2]  # type: ignore[union-attr]
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)
            kills += 1
    assert loader.stats()["worker_restarts"] == kills == 3
    loader.close()
    assert seen == {i: row_draws[0, i] for i in range(LAYOUT_ROWS)}


def test_tokens_and_embeddings_example_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "tokens_and_embeddings.py"),
            "--lake",
            str(tmp_path / "lake"),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained on all 8000 rows once across a resume" in result.stderr


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("kind", ["transform", "batch_transform"])
def test_empty_shares_keep_the_batch_structure(lake: Path, kind: str, workers: int) -> None:
    # 7 ranks x 214 rows: the last global batch holds 2 rows, so 5 ranks get an empty share.
    fn = {"transform": draw_row, "batch_transform": draw_batch}[kind]
    loaders = make_loaders(
        layout_dataset(lake, **{kind: fn}), 7, batch_size=214, num_workers=workers
    )
    *_, last = zip(*(iter(lo) for lo in loaders), strict=True)
    for lo in loaders:
        lo.close()
    assert [len(share["id"]) for share in last] == [1, 1, 0, 0, 0, 0, 0]
    assert all(set(share) == {"id", "draw", "u"} for share in last)
    assert all(isinstance(share["draw"], torch.Tensor) for share in last)


@pytest.mark.parametrize("workers", [0, 2])
def test_rows_carry_pyarrows_python_values(lake: Path, workers: int) -> None:
    table = pq.read_table(lake)
    want = {r["id"]: r for r in table.to_pylist()}
    ds = layout_dataset(lake)
    loader = ll.DataLoader(ds, batch_size=37, num_workers=workers, collate_fn=list)
    rows = [row for batch in loader for row in batch]
    assert len(rows) == LAYOUT_ROWS
    for row in rows:
        expected = want[row["id"]]
        assert row == expected
        assert [type(v) for v in row.values()] == [type(expected[k]) for k in row]
