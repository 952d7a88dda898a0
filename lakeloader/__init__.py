"""lakeloader: deterministic, exactly-resumable streaming of Parquet lakes into PyTorch."""

from __future__ import annotations

import logging

from lakeloader._version import __version__
from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.checkpoint.manager import CheckpointManager
from lakeloader.dataset import LakeDataset
from lakeloader.errors import (
    CacheBudgetWarning,
    CheckpointError,
    ColumnNotFoundError,
    CpuContentionWarning,
    LakeChangedError,
    LakeDataError,
    LakeError,
    LakeNotFoundError,
    LakeWarning,
    MirrorWarning,
    NullValuesError,
    PartitionWarning,
    SchemaMismatchError,
    StateFormatError,
    StateMismatchError,
    StorageRetryWarning,
    StoreAccessError,
    StoreUnavailableError,
    TopologyError,
    WorkerError,
    WorkerWarning,
)
from lakeloader.follow import Follow
from lakeloader.ft.loader import FaultTolerantLoader
from lakeloader.io.retry import RetryPolicy
from lakeloader.loader import DataLoader
from lakeloader.mixture import Mixture
from lakeloader.options import LoaderOptions
from lakeloader.packing import Packing
from lakeloader.preemption import Preemption
from lakeloader.randomness import rng, row_rngs, row_seeds
from lakeloader.recovery.coordinator import RecoveryCoordinator
from lakeloader.state.tracker import ReaderStateTracker
from lakeloader.topology import Topology

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CacheBudgetWarning",
    "Checkpoint",
    "FaultTolerantLoader",
    "Follow",
    "CheckpointError",
    "CheckpointManager",
    "ColumnNotFoundError",
    "CpuContentionWarning",
    "Preemption",
    "LakeChangedError",
    "LakeDataError",
    "DataLoader",
    "LakeDataset",
    "LakeError",
    "LakeNotFoundError",
    "LakeWarning",
    "MirrorWarning",
    "NullValuesError",
    "LoaderOptions",
    "Mixture",
    "Packing",
    "PartitionWarning",
    "ReaderStateTracker",
    "RecoveryCoordinator",
    "RetryPolicy",
    "SchemaMismatchError",
    "StateFormatError",
    "StateMismatchError",
    "StorageRetryWarning",
    "StoreAccessError",
    "StoreUnavailableError",
    "Topology",
    "TopologyError",
    "rng",
    "row_rngs",
    "row_seeds",
    "WorkerError",
    "WorkerWarning",
    "__version__",
]
