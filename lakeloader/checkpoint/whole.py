"""The training side of a whole checkpoint: weights, optimizer, generators and context.

:func:`capture` runs on every rank when a checkpoint is saved, :func:`restore` on every rank
when it is loaded (after the loader's position).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lakeloader._version import __version__
from lakeloader.checkpoint.layout import sha256
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.checkpoint.training import (
    TRAINING_FILE,
    CodeVersion,
    TrainingRecord,
    gather_rng,
    restore_rng,
)
from lakeloader.checkpoint.weights import (
    DCP_METADATA,
    WEIGHTS_DIR,
    load_weights,
    save_weights,
    weights_state,
)
from lakeloader.errors import CheckpointError

logger = logging.getLogger(__name__)


def process_rank() -> int:
    """This process's rank under torch.distributed (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class Captured:
    """What :func:`capture` took: the training record, and the weights being written.

    Attributes:
        record: The training record (rank 0 writes it).
        weights: The weights folder's path, or None without a model.
        pending: The future of an asynchronous weights save.
    """

    record: TrainingRecord
    weights: str | None
    pending: Future[Any] | None

    def wait(self) -> None:
        """Wait for this rank's weights to be written (and, on rank 0, everyone's)."""
        if self.pending is not None:
            self.pending.result()

    def parts(self, store: CheckpointStore, folder: str) -> dict[str, tuple[int, str]]:
        """Write ``training.msgpack`` and list every part for ``COMMIT`` (rank 0).

        Call it after :meth:`wait`. Returns ``{path in the folder: (size, SHA-256)}``, the
        digest empty for the shards.
        """
        data = self.record.to_bytes()
        store.makedirs(folder)
        store.put(posixpath.join(folder, TRAINING_FILE), data)
        out = {TRAINING_FILE: (len(data), sha256(data))}
        if self.weights is None:
            return out
        for path, size in store.sizes(self.weights).items():
            name = posixpath.relpath(path, folder)
            digest = sha256(store.cat(path)) if name.endswith(DCP_METADATA) else ""
            out[name] = (size, digest)
        if posixpath.join(WEIGHTS_DIR, DCP_METADATA) not in out:
            raise CheckpointError(f"DCP wrote no {DCP_METADATA} in {self.weights}")
        return out


def capture(
    step: int,
    folder: str,
    url: str,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    attempt: str,
    code: CodeVersion,
    storage_options: dict[str, Any],
    asynchronous: bool,
    async_group: dist.ProcessGroup | None,
) -> Captured:
    """Gather generators and write (or start writing) the weights: a collective on every rank.

    Args:
        step: The training step.
        folder: The step folder (a path of the checkpoint's filesystem).
        url: The step folder's URL (what DCP's writer opens).
        model: The model, or None.
        optimizer: Its optimizer, or None.
        attempt: The saving attempt's id.
        code: The training code's git commit.
        storage_options: fsspec options of the checkpoint URL.
        asynchronous: Write the weights in the background (DCP's ``async_save``, which
            copies them to memory first) rather than before this returns.
        async_group: The process group of a background save under torch.distributed.

    Raises:
        CheckpointError: If an optimizer is given without its model.
    """
    if optimizer is not None and model is None:
        raise CheckpointError("save(optimizer=...) needs the optimizer's model= too")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    record = TrainingRecord(
        step=step,
        rng=gather_rng(),
        torch_version=str(torch.__version__),
        library_version=__version__,
        code=code,
        attempt=attempt,
        world_size=world,
        model=model is not None,
        optimizer=optimizer is not None,
    )
    if model is None:
        return Captured(record, None, None)
    pending = save_weights(
        posixpath.join(url, WEIGHTS_DIR),
        weights_state(model, optimizer),
        storage_options,
        async_group=async_group,
        asynchronous=asynchronous,
    )
    return Captured(record, posixpath.join(folder, WEIGHTS_DIR), pending)


def check_parts(store: CheckpointStore, folder: str, parts: Mapping[str, tuple[int, str]]) -> None:
    """Check that every part ``COMMIT`` lists is there, whole (sizes; digests where given).

    Raises:
        CheckpointError: Naming the first part missing, torn or overwritten.
    """
    if not parts:
        return
    sizes = store.sizes(folder)
    for name, (size, digest) in sorted(parts.items()):
        path = posixpath.join(folder, name)
        found = sizes.get(path)
        if found is None:
            raise CheckpointError(f"{name} is missing (COMMIT lists it, {size} bytes)")
        if found != size:
            raise CheckpointError(f"{name} is {found} bytes, its COMMIT says {size}: torn")
        if digest and sha256(store.cat(path)) != digest:
            raise CheckpointError(f"{name} does not match the SHA-256 its COMMIT records")


def read_training(
    store: CheckpointStore, folder: str, parts: Mapping[str, Any]
) -> TrainingRecord | None:
    """The step's training record, or None for a checkpoint written before there was one."""
    if TRAINING_FILE not in parts:
        return None
    return TrainingRecord.from_bytes(store.cat(posixpath.join(folder, TRAINING_FILE)))


def restore(
    record: TrainingRecord | None,
    url: str,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    rng: bool,
    storage_options: dict[str, Any],
) -> None:
    """Load the weights (collective under torch.distributed) and this rank's generators.

    Raises:
        CheckpointError: If model or optimizer state is asked for and the checkpoint has none.
    """
    if model is not None or optimizer is not None:
        saved = (record.model, record.optimizer) if record is not None else (False, False)
        load_weights(
            posixpath.join(url, WEIGHTS_DIR), model, optimizer, storage_options, saved=saved
        )
    if rng and record is not None:
        restore_rng(record, process_rank())
