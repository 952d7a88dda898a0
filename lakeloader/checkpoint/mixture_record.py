"""What a mixture's checkpoint holds (no I/O here).

Its state, the context, the caller's extras, and the manifest of every source's pinned
snapshot. A single lake's checkpoint names its one manifest in ``COMMIT``; a mixture's
``COMMIT`` names none, and its ``state.msgpack`` (whose SHA-256 ``COMMIT`` records) lists
each source's manifest with its SHA-256, so every part is verified the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgpack

from lakeloader.checkpoint.layout import sha256
from lakeloader.errors import CheckpointError, StateFormatError
from lakeloader.state.mixture_state import MIXTURE_KIND, MixtureState

#: Key of a record's kind in ``state.msgpack`` (a single lake's record has none).
KIND_KEY: Final = "kind"


@dataclass(frozen=True)
class MixtureRecord:
    """``state.msgpack`` of a mixture's checkpoint.

    Attributes:
        state: The mixture's state.
        step: The training step.
        library_version: The lakeloader that wrote it.
        created: When, ISO 8601 in UTC.
        manifests: ``{source: (manifest path relative to the root, its SHA-256)}``.
        sources: ``{source: what its dataset was given as source}`` (for reports).
        extra: The caller's extras (plain, msgpack-able types).
    """

    state: MixtureState
    step: int
    library_version: str
    created: str
    manifests: Mapping[str, tuple[str, str]]
    sources: Mapping[str, Any]
    extra: Any

    def to_bytes(self) -> bytes:
        """The record's bytes (msgpack).

        >>> from lakeloader.state.mixture_state import SourceRecord, WeightChange
        >>> state = MixtureState(0, 8, {"a": 8}, (WeightChange(0, {"a": 1.0}),), 0, 0, 10,
        ...                      {"a": SourceRecord("f", "c", 10)})
        >>> rec = MixtureRecord(state, 3, "0.1", "now", {"a": ("m/f.msgpack", "ab")}, {}, None)
        >>> MixtureRecord.from_bytes(rec.to_bytes()) == rec
        True

        Raises:
            CheckpointError: If ``extra`` is not msgpack-serialisable.
        """
        body = {
            KIND_KEY: MIXTURE_KIND,
            "state": self.state.to_dict(),
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
    def from_bytes(cls, data: bytes) -> MixtureRecord:
        """Parse a record.

        Raises:
            CheckpointError: If it is malformed or of an unknown version.
        """
        try:
            d = msgpack.unpackb(data, raw=False)
            return cls(
                state=MixtureState.from_dict(d["state"]),
                step=int(d["step"]),
                library_version=str(d["library_version"]),
                created=str(d["created"]),
                manifests={str(k): (str(v[0]), str(v[1])) for k, v in d["manifests"].items()},
                sources=dict(d["sources"]),
                extra=d["extra"],
            )
        except StateFormatError as exc:
            raise CheckpointError(str(exc)) from exc
        except (KeyError, TypeError, ValueError, AttributeError, msgpack.UnpackException) as exc:
            raise CheckpointError(f"its mixture state record is corrupt ({exc!r})") from exc


def is_mixture_record(data: bytes) -> bool:
    """Whether ``state.msgpack``'s bytes are a mixture's record (else a single lake's)."""
    try:
        d = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException):
        return False
    return isinstance(d, dict) and d.get(KIND_KEY) == MIXTURE_KIND


@dataclass(frozen=True)
class MixtureCheckpoint:
    """A loaded, verified mixture checkpoint.

    Attributes:
        step: The training step it was saved at.
        path: Its folder.
        record: What ``state.msgpack`` holds.
        nbytes: Size of ``state.msgpack``.
    """

    step: int
    path: str
    record: MixtureRecord
    nbytes: int

    @property
    def extra(self) -> Any:
        """The caller's extras."""
        return self.record.extra


def mixture_record(
    loader: Any,
    step: int,
    extra: Any,
    created: str,
    library_version: str,
    manifest: Callable[[Any, Any], tuple[str, str]],
) -> MixtureRecord:
    """The record of a loader over a Mixture, its sources' manifests written by ``manifest``.

    Args:
        loader: A ``MixtureLoader``.
        step: The training step.
        extra: The caller's extras.
        created: When, ISO 8601 in UTC.
        library_version: This lakeloader's version.
        manifest: Writes a source's manifest unless an intact one is there (snapshot, source
            description -> relative path, SHA-256).
    """
    mixture = loader.dataset
    state = MixtureState.from_dict(loader.state_dict())
    manifests, sources = {}, {}
    for name, ds in mixture.sources.items():
        sources[name] = ds.source.describe()
        manifests[name] = manifest(ds.snapshot, sources[name])
    return MixtureRecord(state, step, library_version, created, manifests, sources, extra)


def verify_manifests(record: MixtureRecord, cat: Callable[[str], bytes]) -> None:
    """Check every source's manifest against the SHA-256 the record holds.

    Raises:
        CheckpointError: Naming the source and the manifest that is missing or differs.
    """
    for name, (rel, digest) in record.manifests.items():
        try:
            data = cat(rel)
        except FileNotFoundError as exc:
            raise CheckpointError(f"manifest {rel} of mixture source {name!r} is missing") from exc
        if sha256(data) != digest:
            raise CheckpointError(
                f"manifest {rel} of mixture source {name!r} does not match the SHA-256 its "
                "state records: torn or overwritten"
            )


def check_same_kind(path: str, saved_mixture: bool, loader_mixture: bool) -> None:
    """Refuse to load a Mixture's position into a single lake's loader, or the other way.

    Raises:
        CheckpointError: Naming both kinds.
    """
    if saved_mixture != loader_mixture:
        saved, loader = ("Mixture", "lake") if saved_mixture else ("lake", "Mixture")
        raise CheckpointError(
            f"{path} holds a {saved}'s position, and this loader reads a {loader}: load it into "
            "a loader over the same kind of dataset"
        )
