"""The audit of a packed stream: each source's samples, epoch by epoch (every token is in
exactly one sample of its epoch), across a resume under another world size and batch; a step
trained twice or a step skipped is named with its stream (issue 30: packing x audit)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lakeloader as ll
from lakeloader.cli.main import main


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    rows = [[i * 100 + j + 1 for j in range(i % 17)] for i in range(600)]
    pq.write_table(pa.table({"tokens": rows}), root / "a.parquet", row_group_size=50)
    return root


def dataset(lake: Path) -> ll.LakeDataset:
    return ll.LakeDataset(lake, packing=ll.Packing("tokens", 16, eos_id=0))


def packed_mixture(lake: Path) -> ll.Mixture:
    sources = {"a": ll.LakeDataset(lake, seed=1), "b": ll.LakeDataset(lake, seed=2)}
    return ll.Mixture(sources, {"a": 2, "b": 1}, seed=4, packing=ll.Packing("tokens", 16, eos_id=0))


def train(lake: Path, ckpt: Path, stops: list[tuple[int, int, int]], replay: int = 0) -> None:
    """Attempts of (world, batch, last step), each resumed from the newest checkpoint, saving
    every 10 steps; ``replay``: the second attempt trains from ``replay`` steps before it."""
    step = 0
    for attempt, (world, batch, last) in enumerate(stops):
        make = packed_mixture if "mix" in ckpt.name else dataset
        loaders = [
            ll.DataLoader(make(lake), batch_size=batch, rank=r, world_size=world)
            for r in range(world)
        ]
        manager = ll.CheckpointManager(str(ckpt))
        if manager.latest() is not None:
            for loader in loaders:
                manager.load(loader)
            step = manager.latest() or 0
        if attempt == 1 and replay:
            state = loaders[0].state_dict()
            key = "samples" if "samples" in state else None
            assert key is not None
            state[key] -= replay * stops[0][0] * stops[0][1]
            for loader in loaders:
                loader.load_state_dict(state)
        its = [iter(loader) for loader in loaders]
        while step < last:
            step += 1
            for it in its:
                next(it)
            if step % 10 == 0:
                manager.save(step, loaders[0])
        manager.close()
        for loader in loaders:
            loader.close()


@pytest.mark.parametrize("kind", ["lake", "mix"])
def test_a_packed_run_resumed_on_other_shapes_is_exactly_once(
    lake: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / kind
    train(lake, ckpt, [(1, 24, 37), (3, 8, 63), (2, 5, 90)])
    assert main(["audit", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "every row exactly once" in out
    streams = ["lake"] if kind == "lake" else ["a", "b"]
    for stream in streams:
        assert f"\n{stream} " in out, out


def test_a_step_trained_twice_is_named(
    lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "twice"
    train(lake, ckpt, [(1, 24, 30), (1, 24, 50)], replay=3)
    assert main(["audit", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert "NOT exactly once" in out and "ERROR stream lake, epoch" in out, out
    assert "trained on twice" in out
