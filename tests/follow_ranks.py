"""Two ranks following one folder under torchrun, for tests/test_follow.py.

Usage: ``torchrun --nproc-per-node 2 tests/follow_ranks.py LAKE LOGDIR``: each rank follows
LAKE (batch 4 per rank, gloo) until nothing new comes for 4 s, and writes one JSON line per
batch, ``{"epoch": k, "ids": [...]}``, to ``LOGDIR/rank<r>.jsonl``. Rank 0 decides each
increment and rank 1 takes the same (``lakeloader.lake.following``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

import lakeloader as ll


def main(lake: str, log_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    follow = ll.Follow(poll_interval=0.05, timeout=4)
    ds = ll.LakeDataset(lake, follow=follow, seed=3, num_partitions=4)
    loader = ll.DataLoader(ds, batch_size=4)
    with (Path(log_dir) / f"rank{rank}.jsonl").open("w") as out:
        for batch in loader:
            out.write(json.dumps({"epoch": loader.epoch, "ids": batch["id"].tolist()}) + "\n")
            out.flush()
            time.sleep(0.02 * (1 + rank))  # the ranks reach the lake at different moments
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
