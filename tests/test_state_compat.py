"""States written by an earlier release still load and resume where they stood.

``tests/fixtures/states`` holds what ``tests/fixtures/make_states.py`` wrote: tiny lakes, each
loader kind's ``state_dict()`` JSON, and in ``manifest.json`` the ids
of the next batches after each state. Each test builds the same kind of loader over the
committed lakes, loads the frozen state and checks those ids; a change of the state formats
that old states no longer load fails here.

A state names its lake by the snapshot's fingerprint, which hashes the files' absolute paths
and mtimes. The tests set the committed files' mtimes to the recorded one (a checkout does not
keep them) and read the lakes in place. In a checkout at another path than the one the states
were written at, the states' recorded fingerprints are first checked to be those of the
committed files at the recorded paths, then mapped to this checkout's. (A checkpoint folder
is not frozen here: its manifest holds the lake's absolute paths, so it could only be checked
in the checkout that wrote it.)

The packed states were written by per-partition packing (packed state version 1), mid-epoch:
today's packing orders samples otherwise, so they are refused with what to do, and a version 1
packed state loads only at an epoch's start (shown on the frozen one moved to one).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

import lakeloader as ll
from lakeloader.lake.snapshot import fingerprint
from tests.fixtures import make_states as ms

HERE = Path(__file__).resolve().parent / "fixtures" / "states"
MANIFEST: dict[str, Any] = json.loads((HERE / "manifest.json").read_text())
STATES = list(MANIFEST["states"])
LAKE_OF = {"packed": "tokens", "packed_mixture": "tokens"}  # the others read "lake"
#: What refuses each frozen packed state (version 1, taken mid-epoch).
REFUSED = {
    "packed": r"a packed state of version 1 \(per-partition packing\) taken in the middle of an "
    r"epoch \(partitions at \(epoch, row, token\) \[\(0, 11, 5\), \(0, 12, 4\)\].*resumes only "
    r"from an epoch's start; resume from a checkpoint taken at one, or finish the epoch with "
    r"the lakeloader that wrote it",
    "packed_mixture": r"'packed-mixture' state of version 1 is not supported: this lakeloader "
    r"reads versions 2; version 1 \(rounds of per-partition "
    r"packing\) cannot continue in today's order of samples; resume from the start of the "
    r"run's data, or finish it with the lakeloader that wrote it",
}


@pytest.fixture(scope="module", autouse=True)
def _mtimes() -> None:
    """The recorded mtime on the committed Parquet files (their contents stay as committed)."""
    assert MANIFEST["mtime"] == ms.MTIME
    ms.set_mtimes(HERE)


def relocated() -> bool:
    """Whether this checkout's fixture lakes are elsewhere than where the states were taken."""
    return any(str(HERE / name) != path for name, path in MANIFEST["lakes"].items())


def translate(text: str, lake: str) -> str:
    """A state's text with the recorded lake folder's path and fingerprint mapped to this
    checkout's, after checking that the recorded one is the committed files' at that path."""
    recorded, here = MANIFEST["lakes"][lake], str(HERE / lake)
    if recorded == here:
        return text
    snapshot = ll.LakeDataset(here).snapshot
    files = [dataclasses.replace(f, path=f.path.replace(here, recorded)) for f in snapshot.files]
    old = fingerprint(files, snapshot.table)
    assert old in text, f"the state's fingerprint is not {old}, the committed lake's at {recorded}"
    return text.replace(old, snapshot.fingerprint).replace(recorded, here)


def frozen(name: str) -> dict[str, Any]:
    """The frozen state ``name``, mapped to this checkout's lake."""
    entry = MANIFEST["states"][name]
    state: dict[str, Any] = json.loads(
        translate((HERE / entry["file"]).read_text(), LAKE_OF.get(name, "lake"))
    )
    assert state["kind"] == entry["kind"]
    return state


@pytest.mark.parametrize("name", [n for n in STATES if n not in REFUSED])
def test_a_frozen_state_loads_and_resumes_where_it_stood(name: str) -> None:
    loader = ms.KINDS[name](HERE)
    try:
        loader.load_state_dict(frozen(name))
        assert ms.next_ids(loader) == MANIFEST["states"][name]["next_ids"]
    finally:
        loader.close()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_frozen_packed_state_taken_mid_epoch_is_refused_with_what_to_do(name: str) -> None:
    loader, fresh = ms.KINDS[name](HERE), ms.KINDS[name](HERE)
    try:
        with pytest.raises(ll.StateFormatError, match=REFUSED[name]):
            loader.load_state_dict(frozen(name))
        assert ms.next_ids(loader) == ms.next_ids(fresh), "left where it stood"
    finally:
        loader.close()
        fresh.close()


def test_a_version_1_packed_state_at_an_epochs_start_loads_at_that_epoch() -> None:
    """The frozen packed state moved to the start of epoch 1 (every partition at its first
    row and token) continues where today's state of that many samples does."""
    state = frozen("packed")
    assert state["version"] == 1
    at_start = {**state, "partitions": {p: [1, 0, 0, 0, 0] for p in state["partitions"]}}
    total = sum(len(ms.tokens_of(i)) + 1 for i in range(ms.TOKEN_ROWS))  # eos after each row
    bounds = [c * total // 2 for c in range(3)]  # num_partitions=2 streams
    per_epoch = sum(-(-(b - a) // ms.SEQ_LEN) for a, b in itertools.pairwise(bounds))
    old, new = ms.packed(HERE), ms.packed(HERE)
    try:
        old.load_state_dict(at_start)
        assert old.state_dict()["samples"] == per_epoch
        new.load_state_dict({**new.state_dict(), "samples": per_epoch})
        assert ms.next_ids(old) == ms.next_ids(new)
    finally:
        old.close()
        new.close()


def test_make_states_reproduces_the_committed_oracles(tmp_path: Path) -> None:
    """The oracles of the packed states are version 1 packing's order: of them, the kind."""
    made = ms.make_states(tmp_path)

    def oracles(states: dict[str, Any]) -> dict[str, Any]:
        return {n: (s["kind"], None if n in REFUSED else s["next_ids"]) for n, s in states.items()}

    assert oracles(made["states"]) == oracles(MANIFEST["states"])
