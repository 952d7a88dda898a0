"""Hugging Face Accelerate: ``prepare(accelerator, loader)``, for a lake loader.

``accelerator.prepare`` hands back a loader that is not torch's untouched: no checkpointing,
no device placement, no end of epoch for gradient accumulation. ``prepare`` adds them.

The loader it returns (an :class:`AcceleratedLoader` around the lake loader) is:

- saved and loaded with ``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)``
  (registered with ``register_for_checkpointing``; the main process writes the loader's global
  position, every process loads it, under any number of processes). Load before iterating.
- moved to ``accelerator.device`` batch by batch (``send_to_device``, which honours an
  object's own ``.to()``), unless ``device_placement=False``.
- the dataloader that Accelerate's gradient accumulation ends an epoch on: while the last
  batch of a pass is processed, ``accelerator.gradient_state.end_of_dataloader`` is True, so
  ``accelerator.accumulate`` syncs gradients on it (as with torch's loaders). The loader knows
  how many steps its pass delivers, so no batch is pulled ahead: a state saved inside the loop
  stands after exactly the batches trained on. ``remainder`` is -1: nothing is padded.

Resume: ``accelerator.load_state(dir)`` before the epoch loop, then continue from
``loader.epoch`` (the epoch the loaded position is in); the loader stands at its step, so
``accelerator.skip_first_batches(loader, n)``, which scripts written for torch's loaders call
after ``load_state``, returns the loader unchanged (logged at INFO): skipping again would lose
``n`` batches (``prepare`` sets that method on the accelerator; the function
``accelerate.skip_first_batches`` is not covered and fails on a lake loader). ``set_epoch``,
``len``, ``state_dict`` and every other attribute of the lake loader pass through. An endless,
packed or followed loader never ends an epoch for Accelerate (its pass has no known length).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.utils import send_to_device  # type: ignore[import-untyped]

from lakeloader.loader import DataLoader

logger = logging.getLogger(__name__)

__all__ = ["AcceleratedLoader", "prepare"]


class AcceleratedLoader:
    """A lake loader as Accelerate's prepared loaders behave (see the module docstring).

    Args:
        accelerator: The run's ``Accelerator``.
        loader: The lake loader (any lakeloader loader: plain, mixture, packed, endless).
        device_placement: Move batches to ``accelerator.device`` (default: the
            accelerator's ``device_placement``).

    Attributes:
        end_of_dataloader: True while the last batch of a pass is being processed (what
            Accelerate's ``GradientState`` reads of its active dataloader).
        remainder: Always -1: the loader pads nothing, so ``gather_for_metrics`` drops
            nothing.
    """

    def __init__(
        self, accelerator: Accelerator, loader: DataLoader, device_placement: bool | None = None
    ) -> None:
        self.accelerator = accelerator
        self.loader = loader
        self.device_placement = (
            accelerator.device_placement if device_placement is None else device_placement
        )
        self.end_of_dataloader = False
        self.remainder = -1

    def __iter__(self) -> Iterator[Any]:
        """A pass of the lake loader, its batches on the device, its end told to Accelerate."""
        it = iter(self.loader)
        steps = _steps_in_pass(it)
        state = self.accelerator.gradient_state
        self.end_of_dataloader = False
        state._add_dataloader(self)  # what DataLoaderShard.begin() does
        try:
            for delivered, batch in enumerate(it, 1):
                self.end_of_dataloader = delivered == steps
                if self.device_placement:
                    batch = send_to_device(
                        batch, self.accelerator.device, non_blocking=self.accelerator.non_blocking
                    )
                yield batch
        finally:
            self.end_of_dataloader = False
            state._remove_dataloader(self)  # what DataLoaderShard.end() does

    def __len__(self) -> int:
        """Steps in a whole epoch on this topology (TypeError for an endless loader)."""
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """The lake loader's ``set_epoch`` (the epoch under way keeps its position)."""
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The lake loader's global position (what ``accelerator.save_state`` writes)."""
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a position saved under any number of processes."""
        self.loader.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "loader" or name.startswith("__"):  # a copy being made: not set yet
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"AcceleratedLoader({self.loader!r}, device={self.accelerator.device})"


def _steps_in_pass(it: Iterator[Any]) -> int | None:
    """Steps a pass of the lake loader delivers, or None when it does not say (no end).

    A plain or mixture loader's pass iterator stops after its ``num_steps`` (see
    ``DataLoader.__iter__``); an endless, packed or followed stream has no such count, and
    never ends an epoch here.
    """
    steps = getattr(it, "num_steps", None)
    return steps if isinstance(steps, int) else None


def _skip_first_batches(original: Callable[..., Any], dataloader: Any, num_batches: int = 0) -> Any:
    """``accelerator.skip_first_batches`` that leaves a lake loader where its state put it."""
    if isinstance(dataloader, AcceleratedLoader):
        logger.info(
            "skip_first_batches(%d) left the lake loader as it is: it stands at epoch %d after "
            "the batches its loaded state counted",
            num_batches,
            dataloader.loader.epoch,
        )
        return dataloader
    return original(dataloader, num_batches=num_batches)


def prepare(
    accelerator: Accelerator, loader: DataLoader, device_placement: bool | None = None
) -> AcceleratedLoader:
    """Make a lake loader checkpointed, device-placed and epoch-aware under ``accelerator``.

    Call it once per loader, before ``accelerator.load_state``; the loader it returns is the
    one to iterate, pass to ``set_epoch`` and to ``skip_first_batches``.

    Args:
        accelerator: The run's ``Accelerator``.
        loader: A lakeloader loader (made with ``rank``/``world_size`` left to the process
            group, or given explicitly).
        device_placement: Move batches to ``accelerator.device`` (default: the
            accelerator's ``device_placement``).

    Returns:
        The loader to train on (see :class:`AcceleratedLoader`).
    """
    wrapped = AcceleratedLoader(accelerator, loader, device_placement)
    accelerator.register_for_checkpointing(wrapped)
    skip = accelerator.skip_first_batches
    if not (isinstance(skip, functools.partial) and skip.func is _skip_first_batches):
        accelerator.skip_first_batches = functools.partial(_skip_first_batches, skip)
    return wrapped
