"""A ``LakeTrainer`` run for tests/test_transformers.py, under torchrun or as one process.

Usage: ``python tests/transformers_child.py LAKE OUT LOG [options]``: trains a one-weight model
on the lake's ``x`` for 2 epochs (batch 8 per process, a checkpoint every 5 optimizer steps in
OUT) and appends JSON lines to ``LOG-rank{R}.jsonl``: ``start`` (the pid), ``resume`` (the
checkpoint taken), ``begin`` (the global step and epoch the Trainer starts from), one ``step``
per optimizer step (global step, ``state.epoch``, the loader's epoch, the learning rate after
the step, the ids trained in it on this rank, the weights after it), ``end`` (``state.global_step``,
``state.epoch``), and with ``--torch-reference`` ``torch`` (the optimizer steps of one epoch
of the plain Trainer over a torch dataset of the same rows).

Options: ``--ga N`` gradient accumulation; ``--resume`` (``resume_from_checkpoint=True``);
``--ignore-data-skip``; ``--kill-at STEP``: rank 0 SIGKILLs itself after that step;
``--torch-reference``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import lakeloader as ll
from lakeloader.integrations.transformers import LakeTrainer

BATCH = 8
EPOCHS = 2
SAVE_STEPS = 5


class Net(torch.nn.Module):
    """One weight fitting ``x``; keeps the ids of the rows it is given until they are logged."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen: list[int] = []

    def forward(self, id: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen += id.tolist()
        return {"loss": ((self.linear(x[:, None] / 500) - 1.0) ** 2).mean()}


class Log(TrainerCallback):
    """Appends a line per optimizer step; rank 0 SIGKILLs itself after step ``kill_at``."""

    def __init__(self, path: str, net: Net, kill_at: int | None) -> None:
        self.out = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed at exit)
        self.net, self.kill_at = net, kill_at

    def write(self, **record: Any) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.write(type="begin", step=state.global_step, epoch=state.epoch)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        loader = kw["train_dataloader"]
        self.write(
            type="step",
            step=state.global_step,
            epoch=state.epoch,
            loader_epoch=loader.epoch,
            lr=kw["lr_scheduler"].get_last_lr()[0],
            ids=self.net.seen,
            weights=[float(w.detach()) for w in self.net.parameters()],
        )
        self.net.seen = []
        if state.global_step == self.kill_at and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def training_args(out: str, ga: int = 1, epochs: int = EPOCHS, **kw: Any) -> TrainingArguments:
    """The runs' arguments (``kw`` overrides them): no logging, no column removed."""
    settings = {
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": BATCH,
        "gradient_accumulation_steps": ga,
        "num_train_epochs": epochs,
        "learning_rate": 0.01,
        "use_cpu": True,
        "report_to": [],
        "remove_unused_columns": False,
        "disable_tqdm": True,
        "logging_strategy": "no",
        "seed": 0,
        "ddp_find_unused_parameters": False,
    }
    return TrainingArguments(output_dir=out, **{**settings, **kw})


class Rows(torch.utils.data.Dataset[dict[str, Any]]):
    """The lake's rows as a torch map dataset (for the plain Trainer's step count)."""

    def __init__(self, lake: str) -> None:
        table = pq.read_table(lake, columns=["id", "x"])
        self.ids, self.xs = table["id"].to_pylist(), table["x"].to_pylist()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": self.ids[i], "x": self.xs[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("lake")
    p.add_argument("out")
    p.add_argument("log")
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ignore-data-skip", action="store_true")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--torch-reference", action="store_true")
    a = p.parse_args()
    transformers.logging.set_verbosity_error()
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # the same initial weights in every run
    net = Net()
    log = Log(f"{a.log}-rank{rank}.jsonl", net, a.kill_at)
    log.write(type="start", pid=os.getpid())
    args = training_args(
        a.out,
        a.ga,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        ignore_data_skip=a.ignore_data_skip,
    )
    ds = ll.LakeDataset(a.lake, seed=3, columns=["id", "x"])
    trainer = LakeTrainer(model=net, args=args, train_dataset=ds, callbacks=[log])
    if a.resume:
        checkpoint = get_last_checkpoint(a.out)  # what resume_from_checkpoint=True takes
        log.write(type="resume", checkpoint=Path(checkpoint).name if checkpoint else None)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    log.write(type="end", step=trainer.state.global_step, epoch=trainer.state.epoch)
    if a.torch_reference:
        plain = Trainer(
            model=Net(),
            args=training_args(f"{a.out}-torch", a.ga, epochs=1, save_strategy="no"),
            train_dataset=Rows(a.lake),
        )
        plain.train()
        log.write(type="torch", steps_per_epoch=plain.state.global_step)
    # Leave without freeing the DDP model: its process group's destructor may deadlock with
    # a gloo thread that needs the GIL, or abort (pytorch/pytorch#190489, PR #179291).
    log.out.close()
    if trainer.lake_loader is not None:
        trainer.lake_loader.close()  # its decoded units (os._exit runs no finaliser)
    if torch.distributed.is_initialized():
        # no rank leaves while another still talks to it: a peer's socket closing under a
        # gloo operation aborts the process ("terminate called without an active exception")
        torch.distributed.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
