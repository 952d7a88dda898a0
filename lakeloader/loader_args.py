"""A loader's arguments: torch's names for them, what is refused, what is only warned of.

:class:`RootViews` is what a loader (a DataLoader, a FaultTolerantLoader) tells of its node.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lakeloader.dataset import LakeDataset
from lakeloader.errors import CpuContentionWarning, PartitionWarning, warn_user
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.pipeline.collate import Collate
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.state.tracker import ReaderStateTracker, ReaderView
from lakeloader.topology import Topology

if TYPE_CHECKING:
    from lakeloader.nodes.base import Node


class EpochSampler:
    """``loader.sampler``: not a torch ``Sampler``, only where frameworks set the epoch.

    Lightning and Accelerate call ``loader.sampler.set_epoch(epoch)``; this hands it to the
    loader's ``set_epoch``.

    Args:
        set_epoch: The loader's ``set_epoch``; None for a loader whose epochs are not the
            framework's (no ``len()``), which ignores it.
    """

    def __init__(self, set_epoch: Callable[[int], None] | None) -> None:
        self._set_epoch = set_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the loader's next pass run ``epoch`` (see ``DataLoader.set_epoch``)."""
        if self._set_epoch is not None:
            self._set_epoch(epoch)

    def __repr__(self) -> str:
        return "EpochSampler(the loader plans its own order; set_epoch reaches the loader)"


class TorchNames:
    """torch's names for a loader's arguments, read from its options and topology."""

    options: LoaderOptions
    #: The ``rank`` and ``world_size`` arguments as given (None: resolved when needed).
    _placement: tuple[int | None, int | None]
    set_epoch: Callable[[int], None]  # the loader's (see ``DataLoader.set_epoch``)

    @property
    def topology(self) -> Topology:
        """Rank, world size, workers and batch size as of now (resolved when asked for)."""
        return self._resolve_topology(strict=False)

    def _resolve_topology(self, *, strict: bool) -> Topology:
        rank, world_size = self._placement
        o = self.options
        return Topology.resolve(
            rank, world_size, num_workers=o.num_workers, batch_size=o.batch_size, strict=strict
        )

    @property
    def sampler(self) -> EpochSampler:
        """Where frameworks set the epoch: ``loader.sampler.set_epoch(n)`` is ``set_epoch(n)``.

        Ignored by a loader without ``len()`` (endless, followed, packed): it runs through its
        epochs by itself.
        """
        return EpochSampler(self.set_epoch if has_len(self) else None)

    @property
    def batch_sampler(self) -> None:
        """None: batches are planned, not sampled (as torch's loader without one)."""
        return None

    @property
    def batch_size(self) -> int:
        """Rows per batch on this rank."""
        return self.options.batch_size

    @property
    def num_workers(self) -> int:
        """Worker processes per rank."""
        return self.options.num_workers

    @property
    def drop_last(self) -> bool:
        """Whether a short last global batch is dropped."""
        return self.options.drop_last

    @property
    def collate_fn(self) -> Collate | None:
        """The user's collate function, or None."""
        return self.options.collate_fn

    @property
    def rank(self) -> int:
        """This loader's rank."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Ranks in the run."""
        return self.topology.world_size

    @property
    def global_batch_size(self) -> int:
        """Rows all ranks together consume in one step."""
        return self.topology.global_batch


