"""A rank of an Accelerate run over a lake, launched by torchrun (tests/test_accelerate.py).

``accelerate launch --cpu --num_processes 2`` starts ONE process (its simple launcher:
accelerate/commands/launch.py:1413, multi-process only for ``--multi_gpu`` or a config file), so
the tests launch with torchrun, which Accelerate reads (MULTI_CPU, gloo).

``train``: the usual Accelerate loop with gradient accumulation 2, the loader from
``lakeloader.integrations.accelerate.prepare``, a step counter registered for checkpointing,
``accelerator.save_state(ckpt/step_NNNNN)`` at ``--save-at`` steps; on start, the newest
checkpoint is loaded with ``accelerator.load_state`` and the first epoch goes through
``accelerator.skip_first_batches(loader, resume_step)`` as torch-loader scripts do. With
``--kill-at S``, rank 0 sends itself SIGKILL right after step S. Each rank appends JSON lines
to ``{log_dir}/rank{R}-attempt{A}.jsonl``: ``start``, ``resume`` (the checkpoint's step),
``step`` (epoch, step, ids, sync_gradients, end_of_dataloader, device), ``save``, ``end``.

``accumulate``: gradient accumulation 2 over two epochs of the lake loader and of a torch
DataLoader over as many rows prepared by the same Accelerator; then device placement of a
batch type with its own ``.to()``, with and without ``device_placement``. One JSON line per
rank to ``{log_dir}/accumulate-rank{R}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

import lakeloader as ll
from lakeloader.integrations.accelerate import prepare


class Steps:
    """The step counter, saved with ``accelerator.save_state`` beside the loader."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


class Placed:
    """A batch with a device placement of its own (what ``send_to_device`` must honour)."""

    def __init__(self, ids: list[int], device: str | None = None) -> None:
        self.ids, self.device = ids, device

    def to(self, device: Any, non_blocking: bool = False) -> Placed:
        return Placed(self.ids, str(device))


def dataset(lake: str) -> ll.LakeDataset:
    return ll.LakeDataset(lake, seed=7, num_partitions=4, window=64, max_unit_rows=128)


def model_and_optimizer(acc: Accelerator) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    return acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))


def train_step(acc: Accelerator, model: Any, optimizer: Any, x: torch.Tensor) -> bool:
    """One batch under ``accumulate``; whether the optimizer stepped (gradients synced)."""
    with acc.accumulate(model):
        loss = model(x.float()[:, None] / 1000).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return bool(acc.sync_gradients)


def train(args: argparse.Namespace) -> None:
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    rank = acc.process_index
    log = (Path(args.log_dir) / f"rank{rank}-attempt{args.attempt}.jsonl").open("a")

    def write(kind: str, **fields: Any) -> None:
        log.write(json.dumps({"type": kind, "rank": rank, **fields}) + "\n")
        log.flush()

    write("start", pid=os.getpid(), world_size=acc.num_processes, device=str(acc.device))
    model, optimizer = model_and_optimizer(acc)
    loader = prepare(acc, ll.DataLoader(dataset(args.lake), batch_size=args.batch_size))
    steps = Steps()
    acc.register_for_checkpointing(steps)
    saved = sorted(Path(args.ckpt).glob("step_*"))
    resume_step = None
    if saved:
        acc.load_state(str(saved[-1]))
        write(
            "resume", step=steps.step, epoch=loader.epoch, position=loader.state_dict()["position"]
        )
        # what Accelerate's examples compute from the checkpoint's step (wrong on another
        # number of processes, and unneeded: the loader stands at its step)
        resume_step = steps.step % len(loader)
    first = loader.epoch
    for epoch in range(first, args.epochs):
        loader.set_epoch(epoch)
        active = loader
        if epoch == first and resume_step is not None:
            active = acc.skip_first_batches(loader, resume_step)
        for batch in active:
            sync = train_step(acc, model, optimizer, batch["x"])
            steps.step += 1
            write(
                "step",
                epoch=epoch,
                step=steps.step,
                ids=batch["id"].tolist(),
                sync=sync,
                end=acc.gradient_state.end_of_dataloader,
                device=str(batch["id"].device),
            )
            if steps.step in args.save_at:
                acc.save_state(str(Path(args.ckpt) / f"step_{steps.step:05d}"))
                write("save", step=steps.step)
            if steps.step == args.kill_at and rank == 0:
                write("kill", step=steps.step)
                os.kill(os.getpid(), signal.SIGKILL)
    write("end", step=steps.step)
    acc.end_training()


def accumulate(args: argparse.Namespace) -> None:
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model, optimizer = model_and_optimizer(acc)
    rows = len(dataset(args.lake))
    loaders = {
        "lake": prepare(acc, ll.DataLoader(dataset(args.lake), batch_size=args.batch_size)),
        "torch": acc.prepare(
            torch.utils.data.DataLoader(torch.arange(rows), batch_size=args.batch_size)
        ),
    }
    out: dict[str, Any] = {"device": str(acc.device)}
    for name, loader in loaders.items():
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            syncs, ends = [], []
            for batch in loader:
                x = batch["x"] if name == "lake" else batch
                syncs.append(train_step(acc, model, optimizer, x))
                ends.append(acc.gradient_state.end_of_dataloader)
            epochs.append({"steps": len(syncs), "syncs": syncs, "ends": ends})
        out[name] = {"len": len(loader), "epochs": epochs}
    # device placement through the batch's own .to(), and none when asked for none
    for placement in (True, False):
        plain = ll.DataLoader(
            dataset(args.lake),
            batch_size=args.batch_size,
            collate_fn=lambda rows: Placed([r["id"] for r in rows]),
        )
        batches = list(prepare(acc, plain, device_placement=placement))
        out[f"placed_{placement}"] = sorted({str(b.device) for b in batches})
    path = Path(args.log_dir) / f"accumulate-rank{acc.process_index}.json"
    path.write_text(json.dumps(out))
    acc.end_training()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["train", "accumulate"])
    parser.add_argument("--lake", required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, nargs="*", default=[])
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    train(args) if args.mode == "train" else accumulate(args)


if __name__ == "__main__":
    main()
