"""One rank of ``benchmarks/scale_ranks.py`` under torchrun (gloo on loopback).

``--mode barrier``: a few steps, then ``--saves`` checkpoints: each times the sync barrier
alone (``confirm_same_position``, what every ``CheckpointManager.save`` begins with) and the
whole save; then the state's size and ``CheckpointManager.load`` on every rank.
``--mode restart``: attempt 0 saves at step 5, then rank ``--victim`` SIGKILLs itself (the
others wait in a collective until torchrun stops them); attempt 1 (torchrun's restart) loads
the checkpoint and takes a batch. Every rank writes its timestamps (wall clock, seconds) to
``--out``/``<mode>-<attempt>-<rank>.json``: the process's start (before any import), imports
done, process group up, checkpoint loaded, first batch.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import msgpack  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lakeloader as ll  # noqa: E402
from lakeloader.checkpoint.barrier import confirm_same_position  # noqa: E402

IMPORTED = time.time()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lake", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["barrier", "restart"], required=True)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--victim", type=int, default=1)
    args = p.parse_args()
    faulthandler.dump_traceback_later(300, exit=True)  # a rank that hangs says where, and ends
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init_group(rank, attempt)
    times = {"started": STARTED, "imported": IMPORTED, "group": time.time()}
    ds = ll.LakeDataset(args.lake, progress=False)
    loader = ll.DataLoader(ds, batch_size=4)
    manager = ll.CheckpointManager(args.ckpt, ledger=False)
    out: dict[str, object] = {"rank": rank, "world": dist.get_world_size(), "attempt": attempt}
    if args.mode == "barrier":
        out.update(_barrier(loader, manager, ds, args.saves))
    elif attempt == 0:
        it = iter(loader)
        for _ in range(6):
            next(it)
        manager.save(5, loader)
        manager.wait()
        dist.barrier()
        if rank == args.victim:
            times["killed"] = time.time()
            _write(args, out, times, attempt, rank)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # waits for the victim until torchrun stops this attempt
    else:
        manager.load(loader)
        times["loaded"] = time.time()
        next(iter(loader))
        times["first_batch"] = time.time()
    _write(args, out, times, attempt, rank)
    loader.close()
    dist.destroy_process_group()


def _init_group(rank: int, attempt: int) -> None:
    """gloo over torchrun's store, under a prefix of the attempt's own.

    Without it, a restarted rank could read the gloo addresses that the ranks of the attempt
    before left in the store and fail on a dead one ("connectFullMesh failed ... Connection
    refused"), as seen with torch 2.13's torchrun when a rank was SIGKILLed.
    """
    world = int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent and rank == 0,
        multi_tenant=True,
    )
    store = dist.PrefixStore(f"lakeloader-attempt-{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _barrier(
    loader: ll.DataLoader, manager: ll.CheckpointManager, ds: ll.LakeDataset, saves: int
) -> dict[str, object]:
    it = iter(loader)
    next(it)
    barrier, save = [], []
    for step in range(saves):
        next(it)
        dist.barrier()
        began = time.perf_counter()
        confirm_same_position(loader.barrier_position(), None)
        barrier.append(time.perf_counter() - began)
        dist.barrier()
        began = time.perf_counter()
        manager.save(step, loader)
        manager.wait()
        save.append(time.perf_counter() - began)
    state = len(msgpack.packb(loader.state_dict()))
    fresh = ll.DataLoader(ds, batch_size=4)
    dist.barrier()
    began = time.perf_counter()
    manager.load(fresh)
    load = time.perf_counter() - began
    fresh.close()
    return {"barrier_s": barrier, "save_s": save, "state_bytes": state, "load_s": load}


def _write(
    args: argparse.Namespace,
    out: dict[str, object],
    times: dict[str, float],
    attempt: int,
    rank: int,
) -> None:
    path = Path(args.out) / f"{args.mode}-{attempt}-{rank}.json"
    path.write_text(json.dumps({**out, "times": times}))


if __name__ == "__main__":
    main()
