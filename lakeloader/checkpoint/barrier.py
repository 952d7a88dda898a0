"""Rank agreement at a checkpoint's sync barrier (see docs/design.md)."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lakeloader.errors import CheckpointError
from lakeloader.state.quarantine import QuarantineEntry


class Stand(NamedTuple):
    """Where a loader stands, as the barrier compares it across ranks (``barrier_position()``).

    Attributes:
        fingerprint: Of the snapshot it reads (a mixture's: a digest of its sources').
        config_hash: Of what orders it (a packed lake's: and its packing; a mixture's: its
            seed, weights and sources' settings).
        epoch: The epoch (a mixture's pass; 0 for a packed lake, whose samples count epochs).
        position: Where in it (a mixture's slot; a packed stream's samples).
        quarantine: This rank's units skipped for good.
    """

    fingerprint: str
    config_hash: str
    epoch: int
    position: int
    quarantine: tuple[QuarantineEntry, ...]


#: What one rank all-gathers: its rank, (fingerprint, config hash, epoch, position), its
#: previous save's error, its quarantine.
_Gathered = tuple[int, tuple[str, str, int, int], str | None, tuple[QuarantineEntry, ...]]


def confirm_same_position(
    stand: Stand, error: CheckpointError | None
) -> list[QuarantineEntry] | None:
    """Check that every rank stands at the same position and that no earlier save failed.

    After a failed background save, the ranks where it failed return (their caller raises it).

    Returns:
        The quarantine entries of all ranks (unmerged; one rank's when all hold the same), or
        None when torch.distributed is not initialised.

    Raises:
        CheckpointError: Naming the ranks at each position, or the ranks whose previous
            background save failed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    where = (str(stand.fingerprint), str(stand.config_hash), int(stand.epoch), int(stand.position))
    if _all_alike(_digest(where), _digest(stand.quarantine), error is not None):
        return list(stand.quarantine)  # every rank's is this one
    mine = (dist.get_rank(), where, None if error is None else str(error), stand.quarantine)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)  # plain values: what every release gathers
    stands: list[_Gathered] = gathered
    failed = [(rank, failure) for rank, _, failure, _ in stands if failure is not None]
    if failed and error is None:
        raise CheckpointError(f"the previous background save failed on rank(s) {failed}")
    groups: dict[tuple[str, str, int, int], list[int]] = {}
    for rank, at, _, _ in stands:
        groups.setdefault(at, []).append(rank)
    if len(groups) > 1:
        lake = len({w[:2] for w in groups}) > 1
        detail = "; ".join(
            f"ranks {ranks} at epoch {epoch}, position {position}"
            + (f" (snapshot {fp[:12]}, config {cfg})" if lake else "")
            for (fp, cfg, epoch, position), ranks in groups.items()
        )
        raise CheckpointError(
            f"ranks disagree on the loader position, refusing to save: {detail}. Every rank "
            "must call save() after the same number of steps, on the same lake and config"
        )
    return [entry for *_, entries in stands for entry in entries]


def _digest(value: object) -> int:
    """A 62-bit digest of plain data (its repr: strings, ints and frozen dataclasses)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "big") >> 2


def _all_alike(where: int, quarantine: int, failed: bool) -> bool:
    """Whether every rank stands at the same digests and none failed: one all-reduce."""
    values = [where, -where, quarantine, -quarantine, int(failed)]
    mine = torch.tensor(values, dtype=torch.int64, device=collective_device())
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    top: list[int] = mine.tolist()
    return top[0] == -top[1] and top[2] == -top[3] and top[4] == 0


def collective_device() -> torch.device | None:
    """Where a tensor for a collective of the default group lives (NCCL takes no CPU tensor)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None
