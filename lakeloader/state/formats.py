"""Every state lakeloader writes or wrote, read into today's states: the one table of formats.

A state is plain data with a ``kind`` and a ``version``. Each row of the table (:data:`LAKE`,
:data:`MIXTURE`, :data:`PACKED`, :data:`PACKED_MIXTURE`) names the versions read, the words that
refuse another kind and the pure function that reads one; :func:`read` is the one way a state is
read (the nodes, checkpoints, the recovery coordinator, ``lakeloader inspect``). The states
write themselves (``to_dict``), in the oldest version that says what they hold::

    kind                     reads    writes                                  read into
    lakeloader.loader_state  1, 2     2 (followed: follow_increment too)      LoaderState
    mixture                  1, 2     2 if a source names its epoch, else 1   MixtureState
    packed                   1, 2, 3  3 if its lake grew at a resume, else 2  PackedState
    packed-mixture           2        2 (1 is refused, with what to do)       MixtureState

>>> s = MixtureState(0, 8, {"a": 5, "b": 3}, (WeightChange(0, {"a": 1.0, "b": 1.0}),),
...                  0, 0, 100, {"a": SourceRecord("f", "c", 50)})
>>> read(s.to_dict(), MIXTURE) == s
True
>>> read({"kind": "packed", "version": 9}, PACKED)  # doctest: +ELLIPSIS
Traceback (most recent call last):
lakeloader.errors.StateFormatError: a 'packed' state of version 9 ... reads versions 1 to 3; ...
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from lakeloader.errors import StateFormatError
from lakeloader.state.loader_state import LAKE_KIND, LoaderState
from lakeloader.state.mixture_state import MIXTURE_KIND, MixtureState, SourceRecord, WeightChange
from lakeloader.state.packed_state import PACKED_KIND, PACKED_MIXTURE_KIND, PackedState
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology

S = TypeVar("S", LoaderState, MixtureState, PackedState)


@dataclass(frozen=True)
class Format(Generic[S]):
    """One kind of state as read: a row of the table.

    Attributes:
        kind: Its ``"kind"``.
        versions: The versions read.
        refusal: Why a value of another kind is refused (the kind given is added).
        name: What a malformed one is called.
        parse: Reads one of the kind: ``(state, its version, samples in a packed epoch)``.
        remedy: What to do with a version not read.
    """

    kind: str
    versions: tuple[int, ...]
    refusal: str
    name: str
    parse: Callable[[Mapping[str, Any], int, int], S]
    remedy: str = "load it with the lakeloader that wrote it"


def read(given: Any, form: Format[S], per_epoch: int = 0) -> S:
    """A state of ``form``'s kind; of a list of every rank's, the first with every quarantine.

    ``per_epoch``: samples in an epoch of a packed lake (a version 1 packed state counts epochs).

    Raises:
        StateFormatError: If it is not a state of the kind, is of a version not read (with the
            remedy), is malformed, or is a version 1 packed state taken in the middle of an epoch.
    """
    if not isinstance(given, list | tuple):
        return _one(given, form, per_epoch)
    if not given:
        raise StateFormatError(f"{form.refusal} (given: an empty list of states)")
    states = [_one(s, form, per_epoch) for s in given]
    for i, state in enumerate(states[1:], 1):
        if _where(state) != _where(states[0]):
            at = [", ".join(f"{k} {getattr(s, k)}" for k in _AT if hasattr(s, k)) for s in states]
            raise StateFormatError(
                f"the {form.name}s given are not every rank's of one step: the first at {at[0]}, "
                f"number {i} at {at[i]} (or of another snapshot or configuration); give the "
                "states that all ranks took at one step"
            )
    return states[0].with_quarantine(q for s in states for q in s.quarantine)


#: What a refusal of states of different steps names of each.
_AT = ("epoch", "position", "slot", "samples")


def _where(state: Any) -> Any:
    """What every rank's state of one step holds alike: all but its quarantine and topology."""
    fields: dict[str, Any] = {"quarantine": ()}
    if hasattr(state, "topology"):
        fields["topology"] = {}
    return dataclasses.replace(state, **fields)


def _marks(value: Any) -> list[Any] | None:
    """A followed lake's increment marks, as a state holds them (None: it does not follow)."""
    if value is not None and not (isinstance(value, list | tuple) and len(value) >= 3):
        raise ValueError(f"increment {value!r} is not a list of its marks")
    return None if value is None else list(value)


def _one(data: Any, form: Format[S], per_epoch: int) -> S:
    if not isinstance(data, Mapping) or data.get("kind") != form.kind:
        found = f"kind {data.get('kind')!r}" if isinstance(data, Mapping) else type(data).__name__
        raise StateFormatError(f"{form.refusal} (given: {found})")
    version = data.get("version")
    if version not in form.versions:
        reads = " to ".join(str(v) for v in sorted({form.versions[0], form.versions[-1]}))
        raise StateFormatError(
            f"a {form.kind!r} state of version {version!r} is not supported: this lakeloader "
            f"reads versions {reads}; {form.remedy}"
        )
    try:
        return form.parse(data, int(version), per_epoch)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StateFormatError(f"malformed {form.name}: {exc!r}") from exc


