"""The checkpoint format on disk: names, and the typed records behind each file.

Layout under the root URL::

    manifests/<fingerprint>.msgpack   the pinned snapshot, written once and shared
    step-000000001200/state.msgpack   a StateRecord: loader state, context, the caller's extras
    step-000000001200/COMMIT          a CommitRecord, written last: sizes and SHA-256 of the parts

A checkpoint is visible only once its ``COMMIT`` exists, which works the same on a local disk
and on object stores that cannot rename. Every record is versioned, and a version this library
does not know is refused with both versions in the message. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from lakeloader.checkpoint.training import TrainingRecord
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.lake.snapshot import Snapshot
from lakeloader.state.loader_state import LoaderState
from lakeloader.topology import Topology

STATE_FILE: Final = "state.msgpack"
COMMIT_FILE: Final = "COMMIT"
MANIFEST_DIR: Final = "manifests"
STEP_PREFIX: Final = "step-"
STEP_DIR_RE: Final = re.compile(r"step-(\d{12})$")
#: Version of the COMMIT record (and of the folder layout it describes).
CHECKPOINT_FORMAT_VERSION: Final = 1


def sha256(data: bytes) -> str:
    """Hex SHA-256 of some bytes."""
    return hashlib.sha256(data).hexdigest()


def step_dir_name(step: int) -> str:
    """Folder name of a step's checkpoint (zero-padded so that names sort by step).

    >>> step_dir_name(1200)
    'step-000000001200'
    """
    return f"{STEP_PREFIX}{step:012d}"


def manifest_name(fingerprint: str) -> str:
    """Path of a snapshot's manifest, relative to the root.

    >>> manifest_name("ab12")
    'manifests/ab12.msgpack'
    """
    return posixpath.join(MANIFEST_DIR, f"{fingerprint}.msgpack")


def split_checkpoint_path(path: str) -> tuple[str, int | None]:
    """Split a checkpoint path into (root, step); the step is None for a root folder.

    >>> split_checkpoint_path("/runs/ckpt/step-000000000120/")
    ('/runs/ckpt', 120)
    >>> split_checkpoint_path("s3://bucket/ckpt")
    ('s3://bucket/ckpt', None)
    """
    path = path.rstrip("/")
    parent, name = posixpath.split(path)
    match = STEP_DIR_RE.fullmatch(name)
    return (parent, int(match.group(1))) if match else (path, None)


@dataclass(frozen=True)
class CommitRecord:
    """The ``COMMIT`` marker: what a complete checkpoint holds, with sizes and digests.

    Attributes:
        step: The training step.
        state_bytes: Size of ``state.msgpack``.
        state_sha256: Its SHA-256.
        manifest: Path of the pinned snapshot's manifest, relative to the root.
        manifest_sha256: The manifest's SHA-256.
        version: The format version.
        parts: The step folder's other files (the training context, the weights' shards),
            by path relative to the folder: ``(size, SHA-256)``, the digest empty for shards
            (their sizes are checked; DCP checks what it reads).

    Example:
        >>> c = CommitRecord(7, 10, "ab", "manifests/f.msgpack", "cd")
        >>> CommitRecord.from_bytes(c.to_bytes()) == c
        True
    """

    step: int
    state_bytes: int
    state_sha256: str
    manifest: str
    manifest_sha256: str
    version: int = CHECKPOINT_FORMAT_VERSION
    parts: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The marker's bytes (msgpack)."""
        files = {name: [size, digest] for name, (size, digest) in self.parts.items()}
        packed: bytes = msgpack.packb(
            {
                "version": self.version,
                "step": self.step,
                "files": {STATE_FILE: [self.state_bytes, self.state_sha256], **files},
                "manifest": self.manifest,
                "manifest_sha256": self.manifest_sha256,
            }
        )
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> CommitRecord:
        """Parse a marker, refusing a format version this library does not read.

        Raises:
            CheckpointError: If the version is unknown or the marker is malformed.
        """
        try:
            d = msgpack.unpackb(data)
            version = d.get("version")
            if version != CHECKPOINT_FORMAT_VERSION:
                raise CheckpointError(
                    f"its COMMIT has format version {version!r}; this lakeloader reads version "
                    f"{CHECKPOINT_FORMAT_VERSION}. Load it with the lakeloader that wrote it"
                )
            size, digest = d["files"][STATE_FILE]
            parts = {
                str(name): (int(n), str(sha))
                for name, (n, sha) in d["files"].items()
                if name != STATE_FILE
            }
            return cls(
                int(d["step"]),
                int(size),
                str(digest),
                str(d["manifest"]),
                str(d["manifest_sha256"]),
                int(version),
                parts,
            )
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise CheckpointError(f"its COMMIT is corrupt ({exc!r})") from exc


