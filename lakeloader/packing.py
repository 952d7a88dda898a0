"""``Packing``: rows' token lists cut into fixed-length samples, as a dataset option.

``LakeDataset(..., packing=Packing("tokens", 2048, eos_id=2))`` makes the loader deliver
samples of ``seq_len`` tokens cut from the concatenated token lists of the rows (a document may
span two samples), with per-token position ids that restart at each document and, with
``eos_id``, a separator after each document. How rows become samples, under any world size,
is in :mod:`lakeloader.order.packing`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Packing:
    """How to pack a token column into fixed-length samples.

    Args:
        column: A list column of integers (token ids), or a fixed-size list.
        seq_len: Tokens per sample.
        eos_id: A token appended after each document (row), or None: documents are laid end
            to end without one.
        pad_id: What fills the rest of the last sample of a stream's epoch, and a skipped
            unit's tokens (counted, and marked in the batch's ``pad_mask``).

    Raises:
        ValueError: If ``seq_len`` is not a positive integer or a token id is negative.

    >>> Packing("tokens", 8, eos_id=0)
    Packing(column='tokens', seq_len=8, eos_id=0, pad_id=0)
    """

    column: str
    seq_len: int
    eos_id: int | None = None
    pad_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"Packing seq_len must be a positive integer, got {self.seq_len!r}")
        for name in ("eos_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"Packing {name} must be a non-negative token id, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain types (hashed into the packed state's configuration)."""
        return asdict(self)
