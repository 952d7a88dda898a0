"""Pretrain a tiny next-token model under DDP on packed token streams, launched by ``torchrun``.

Run it::

    python examples/pretrain_packed.py --make-lake /tmp/tokens --rows 2000
    torchrun --standalone --nproc-per-node=4 --max-restarts=1 examples/pretrain_packed.py \\
        --lake /tmp/tokens --ckpt /tmp/ckpt --log-dir /tmp/logs --steps 40 --resume

Every rank reads its share of each step's packed samples
(``LakeDataset(..., packing=Packing(...))``)
through ``lakeloader.DataLoader``; the global batch is 24 samples of 16 tokens whatever the
world size (1, 2, 3, 4, 6 or 8 ranks). Every ``--save-every`` steps, and at the end, every rank
calls ``CheckpointManager.save`` (a collective: the ranks' positions are compared; each rank
writes its shards of the model and the optimizer through ``torch.distributed.checkpoint``, rank
0 the loader's state: the samples delivered, the same on every rank). With ``--resume`` the
newest checkpoint restores the loader (under any world size), the model and the optimizer.

Logs: JSON lines in ``{log_dir}/rank{RANK}-attempt{N}.jsonl`` (``start``, ``resume``,
``step`` with the ``input_ids`` this rank trained on, ``kill``, ``end``), as in
``examples/train_ddp.py``, whose fault injection this shares: with ``LL_KILL_RANK=r`` and
``LL_KILL_AT_STEP=s``, on restart attempt 0, rank ``r`` SIGKILLs itself right after step ``s``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_ddp import Log, base_parser, init_distributed

import lakeloader as ll

SEQ, GLOBAL_SAMPLES, PARTITIONS, VOCAB, EOS = 16, 24, 4, 997, 0


def tokens_of(i: int) -> list[int]:
    """Row ``i``'s tokens: 0 to 24 of them, unique across the lake (ids ``i * 100 + j``)."""
    return [i * 100 + j + 1 for j in range((i * 7919) % 25)]


def make_lake(root: Path, rows: int) -> int:
    """Write ``rows`` rows of token lists in 4 files; return the rows written."""
    root.mkdir(parents=True, exist_ok=True)
    per = -(-rows // 4)
    for f in range(4):
        ids = list(range(f * per, min(rows, (f + 1) * per)))
        table = pa.table({"id": ids, "tokens": [tokens_of(i) for i in ids]})
        pq.write_table(table, root / f"part-{f}.parquet", row_group_size=100)
    return rows


def dataset(lake: Path) -> ll.LakeDataset:
    """The packed dataset every run of the example reads."""
    packing = ll.Packing("tokens", SEQ, eos_id=EOS)
    return ll.LakeDataset(
        lake, columns=["tokens"], seed=5, num_partitions=PARTITIONS, window=64, packing=packing
    )


def train(args: argparse.Namespace) -> None:
    """One rank's training run (see the module docstring)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_distributed(attempt)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(args.log_dir / f"rank{rank}-attempt{attempt}.jsonl", rank=rank, attempt=attempt)
    log.write("start", world_size=world, pid=os.getpid())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loader = ll.DataLoader(dataset(args.lake), batch_size=GLOBAL_SAMPLES // world)
    net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    model = DistributedDataParallel(net)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ll.CheckpointManager(args.ckpt)
    step = 0
    if args.resume and ckpt.latest() is not None:
        extra = ckpt.load(loader, model=net, optimizer=optim)
        step = int(extra["step"])
        log.write("resume", step=step)
    kill_rank = int(os.environ.get("LL_KILL_RANK", "-1"))
    kill_step = int(os.environ.get("LL_KILL_AT_STEP", "-1"))
    for batch in loader:
        if step >= args.steps:
            break
        step += 1
        ids = batch["input_ids"]
        logits = model(ids[:, :-1] % VOCAB)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), (ids[:, 1:] % VOCAB).reshape(-1)
        )
        optim.zero_grad()
        loss.backward()
        optim.step()
        log.write("step", step=step, input_ids=ids.tolist(), loss=float(loss))
        if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, loader, model=net, optimizer=optim, extra={"step": step})
        if attempt == 0 and rank == kill_rank and step == kill_step:
            log.write("kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
    log.write("end", step=step)
    ckpt.close()
    loader.close()
    log.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = base_parser(__doc__.split("\n")[0], 2000)
    p.add_argument("--steps", type=int, default=40, help="train until this global step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    args = p.parse_args(argv)
    if args.make_lake is not None:
        make_lake(args.make_lake, args.rows)
        return 0
    if args.lake is None or args.ckpt is None or args.log_dir is None:
        p.error("--lake, --ckpt and --log-dir are required to train")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
