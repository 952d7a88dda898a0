"""A Lightning training run over a lake, launched by tests/test_lightning.py.

``python -m tests.lightning_child CONFIG`` (CONFIG: JSON, see :func:`main`). Lightning's
``ddp`` runs this command again in each other rank; ``ddp_spawn`` pickles the trainer and the
loader into spawned processes. Every rank appends one JSON line per trained step to
``OUT/{tag}-rank{r}.jsonl``: ``{"e": current_epoch, "le": the loader's epoch, "s":
global_step, "b": batch_idx, "ids": [...]}``, and one per validation step
(``{"v": validation run, "sanity": bool, "e": ..., "ids": [...]}``). At global step ``hold``
each rank writes ``OUT/{tag}-held{r}`` and waits to be killed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lakeloader as ll
from lakeloader.integrations.lightning import LakeloaderCallback


def dataset(cfg: dict[str, Any], root: str) -> ll.LakeDataset:
    """The training (or validation) lake of a run."""
    follow = ll.Follow(poll_interval=0.05, timeout=cfg["timeout"]) if cfg.get("follow") else None
    return ll.LakeDataset(root, seed=3, num_partitions=4, window=32, follow=follow)


def train_loader(cfg: dict[str, Any]) -> ll.DataLoader:
    return ll.DataLoader(
        dataset(cfg, cfg["lake"]), batch_size=cfg["batch"], endless=cfg.get("endless", False)
    )


class Model(pl.LightningModule):
    """A linear model of ``x``; logs the ids of each step it trains."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.lin = torch.nn.Linear(1, 1)
        self.validations = 0
        self._log: Any = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is None:
            path = Path(self.cfg["out"]) / f"{self.cfg['tag']}-rank{self.global_rank}.jsonl"
            self._log = path.open("a")
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["x"].float()[:, None] / 1000
        return torch.nn.functional.mse_loss(self.lin(x), x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.cfg.get("hold"):
            Path(self.cfg["out"], f"{self.cfg['tag']}-held{self.global_rank}").touch()
            while True:  # until the test's SIGKILL
                time.sleep(1)
        loader = self.trainer.train_dataloader
        self._write(
            {
                "e": self.current_epoch,
                "le": loader.epoch,
                "s": self.global_step,
                "b": batch_idx,
                "ids": batch["id"].tolist(),
            }
        )
        return self._loss(batch)

    def on_validation_start(self) -> None:
        self.validations += 1

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loader = self.trainer.val_dataloaders
        record = {"v": self.validations, "sanity": self.trainer.sanity_checking, "le": loader.epoch}
        self._write({**record, "ids": batch["id"].tolist()})

    def train_dataloader(self) -> ll.DataLoader:
        """A new loader at every call (``reload_dataloaders_every_n_epochs``)."""
        return train_loader(self.cfg)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.cfg.get("estimate"):  # sets the loaders up before the loops are restored
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main(cfg: dict[str, Any]) -> None:
    """Train as ``cfg`` says.

    Keys: ``lake``, ``out``, ``tag``, ``batch``, ``devices``, ``strategy``, ``setup``
    (``fit``: a loader made here and passed to ``fit``; ``hook``: ``train_dataloader()``
    with ``reload_dataloaders_every_n_epochs=1``), ``every`` (a checkpoint every so many
    steps, ``OUT/ckpt/last.ckpt``; also one at every epoch's end in ``OUT/ckpt/epochs``),
    ``hold``, ``resume`` (a checkpoint path), ``callback``, ``max_epochs``, ``max_steps``,
    ``follow`` (with ``timeout``), ``endless``, ``val`` (a validation lake,
    ``restart_on_iter=True``), ``val_batch``, ``limit_val``, ``sanity``, ``estimate`` (read
    ``trainer.estimated_stepping_batches`` in ``configure_optimizers``).
    """
    out = Path(cfg["out"])
    loader = train_loader(cfg) if cfg["setup"] == "fit" else None
    val = None
    if cfg.get("val"):
        val_ds = dataset({}, cfg["val"])
        val = ll.DataLoader(val_ds, batch_size=cfg["val_batch"], restart_on_iter=True)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(out / "ckpt", every_n_train_steps=cfg["every"], save_last=True),
        ModelCheckpoint(out / "ckpt" / "epochs", "{epoch}", every_n_epochs=1, save_top_k=-1),
    ]
    if cfg.get("callback"):
        callbacks.append(LakeloaderCallback())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=cfg["strategy"] if cfg["devices"] > 1 else "auto",
        max_epochs=cfg.get("max_epochs"),
        max_steps=cfg.get("max_steps", -1),
        limit_val_batches=cfg.get("limit_val", 1.0),
        num_sanity_val_steps=cfg.get("sanity", 0),
        reload_dataloaders_every_n_epochs=1 if cfg["setup"] == "hook" else 0,
        callbacks=callbacks,
        default_root_dir=out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Model(cfg), train_dataloaders=loader, val_dataloaders=val, ckpt_path=cfg.get("resume")
    )


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    main(json.loads(sys.argv[1]))