class RootViews:
    """What a loader tells of the node it reads, its ``root`` (see :mod:`lakeloader.nodes`)."""

    #: What it reads: a lake, a followed lake, a mixture or a packed stream.
    root: Node

    @property
    def dataset(self) -> Any:
        """What the loader reads: the dataset given (a followed lake's increment under way)."""
        return self.root.dataset

    @property
    def tracker(self) -> ReaderStateTracker:
        """The reader-state tracker: the position, the steps delivered, the quarantine.

        A lake's position is its epoch and the global rows of it delivered; a mixture's, its
        pass and the rows of it; a packed stream's, the samples delivered. Where that leaves
        every rank, worker and source is :meth:`view`.
        """
        return self.root.tracker

    def view(self) -> ReaderView:
        """Where the position leaves every rank and worker (see :mod:`lakeloader.state.view`).

        Each rank's share of the next step, and what each worker of each rank builds or
        decodes first: files, row groups and row offsets, derived from the position alone
        (nothing is read, no worker is started).

        A mixture's or a packed stream's says where each rank's share and each source stands
        (``sources``: its epoch, the rows or samples of it given, the location of its next
        one), not what each worker does first (their work is dealt as it is planned).

        Example:
            >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
            >>> from lakeloader import DataLoader, LakeDataset
            >>> tmp = tempfile.TemporaryDirectory(); path = f"{tmp.name}/a.parquet"
            >>> pq.write_table(pa.table({"id": range(10)}), path, row_group_size=5)
            >>> ds = LakeDataset(tmp.name, shuffle=False, max_unit_rows=5)
            >>> loader = DataLoader(ds, batch_size=4, num_workers=2)
            >>> next(iter(loader))["id"].tolist()
            [0, 1, 2, 3]
            >>> view = loader.view()
            >>> view.epoch, view.position, view.steps_remaining, view.ranks[0].rows
            (0, 4, 2, 4)
            >>> at = view.ranks[0].at; at.file == path, at.row_group, at.row_offset
            (True, 0, 4)
            >>> [(w.worker, w.role, w.at.row_group, w.at.row_offset) for w in view.workers]
            [(0, 'decode', 0, 0), (1, 'decode', 1, 0)]
            >>> loader.close(); tmp.cleanup()
        """
        return self.root.view()

    @property
    def quarantine(self) -> list[QuarantineEntry]:
        """Units skipped so far (``on_error="skip"``), sorted; merged across ranks at saves."""
        return self.root.quarantine

    @property
    def workers_build(self) -> bool:
        """Whether workers build batches (a transform or collate_fn) rather than decode."""
        return self.root.workers_build


def has_len(loader: object) -> bool:
    """Whether ``len(loader)`` is defined: its passes are epochs that end."""
    try:
        len(loader)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_unsupported(
    dataset: LakeDataset | Mixture,
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


def refuse_fetched_ahead(fetched_ahead: int, what: str) -> None:
    """Raise ValueError for a state asked to stand before batches fetched ahead (``what``'s)."""
    if fetched_ahead:
        raise ValueError(
            f"state_dict(fetched_ahead={fetched_ahead}) of {what}: its position cannot stand "
            "before batches already delivered. Checkpoint it where the training loop has "
            "trained on every batch it fetched (with Lightning: a loader with len(), or "
            "training_step(self, dataloader_iter))"
        )


def warn_partitions(num_partitions: int, topology: Topology) -> None:
    """Warn when ranks will re-read each other's units: C does not divide the global batch."""
    c, b = num_partitions, topology.global_batch
    if b % c and topology.world_size > 1:
        divisors = [d for d in range(1, b + 1) if b % d == 0 and d <= c]
        warn_user(
            f"C={c} canonical partitions do not divide the global batch of {b} rows "
            f"({topology.world_size} ranks x {topology.batch_size}): the order is still "
            f"exact, but ranks re-read each other's units. Choose num_partitions={divisors[-1]} "
            "(or a global batch that is a multiple of C)",
            PartitionWarning,
        )


def warn_cpu_contention(num_workers: int) -> None:
    """Warn once per process when torch's intra-op threads and the workers exceed the cores."""
    _warn_cpu_contention(num_workers, torch.get_num_threads(), os.cpu_count() or 1)


@functools.cache
def _warn_cpu_contention(num_workers: int, threads: int, cores: int) -> None:
    if threads + num_workers > cores:
        warn_user(
            f"torch runs {threads} intra-op threads beside {num_workers} DataLoader workers on "
            f"{cores} cores: they compete, and a training step can take several times longer. "
            f"Call torch.set_num_threads({max(1, cores - num_workers)}) in the training "
            "process, or use fewer workers",
            CpuContentionWarning,
        )
