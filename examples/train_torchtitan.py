"""Train under torchtitan's checkpointing on a lakeloader lake (torchrun, gloo, CPU).

Run it::

    python examples/train_torchtitan.py --make-lake /tmp/lake --rows 4000
    torchrun --standalone --nproc-per-node=2 examples/train_torchtitan.py \\
        --lake /tmp/lake --dump /tmp/run --steps 80 --interval 10

``LakeTitanLoader`` is a torchtitan dataloader (a ``BaseDataLoader``, built from its ``Config``
with the keyword arguments torchtitan's ``Trainer`` passes: ``dp_world_size``, ``dp_rank``,
``local_batch_size``, ...) over an ``endless=True`` :class:`lakeloader.DataLoader`: torchtitan
calls ``iter()`` once for the whole run and takes ``StopIteration`` for "ran out of data", so
the loader runs epoch after epoch. Batches are ``({"input": ids}, labels)``, left on the CPU.
Its rank and world size are the data-parallel ones (torchtitan's ``"batch"`` mesh), not the
global rank: ranks of one data-parallel group must get the same batches.

torchtitan's ``CheckpointManager`` (``torchtitan.components.checkpoint``, 0.3.0) holds the
loader under ``"dataloader"`` beside the model, the optimizers, the LR schedulers and the train
state, and hands it to ``torch.distributed.checkpoint`` as a ``Stateful``: ``dcp.save`` calls
``state_dict()`` on every rank, ``dcp.load`` calls it for the keys to read, then
``load_state_dict()``. The loader's state is its global position (the same on every rank), so
it is saved under one key, ``"dataloader.lakeloader"``, one JSON string (a leaf whose shape
never depends on the content, so that a fresh loader's template matches any saved state): DCP
keeps one copy of a key that every rank writes, and every rank reads that copy back, under
any number of data-parallel ranks. (torchtitan's own dataloaders key their state by
``dp_rank_N`` and refuse another data-parallel degree on load.) Load before ``iter()``.

The loop is torchtitan's ``Trainer.train`` in miniature: ``checkpointer.load(step=-1)``,
``data_iterator = iter(dataloader)``, then per step ``--accum`` micro-batches (torchtitan's
gradient accumulation), gradients averaged over the ranks, an optimizer and scheduler step,
``checkpointer.save(step, last_step=...)`` every ``--interval`` steps and at the last step. That
one is a whole checkpoint here (``last_save_model_only=False``), so a run can be taken further
with a larger ``--steps``; torchtitan's default saves the model alone at the last step, and a
load of such a checkpoint fails in DCP with "Missing key in checkpoint state_dict:
dataloader.lakeloader" (for the optimizer too).

Needs ``pip install torchtitan==0.3.0`` (checked with torch 2.13.0 on CPU; it brings
datasets<4.8, tensorboard, wandb, tyro, spmd_types, torch_checkpointing and torchdata).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

import lakeloader as ll

#: The loader's key in its state dict: DCP saves it as ``dataloader.lakeloader``.
STATE_KEY = "lakeloader"
BUCKETS = 1024  # the model embeds row ids modulo this


class LakeTitanLoader(BaseDataLoader):
    """A torchtitan dataloader over a lake: endless, global state, any data-parallel degree.

    Args:
        config: The lake and its columns.
        dp_world_size: Data-parallel ranks (torchtitan's ``"batch"`` mesh size).
        dp_rank: This rank among them.
        local_batch_size: Rows per rank per micro-batch.
        **unused: What else torchtitan's ``Trainer`` passes (tokenizer, seq_len, ...).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """``dataset_path``: the lake (a folder or URL)."""

        seed: int = 0
        input_column: str = "id"
        label_column: str = "label"
        num_workers: int = 0

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        local_batch_size: int,
        **unused: Any,
    ) -> None:
        if not config.dataset_path:
            raise ValueError("LakeTitanLoader.Config.dataset_path names no lake")
        self.config = config
        self.loader = ll.DataLoader(
            ll.LakeDataset(config.dataset_path, seed=config.seed),
            batch_size=local_batch_size,
            num_workers=config.num_workers,
            rank=dp_rank,
            world_size=dp_world_size,
            endless=True,
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        c = self.config
        for batch in self.loader:
            yield {"input": batch[c.input_column]}, batch[c.label_column]

    @property
    def epoch(self) -> int:
        """The epoch of the last batch delivered."""
        return self.loader.epoch

    def state_dict(self) -> dict[str, Any]:
        """The global position, one JSON string under one key (the same on every rank)."""
        return {STATE_KEY: json.dumps(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position saved under any number of data-parallel ranks."""
        if state_dict.get(STATE_KEY):  # torchtitan passes {} for "nothing saved"
            self.loader.load_state_dict(json.loads(state_dict[STATE_KEY]))

    def close(self) -> None:
        self.loader.close()


class TrainState:
    """The step counter, a ``Stateful`` saved beside the rest (torchtitan's ``train_state``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class RowClassifier(torch.nn.Module):
    """Embeds row ids (as a language model embeds token ids) and classifies them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(BUCKETS, 16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input % BUCKETS))


def make_lake(root: Path, rows: int) -> None:
    """Write ``rows`` rows (``id`` 0..rows-1, ``label`` 0..9) in files of 1000."""
    root.mkdir(parents=True, exist_ok=True)
    for start in range(0, rows, 1000):
        ids = np.arange(start, min(rows, start + 1000), dtype=np.int64)
        table = pa.table({"id": ids, "label": ids * 7 % 10})
        pq.write_table(table, root / f"part-{start:08d}.parquet")


#: Called after each step's save: the step and, per micro-batch, its epoch and row ids.
OnStep = Callable[[int, list[tuple[int, list[int]]]], None]


def train(args: argparse.Namespace, on_step: OnStep | None = None) -> int:
    """Train to ``args.steps`` (resuming from the newest checkpoint); the last step done."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dataloader = LakeTitanLoader.Config(dataset_path=str(args.lake), seed=args.seed).build(
        dp_world_size=world, dp_rank=dist.get_rank(), local_batch_size=args.batch_size
    )
    model = RowClassifier()
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": args.lr})
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps
    )
    state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=args.interval,
        keep_latest_k=0,
        last_save_model_only=False,  # the last step's checkpoint can be trained on from
    ).build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=str(args.dump),
    )
    try:
        checkpointer.load(step=-1)  # before iter(): the loader goes on from its saved position
        data_iterator = iter(dataloader)
        while state.step < args.steps:
            micro = []
            for _ in range(args.accum):  # an endless loader never runs out (StopIteration)
                inputs, labels = next(data_iterator)
                micro.append((dataloader.epoch, inputs["input"].tolist()))
                loss = torch.nn.functional.cross_entropy(model(inputs["input"]), labels.long())
                (loss / args.accum).backward()
            for p in model.parameters():  # what torchtitan's data parallelism does
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
            optimizers.step()
            optimizers.zero_grad()
            schedulers.step()
            state.step += 1
            checkpointer.save(state.step, last_step=state.step == args.steps)
            if on_step is not None:
                on_step(state.step, micro)
        return state.step
    finally:
        checkpointer.close()
        dataloader.close()
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--make-lake", type=Path, help="write a lake here and exit")
    p.add_argument("--rows", type=int, default=4000, help="rows of --make-lake")
    p.add_argument("--lake", type=Path, help="the lake to train on")
    p.add_argument("--dump", type=Path, help="torchtitan's dump folder (checkpoints in it)")
    p.add_argument("--steps", type=int, default=80, help="train until this step")
    p.add_argument("--batch-size", type=int, default=32, help="rows per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args(argv)
    if args.make_lake is None and None in (args.lake, args.dump):
        p.error("--lake and --dump are required (or --make-lake)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make_lake is not None:
        make_lake(args.make_lake, args.rows)
        return
    train(args)


if __name__ == "__main__":
    main()
