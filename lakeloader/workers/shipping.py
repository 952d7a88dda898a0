"""Batches from a worker to the loader's process through shared memory, not the pipe.

The worker writes a batch's tensors and arrays into one file of the pass's folder and sends
its structure with a :class:`Slot` for each (:func:`ship`); the loader's process maps the
file, wraps each slot with no copy, and unlinks it (:func:`receive`).
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

#: Byte alignment of each tensor in a shipped file.
ALIGN: Final = 64


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a shipped file (``array``: it was a numpy array)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    array: bool = False


@dataclass(frozen=True)
class Jagged:
    """A jagged nested tensor, as its values and offsets."""

    values: Slot
    offsets: Slot


@dataclass(frozen=True)
class Shipped:
    """A batch in shared memory: its structure with slots, and the file (None: no tensor)."""

    tree: Any
    path: str | None


_names = itertools.count()


class _Writer:
    def __init__(self) -> None:
        self.size = 0
        self.parts: list[tuple[int, torch.Tensor]] = []

    def slot(self, tensor: torch.Tensor, array: bool = False) -> Slot:
        tensor = tensor.contiguous()
        at = -(-self.size // ALIGN) * ALIGN
        self.size = at + tensor.numel() * tensor.element_size()
        self.parts.append((at, tensor))
        return Slot(at, tensor.dtype, tuple(tensor.shape), array)

    def leaf(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            if obj.is_nested:
                if obj.layout != torch.jagged:
                    return obj
                return Jagged(self.slot(obj.values()), self.slot(obj.offsets()))  # type: ignore[attr-defined]
            return self.slot(obj.detach())
        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
            return self.slot(
                torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape)), array=True
            )
        return _WALK


#: What a leaf function returns for an object that is not a leaf: walk into it.
_WALK: Final = object()


def _rebuild(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` with each leaf replaced by ``leaf(obj)``; containers walked as :func:`ship` says."""
    got = leaf(obj)
    if got is not _WALK:
        return got
    if type(obj) is dict:
        return {k: _rebuild(v, leaf) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_rebuild(v, leaf) for v in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, leaf) for v in obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f for f in dataclasses.fields(obj) if f.init]
        try:
            changes = {f.name: _rebuild(getattr(obj, f.name), leaf) for f in fields}
            return dataclasses.replace(obj, **changes)
        except (TypeError, ValueError):
            return obj
    return obj


def ship(batch: Any, folder: str) -> Shipped:
    """Write a batch's tensors and arrays into one new file of ``folder``.

    Dicts, lists, tuples (named too) and dataclasses are walked; anything else travels as it
    is (pickled with the answer).
    """
    writer = _Writer()
    tree = _rebuild(batch, writer.leaf)
    if not writer.parts:
        return Shipped(tree, None)
    path = os.path.join(folder, f"batch-{os.getpid()}-{next(_names)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(writer.size, 1))
        for at, tensor in writer.parts:
            if tensor.numel():  # bytes of any dtype (bfloat16 has no numpy type)
                os.pwrite(fd, tensor.reshape(-1).view(torch.uint8).numpy().data, at)
    finally:
        os.close(fd)
    return Shipped(tree, path)


def receive(shipped: Shipped) -> Any:
    """The batch a worker shipped: its tensors map the file, which is unlinked here."""
    mm: mmap.mmap | None = None
    if shipped.path is not None:
        fd = os.open(shipped.path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
            os.unlink(shipped.path)

    def tensor(slot: Slot) -> Any:
        count = int(np.prod(slot.shape, dtype=np.int64))
        if count == 0 or mm is None:
            out = torch.empty(slot.shape, dtype=slot.dtype)
        else:
            out = torch.frombuffer(mm, dtype=slot.dtype, count=count, offset=slot.offset)
            out = out.view(slot.shape)
        return out.numpy() if slot.array else out

    def leaf(obj: Any) -> Any:
        if isinstance(obj, Slot):
            return tensor(obj)
        if isinstance(obj, Jagged):
            return torch.nested.nested_tensor_from_jagged(tensor(obj.values), tensor(obj.offsets))
        return _WALK

    return _rebuild(shipped.tree, leaf)


def built(future: Future[Any], deadline: float | None, timeout: float, what: str) -> Any:
    """A worker's answer to a build, its batch received: a payload ``(kind, batch)``.

    Raises:
        RuntimeError: If it is not in by ``deadline`` (``time.monotonic()``; None: no limit),
            the loader's ``timeout`` seconds after it was asked for: names ``what`` it was.
    """
    try:
        kind, value = future.result(max(0.0, deadline - time.monotonic()) if deadline else None)
    except FutureTimeout:
        raise RuntimeError(
            f"DataLoader timed out after {timeout} seconds waiting for {what} from its worker"
        ) from None
    return kind, receive(value) if isinstance(value, Shipped) else value
