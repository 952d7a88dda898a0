"""A training loop written from the README's checkpoint snippet, without ``attach``.

``python -m tests.audit_child LAKE CKPT LOG BATCH EPOCHS [MISTAKE]`` trains (no model: the rows
are what is audited), saving every 3 steps, resuming from the newest checkpoint if there is
one, and appends ``[epoch, step, ids]`` per step to LOG (msgpack). With ``AUDIT_CHILD_HOLD=8``
in its environment it stops after step 8 until the parent SIGKILLs it (2 steps after the
checkpoint of step 6); without, it trains to the end. MISTAKE makes the loop really lose or
double rows, for the audit to catch: ``double`` trains the first step after the resume twice
(it restores the position before it), ``lose`` ends epoch 0 early (``set_epoch(1)`` at the
resume), ``unrecorded`` resumes by ``load_state_dict`` from the checkpoint instead of
``CheckpointManager.load``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgpack

import lakeloader as ll
from tests.conftest import layout_dataset


def main(lake: str, ckpt_dir: str, log: str, batch: str, epochs: str, mistake: str = "") -> None:
    loader = ll.DataLoader(layout_dataset(Path(lake)), batch_size=int(batch))
    ckpt = ll.CheckpointManager(ckpt_dir, ledger_flush_seconds=0)
    step = 0
    if ckpt.latest() is not None:
        if mistake == "unrecorded":
            loader.load_state_dict(ckpt.load_checkpoint().state.to_dict())
            step = ckpt.latest() or 0
        else:
            step = ckpt.load(loader)["step"]
    if mistake == "lose" and step:
        loader.set_epoch(1)
    doubled = mistake != "double" or not step
    before = loader.state_dict()
    with open(log, "ab") as out:
        while True:
            left_early = False
            for batch_ in loader:
                step += 1
                out.write(msgpack.packb([loader.epoch, step, batch_["id"].tolist()]))
                out.flush()
                if step % 3 == 0:
                    ckpt.save(step, loader, extra={"step": step})
                if step == int(os.environ.get("AUDIT_CHILD_HOLD", "0")):
                    time.sleep(600)  # the parent kills it here
                if not doubled:  # as if the loop lost track: it trains this step again
                    doubled = left_early = True
                    loader.load_state_dict(before)
                    break
                before = loader.state_dict()
            if not left_early and loader.epoch >= int(epochs) - 1:
                break
    if step % 3:
        ckpt.save(step, loader, extra={"step": step})
    ckpt.close()
    loader.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
