"""lakeloader: deterministic, exactly-resumable streaming of Parquet lakes into PyTorch.

>>> import lakeloader as ll
>>> sorted(n for n in ll.__all__ if n[0].isupper())[:3]
['DataLoader', 'LakeDataset', 'LakeError']
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from lakeloader.dataset import LakeDataset
from lakeloader.errors import (
    LakeError,
    LakeNotFoundError,
    NullValuesError,
    SchemaMismatchError,
    StateFormatError,
    StateMismatchError,
    UnreadableFileError,
    WorkerError,
)
from lakeloader.loader import DataLoader, PartitionWarning

try:
    __version__ = version("lakeloader")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "DataLoader",
    "LakeDataset",
    "LakeError",
    "LakeNotFoundError",
    "NullValuesError",
    "PartitionWarning",
    "SchemaMismatchError",
    "StateFormatError",
    "StateMismatchError",
    "UnreadableFileError",
    "WorkerError",
    "__version__",
]
