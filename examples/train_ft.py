"""Fault-tolerant training with torchft on a lakeloader lake: replica groups die and join, no
process restarts, every committed row of each epoch trained on exactly once.

Run the whole story (a torchft Lighthouse, three replica groups of one process each, gloo on
CPU, one group SIGKILLed mid-epoch, a replacement that joins)::

    pip install -e '.[ft]'  # from the root of a clone of lakeloader
    python examples/train_ft.py --demo

It writes a lake of ``--rows`` rows and the logs to a temporary folder that it names (choose
them with ``--lake`` and ``--log-dir``; ``--make-lake DIR`` only writes a lake). torchft's
Lighthouse and managers log at INFO through Rust's ``RUST_LOG`` (a thousand lines for the
demo): the example sets ``RUST_LOG=warn`` unless ``--verbose`` or ``RUST_LOG`` is given.

or one replica group by hand, against a Lighthouse of your own (``torchft_lighthouse``)::

    python examples/train_ft.py --lake /tmp/ftlake --log-dir /tmp/ftlogs \\
        --replica-id 0 --lighthouse http://127.0.0.1:29510

Each group trains the classifier of ``train_ddp.py`` with torchft's ``DistributedDataParallel``
(gradients averaged over the step's participants) and reads through
``lakeloader.FaultTolerantLoader``: each step, the loader starts torchft's quorum and hands the
group its share of the global step at the committed position, sliced for the step's
participants; the position moves only when ``manager.should_commit()`` commits the step. When
a group dies, the survivors' next step is re-sliced for two; a group that joins receives the
model, the optimizer and the loader's position from a healthy peer. The manager runs a
synchronous quorum (``use_async_quorum=False``), so a joining group takes part in its first
step with the state it healed from.

Logs: each group appends JSON lines to ``{log_dir}/replica{ID}.jsonl``, the records of
``train_ddp.py``: ``start`` (replica, pid), ``step`` (epoch, ``step`` = the manager's committed
step count after it, ``position`` where the step began, ``rows`` of the global step, this
group's row ``ids``, ``loss`` and ``local_loss_sum`` as ``float.hex``) with ``committed``,
``participants`` and ``rank``; ``end``. ``--demo`` ends with one JSON summary line on stdout:
the rows of each epoch in committed steps, how many were missing or doubled, the time from
the kill to the survivors' next committed step, and when the replacement took part.

torchft 0.2.0's ``DistributedDataParallel`` asserts when a peer dies in the middle of the
gradient all-reduce (its hook asserts on a future the failed work never built) and takes the
survivors down; ``SafeDDP`` below returns the bucket as it is instead: the manager has recorded
the error, so ``should_commit()`` is False and the step is handed out again.
"""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations at runtime.
import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# torchft's Rust logging reads RUST_LOG when torchft is imported (its replica groups inherit it)
os.environ.setdefault("RUST_LOG", "info" if "--verbose" in sys.argv else "warn")

import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
from torchft.coordination import LighthouseServer
from train_ddp import SEED, Log, base_parser, make_lake, make_model

import lakeloader as ll
from lakeloader.cli.demo import FEATURES

TIMEOUT = datetime.timedelta(seconds=5)  # a dead peer is noticed within this


class SafeDDP(DistributedDataParallel):  # type: ignore[misc]
    """torchft's DDP, surviving a peer that dies during the gradient all-reduce."""

    @staticmethod
    def _comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        ok = work.wait()
        inner = getattr(work.get_future(), "_fut", None)
        if not ok or inner is None:  # the manager has the error: the step will not commit
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return inner  # type: ignore[no-any-return]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = base_parser(__doc__.split("\n")[0], 6000)
    p.add_argument("--replica-id", help="run one replica group with this id")
    p.add_argument("--lighthouse", help="the Lighthouse's URL (for --replica-id)")
    p.add_argument("--demo", action="store_true", help="Lighthouse, 3 groups, a kill, a join")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="rows per group per step")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds of 'compute' a step")
    p.add_argument("--kill-at-step", type=int, default=20, help="--demo: kill group 1 here")
    p.add_argument("--join-after", type=Path, help="start, then join once this file exists")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--verbose", action="store_true", help="torchft's INFO logs (RUST_LOG=info)")
    args = p.parse_args(argv)
    one_group = (args.lake, args.log_dir, args.replica_id, args.lighthouse)
    if args.make_lake is None and not args.demo and None in one_group:
        p.error("--lake, --log-dir, --replica-id and --lighthouse are required (or --demo)")
    return args