@dataclass(frozen=True)
class CheckpointContext:
    """The context that produced a checkpoint (information for people and ``inspect``).

    Attributes:
        step: The training step.
        library_version: The lakeloader that wrote it.
        created: When, ISO 8601 in UTC.
        fingerprint: The snapshot's fingerprint.
        config: The order configuration (plain types).
        topology: The saving loader's topology (rank 0's).
        drop_last: Whether its short last batch is dropped.
        workers_build: Whether its workers build batches (a transform or collate_fn) rather
            than decode units.
        source: The lake's source as given to the dataset (a URL or a list of them).
    """

    step: int
    library_version: str
    created: str
    fingerprint: str
    config: dict[str, Any]
    topology: Topology
    drop_last: bool
    workers_build: bool
    source: str | list[str]

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return {
            "step": self.step,
            "library_version": self.library_version,
            "created": self.created,
            "fingerprint": self.fingerprint,
            "config": dict(self.config),
            "topology": self.topology.to_dict(),
            "drop_last": self.drop_last,
            "workers_build": self.workers_build,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointContext:
        """Parse :meth:`to_dict`'s output, or a context of lakeloader 0.1.

        In 0.1 the topology held ``drop_last`` and no rank.

        Raises:
            KeyError: If a required key is missing.
        """
        topo = d["topology"]
        return cls(
            step=int(d["step"]),
            library_version=str(d.get("library_version", "")),
            created=str(d.get("created", "")),
            fingerprint=str(d["fingerprint"]),
            config=dict(d["config"]),
            topology=Topology.from_dict(topo),
            drop_last=bool(d.get("drop_last", topo.get("drop_last", False))),
            workers_build=bool(d.get("workers_build", False)),
            source=d["source"],
        )


@dataclass(frozen=True)
class StateRecord:
    """What ``state.msgpack`` holds.

    Attributes:
        loader: The loader state.
        context: The context that produced it.
        extra: The caller's extras (plain, msgpack-able types).
    """

    loader: LoaderState
    context: CheckpointContext
    extra: Any

    def to_bytes(self) -> bytes:
        """The record's bytes (msgpack).

        Raises:
            CheckpointError: If ``extra`` is not msgpack-serialisable.
        """
        try:
            packed: bytes = msgpack.packb(
                {
                    "loader": self.loader.to_dict(),
                    "context": self.context.to_dict(),
                    "extra": self.extra,
                },
                use_bin_type=True,
            )
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"extra for step {self.context.step} is not msgpack-serialisable ({exc}); pass "
                "plain types (dicts, lists, numbers, strings, bytes)"
            ) from exc
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> StateRecord:
        """Parse a record.

        Raises:
            CheckpointError: If it is malformed, or its loader state has an unknown version.
        """
        try:
            d = msgpack.unpackb(data, raw=False)
            return cls(
                LoaderState.from_dict(d["loader"]),
                CheckpointContext.from_dict(d["context"]),
                d["extra"],
            )
        except StateFormatError as exc:
            raise CheckpointError(str(exc)) from exc
        except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise CheckpointError(f"its {STATE_FILE} is corrupt ({exc!r})") from exc


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint.

    Attributes:
        step: The training step it was saved at.
        path: Its folder.
        state: The loader state.
        context: The context that produced it.
        extra: The caller's extras.
        snapshot: The pinned snapshot from the manifest.
        manifest: The manifest itself (plain dict).
        nbytes: Size of ``state.msgpack``.
        training: Its training context (generators, versions, what the weights hold), or
            None for a checkpoint written before lakeloader saved one.
    """

    step: int
    path: str
    state: LoaderState
    context: CheckpointContext
    extra: Any
    snapshot: Snapshot
    manifest: dict[str, Any]
    nbytes: int
    training: TrainingRecord | None = None
