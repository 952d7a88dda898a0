"""Whole checkpoints in one process: weights and optimizer, generators, torn parts, inspect.

Distributed saves and loads (3 ranks to 2, DDP and FSDP2) run under torchrun in
tests/test_torchrun_whole.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import lakeloader as ll
from lakeloader.checkpoint.layout import step_dir_name
from lakeloader.checkpoint.training import TRAINING_FILE, RngState
from lakeloader.cli.main import main as cli
from tests.conftest import layout_dataset

BATCH = 32


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: dict) -> float:
    x = batch["id"].to(torch.float32).unsqueeze(1) / 1000.0
    noise = torch.randn_like(x) * 0.01  # draws from torch's generator: restored or not
    loss = ((model(x + noise) - torch.sin(x)) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.item())


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.random()), float(torch.rand(1).item())


@pytest.mark.parametrize("async_save", [False, True])
def test_weights_optimizer_and_generators_resume_bit_identically(
    own_lake: Path, tmp_path: Path, async_save: bool
) -> None:
    ds = layout_dataset(own_lake)
    model, optim = _model()
    loader = ll.DataLoader(ds, batch_size=BATCH)
    ckpt = ll.CheckpointManager(str(tmp_path / "ckpt"), async_save=async_save)
    ckpt.attach(loader)
    losses, after = [], []
    for step, batch in enumerate(loader, 1):
        losses.append(_step(model, optim, batch))
        if step == 7:
            ckpt.save(step, loader, model=model, optimizer=optim, extra={"lr": 0.01})
            kept = RngState.capture()
            draws = _draws()  # what the generators give next; then put back for the run
            kept.restore()
        if step == 12:
            break
    ckpt.close()
    # another process would start with other generators: scramble them
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    model2, optim2 = _model()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # not the saved weights
    fresh = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    manager = ll.CheckpointManager(str(tmp_path / "ckpt"))
    assert manager.load(fresh, model=model2, optimizer=optim2) == {"lr": 0.01}
    assert _draws() == draws, "every generator continues as it was at the save"
    manager.load(fresh, model=model2, optimizer=optim2)  # and again, for the losses
    for step, batch in enumerate(fresh, 8):
        after.append(_step(model2, optim2, batch))
        if step == 12:
            break
    assert after == losses[7:12], "the same weights, moments and noise: the same bits"
    manager.close()


def test_a_torn_shard_makes_the_whole_checkpoint_invisible(
    own_lake: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optim = _model()
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    ckpt = ll.CheckpointManager(str(tmp_path))
    it = iter(loader)
    for step in (1, 2):
        _step(model, optim, next(it))
        ckpt.save(step, loader, model=model, optimizer=optim, extra={"step": step})
    ckpt.close()
    shard = next((tmp_path / step_dir_name(2) / "weights").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # torn: a crash or a bad copy
    manager = ll.CheckpointManager(str(tmp_path))
    with pytest.raises(ll.CheckpointError, match=r"weights/.*\.distcp is \d+ bytes, its COMMIT"):
        manager.read(2)
    fresh = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    model2, optim2 = _model()
    assert manager.load(fresh, model=model2, optimizer=optim2) == {"step": 1}
    assert "falling back to the checkpoint of step" in caplog.text
    assert fresh.state_dict()["position"] == BATCH, "the loader came from step 1 too"
    manager.close()


def test_loading_weights_a_checkpoint_does_not_hold_is_refused(
    own_lake: Path, tmp_path: Path
) -> None:
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    next(iter(loader))
    with ll.CheckpointManager(str(tmp_path)) as ckpt:
        ckpt.save(1, loader)
        model, optim = _model()
        with pytest.raises(ll.CheckpointError, match="holds no model state"):
            ckpt.load(loader, model=model)
        with pytest.raises(ll.CheckpointError, match="needs the optimizer's model"):
            ckpt.save(2, loader, optimizer=optim)


def test_inspect_shows_the_training_context(
    own_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, optim = _model()
    loader = ll.DataLoader(layout_dataset(own_lake), batch_size=BATCH)
    _step(model, optim, next(iter(loader)))
    with ll.CheckpointManager(str(tmp_path)) as ckpt:
        ckpt.save(1, loader, model=model, optimizer=optim)
    assert (tmp_path / step_dir_name(1) / TRAINING_FILE).exists()
    assert cli(["inspect", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    training = info["training"]
    assert training["model"] and training["optimizer"] and training["rng_ranks"] == 1
    assert training["torch_version"] == torch.__version__
    assert training["world_size"] == 1 and training["attempt"]
    assert len(training["code_commit"]) in (0, 40)
    assert info["config_hash"] and info["topology_saved"]["batch_size"] == BATCH
    assert cli(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "model and optimizer (torch.distributed.checkpoint)" in text
    assert "torch version" in text and "training code" in text
