"""Train a tiny classifier under DDP (gloo, CPU) on a lakeloader lake, launched by ``torchrun``.

Run it::

    python examples/train_ddp.py --make-lake /tmp/lake --rows 4000
    torchrun --standalone --nproc-per-node=3 --max-restarts=1 examples/train_ddp.py \\
        --lake /tmp/lake --ckpt /tmp/ckpt --log-dir /tmp/logs --epochs 2 --resume

Each rank reads its share of every global batch through ``lakeloader.DataLoader`` (rank and
world size come from ``torch.distributed`` once the gloo process group is up). The model is
wrapped in ``DistributedDataParallel``; the loss of a step is the mean cross-entropy over the
whole global batch: each rank back-propagates ``sum of its rows' losses * world_size / rows of
the global batch`` (DDP averages gradients over ranks), so a short last batch, or a rank that
gets no row of it, weighs exactly what it should. The rows of the global batch are the growth
of the loader's position ``G`` over the step, so no collective is needed to count them.

``--max-steps N`` stops the run at global step ``N`` (saving there), wherever it falls in an
epoch; the tests use it to hand a run over to another world size in the middle of an epoch.

``--fsdp`` shards the model with FSDP2 (``fully_shard`` on a CPU device mesh) instead of
wrapping it in DDP; the loss and the gradients mean the same.

Checkpoints: every ``--save-every`` steps, and once more at the end of the run, every rank calls
``CheckpointManager.save(step, loader, model=model, optimizer=optim, extra=...)`` (a
collective: the ranks' loader positions are compared with an all-gather, each rank writes its
shards of the model and the optimizer through ``torch.distributed.checkpoint``, rank 0 writes
the loader's position, every rank's random generators and the context, then ``COMMIT``).
``extra`` is ``{"step": int, "epoch": int}``; ``--async-save`` writes them in the background
(DCP's ``async_save`` on a process group of its own). With ``--resume``, the newest checkpoint (if
any) restores the loader (under any world size, worker count or batch size), the model and
the optimizer (resharded onto this world size) and the generators, and the step counter goes
on from the saved step. Torchrun's restarts pass the same arguments, so ``--resume`` is how a
restarted group picks up where the last checkpoint left it. The manager's audit ledger records
every step (``lakeloader audit CKPT`` proves the run exactly once).

``--preemptible`` catches SIGTERM (``lakeloader.Preemption``): at the next step boundary every
rank learns that one was signalled, a checkpoint of that step is saved, and the run ends with
status 0 (a ``preempted`` record).

Logs: every rank appends JSON lines to ``{log_dir}/rank{RANK}-attempt{N}.jsonl`` (``N`` is
torchrun's ``TORCHELASTIC_RESTART_COUNT``), flushed after each line. Record types:

- ``start``: attempt, rank, world_size, batch_size, num_workers, pid;
- ``resume``: the checkpoint ``step`` and the loader's ``epoch`` and ``position`` it restored;
- ``step``: attempt, rank, epoch, global step, the loader ``position`` after the step, the
  ``rows`` of the global batch, the row ``ids`` this rank trained on, ``loss`` (the global
  batch's mean loss, all-reduced in float64) and ``local_loss_sum`` (this rank's float32 sum),
  both as ``float.hex`` so that they round-trip exactly;
- ``save``: a checkpoint of ``step`` was saved; ``kill``: the fault injection fires;
- ``preempted``: a SIGTERM was agreed on at ``step`` (saved, then the loop ends);
- ``end``: the run finished at ``step``.

Every record also has ``time`` (Unix seconds).

Fault injection (for tests): with ``LL_KILL_RANK=r`` and ``LL_KILL_AT_STEP=s`` in the
environment, on restart attempt 0 only, rank ``r`` logs a ``kill`` record and sends itself
``SIGKILL`` right after step ``s`` is finished: trained, logged, and checkpointed if ``s`` is a
save step. ``LL_TERM_RANK`` and ``LL_TERM_AT_STEP`` do the same with ``SIGTERM`` (a ``term``
record), the notice of a preemptible machine.

Determinism: torch is seeded and runs on one thread with deterministic algorithms; the loader's
order does not depend on the topology; DDP reduces gradients with gloo on CPU, which for a
fixed world size and a fixed bucket layout gives the same bits every run. The layout is the
catch: DDP fills its flat gradient bucket in parameter order at construction and, after the
first iteration, rebuilds it in the order gradients became ready (here ``3 2 1 0`` instead of
``0 1 2 3``). Gloo sums each element in an order that depends on its offset in the bucket, so
the first step after a resume (a fresh DDP, the initial layout) would reduce differently from
the uninterrupted run (long since on the rebuilt layout) and the losses would drift apart in
the last bits from there on. DDP never rebuilds buckets with ``find_unused_parameters=True``,
so the script sets it (at the cost of one walk of the autograd graph per step and a warning
from DDP that no parameter was unused). With that, and an unchanged topology, the losses after
a resume are bit-identical to those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import lakeloader as ll
from lakeloader.cli.demo import CLASSES, FEATURES, write_demo_lake

SEED = 0
STORE_TIMEOUT = datetime.timedelta(minutes=5)


def make_lake(root: Path, rows: int) -> int:
    """Write a small deterministic lake: ``id`` int64, float32 ``f0..f7``, int64 ``label``."""
    return write_demo_lake(root, rows, seed=SEED)


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(len(FEATURES), 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, CLASSES),
    )


class Log:
    """One JSON line per record, flushed at once (a SIGKILL loses nothing written)."""

    def __init__(self, path: Path, **common: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh: TextIO = path.open("a", encoding="utf-8")
        self.common = common

    def write(self, kind: str, **fields: Any) -> None:
        record = {"type": kind, **self.common, **fields, "time": round(time.time(), 3)}
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()

    def close(self) -> None:
        self.fh.close()


def init_distributed(attempt: int) -> None:
    """``init_process_group("gloo")``, in a store namespace of its own for each restart attempt.

    torchrun's c10d rendezvous shares its TCPStore with the workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps that same store across restarts, so a
    restarted group finds the keys of the group it replaces: gloo connects to the dead
    processes' ports ("Gloo connectFullMesh failed ... Connection refused") or the store
    barrier of ``init_process_group`` waits for ever (torch 2.13; pytorch/pytorch#135712).
    Prefixing the store with the restart attempt gives each attempt fresh keys. That is sound
    on one node; across nodes the agents' restart counts can differ, so there run torchrun
    with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per rendezvous round), which
    this function leaves alone.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=STORE_TIMEOUT)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=STORE_TIMEOUT,
    )
    prefixed = dist.PrefixStore(f"train_ddp/attempt-{attempt}/", store)
    dist.init_process_group(
        "gloo", store=prefixed, rank=rank, world_size=world, timeout=STORE_TIMEOUT
    )


