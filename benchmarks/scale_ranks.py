"""Scale with real ranks: the checkpoint barrier, the state, load, and a restart after a loss.

``benchmarks/scale.py`` measures the order and the recovery as pure functions at 256 x 8 ranks
in one process; this measures what runs between processes (issue 32, item 4):

gloo processes (``torchrun``, loopback, as many as this machine holds)
    Each world size runs ``benchmarks/_ranks_child.py --mode barrier``: a loader per rank
    over a small local lake, then ``SAVES`` checkpoints. Per save: the sync barrier alone
    (``checkpoint.barrier.confirm_same_position``, the flat ``all_gather_object`` every
    ``CheckpointManager.save`` begins with; the slowest rank's time) and the whole save; then
    the state's size (msgpack) and ``CheckpointManager.load`` on every rank at once.
torch's threaded process group (one process, a thread a rank)
    The barrier alone up to 1,024 ranks, beside the flat ``all_gather_object`` of every
    rank's stand that it was before (up to ``FLAT_UP_TO`` ranks). Every rank's work runs in
    this one process, one thread at a time (the GIL): the wall time of a barrier is the sum of
    every rank's part, so ``per rank`` (wall / ranks) is what one rank of a real job spends
    on it besides the network.
A lost process (``torchrun --max-restarts=1``)
    ``--mode restart`` on the largest world size: a checkpoint at step 5, then one rank
    SIGKILLs itself; torchrun stops the others and starts every rank again, which load the
    checkpoint and take a batch. Split: restart (the kill to the new processes' start),
    imports, process group, checkpoint load, first batch (medians over ranks; the total is
    the kill to the last rank's first batch).

On this machine's 2 cores, 32 processes share 2 cores: every figure above 2 ranks includes
the wait for a core (the load is stated), so they bound what a rank of a real job spends.

Run: ``python -m benchmarks.scale_ranks`` (a few minutes); ``--smoke``: 2 and 4 ranks.
Results: ``benchmarks/results/scale-ranks.json`` and ``scale-ranks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, markdown_table, pinned_tree, write_results

SAVES = 5
GLOO_RANKS = (2, 4, 8, 16, 32)
THREADED_RANKS = (2, 16, 64, 256, 1024)
#: The flat gather (the barrier before) is timed up to this many threaded ranks: it grows as
#: the square of the ranks in one process (256: about 10 s a barrier).
FLAT_UP_TO = 256
#: The environment of every torchrun launch: one intra-op thread, gloo on loopback.
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def write_lake(folder: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for f in range(8):
        ids = list(range(f * 4096, (f + 1) * 4096))
        pq.write_table(pa.table({"id": ids}), folder / f"part-{f}.parquet", row_group_size=1024)


def torchrun(tree: Path, nproc: int, work: Path, mode: str, restarts: int = 0) -> float:
    """One torchrun launch of the child; its wall time in seconds."""
    out = work / f"{mode}-{nproc}"
    out.mkdir()
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
        f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
        f"--log-dir={work / 'torchrun-logs'}", "-m", "benchmarks._ranks_child",
        "--lake", str(work / "lake"), "--ckpt", str(work / f"ckpt-{mode}-{nproc}"),
        "--out", str(out), "--mode", mode, "--saves", str(SAVES),
    ]  # fmt: skip
    began = time.monotonic()
    result = subprocess.run(
        argv, cwd=tree, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=1200
    )
    if result.returncode != 0:
        raise RuntimeError(f"torchrun {mode} x{nproc} failed:\n{result.stderr[-4000:]}")
    return time.monotonic() - began


def _reports(folder: Path, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{prefix}-*.json"))]


def gloo_barriers(tree: Path, work: Path, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        torchrun(tree, n, work, "barrier")
        ranks = _reports(work / f"barrier-{n}", "barrier-0")
        assert len(ranks) == n, f"{len(ranks)} of {n} ranks reported"
        barrier = [max(r["barrier_s"][k] for r in ranks) for k in range(SAVES)]
        save = [max(r["save_s"][k] for r in ranks) for k in range(SAVES)]
        rows.append(
            {
                "ranks": n,
                "barrier_ms": 1e3 * statistics.median(barrier),
                "save_ms": 1e3 * statistics.median(save),
                "state_bytes": max(r["state_bytes"] for r in ranks),
                "load_ms_max": 1e3 * max(r["load_s"] for r in ranks),
                "load_ms_median": 1e3 * statistics.median(r["load_s"] for r in ranks),
                "loadavg": round(os.getloadavg()[0], 2),
            }
        )
        print(f"gloo x{n}: {rows[-1]}", flush=True)
    return rows


def threaded_barriers(sizes: tuple[int, ...], reps: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    from lakeloader.checkpoint.barrier import Stand, confirm_same_position

    def flat(position: Any) -> None:  # what the barrier was: every rank's stand on every rank
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dist.get_rank(), position))

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a group registry a thread
    multi_threaded_pg._install_threaded_pg()
    rows = []
    try:
        for n in sizes:
            position = Stand("f" * 32, "c" * 16, 3, 123_456, ())
            row: dict[str, Any] = {"ranks": n}
            calls = {"barrier": lambda p: confirm_same_position(p, None)}
            if n <= FLAT_UP_TO:
                calls["flat_gather"] = flat
            for name, call in calls.items():
                row[f"{name}_ms"] = 1e3 * _threaded(n, reps, call, position)
                row[f"{name}_per_rank_us"] = 1e3 * row[f"{name}_ms"] / n
            rows.append(row)
            print(f"threaded x{n}: {row}", file=sys.stderr, flush=True)
    finally:
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return rows


def _threaded(n: int, reps: int, call: Any, position: Any) -> float:
    """Median wall seconds of ``call(position)`` on ``n`` threaded ranks at once."""
    import torch.distributed as dist

    store, walls, start = dist.HashStore(), [0.0] * reps, threading.Barrier(n)

    def rank(r: int) -> None:
        dist.init_process_group("threaded", rank=r, world_size=n, store=store)
        for k in range(reps):
            start.wait()
            began = time.perf_counter()
            call(position)
            start.wait()
            if r == 0:
                walls[k] = time.perf_counter() - began
        dist.destroy_process_group()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(walls)


def threaded_in(tree: Path, sizes: tuple[int, ...], reps: int) -> list[dict[str, Any]]:
    """:func:`threaded_barriers` in a child started in ``tree`` (the lakeloader measured)."""
    argv = [
        sys.executable,
        "-m",
        "benchmarks.scale_ranks",
        "--threaded-child",
        ",".join(map(str, sizes)),
    ]
    argv += ["--reps", str(reps)]
    result = subprocess.run(
        argv, cwd=tree, capture_output=True, text=True, timeout=1200, check=True
    )
    rows: list[dict[str, Any]] = json.loads(result.stdout.strip().splitlines()[-1])
    return rows


def restart(tree: Path, work: Path, n: int) -> dict[str, Any]:
    wall = torchrun(tree, n, work, "restart", restarts=1)
    folder = work / f"restart-{n}"
    killed = _reports(folder, "restart-0")
    assert len(killed) == 1 and "killed" in killed[0]["times"], "one rank killed itself"
    kill = killed[0]["times"]["killed"]
    again = [r["times"] for r in _reports(folder, "restart-1")]
    assert len(again) == n, f"{len(again)} of {n} ranks came back"

    def median(a: str, b: str) -> float:
        return statistics.median(t[b] - t[a] for t in again)

    return {
        "ranks": n,
        "restart_s": min(t["started"] for t in again) - kill,
        "imports_s": median("started", "imported"),
        "process_group_s": median("imported", "group"),
        "checkpoint_load_s": median("group", "loaded"),
        "first_batch_s": median("loaded", "first_batch"),
        "total_s": max(t["first_batch"] for t in again) - kill,
        "torchrun_wall_s": wall,
        "loadavg": round(os.getloadavg()[0], 2),
    }


#: Each table's columns: (header, key, digits); a key a row lacks shows "-".
GLOO_COLUMNS = [
    ("ranks", "ranks", 0), ("barrier ms", "barrier_ms", 2), ("whole save ms", "save_ms", 1),
    ("state bytes", "state_bytes", 0), ("load ms (max)", "load_ms_max", 1),
    ("load ms (median)", "load_ms_median", 1), ("load avg", "loadavg", 2),
]  # fmt: skip
THREADED_COLUMNS = [
    ("ranks", "ranks", 0), ("barrier ms (all ranks, one process)", "barrier_ms", 2),
    ("per rank us", "barrier_per_rank_us", 1), ("flat gather ms (before)", "flat_gather_ms", 2),
    ("per rank us", "flat_gather_per_rank_us", 1),
]  # fmt: skip
RESTART_COLUMNS = [
    ("ranks", "ranks", 0), ("restart s", "restart_s", 2), ("imports s", "imports_s", 2),
    ("process group s", "process_group_s", 2), ("checkpoint load s", "checkpoint_load_s", 2),
    ("first batch s", "first_batch_s", 2), ("total s", "total_s", 2), ("load avg", "loadavg", 2),
]  # fmt: skip


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str, int]]) -> str:
    cells = [
        [round(r[key], digits) if key in r else "-" for _, key, digits in columns] for r in rows
    ]
    return markdown_table([header for header, _, _ in columns], cells)


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    return "\n".join(
        [
            "# Scale with real ranks (benchmarks/scale_ranks.py)",
            "",
            f"{m['cpus']} cores, load {m['loadavg_1min']} at the start, commit "
            f"{data['tree'].get('commit', '?')}. Every figure above 2 ranks includes the wait "
            "for a core (up to 32 processes on these cores).",
            "",
            "## gloo processes: the barrier at each save, the state, load on every rank",
            "",
            _table(data["gloo"], GLOO_COLUMNS),
            "",
            "## torch's threaded process group: the barrier alone",
            "",
            _table(data["threaded"], THREADED_COLUMNS),
            "",
            "## A lost process: torchrun restarts every rank",
            "",
            _table([data["restart"]], RESTART_COLUMNS),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 and 4 ranks, seconds")
    parser.add_argument("--out", help="results folder (default benchmarks/results)")
    parser.add_argument("--src", help="git revision to measure (HEAD; smoke: worktree)")
    parser.add_argument("--reps", type=int, default=5, help="threaded barriers per size")
    parser.add_argument("--threaded-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threaded_child:
        sizes = tuple(int(n) for n in args.threaded_child.split(","))
        print(json.dumps(threaded_barriers(sizes, args.reps)))
        return 0
    tree, info = pinned_tree(args.src or ("worktree" if args.smoke else "HEAD"))
    gloo = (2, 4) if args.smoke else GLOO_RANKS
    threaded = (2, 16) if args.smoke else THREADED_RANKS
    work = Path(tempfile.mkdtemp(prefix="lakeloader-bench-ranks-"))
    try:
        write_lake(work / "lake")
        data = {
            "machine": machine(),
            "tree": info,
            "smoke": args.smoke,
            "gloo": gloo_barriers(tree, work, gloo),
            "threaded": threaded_in(tree, threaded, args.reps),
            "restart": restart(tree, work, max(gloo)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = "scale-ranks-smoke" if args.smoke else "scale-ranks"
    write_results(name, data, markdown(data), args.out)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
