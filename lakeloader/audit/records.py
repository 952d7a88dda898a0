"""The entries of the audit ledger, one JSON object per line (no I/O here).

A single lake's entries are version 1, entries naming a stream version 2, those of steps
skipped on request 3.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Final, TypeAlias

from lakeloader.errors import CheckpointError

#: The newest version of the ledger's entries.
LEDGER_VERSION: Final = 3

#: Where each stream stands: ``{stream: (epoch, position)}``.
Stands: TypeAlias = dict[str, tuple[int, int]]


def _stands(entry: Any) -> None:
    """Fill in a start or save entry's ``streams`` (a single lake's by default), as tuples."""
    streams = {str(k): (int(v[0]), int(v[1])) for k, v in entry.streams.items()}
    object.__setattr__(entry, "streams", streams or {"": (entry.epoch, entry.position)})


@dataclass(frozen=True)
class StartEntry:
    """An attempt began.

    Attributes:
        time: Unix seconds.
        restart: torchrun's restart count (0 outside torchrun).
        resumed_step: The checkpoint step it resumed from (-1: a fresh start).
        resumed_attempt: The attempt that saved that checkpoint ("" if unknown).
        epoch: The epoch it resumed in (``position``: the position).
        seq: Steps the attempt had delivered before (a second load within an attempt).
        index: Its place among the attempt's start entries (0, 1, ...).
        streams: Where each stream stood (default: ``{"": (epoch, position)}``); a stream it
            does not name began where its first step in the history begins.
    """

    attempt: str
    time: float
    world_size: int
    restart: int
    resumed_step: int
    resumed_attempt: str
    epoch: int
    position: int
    seq: int = 0
    index: int = 0
    streams: Stands = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _stands(self)


@dataclass(frozen=True)
class StepEntry:
    """A step delivered to the training loop.

    Attributes:
        seq: The step's number within its attempt (1, 2, ...).
        start: The global position before it (``stop``: after it).
        num_rows: Rows in the epoch.
        world_size: Ranks (or fault-tolerant participants) that took the step.
        batch_size: Rows per rank per step.
        committed: False if the step was discarded (a fault-tolerant step that did not
            commit); a step is in the committed history only if a checkpoint also covers it.
        steps: Consecutive steps the entry stands for (more than one where the loader
            delivered them before the ledger was attached to it).
        stream: The stream whose positions it covers (``""``: a single lake's).
        skipped: Skipped on request (``DataLoader.skip``): covered, not trained on.
    """

    attempt: str
    seq: int
    epoch: int
    start: int
    stop: int
    num_rows: int
    world_size: int
    batch_size: int
    committed: bool = True
    steps: int = 1
    stream: str = ""
    skipped: bool = False


@dataclass(frozen=True)
class SaveEntry:
    """A checkpoint committed.

    Attributes:
        step: The checkpoint's step.
        seq: The attempt's last delivered step in it.
        epoch: The loader's epoch (``position``: its position).
        start: The index of the attempt's start entry its history begins at.
        streams: Where each stream stood (default: ``{"": (epoch, position)}``).
    """

    attempt: str
    step: int
    seq: int
    epoch: int
    position: int
    start: int = 0
    streams: Stands = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _stands(self)


Entry = StartEntry | StepEntry | SaveEntry
_KINDS: Final[dict[str, type[Any]]] = {"start": StartEntry, "step": StepEntry, "save": SaveEntry}
_NAMES: Final = {cls: name for name, cls in _KINDS.items()}


def dump_entry(entry: Entry) -> str:
    """One JSON line (without its newline).

    >>> print(dump_entry(SaveEntry("a1", 10, 10, 0, 160)))  # doctest: +NORMALIZE_WHITESPACE
    {"v": 1, "type": "save", "attempt": "a1", "step": 10, "seq": 10, "epoch": 0,
     "position": 160, "start": 0}
    >>> print(dump_entry(SaveEntry("a1", 10, 10, 0, 160, streams={"web": (1, 4)})))
    ... # doctest: +NORMALIZE_WHITESPACE
    {"v": 2, "type": "save", "attempt": "a1", "step": 10, "seq": 10, "epoch": 0,
     "position": 160, "start": 0, "streams": {"web": [1, 4]}}
    """
    d = asdict(entry)
    for key, default in (("steps", 1), ("stream", ""), ("skipped", False)):
        if key in d and d[key] == default:
            del d[key]  # as entries were written before the field was
    if "streams" in d and d["streams"] == {"": (d["epoch"], d["position"])}:
        del d["streams"]
    named = "stream" in d or "streams" in d
    version = LEDGER_VERSION if "skipped" in d else (2 if named else 1)
    return json.dumps({"v": version, "type": _NAMES[type(entry)], **d})


def parse_entry(line: str, where: str) -> Entry:
    """Parse one line of a ledger segment.

    Raises:
        CheckpointError: Naming the segment, if the line is malformed or of a version this
            lakeloader does not read.
    """
    try:
        d = json.loads(line)
        version = d.pop("v")
        if version not in range(1, LEDGER_VERSION + 1):
            raise CheckpointError(
                f"{where}: ledger entry of version {version!r}; this lakeloader reads "
                f"versions 1 to {LEDGER_VERSION}: audit it with the lakeloader that wrote it"
            )
        cls = _KINDS[d.pop("type")]
        entry: Entry = cls(**d)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}: malformed ledger entry {line[:120]!r} ({exc!r})") from exc
    return entry
