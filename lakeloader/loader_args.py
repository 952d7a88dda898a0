"""torch's DataLoader arguments that lakeloader does not take, refused with the reason."""

from __future__ import annotations

import logging
from typing import Any

from lakeloader.dataset import LakeDataset
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions

logger = logging.getLogger(__name__)


def check_unsupported(
    dataset: LakeDataset | Mixture,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    generator: Any,
) -> None:
    """Raise ValueError or TypeError, naming the argument, for what is not supported."""
    if not isinstance(dataset, LakeDataset | Mixture):
        raise TypeError(
            f"dataset must be a lakeloader.LakeDataset or Mixture, got {type(dataset).__name__}"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(dataset, Mixture):
        if shuffle is not None:
            raise ValueError("shuffle= belongs to each source's LakeDataset(...) in a Mixture")
    elif shuffle is not None and bool(shuffle) != dataset.config.shuffle:
        raise ValueError(
            f"shuffle={shuffle} but the dataset has shuffle={dataset.config.shuffle}: the order "
            "belongs to the dataset, so pass shuffle= to LakeDataset(...)"
        )
    for name, value in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if value is not None:
            raise ValueError(f"{name} is not supported: lakeloader plans the order itself")
    if generator is not None:
        raise ValueError("generator is not supported: the order comes from LakeDataset(seed=...)")


def check_stream_options(options: LoaderOptions, what: str) -> None:
    """Check what a Mixture's or a packed loader takes of torch's arguments.

    No ``collate_fn``; ``num_workers`` starts no process (it decodes in the loader's threads;
    said in the log).

    Raises:
        ValueError: If a ``collate_fn`` is given.
    """
    if options.collate_fn is not None:
        raise ValueError(f"collate_fn is not supported over {what}: batches are columnar")
    if options.num_workers:
        logger.warning(
            "%s decodes in the loader's %d io_threads: num_workers=%d starts no worker "
            "process for it",
            what,
            options.io_threads,
            options.num_workers,
        )
