"""A training process on a followed folder, for tests/test_follow.py (killed with SIGKILL).

Usage: ``python -m tests.follow_child LAKE CKPT LOG``: follows LAKE (batch 8, one rank),
appends each batch's ids to LOG as a JSON line ``{"step": k, "ids": [...]}`` and saves a
checkpoint to CKPT every 5 steps (a step takes 0.1 s), until nothing new comes for 60 s.
"""

from __future__ import annotations

import json
import sys
import time

import lakeloader as ll


def main(lake: str, ckpt: str, log: str) -> None:
    follow = ll.Follow(poll_interval=0.05, timeout=60)
    ds = ll.LakeDataset(lake, follow=follow, seed=1, num_partitions=4)
    loader = ll.DataLoader(ds, batch_size=8)
    manager = ll.CheckpointManager(ckpt)
    with open(log, "a") as out:
        for step, batch in enumerate(loader, start=1):
            out.write(json.dumps({"step": step, "ids": batch["id"].tolist()}) + "\n")
            out.flush()
            if step % 5 == 0:
                manager.save(step, loader)
            time.sleep(0.1)  # a training step: the test kills the process between two


if __name__ == "__main__":
    main(*sys.argv[1:4])