def quarantine_in(state: Mapping[str, Any]) -> tuple[QuarantineEntry, ...]:
    """The quarantine alone, of any kind and version of state (a packed mixture's: its cursor's)."""
    return _quarantine(state.get("mixture", state).get("quarantine") or "[]")


def _quarantine(value: Any) -> tuple[QuarantineEntry, ...]:
    """A state's quarantine: a JSON string (a version 1 lake state's: a list of dicts)."""
    entries = json.loads(value) if isinstance(value, str) else value
    if not isinstance(entries, list):
        raise TypeError(f"quarantine must be a list of entries, got {type(entries).__name__}")
    return tuple(QuarantineEntry.from_dict(q) for q in entries)


def _lake(d: Mapping[str, Any], version: int, per_epoch: int) -> LoaderState:
    """Versions 1 and 2 differ only in the quarantine's encoding; a followed lake's adds one key."""
    return LoaderState(
        fingerprint=str(d["fingerprint"]),
        config_hash=str(d["config_hash"]),
        config=dict(d["config"]),
        epoch=int(d["epoch"]),
        position=int(d["position"]),
        rows_dropped=int(d["rows_dropped"]),
        num_rows=int(d["num_rows"]),
        topology=Topology.from_dict(d["topology"]),
        quarantine=_quarantine(d["quarantine"]),
        increment=_marks(d.get("follow_increment")),
    )


def _mixture(d: Mapping[str, Any], version: int, per_epoch: int) -> MixtureState:
    """Version 2's source records may name the epoch they stand in (``start``, ``from_epoch``)."""
    history = tuple(
        WeightChange(int(c["start"]), {str(k): float(v) for k, v in c["weights"].items()})
        for c in d["history"]
    )
    sources = {
        str(name): SourceRecord(
            str(r["fingerprint"]),
            str(r["config"]),
            int(r["rows"]),
            r.get("increment"),
            int(r.get("start", 0)),
            int(r.get("from_epoch", 0)),
        )
        for name, r in d["sources"].items()
    }
    return MixtureState(
        seed=int(d["seed"]),
        slot=int(d["slot"]),
        counts={str(k): int(v) for k, v in d["counts"].items()},
        history=history,
        epoch=int(d["epoch"]),
        epoch_start=int(d["epoch_start"]),
        epoch_rows=int(d["epoch_rows"]),
        sources=sources,
        topology={str(k): int(v) for k, v in d.get("topology", {}).items()},
        quarantine=_quarantine(d.get("quarantine", "[]")),
    )


def _packed(d: Mapping[str, Any], version: int, per_epoch: int) -> PackedState:
    """Version 1 (per-partition packing) is read at an epoch's start only; 3 names its epoch."""
    samples = _epoch_start(d["partitions"]) * per_epoch if version == 1 else int(d["samples"])
    return PackedState(
        str(d["fingerprint"]),
        str(d["config"]),
        samples,
        _quarantine(d.get("quarantine", "[]")),
        _marks(d.get("increment")),
        int(d.get("start", 0)),
        int(d.get("from_epoch", 0)),
    )


def _epoch_start(partitions: Mapping[str, Any]) -> int:
    """The epoch a version 1 state's partitions all start at (one taken mid-epoch is refused)."""
    at = {(int(x[0]), int(x[1]), int(x[2])) for x in partitions.values()}
    if len(at) != 1 or next(iter(at))[1:] != (0, 0):
        raise StateFormatError(
            "a packed state of version 1 (per-partition packing) taken in the middle of an "
            f"epoch (partitions at (epoch, row, token) {sorted(at)[:4]}...): today's packing "
            "orders samples otherwise, so it resumes only from an epoch's start; resume from a "
            "checkpoint taken at one, or finish the epoch with the lakeloader that wrote it"
        )
    return next(iter(at))[0]


def _packed_mixture(d: Mapping[str, Any], version: int, per_epoch: int) -> MixtureState:
    """Version 2: the samples' cursor, a mixture's state (version 1 is refused)."""
    return _one(d["mixture"], MIXTURE, 0)


LAKE: Final = Format(
    LAKE_KIND,
    (1, 2),
    f"not a lakeloader state (expected kind={LAKE_KIND!r}): load a state into a loader over "
    "what took it",
    "lakeloader state",
    _lake,
)
MIXTURE: Final = Format(
    MIXTURE_KIND,
    (1, 2),
    "not a mixture state (no kind='mixture'): a single lake's state cannot be loaded into a "
    "loader over a Mixture, nor the other way round",
    "mixture state",
    _mixture,
)
PACKED: Final = Format(
    PACKED_KIND,
    (1, 2, 3),
    "not a packed state (no kind='packed'): a packed loader loads only the states of packed "
    "loaders",
    "packed state",
    _packed,
)
PACKED_MIXTURE: Final = Format(
    PACKED_MIXTURE_KIND,
    (2,),
    "not a packed mixture's state (no kind='packed-mixture'): a loader over a packed Mixture "
    "loads only the states of such loaders",
    "packed mixture state",
    _packed_mixture,
    "version 1 (rounds of per-partition packing) cannot continue in today's order of samples; "
    "resume from the start of the run's data, or finish it with the lakeloader that wrote it",
)
