"""Where a loader stands in the run: rank, world size, workers and rows per step."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from lakeloader.errors import TopologyError


@dataclass(frozen=True)
class Topology:
    """The shape of a run as one loader sees it.

    Attributes:
        world_size: Ranks in the run.
        rank: This loader's rank, in ``[0, world_size)``.
        num_workers: DataLoader worker processes per rank (0: everything in the rank's
            process).
        batch_size: Rows per rank per step.

    Example:
        >>> t = Topology(world_size=4, rank=1, num_workers=2, batch_size=64)
        >>> t.global_batch, Topology.from_dict(t.to_dict()) == t
        (256, True)
        >>> Topology(world_size=2, rank=2, num_workers=0, batch_size=1)
        Traceback (most recent call last):
        ...
        ValueError: rank 2 is not in [0, world_size=2)
    """

    world_size: int
    rank: int
    num_workers: int
    batch_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @property
    def global_batch(self) -> int:
        """Rows all ranks together consume in one step."""
        return self.world_size * self.batch_size

    def to_dict(self) -> dict[str, int]:
        """Plain types (the ``topology`` of a state and of a checkpoint's context)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        """Parse :meth:`to_dict`'s output; a missing rank reads as 0 (older checkpoints).

        Raises:
            KeyError: If ``world_size``, ``num_workers`` or ``batch_size`` is missing.
        """
        return cls(
            world_size=int(d["world_size"]),
            rank=int(d.get("rank", 0)),
            num_workers=int(d["num_workers"]),
            batch_size=int(d["batch_size"]),
        )

    @classmethod
    def resolve(
        cls,
        rank: int | None,
        world_size: int | None,
        *,
        num_workers: int,
        batch_size: int,
        strict: bool = False,
    ) -> Topology:
        """The topology of a loader in this process, as things stand now.

        Rank and world size come, in order, from the explicit arguments, an initialised
        ``torch.distributed`` process group, or the ``RANK``/``WORLD_SIZE`` variables that
        torchrun sets; else a single process.

        >>> Topology.resolve(2, 4, num_workers=0, batch_size=8).rank
        2

        Raises:
            ValueError: If the rank is not in ``[0, world_size)``, or a count is negative.
            TopologyError: With ``strict``, if the world size is above 1 but nothing says
                this process's rank.
        """
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = (
                dist.get_world_size() if distributed else int(os.environ.get("WORLD_SIZE", "1"))
            )
        if rank is None:
            if strict and not distributed and int(world_size) > 1 and "RANK" not in os.environ:
                local = os.environ.get("LOCAL_RANK")
                raise TopologyError(
                    f"this process is one of WORLD_SIZE={world_size} but its rank is unknown: "
                    "torch.distributed is not initialised and RANK is not set"
                    + (f" (LOCAL_RANK={local} is)" if local is not None else "")
                    + ". Iterate the loader once the process group is initialised (Lightning, "
                    "Accelerate and transformers' Trainer do that before training), or pass "
                    "DataLoader(rank=..., world_size=...)"
                )
            rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
        return cls(int(world_size), int(rank), int(num_workers), int(batch_size))

    def describe(self) -> str:
        """One line for reports: ``2 ranks x 64 rows, 2 workers``."""
        return f"{self.world_size} ranks x {self.batch_size} rows, {self.num_workers} workers"
