"""``state/formats.py``: the one table of state kinds and versions, read back into today's states.

The frozen states of earlier releases are in tests/test_state_compat.py; here, today's states of
every kind go through ``to_dict`` and back, each kind refuses the others in its own words, the
versions read are named, and a list of every rank's states merges their quarantines.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack
import pytest

from lakeloader.errors import StateFormatError
from lakeloader.state.formats import LAKE, MIXTURE, PACKED, PACKED_MIXTURE, Format, read
from lakeloader.state.loader_state import LoaderState
from lakeloader.state.mixture_state import MixtureState, SourceRecord, WeightChange
from lakeloader.state.packed_state import PackedState, packed_mixture_dict
from lakeloader.state.quarantine import QuarantineEntry
from lakeloader.topology import Topology

A = QuarantineEntry("a.parquet", 0, 0, 10, "bad page")
B = QuarantineEntry("b.parquet", 2, 5, 5, "rejected")
LAKE_STATE = LoaderState("f" * 32, "c" * 16, {"seed": 1}, 2, 40, 0, 100, Topology(2, 1, 0, 8))
FOLLOWED = LoaderState(
    "f", "c", {}, 3, 0, 0, 10, Topology(1, 0, 0, 4), increment=[3, 7, "x.parquet"]
)
MIXED = MixtureState(
    7,
    12,
    {"a": 7, "b": 5, "gone": 1},
    (WeightChange(0, {"a": 1.0, "b": 1.0}), WeightChange(8, {"a": 3.0, "b": 1.0})),
    1,
    10,
    20,
    {"a": SourceRecord("fa", "ca", 9, None, 4, 1), "b": SourceRecord("fb", "cb", 6, [1, 2], 3)},
    {"world_size": 2},
)
PACKED_STATE = PackedState("f", "c", 24, (A,), None, 20, 2)
#: Each kind: a state of it as written, what reads it, what it reads back to.
KINDS: dict[str, tuple[dict[str, Any], Format[Any], Any]] = {
    "lake": (LAKE_STATE.to_dict(), LAKE, LAKE_STATE),
    "followed": (FOLLOWED.to_dict(), LAKE, FOLLOWED),
    "mixture": (MIXED.to_dict(), MIXTURE, MIXED),
    "packed": (PACKED_STATE.to_dict(), PACKED, PACKED_STATE),
    "packed-mixture": (packed_mixture_dict(MIXED), PACKED_MIXTURE, MIXED),
}
REFUSALS = {
    LAKE: "not a lakeloader state",
    MIXTURE: "not a mixture state",
    PACKED: "not a packed state",
    PACKED_MIXTURE: "not a packed mixture's state",
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_reads_back_what_it_wrote_after_a_msgpack_and_a_json_trip(kind: str) -> None:
    written, form, state = KINDS[kind]
    for trip in (
        msgpack.unpackb(msgpack.packb(written), raw=False),
        json.loads(json.dumps(written)),
    ):
        assert read(trip, form) == state


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_refuses_the_others_in_its_own_words(kind: str) -> None:
    written, mine, _ = KINDS[kind]
    for form, words in REFUSALS.items():
        if form is not mine:
            with pytest.raises(StateFormatError, match=f"^{re.escape(words)}"):
                read(written, form)


@pytest.mark.parametrize(
    ("form", "reads"), [(LAKE, "1 to 2"), (MIXTURE, "1 to 2"), (PACKED, "1 to 3")]
)
def test_a_version_not_read_names_the_versions_read(form: Format[Any], reads: str) -> None:
    said = f"version 9 is not supported: this lakeloader reads versions {reads}; load it with"
    with pytest.raises(StateFormatError, match=said):
        read({"kind": form.kind, "version": 9}, form)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_missing_key_is_malformed_and_named(kind: str) -> None:
    written, form = json.loads(json.dumps(KINDS[kind][0])), KINDS[kind][1]  # a copy to break
    inner = written.get("mixture", written)
    del inner["seed" if "seed" in inner else "fingerprint"]
    with pytest.raises(StateFormatError, match=r"^malformed .*KeyError\('(seed|fingerprint)'\)"):
        read(written, form)


def test_every_ranks_states_are_read_as_the_first_with_all_quarantines() -> None:
    ranks = [PACKED_STATE.to_dict(), PackedState("f", "c", 24, (B, A), None, 20, 2).to_dict()]
    assert read(ranks, PACKED) == PackedState("f", "c", 24, (A, B), None, 20, 2)
    lakes = [LAKE_STATE.with_quarantine([B]).to_dict(), LAKE_STATE.with_quarantine([A]).to_dict()]
    assert read(lakes, LAKE).quarantine == (A, B)


@pytest.mark.parametrize("kind", KINDS)
def test_states_of_ranks_at_other_steps_or_none_are_refused(kind: str) -> None:
    data, form, _ = KINDS[kind]
    moved = json.loads(json.dumps(data))
    where = moved.get("mixture", moved)
    key = next(k for k in ("position", "slot", "samples") if k in where)
    where[key] += 1
    with pytest.raises(StateFormatError, match=r"not every rank's of one step: the first at .*"):
        read([data, moved], form)
    with pytest.raises(StateFormatError, match=r"\(given: an empty list of states\)$"):
        read([], form)


@pytest.mark.parametrize("marks", [[1], "x.parquet", 5, {}])
def test_a_followed_lake_s_increment_must_be_its_marks(marks: Any) -> None:
    data = {**FOLLOWED.to_dict(), "follow_increment": marks}
    with pytest.raises(StateFormatError, match=r"malformed lakeloader state.*is not a list of"):
        read(data, LAKE)