def replica(args: argparse.Namespace) -> None:
    """One replica group: train until the epochs are done, whoever else comes and goes."""
    torch.set_num_threads(1)
    log = Log(args.log_dir / f"replica{args.replica_id}.jsonl", replica=args.replica_id)
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    while args.join_after is not None and not args.join_after.exists():
        time.sleep(0.02)  # started (imports done) ahead of its turn: it joins at once
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            optim.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        timeout=TIMEOUT,
        quorum_timeout=datetime.timedelta(seconds=60),
        connect_timeout=TIMEOUT,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"train_ft_{args.replica_id}",
        hostname="127.0.0.1",
        heartbeat_interval=datetime.timedelta(milliseconds=100),
    )
    net = SafeDDP(manager, model)
    ds = ll.LakeDataset(args.lake, columns=["id", *FEATURES, "label"], seed=SEED)
    loader = ll.FaultTolerantLoader(ds, manager, batch_size=args.batch_size)
    log.write("start", pid=os.getpid(), batch_size=args.batch_size)
    # the loader's epoch, not a counter of this process's: a group that joins late heals into
    # its peers' epoch
    while loader.epoch < args.epochs:
        epoch = loader.epoch
        for batch in loader:  # starts the step's quorum, slices for its participants
            x = torch.stack([batch[f] for f in FEATURES], 1)
            optim.zero_grad()
            loss_sum = torch.nn.functional.cross_entropy(net(x), batch["label"], reduction="sum")
            # torchft averages gradients over the participants: the global batch's mean
            (loss_sum * (loader.participants / loader.step_rows)).backward()
            total = loss_sum.detach().to(torch.float64).reshape(1)
            manager.allreduce(total).wait()  # the participants' mean of the sums
            committed = manager.should_commit()
            if committed:
                optim.step()
            log.write(
                "step",
                epoch=loader.epoch,
                step=manager.current_step(),
                position=loader.position,
                rows=loader.step_rows,
                ids=batch["id"].tolist(),
                loss=(total.item() * loader.participants / loader.step_rows).hex(),
                local_loss_sum=loss_sum.item().hex(),
                committed=committed,
                participants=loader.participants,
                rank=loader.participating_rank,
            )
            time.sleep(args.step_sleep)
        loader.set_epoch(max(epoch, loader.epoch) + 1)
    log.write("end", step=manager.current_step(), epoch=loader.epoch)
    log.close()
    loader.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads can hold the interpreter's exit


# --------------------------------------------------------------------------- the demo
def records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a replica's log."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    return [json.loads(line) for line in lines if line]


def committed_rows(log_dir: Path) -> dict[int, Counter[int]]:
    """Per epoch, how often each row id appears in committed steps (one share per group)."""
    out: dict[int, Counter[int]] = {}
    for path in sorted(log_dir.glob("replica*.jsonl")):
        for r in records(path):
            if r["type"] == "step" and r["committed"] and r["rank"] is not None:
                out.setdefault(r["epoch"], Counter()).update(r["ids"])
    return out


def wait_for(
    what: str, check: Any, procs: dict[str, subprocess.Popen[bytes]], timeout: float = 120.0
) -> Any:
    """Poll ``check`` until it returns something; fail at once if a group process failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        failed = {rid: p.returncode for rid, p in procs.items() if p.poll() not in (None, 0, -9)}
        if failed:
            raise RuntimeError(f"train_ft --demo: replica group(s) failed {failed} ({what})")
        time.sleep(0.05)
    raise TimeoutError(f"train_ft --demo: timed out waiting for {what}")


def demo_folders(args: argparse.Namespace) -> None:
    """Fill in the demo's ``--lake`` (written) and ``--log-dir`` in a temporary folder."""
    if args.lake is not None and args.log_dir is not None:
        return
    work = Path(tempfile.mkdtemp(prefix="train_ft-"))
    if args.lake is None:
        args.lake = work / "lake"
        print(f"wrote a lake of {make_lake(args.lake, args.rows):,} rows to {args.lake}")
    if args.log_dir is None:
        args.log_dir = work / "logs"
    print(f"logs go to {args.log_dir}", flush=True)


