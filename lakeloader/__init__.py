"""lakeloader: deterministic, exactly-resumable streaming of Parquet lakes into PyTorch.

>>> import lakeloader as ll
>>> [n for n in ('DataLoader', 'LakeDataset', 'CheckpointManager') if n in ll.__all__]
['DataLoader', 'LakeDataset', 'CheckpointManager']
"""

from __future__ import annotations

import logging

from lakeloader._version import __version__
from lakeloader.checkpoint.manager import Checkpoint, CheckpointManager
from lakeloader.dataset import LakeDataset
from lakeloader.errors import (
    CacheBudgetWarning,
    CheckpointError,
    LakeChangedError,
    LakeDataError,
    LakeError,
    LakeNotFoundError,
    NullValuesError,
    SchemaMismatchError,
    StateFormatError,
    StateMismatchError,
    StoreUnavailableError,
    WorkerError,
)
from lakeloader.io.retry import RetryPolicy
from lakeloader.loader import DataLoader, PartitionWarning

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CacheBudgetWarning",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "LakeChangedError",
    "LakeDataError",
    "DataLoader",
    "LakeDataset",
    "LakeError",
    "LakeNotFoundError",
    "NullValuesError",
    "PartitionWarning",
    "RetryPolicy",
    "SchemaMismatchError",
    "StateFormatError",
    "StateMismatchError",
    "StoreUnavailableError",
    "WorkerError",
    "__version__",
]
