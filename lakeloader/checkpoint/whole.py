"""The training side of a whole checkpoint: weights (through DCP, resharded at a load), generators.

:func:`capture` runs on every rank at a save, :func:`restore` on every rank at a load (after the
loader's position).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from lakeloader._version import __version__
from lakeloader.checkpoint.layout import sha256
from lakeloader.checkpoint.store import CheckpointStore
from lakeloader.checkpoint.training import TRAINING_FILE, CodeVersion, RngState, TrainingRecord
from lakeloader.errors import CheckpointError

logger = logging.getLogger(__name__)

# torch.distributed.checkpoint is imported where it is used: importing it costs about a second
# (DTensor, sympy), which every process importing lakeloader (the CLI, each worker) would pay.

#: The DCP folder inside a step's folder.
WEIGHTS_DIR: Final = "weights"
#: DCP's metadata file (written last, by the coordinator rank).
DCP_METADATA: Final = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def process_rank() -> int:
    """This process's rank under torch.distributed (0 without a process group)."""
    return dist.get_rank() if _distributed() else 0


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (asked for: ``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _weights_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """The DCP state dict of a model and its optimizer (sharded as they are)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _storage(url: str, storage_options: dict[str, Any], kind: str) -> Any:
    """DCP's ``Writer`` or ``Reader`` (``kind``) of a local folder or an fsspec URL."""
    if "://" not in url or url.startswith("file://"):
        from torch.distributed.checkpoint import filesystem

        return getattr(filesystem, f"FileSystem{kind}")(url.removeprefix("file://"))
    from torch.distributed.checkpoint import _fsspec_filesystem

    return getattr(_fsspec_filesystem, f"Fsspec{kind}")(url, **storage_options)


@dataclass
class Captured:
    """What :func:`capture` took: the training record, and the weights being written.

    Attributes:
        record: The training record (rank 0 writes it; the weights folder is there if it
            holds a model).
        pending: The future of an asynchronous weights save, or None.
    """

    record: TrainingRecord
    pending: Future[Any] | None

    def parts(self, store: CheckpointStore, folder: str) -> dict[str, tuple[int, str]]:
        """Wait for every rank's weights, write ``training.msgpack``, list the parts (rank 0).

        Returns ``{path in the folder: (size, SHA-256)}``, the digest empty for the shards.
        """
        if self.pending is not None:
            self.pending.result()
        data = self.record.to_bytes()
        store.makedirs(folder)
        store.put(posixpath.join(folder, TRAINING_FILE), data)
        out = {TRAINING_FILE: (len(data), sha256(data))}
        if not self.record.model:
            return out
        weights = posixpath.join(folder, WEIGHTS_DIR)
        for path, size in store.sizes(weights).items():
            name = posixpath.relpath(path, folder)
            digest = sha256(store.cat(path)) if name.endswith(DCP_METADATA) else ""
            out[name] = (size, digest)
        if posixpath.join(WEIGHTS_DIR, DCP_METADATA) not in out:
            raise CheckpointError(f"DCP wrote no {DCP_METADATA} in {weights}")
        return out


def capture(
    step: int,
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

    Every rank's generators are gathered to rank 0, in rank order (only rank 0 writes them).
    ``url`` is the step folder's URL (what DCP's writer opens). With ``asynchronous`` DCP copies
    the weights to memory and writes them in the background (``async_save``), its collectives
    on ``async_group``.

    Raises:
        CheckpointError: If an optimizer is given without its model.
    """
    if optimizer is not None and model is None:
        raise CheckpointError("save(optimizer=...) needs the optimizer's model= too")
    rng: tuple[RngState, ...] = (RngState.capture(),)
    world = dist.get_world_size() if _distributed() else 1
    if _distributed():
        gathered: list[Any] | None = [None] * world if process_rank() == 0 else None
        dist.gather_object(rng[0], gathered, dst=0)
        rng = tuple(gathered) if gathered is not None else rng
    record = TrainingRecord(
        step=step,
        rng=rng,
        torch_version=str(torch.__version__),
        library_version=__version__,
        code=code,
        attempt=attempt,
        world_size=world,
        model=model is not None,
        optimizer=optimizer is not None,
    )
    if model is None:
        return Captured(record, None)
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    state = _weights_state(model, optimizer)
    writer = _storage(posixpath.join(url, WEIGHTS_DIR), storage_options, "Writer")
    if not asynchronous:
        with _single_process():
            save(state, storage_writer=writer, no_dist=not _distributed())
        return Captured(record, None)
    single: dict[str, Any] = {} if _distributed() else {"no_dist": True}
    response: Any = async_save(state, storage_writer=writer, process_group=async_group, **single)
    # a Future, or (torch >= 2.9, with an async stager) a response holding the upload's; it
    # completes on every rank once the whole folder is written
    return Captured(record, getattr(response, "upload_completion", response))


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


def restore(
    record: TrainingRecord | None,
    url: str,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    rng: bool,
    storage_options: dict[str, Any],
) -> None:
    """Load the weights (collective under torch.distributed, resharding) and this rank's generators.

    A rank the saving run did not have (the world grew) keeps its generators, with a log line.

    Raises:
        CheckpointError: If model or optimizer state is asked for and the checkpoint has none.
    """
    if model is None and optimizer is not None:
        raise CheckpointError("an optimizer's state loads with its model: pass model= too")
    if model is not None:
        url = posixpath.join(url, WEIGHTS_DIR)
        has_model, has_optimizer = (record.model, record.optimizer) if record else (False, False)
        if not has_model or (optimizer is not None and not has_optimizer):
            missing = "model" if not has_model else "optimizer"
            raise CheckpointError(
                f"{posixpath.dirname(url)} holds no {missing} state: it was saved without "
                f"{missing}= (or by an older lakeloader); load what it holds"
            )
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = _weights_state(model, optimizer)
        reader = _storage(url, storage_options, "Reader")
        with _single_process():
            load(state, storage_reader=reader, no_dist=not _distributed())
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            model_sd, optim_sd = state["model"], state["optimizer"]
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if not rng or record is None:
        return
    rank = process_rank()
    if rank < len(record.rng):
        record.rng[rank].restore()
        return
    logger.info(
        "rank %d: the checkpoint of step %d holds the generators of %d rank(s); this "
        "rank keeps its own",
        rank,
        record.step,
        len(record.rng),
    )
