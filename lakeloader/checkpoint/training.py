"""The training context of a checkpoint (``training.msgpack``), saved beside the weights.

It holds every rank's random generators: Python's ``random``, NumPy's global generator, torch's
CPU generator, and every CUDA device's. Nothing here does I/O but :func:`code_version` (one
``git`` call).
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

import msgpack
import numpy as np
import torch

from lakeloader.errors import CheckpointError

logger = logging.getLogger(__name__)

TRAINING_FILE: Final = "training.msgpack"
#: Version of :class:`TrainingRecord`'s layout.
TRAINING_RECORD_VERSION: Final = 1
#: What reading a malformed msgpack record raises.
MALFORMED: Final = (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException)


def check_version(name: str, found: Any, reads: int, what: str = "version", more: str = "") -> None:
    """Refuse a checkpoint file's record (``name``) of a version this lakeloader does not read.

    Raises:
        CheckpointError: Naming the file, the version found and the version read.
    """
    if found != reads:
        raise CheckpointError(
            f"its {name} has {what} {found!r}; this lakeloader reads version {reads}{more}"
        )


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
            CheckpointError: If the layout version is unknown.
            KeyError, TypeError, ValueError: If a field is malformed (:data:`MALFORMED`).
        """
        check_version("generators' record", d.get("version"), RNG_STATE_VERSION)
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


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class CodeVersion:
    """The git commit of the training code, when it runs from a repository.

    Attributes:
        commit: The commit's full hash ("" outside a repository or without git).
        dirty: Whether tracked files differ from the commit.
        root: The repository's folder ("" outside one).
    """

    commit: str
    dirty: bool
    root: str

    def describe(self) -> str:
        """One line for people.

        >>> CodeVersion("0123456789abcdef", True, "/src").describe()
        '0123456789ab (modified) in /src'
        >>> CodeVersion("", False, "").describe()
        'not in a git repository'
        """
        if not self.commit:
            return "not in a git repository"
        return f"{self.commit[:12]}{' (modified)' if self.dirty else ''} in {self.root}"


def code_version() -> CodeVersion:
    """The git commit of the repository holding the running script.

    The script is ``sys.argv[0]`` (the training program), falling back to the working folder
    when there is none (an interactive session).
    """
    where = os.path.dirname(os.path.abspath(sys.argv[0])) if sys.argv[0] else os.getcwd()
    if not os.path.isdir(where):
        where = os.getcwd()

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", where, *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        root = git("rev-parse", "--show-toplevel")
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("no git commit for %s (%s)", where, exc)
        return CodeVersion("", False, "")
    return CodeVersion(commit, dirty, root)


@dataclass(frozen=True)
class TrainingRecord:
    """``training.msgpack``: the context that produced a checkpoint's weights.

    Attributes:
        rng: Every rank's generators, in rank order.
        torch_version: ``torch.__version__`` of the saving run.
        library_version: The lakeloader that wrote it.
        code: The git commit of the training code (see :func:`code_version`).
        attempt: The run attempt that saved it (see :mod:`lakeloader.audit.ledger`).
        model: Whether the weights folder holds a model's state.
        optimizer: Whether it holds an optimizer's state.
    """

    step: int
    rng: tuple[RngState, ...]
    torch_version: str
    library_version: str
    code: CodeVersion
    attempt: str
    world_size: int
    model: bool
    optimizer: bool
    version: int = TRAINING_RECORD_VERSION

    def to_bytes(self) -> bytes:
        """The record's bytes."""
        # the version first, then the fields in order (not asdict: it deep-copies the generators)
        body = {"version": self.version, **{f.name: getattr(self, f.name) for f in fields(self)}}
        body.update(rng=[r.to_dict() for r in self.rng], code=asdict(self.code))
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainingRecord:
        """Parse a record.

        Raises:
            CheckpointError: If its version is unknown or it is malformed.
        """
        try:
            d = msgpack.unpackb(data, raw=False)
            check_version(TRAINING_FILE, d.get("version"), TRAINING_RECORD_VERSION)
            code = d["code"]
            return cls(
                step=int(d["step"]),
                rng=tuple(RngState.from_dict(r) for r in d["rng"]),
                torch_version=str(d["torch_version"]),
                library_version=str(d["library_version"]),
                code=CodeVersion(str(code["commit"]), bool(code["dirty"]), str(code["root"])),
                attempt=str(d["attempt"]),
                world_size=int(d["world_size"]),
                model=bool(d["model"]),
                optimizer=bool(d["optimizer"]),
            )
        except MALFORMED as exc:
            raise CheckpointError(f"its {TRAINING_FILE} is corrupt ({exc!r})") from exc

    def to_dict(self) -> dict[str, Any]:
        """What ``lakeloader inspect`` shows (generators as digests, not their words)."""
        return {
            "step": self.step,
            "torch_version": self.torch_version,
            "library_version": self.library_version,
            "code_commit": self.code.commit,
            "code_modified": self.code.dirty,
            "code_root": self.code.root,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "model": self.model,
            "optimizer": self.optimizer,
            "rng_ranks": len(self.rng),
            "rng_cuda_devices": max((len(r.cuda) for r in self.rng), default=0),
        }