def base_parser(description: str, rows: int) -> argparse.ArgumentParser:
    """The arguments of this example and ``pretrain_packed.py``: the lake, checkpoints, logs."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--make-lake", type=Path, help="write a lake here and exit")
    p.add_argument("--rows", type=int, default=rows, help="rows of --make-lake")
    p.add_argument("--lake", type=Path, help="the lake to train on")
    p.add_argument("--ckpt", help="checkpoint folder (any fsspec URL)")
    p.add_argument("--log-dir", type=Path, help="per-rank JSON-lines logs")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__.split("\n")[0], 4000)
    p.add_argument("--epochs", type=int, default=2, help="train until this many epochs are done")
    p.add_argument("--max-steps", type=int, default=0, help="stop at this global step (0: none)")
    p.add_argument("--batch-size", type=int, default=16, help="rows per rank per step")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--save-every", type=int, default=5, help="0: only at the end")
    p.add_argument("--resume", action="store_true", help="load the newest checkpoint if any")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2, not DDP")
    p.add_argument("--preemptible", action="store_true", help="save and stop on SIGTERM")
    p.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    args = p.parse_args(argv)
    if args.make_lake is None and None in (args.lake, args.ckpt, args.log_dir):
        p.error("--lake, --ckpt and --log-dir are required (or --make-lake)")
    return args


def train(args: argparse.Namespace) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill_rank = int(os.environ.get("LL_KILL_RANK", "-1"))
    kill_step = int(os.environ.get("LL_KILL_AT_STEP", "-1"))
    term_rank = int(os.environ.get("LL_TERM_RANK", "-1"))
    term_step = int(os.environ.get("LL_TERM_AT_STEP", "-1"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    init_distributed(attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(args.log_dir / f"rank{rank}-attempt{attempt}.jsonl", attempt=attempt, rank=rank)
    log.write(
        "start",
        world_size=world,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        pid=os.getpid(),
    )

    ds = ll.LakeDataset(args.lake, columns=["id", *FEATURES, "label"], seed=SEED)
    loader = ll.DataLoader(ds, batch_size=args.batch_size, num_workers=args.num_workers)
    ckpt = ll.CheckpointManager(args.ckpt, async_save=args.async_save, ledger_flush_seconds=0)
    ckpt.attach(loader)
    model = make_model()
    if args.fsdp:
        shard(model, world)
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    if args.resume and ckpt.latest() is not None:
        extra = ckpt.load(loader, model=model, optimizer=optim)
        step = int(extra["step"])
        state = loader.state_dict()
        log.write("resume", step=step, epoch=state["epoch"], position=state["position"])
    # find_unused_parameters=True keeps DDP's first gradient-bucket layout for the whole run
    # (see the module docstring): a restarted process reduces in the same order as before.
    net = model if args.fsdp else DistributedDataParallel(model, find_unused_parameters=True)

    state = loader.state_dict()
    epoch = state["epoch"]
    if state["position"] > 0 and state["position"] + state["rows_dropped"] >= state["num_rows"]:
        epoch += 1  # the saved epoch was complete
    saved_at = step
    stop = bool(args.max_steps) and step >= args.max_steps
    with ll.Preemption() if args.preemptible else contextlib.nullcontext() as preempt:
        while epoch < args.epochs and not stop:
            loader.set_epoch(epoch)  # keeps a just-loaded position of this epoch
            batches = iter(loader)
            assert loader.epoch == epoch, f"the loader runs epoch {loader.epoch}, not {epoch}"
            before = loader.state_dict()["position"]
            for batch in batches:
                after = loader.state_dict()["position"]
                rows, before = after - before, after
                x = torch.stack([batch[f] for f in FEATURES], 1)
                y = batch["label"]
                loss_sum = torch.nn.functional.cross_entropy(net(x), y, reduction="sum")
                optim.zero_grad()
                (loss_sum * (world / rows)).backward()  # ranks average: the global batch's mean
                optim.step()
                step += 1
                total = loss_sum.detach().to(torch.float64)
                dist.all_reduce(total)
                log.write(
                    "step",
                    epoch=epoch,
                    step=step,
                    position=after,
                    rows=rows,
                    ids=batch["id"].tolist(),
                    loss=(total.item() / rows).hex(),
                    local_loss_sum=loss_sum.item().hex(),
                )
                if args.save_every and step % args.save_every == 0:
                    save(ckpt, step, epoch, loader, model, optim)
                    saved_at = step
                    log.write("save", step=step)
                if attempt == 0 and rank == kill_rank and step == kill_step:
                    log.write("kill", step=step)
                    os.kill(os.getpid(), signal.SIGKILL)
                if attempt == 0 and rank == term_rank and step == term_step:
                    log.write("term", step=step)
                    os.kill(os.getpid(), signal.SIGTERM)  # the machine's preemption notice
                if preempt is not None and preempt.requested():
                    log.write("preempted", step=step, signal=preempt.signalled)
                    stop = True
                    break
                if args.max_steps and step >= args.max_steps:
                    stop = True
                    break
            epoch += 1
        if step != saved_at:
            save(ckpt, step, loader.epoch, loader, model, optim)
            log.write("save", step=step)
    ckpt.close()
    loader.close()
    log.write("end", step=step, epoch=loader.epoch)
    log.close()
    # DDP's reducer holds the process group. Dropped last, with the GIL held, it would run
    # the gloo group's destructor, which joins a thread that may need the GIL to free the
    # final barrier's tensor: a hang at exit (pytorch/pytorch#56297). So drop the model
    # first, and let destroy_process_group (which releases the GIL) end the group.
    del net
    dist.barrier()
    dist.destroy_process_group()


def shard(model: torch.nn.Module, world: int) -> None:
    """FSDP2: each linear layer, then the whole model, sharded over a CPU mesh of the ranks."""
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.children():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def save(
    ckpt: ll.CheckpointManager,
    step: int,
    epoch: int,
    loader: ll.DataLoader,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
) -> None:
    """Collective: every rank writes its shards; rank 0 the loader's position and extras."""
    ckpt.save(step, loader, model=model, optimizer=optim, extra={"step": step, "epoch": epoch})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.make_lake is not None:
        rows = make_lake(args.make_lake, args.rows)
        print(f"wrote {rows} rows to {args.make_lake}")
        return
    train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
