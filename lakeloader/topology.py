"""Where this process stands: rank and world size.

Taken, in order, from explicit arguments, an initialised ``torch.distributed`` process group,
or the ``RANK``/``WORLD_SIZE`` variables that torchrun sets; else a single process.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from lakeloader.state.keys import ENV_RANK, ENV_WORLD_SIZE


def resolve_topology(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Return ``(rank, world_size)``, validated.

    >>> resolve_topology(2, 4)
    (2, 4)

    Raises:
        ValueError: If the rank is not in ``[0, world_size)``.
    """
    if world_size is None:
        if dist.is_available() and dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            world_size = int(os.environ.get(ENV_WORLD_SIZE, "1"))
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        else:
            rank = int(os.environ.get(ENV_RANK, "0"))
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size