def demo(args: argparse.Namespace) -> int:
    """Lighthouse, 3 groups, group 1 SIGKILLed mid-epoch, a replacement joins; summary."""
    demo_folders(args)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=2,
        join_timeout_ms=200,
        quorum_tick_ms=50,
        heartbeat_timeout_ms=1000,
    )
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(rid: str, *extra: str) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--lake",
            str(args.lake),
            "--log-dir",
            str(args.log_dir),
            "--replica-id",
            rid,
            "--lighthouse",
            address,
            "--epochs",
            str(args.epochs),
            "--batch-size",
            str(args.batch_size),
            "--step-sleep",
            str(args.step_sleep),
            *extra,
        ]
        with (args.log_dir / f"replica{rid}.out").open("wb") as out:
            procs[rid] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def steps(rid: str) -> list[dict[str, Any]]:
        return [r for r in records(args.log_dir / f"replica{rid}.jsonl") if r["type"] == "step"]

    try:
        for rid in "012":
            launch(rid)
        wait_for(
            "3 groups training",
            lambda: all(
                any(r["committed"] and r["step"] >= args.kill_at_step for r in steps(rid))
                for rid in "012"
            ),
            procs,
        )
        killed_at = time.time()
        procs["1"].send_signal(signal.SIGKILL)
        procs["1"].wait()
        go = args.log_dir / "replacement-joins"
        launch("3", "--join-after", str(go))  # its start-up overlaps the survivors' recovery
        first = wait_for(
            "the survivors' next commit",
            lambda: [
                r
                for rid in "02"
                for r in steps(rid)
                if r["time"] > killed_at and r["committed"] and r["participants"] == 2
            ],
            procs,
        )
        recovery = min(r["time"] for r in first) - killed_at
        joined_at = time.time()
        go.touch()
        taking_part = wait_for(
            "the replacement taking part",
            lambda: [r for r in steps("3") if r["committed"] and r["participants"] == 3],
            procs,
        )
        for rid in "023":
            procs[rid].wait(timeout=300)
        survivors_pids = {rid: procs[rid].pid for rid in "02"}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lighthouse.shutdown()
    rows = len(ll.LakeDataset(args.lake))
    per_epoch = committed_rows(args.log_dir)
    epochs = []
    for epoch in range(args.epochs):
        seen = per_epoch.get(epoch, Counter())
        epochs.append(
            {
                "epoch": epoch,
                "rows": rows,
                "trained": sum(seen.values()),
                "missing": rows - len(seen),
                "doubled": sum(1 for n in seen.values() if n > 1),
            }
        )
    ok = all(e["missing"] == 0 and e["doubled"] == 0 for e in epochs)
    logs = {rid: records(args.log_dir / f"replica{rid}.jsonl") for rid in "023"}
    ends = {rid: [r for r in log if r["type"] == "end"] for rid, log in logs.items()}
    starts = {rid: [r["pid"] for r in logs[rid] if r["type"] == "start"] for rid in "02"}
    summary = {
        "type": "summary",
        "exactly_once": ok,
        "epochs": epochs,
        "killed": "1",
        "kill_to_next_commit_seconds": round(recovery, 3),
        "replacement_first_step": taking_part[0]["step"],
        "replacement_launch_to_taking_part_seconds": round(taking_part[0]["time"] - joined_at, 3),
        "survivors_restarted": any(starts[rid] != [pid] for rid, pid in survivors_pids.items()),
        "survivor_pids": survivors_pids,
        "final_steps": {rid: e[-1]["step"] if e else None for rid, e in ends.items()},
    }
    print(json.dumps(summary))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_lake is not None:
        written = make_lake(args.make_lake, args.rows)
        print(f"wrote {written} rows to {args.make_lake}")
        return 0
    if args.demo:
        return demo(args)
    replica(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
