"""Rank agreement at a checkpoint's sync barrier.

Under ``torch.distributed`` every rank must hold the same loader position when a checkpoint is
saved (the position is global). One all-gather of a small digest checks that, and carries each
rank's earlier background-save failure, so that every rank raises alike and none is left
waiting in a collective, and each rank's quarantine entries, so that all ranks (and the saved
state) hold the same quarantine list.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch.distributed as dist

from lakeloader.checkpoint.layout import sha256
from lakeloader.errors import CheckpointError
from lakeloader.state import keys as K


def confirm_same_position(
    state: dict[str, Any], error: CheckpointError | None
) -> list[dict[str, Any]] | None:
    """All-gather a digest of the position; fail on every rank if ranks disagree or failed.

    Returns:
        The quarantine entries of all ranks (plain dicts, unmerged), or None when
        torch.distributed is not initialised.

    Raises:
        CheckpointError: Naming the ranks at each position, or the ranks whose previous
            background save failed, on every rank alike (so that none is left waiting).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = [state["fingerprint"], state["config_hash"], state["epoch"], state["position"]]
    mine = (
        dist.get_rank(),
        sha256(msgpack.packb(key)),
        state["epoch"],
        state["position"],
        None if error is None else str(error),
        state[K.STATE_QUARANTINE],
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [(rank, err) for rank, _, _, _, err, _ in gathered if err is not None]
    if failed and error is None:
        raise CheckpointError(f"the previous background save failed on rank(s) {failed}")
    groups: dict[str, list[tuple[int, int, int]]] = {}
    for rank, digest, epoch, position, _, _ in gathered:
        groups.setdefault(digest, []).append((rank, epoch, position))
    if len(groups) > 1:
        detail = "; ".join(
            f"ranks {[r for r, _, _ in members]} at epoch {members[0][1]}, position {members[0][2]}"
            for members in groups.values()
        )
        raise CheckpointError(
            f"ranks disagree on the loader position, refusing to save: {detail}. Every rank "
            "must call save() after the same number of steps"
        )
    return [entry for *_, entries in gathered for entry in entries]
