"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own shards into a step's ``weights/`` folder and reads back what its
parameters need, so a load reshards; plain, DDP and FSDP2 modules go through the same calls.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Final

import torch
import torch.distributed as dist

from lakeloader.errors import CheckpointError

# torch.distributed.checkpoint is imported where it is used: importing it costs about a second
# (DTensor, sympy), which every process importing lakeloader (the CLI, each worker) would pay.

logger = logging.getLogger(__name__)

#: The DCP folder inside a step's folder.
WEIGHTS_DIR: Final = "weights"
#: DCP's metadata file (written last, by the coordinator rank).
DCP_METADATA: Final = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process (asked for: ``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def weights_state(
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


def save_weights(
    url: str,
    state: dict[str, Any],
    storage_options: dict[str, Any],
    *,
    async_group: dist.ProcessGroup | None = None,
    asynchronous: bool = False,
) -> Future[Any] | None:
    """Write ``state`` under ``url`` (collective: every rank writes its shards).

    Args:
        url: The weights folder.
        state: From :func:`weights_state`.
        storage_options: fsspec options for a URL that is not a local path.
        async_group: The process group of asynchronous saves (their collectives run in a
            background thread, beside the training loop's on the default group).
        asynchronous: Stage to memory now and write in the background (DCP's
            ``async_save``); the returned future completes, on every rank, once the whole
            folder (every rank's shards and the metadata) is written.

    Returns:
        The future of an asynchronous save, else None.
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    writer = _storage(url, storage_options, "Writer")
    if asynchronous:
        single: dict[str, Any] = {} if _distributed() else {"no_dist": True}
        response: Any = async_save(
            state, storage_writer=writer, process_group=async_group, **single
        )
        # a Future, or (torch >= 2.9, with an async stager) a response holding the upload's
        upload: Future[Any] = getattr(response, "upload_completion", response)
        return upload
    with _single_process():
        save(state, storage_writer=writer, no_dist=not _distributed())
    return None


def load_weights(
    url: str,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    storage_options: dict[str, Any],
    *,
    saved: tuple[bool, bool],
) -> None:
    """Load a weights folder into ``model`` (and ``optimizer``), resharding as needed.

    Args:
        url: The weights folder.
        model: The model (its parameters' placement decides what each rank reads).
        optimizer: Its optimizer, or None.
        storage_options: fsspec options for a URL that is not a local path.
        saved: Whether the folder holds a model's and an optimizer's state.

    Raises:
        CheckpointError: If asked for a state the checkpoint does not hold.
    """
    if model is None:
        raise CheckpointError("an optimizer's state loads with its model: pass model= too")
    has_model, has_optimizer = saved
    if not has_model or (optimizer is not None and not has_optimizer):
        missing = "model" if not has_model else "optimizer"
        raise CheckpointError(
            f"{posixpath.dirname(url)} holds no {missing} state: it was saved without "
            f"{missing}= (or by an older lakeloader); load what it holds"
        )
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    state = weights_state(model, optimizer)
    reader = _storage(url, storage_options, "Reader")
    with _single_process():
        load(state, storage_reader=reader, no_dist=not _distributed())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
