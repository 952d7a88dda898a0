"""Train with PyTorch Lightning on a lakeloader lake: ``ll.DataLoader`` where torch's was.

Run the demo (2 CPU processes under Lightning's ``ddp``, on gloo)::

    pip install -e '.[lightning]'  # from the root of a clone of lakeloader
    python examples/train_lightning.py --demo

It writes a lake of ``--rows`` rows in a temporary folder that it names, trains ``--epochs``
epochs with a checkpoint every ``--save-every`` steps, and prints one JSON line: each epoch's
rows trained, missing and doubled, from the row ids every rank logs per step. On a lake of
your own::

    python examples/train_lightning.py --lake data/events --run runs/1 --devices 2

Run it again with the same ``--run`` (after a crash, on any ``--devices``): it resumes from
its ``checkpoints/last.ckpt``; every rank appends its steps' row ids to ``logs/``. The loader
is made at the script's top level; Lightning's ``ddp`` runs the script again in each other
process, and the loader takes its rank inside ``fit()``. ``LakeloaderCallback`` keeps the
resume exact from an end-of-epoch checkpoint and on another number of processes
(:mod:`lakeloader.integrations.lightning`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lakeloader as ll
from lakeloader.cli.demo import CLASSES, FEATURES, write_demo_lake
from lakeloader.integrations.lightning import LakeloaderCallback

#: The options a demo passes on to the processes Lightning starts.
TUNED = ("devices", "epochs", "batch_size", "save_every")


class Classifier(pl.LightningModule):
    """A linear classifier of ``label`` from ``f0..f7``; logs each step's row ids."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(len(FEATURES), CLASSES)
        self.log_dir = log_dir

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        with (self.log_dir / f"rank{self.global_rank}.jsonl").open("a") as fh:
            step = {"epoch": self.current_epoch, "step": self.global_step}
            fh.write(json.dumps({**step, "ids": batch["id"].tolist()}) + "\n")
        x = torch.stack([batch[f] for f in FEATURES], dim=1)
        return torch.nn.functional.cross_entropy(self.lin(x), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="a lake and a run of its own")
    p.add_argument("--lake", type=Path, help="the lake (a folder of Parquet files)")
    p.add_argument("--run", type=Path, help="the run's folder (resumed if it has a checkpoint)")
    p.add_argument("--devices", type=int, default=2, help="CPU processes (ddp when above 1)")
    p.add_argument("--rows", type=int, default=3000, help="--demo: rows of the lake")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="rows per process and step")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--summary", action="store_true", help="print each epoch's rows at the end")
    args = p.parse_args()
    if args.demo:
        work = Path(tempfile.mkdtemp(prefix="train_lightning-"))
        write_demo_lake(work / "lake", args.rows)
        print(f"the lake and the run go to {work}")
        # Lightning's ddp starts the other processes with this command line: the same folders
        sys.argv[1:] = ["--lake", str(work / "lake"), "--run", str(work / "run")]
        sys.argv += ["--summary", *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in TUNED)]
        return parse_args()
    if args.lake is None or args.run is None:
        p.error("--lake and --run are required (or --demo)")
    return args


def tally(log_dir: Path, rows: int) -> dict[str, Any]:
    """Rows of each epoch trained, missing and doubled, for a run without a crash."""
    epochs: dict[int, Counter[int]] = {}
    for path in log_dir.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            step = json.loads(line)
            epochs.setdefault(step["epoch"], Counter()).update(step["ids"])
    out = [
        {
            "epoch": e,
            "rows": sum(c.values()),
            "missing": rows - len(c),
            "doubled": sum(n - 1 for n in c.values()),
        }
        for e, c in sorted(epochs.items())
    ]
    return {"epochs": out, "exactly_once": all(e["missing"] == e["doubled"] == 0 for e in out)}


def main() -> None:
    args = parse_args()
    loader = ll.DataLoader(ll.LakeDataset(args.lake, seed=0), batch_size=args.batch_size)
    log_dir = args.run / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    checkpoints = args.run / "checkpoints"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[
            ModelCheckpoint(checkpoints, every_n_train_steps=args.save_every, save_last=True),
            LakeloaderCallback(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = checkpoints / "last.ckpt"
    trainer.fit(Classifier(log_dir), loader, ckpt_path=last if last.exists() else None)
    if args.summary and trainer.global_rank == 0:
        print(json.dumps(tally(log_dir, len(loader.dataset))))


if __name__ == "__main__":
    main()
