"""The checkpoint format on disk (see docs/design.md): names, and the typed records of each file.

Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import msgpack

from lakeloader.checkpoint.training import MALFORMED, TrainingRecord, check_version
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.lake.snapshot import Snapshot
from lakeloader.state.formats import LAKE, read
from lakeloader.state.loader_state import LoaderState
from lakeloader.topology import Topology

STATE_FILE: Final = "state.msgpack"
COMMIT_FILE: Final = "COMMIT"
MANIFEST_DIR: Final = "manifests"
STEP_DIR_RE: Final = re.compile(r"step-(\d{12})$")
#: Version of the COMMIT record (and of the folder layout it describes).
CHECKPOINT_FORMAT_VERSION: Final = 1
#: Key of the version of ``state.msgpack``'s record, and the version this library writes.
RECORD_KEY: Final = "record"
RECORD_VERSION: Final = 2
#: The leaf path of a loader over one lake.
ROOT: Final = ""


def sha256(data: bytes) -> str:
    """Hex SHA-256 of some bytes."""
    return hashlib.sha256(data).hexdigest()


def step_dir_name(step: int) -> str:
    """Folder name of a step's checkpoint (zero-padded so that names sort by step)."""
    return f"step-{step:012d}"


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
        manifest: Path of a single lake's manifest, relative to the root ("" for a loader
            over several; the state record lists every manifest with its SHA-256).
        parts: The step folder's other files by path relative to it: ``(size, SHA-256)``,
            the digest empty for the weights' shards.
    """

    step: int
    state_bytes: int
    state_sha256: str
    manifest: str
    manifest_sha256: str
    parts: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The marker's bytes."""
        files = {name: [size, digest] for name, (size, digest) in self.parts.items()}
        packed: bytes = msgpack.packb(
            {
                "version": CHECKPOINT_FORMAT_VERSION,
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
            remedy = ". Load it with the lakeloader that wrote it"
            check_version(
                COMMIT_FILE, d.get("version"), CHECKPOINT_FORMAT_VERSION, "format version", remedy
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
                parts,
            )
        except MALFORMED as exc:
            raise CheckpointError(f"its COMMIT is corrupt ({exc!r})") from exc


@dataclass(frozen=True)
class CheckpointContext:
    """The context that produced a checkpoint (information for people and ``inspect``).

    Attributes:
        created: When, ISO 8601 in UTC.
        topology: The saving loader's topology (rank 0's), or None in a Mixture's or a packed
            loader's checkpoint written before record version 2 (which did not keep it).
        workers_build: Whether its workers build batches (a transform or collate_fn) rather
            than decode units.
    """

    step: int
    library_version: str
    created: str
    topology: Topology | None
    drop_last: bool = False
    workers_build: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain types."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointContext:
        """Parse :meth:`to_dict`'s output, or an older context (its other keys are ignored)."""
        topo = d["topology"]
        return cls(
            step=int(d["step"]),
            library_version=str(d.get("library_version", "")),
            created=str(d.get("created", "")),
            topology=None if topo is None else Topology.from_dict(topo),
            drop_last=bool(d.get("drop_last", (topo or {}).get("drop_last", False))),
            workers_build=bool(d.get("workers_build", False)),
        )


@dataclass(frozen=True)
class StateRecord:
    """What ``state.msgpack`` holds, for every kind of loader.

    Leaf paths name the lakes a loader reads: ``""`` for a loader over one lake, a source's
    name in a Mixture, ``"lake"`` for a packed loader's lake.

    Attributes:
        state: The loader's state as plain data (``checkpoint_state()``, every rank's
            quarantine merged in).
        extra: The caller's extras (plain, msgpack-able types).
        manifests: ``{leaf path: (its snapshot's manifest, relative to the root; SHA-256)}``.
        sources: ``{leaf path: what its dataset was given as source}``.
    """

    state: Mapping[str, Any]
    context: CheckpointContext
    extra: Any
    manifests: Mapping[str, tuple[str, str]]
    sources: Mapping[str, Any]

    def to_bytes(self) -> bytes:
        """The record's bytes, of version :data:`RECORD_VERSION`.

        Raises:
            CheckpointError: If ``extra`` is not msgpack-serialisable.
        """
        body = {
            RECORD_KEY: RECORD_VERSION,
            "state": dict(self.state),
            "context": self.context.to_dict(),
            "extra": self.extra,
            "manifests": {leaf: list(pair) for leaf, pair in self.manifests.items()},
            "sources": dict(self.sources),
        }
        try:
            packed: bytes = msgpack.packb(body, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"extra for step {self.context.step} is not msgpack-serialisable ({exc}); pass "
                "plain types (dicts, lists, numbers, strings, bytes)"
            ) from exc
        return packed

    @classmethod
    def from_bytes(cls, data: bytes, root_manifest: tuple[str, str] = ("", "")) -> StateRecord:
        """Parse a record: this version's, or either record written before it.

        Those are a single lake's ``{loader, context, extra}``, whose manifest ``COMMIT``
        names (``root_manifest``), and a Mixture's or a packed loader's ``{kind, version: 1,
        ...}``.

        Raises:
            CheckpointError: If it is malformed, of an unknown version, or a single lake's
                record whose loader state is not one.
        """
        try:
            d = msgpack.unpackb(data, raw=False)
            if RECORD_KEY in d:
                before = " and the records before it"
                check_version(STATE_FILE, d[RECORD_KEY], RECORD_VERSION, "record version", before)
            elif "kind" in d:  # a Mixture's or a packed loader's: its context at the top
                check_version(f"{d['kind']} record", d.get("version"), 1)
                keys = ("step", "library_version", "created")  # it kept no topology
                d = {**d, "context": {k: d[k] for k in keys if k in d} | {"topology": None}}
            else:  # a lake's: its state checked now, its manifest the one COMMIT names
                read(d["loader"], LAKE)
                lake = {
                    "manifests": {ROOT: root_manifest},
                    "sources": {ROOT: d["context"]["source"]},
                }
                d = {**d, "state": d["loader"], **lake}
            manifests = {str(leaf): (str(p[0]), str(p[1])) for leaf, p in d["manifests"].items()}
            context = CheckpointContext.from_dict(d["context"])
            return cls(dict(d["state"]), context, d["extra"], manifests, dict(d["sources"]))
        except StateFormatError as exc:
            raise CheckpointError(str(exc)) from exc
        except (*MALFORMED, IndexError) as exc:
            raise CheckpointError(f"its {STATE_FILE} is corrupt ({exc!r})") from exc


@dataclass(frozen=True)
class Checkpoint:
    """A loaded, verified checkpoint, of any kind of loader.

    Attributes:
        step: The training step it was saved at.
        path: Its folder.
        state_dict: The loader's state as saved (what its ``load_state_dict`` takes).
        context: The context that produced it.
        extra: The caller's extras.
        manifests: Each leaf's manifest (plain dicts, by leaf path, see :class:`StateRecord`).
        sources: What each leaf's dataset was given as source, by leaf path.
        nbytes: Size of ``state.msgpack``.
        training: Its training context (generators, versions, what the weights hold), or
            None for a checkpoint written before lakeloader saved one.
        lake: The pinned snapshot of a loader over one lake (the root leaf ``""``), rebuilt
            from its manifest; None for a Mixture's or a packed loader's.
    """

    step: int
    path: str
    state_dict: dict[str, Any]
    context: CheckpointContext
    extra: Any
    manifests: Mapping[str, dict[str, Any]]
    sources: Mapping[str, Any]
    nbytes: int
    training: TrainingRecord | None = None
    lake: Snapshot | None = None

    @property
    def state(self) -> LoaderState:
        """The position of a loader over one lake.

        Raises:
            StateFormatError: If the checkpoint holds another kind of state (named).
        """
        return read(self.state_dict, LAKE)

    @property
    def snapshot(self) -> Snapshot:
        """The pinned snapshot of a loader over one lake.

        Raises:
            CheckpointError: If the checkpoint pins no single lake (a Mixture's or a packed
                loader's: its leaves are named).
        """
        if self.lake is None:
            raise CheckpointError(
                f"{self.path} pins no single lake: it holds a {self.state_dict.get('kind')!r} "
                f"state over the lakes {dict(self.sources)}: build the datasets on them and "
                "load the checkpoint into a DataLoader over those"
            )
        return self.lake

    @property
    def source(self) -> Any:
        """What the dataset of a loader over one lake was given as source."""
        return self.sources[ROOT]
