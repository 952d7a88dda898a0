"""The random-number generators of one rank, captured and restored as plain data.

Python's ``random``, NumPy's global generator, torch's CPU generator, and every CUDA device's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from lakeloader.errors import CheckpointError

#: Version of :meth:`RngState.to_dict`'s layout.
RNG_STATE_VERSION: Final = 1


@dataclass(frozen=True)
class RngState:
    """One rank's generator states.

    Attributes:
        python: ``random.getstate()``: (version, the 625 words, gauss_next).
        numpy: ``np.random.get_state()``: (name, the 624 keys, pos, has_gauss, cached_gaussian).
        torch: ``torch.get_rng_state()`` as bytes.
        cuda: ``torch.cuda.get_rng_state_all()`` as bytes, one per device (empty without CUDA).
    """

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: bytes
    cuda: tuple[bytes, ...]

    @classmethod
    def capture(cls) -> RngState:
        """The calling process's generators now."""
        cuda: tuple[bytes, ...] = ()
        if torch.cuda.is_available():
            cuda = tuple(bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all())
        np_state = np.random.get_state(legacy=True)
        assert isinstance(np_state, tuple)  # legacy=True: the tuple form
        return cls(
            python=random.getstate(),
            numpy=np_state,
            torch=bytes(torch.get_rng_state().numpy().tobytes()),
            cuda=cuda,
        )

    def restore(self) -> None:
        """Set the calling process's generators to these states.

        Raises:
            CheckpointError: If the states were captured with CUDA devices this process
                does not have.
        """
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(_tensor(self.torch))
        if self.cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() < len(self.cuda):
                have = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise CheckpointError(
                    f"the checkpoint holds the generators of {len(self.cuda)} CUDA device(s), "
                    f"this process has {have}: load it where the devices are, or pass "
                    "rng=False to load() to leave the generators as they are"
                )
            torch.cuda.set_rng_state_all([_tensor(s) for s in self.cuda])

    def to_dict(self) -> dict[str, Any]:
        """Plain types (msgpack-able)."""
        version, words, gauss = self.python
        name, keys, pos, has_gauss, cached = self.numpy
        return {
            "version": RNG_STATE_VERSION,
            "python": [version, list(words), gauss],
            "numpy": [name, np.asarray(keys, dtype=np.uint32).tobytes(), pos, has_gauss, cached],
            "torch": self.torch,
            "cuda": list(self.cuda),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RngState:
        """Parse :meth:`to_dict`'s output.

        Raises:
            CheckpointError: If the layout version is unknown or a field is malformed.
        """
        if d.get("version") != RNG_STATE_VERSION:
            raise CheckpointError(
                f"generator states of version {d.get('version')!r}; this lakeloader reads "
                f"version {RNG_STATE_VERSION}"
            )
        try:
            version, words, gauss = d["python"]
            name, keys, pos, has_gauss, cached = d["numpy"]
            return cls(
                python=(int(version), tuple(int(w) for w in words), gauss),
                numpy=(
                    str(name),
                    np.frombuffer(keys, dtype=np.uint32).copy(),
                    int(pos),
                    int(has_gauss),
                    float(cached),
                ),
                torch=bytes(d["torch"]),
                cuda=tuple(bytes(s) for s in d["cuda"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"generator states are malformed ({exc!r})") from exc


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
