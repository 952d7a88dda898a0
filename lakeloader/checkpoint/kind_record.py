"""What the checkpoint of a Mixture's or a packed loader holds (no I/O here).

A single lake's checkpoint is a ``StateRecord`` naming its one manifest in ``COMMIT``. The
other kinds of loader (``dataset.loader_kind``: ``"mixture"``, ``"packed"``) write a
:class:`KindRecord`: their state as plain data, the context, the caller's extras, and the
manifest of every pinned snapshot they read (one per source of a mixture), each with its
SHA-256; ``COMMIT`` records the SHA-256 of the record itself, so every part is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from lakeloader.checkpoint.layout import sha256
from lakeloader.checkpoint.training import TrainingRecord
from lakeloader.errors import CheckpointError

#: Key of a record's kind in ``state.msgpack`` (a single lake's record has none).
KIND_KEY: Final = "kind"
#: Version of the record below.
KIND_RECORD_VERSION: Final = 1


@dataclass(frozen=True)
class KindRecord:
    """``state.msgpack`` of a Mixture's or a packed loader's checkpoint.

    Attributes:
        kind: The loader's kind (``"mixture"`` or ``"packed"``).
        state: Its state, as ``state_dict()`` gives it (for a packed loader, every rank's
            partitions merged).
        step: The training step.
        library_version: The lakeloader that wrote it.
        created: When, ISO 8601 in UTC.
        manifests: ``{name: (manifest path relative to the root, its SHA-256)}``, a name per
            snapshot read (a mixture's sources; ``"lake"`` for a packed loader).
        sources: ``{name: what its dataset was given as source}`` (for reports).
        extra: The caller's extras (plain, msgpack-able types).
    """

    kind: str
    state: Mapping[str, Any]
    step: int
    library_version: str
    created: str
    manifests: Mapping[str, tuple[str, str]]
    sources: Mapping[str, Any]
    extra: Any

    def to_bytes(self) -> bytes:
        """The record's bytes (msgpack).

        >>> rec = KindRecord("packed", {"samples": 3}, 3, "0.1", "now", {"lake": ("m", "ab")},
        ...                  {"lake": "/data"}, None)
        >>> KindRecord.from_bytes(rec.to_bytes()) == rec
        True

        Raises:
            CheckpointError: If ``extra`` is not msgpack-serialisable.
        """
        body = {
            KIND_KEY: self.kind,
            "version": KIND_RECORD_VERSION,
            "state": dict(self.state),
            "step": self.step,
            "library_version": self.library_version,
            "created": self.created,
            "manifests": {name: list(pair) for name, pair in self.manifests.items()},
            "sources": dict(self.sources),
            "extra": self.extra,
        }
        try:
            packed: bytes = msgpack.packb(body, use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"extra for step {self.step} is not msgpack-serialisable ({exc}); pass plain "
                "types (dicts, lists, numbers, strings, bytes)"
            ) from exc
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> KindRecord:
        """Parse a record.

        Raises:
            CheckpointError: If it is malformed or of an unknown version.
        """
        try:
            d = msgpack.unpackb(data, raw=False)
            if d.get("version") != KIND_RECORD_VERSION:
                raise CheckpointError(
                    f"its {d.get(KIND_KEY)} record has version {d.get('version')!r}; this "
                    f"lakeloader reads version {KIND_RECORD_VERSION}"
                )
            return cls(
                kind=str(d[KIND_KEY]),
                state=dict(d["state"]),
                step=int(d["step"]),
                library_version=str(d["library_version"]),
                created=str(d["created"]),
                manifests={str(k): (str(v[0]), str(v[1])) for k, v in d["manifests"].items()},
                sources=dict(d["sources"]),
                extra=d["extra"],
            )
        except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise CheckpointError(f"its state record is corrupt ({exc!r})") from exc


def record_kind(data: bytes) -> str | None:
    """The kind of ``state.msgpack``'s record, or None for a single lake's."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException):
        return None
    kind = d.get(KIND_KEY) if isinstance(d, dict) else None
    return str(kind) if kind is not None else None


@dataclass(frozen=True)
class KindCheckpoint:
    """A loaded, verified checkpoint of a Mixture's or a packed loader.

    Attributes:
        step: The training step it was saved at.
        path: Its folder.
        record: What ``state.msgpack`` holds.
        nbytes: Size of ``state.msgpack``.
        training: Its training context, or None (written before lakeloader saved one).
    """

    step: int
    path: str
    record: KindRecord
    nbytes: int
    training: TrainingRecord | None = None

    @property
    def kind(self) -> str:
        """The loader's kind."""
        return self.record.kind

    @property
    def extra(self) -> Any:
        """The caller's extras."""
        return self.record.extra


def kind_record(
    loader: Any,
    state: Mapping[str, Any],
    step: int,
    extra: Any,
    created: str,
    library_version: str,
    manifest: Callable[[Any, Any], tuple[str, str]],
) -> KindRecord:
    """The record of a Mixture's or a packed loader; its snapshots' manifests written first.

    Args:
        loader: The loader (``checkpoint_datasets()`` gives the snapshots it reads).
        state: Its state, gathered from every rank (``checkpoint_state()``).
        step: The training step.
        extra: The caller's extras.
        created: When, ISO 8601 in UTC.
        library_version: This lakeloader's version.
        manifest: Writes a snapshot's manifest unless an intact one is there (snapshot,
            source description -> relative path, SHA-256).
    """
    manifests, sources = {}, {}
    for name, ds in loader.checkpoint_datasets().items():
        sources[name] = ds.source.describe()
        manifests[name] = manifest(ds.snapshot, sources[name])
    return KindRecord(
        loader.dataset.loader_kind,
        state,
        step,
        library_version,
        created,
        manifests,
        sources,
        extra,
    )


def verify_manifests(record: KindRecord, cat: Callable[[str], bytes]) -> None:
    """Check every manifest against the SHA-256 the record holds.

    Raises:
        CheckpointError: Naming the snapshot and the manifest that is missing or differs.
    """
    for name, (rel, digest) in record.manifests.items():
        try:
            data = cat(rel)
        except FileNotFoundError as exc:
            raise CheckpointError(f"manifest {rel} of {name!r} is missing") from exc
        if sha256(data) != digest:
            raise CheckpointError(
                f"manifest {rel} of {name!r} does not match the SHA-256 its state records: "
                "torn or overwritten"
            )


def check_same_kind(path: str, saved: str, loader: str) -> None:
    """Refuse to load a checkpoint into a loader of another kind.

    Raises:
        CheckpointError: Naming both kinds.
    """
    if saved != loader:
        raise CheckpointError(
            f"{path} holds a {saved} loader's position, and this loader is a {loader} loader: "
            "load it into a loader over the same kind of dataset"
        )
