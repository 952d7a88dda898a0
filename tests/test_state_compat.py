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
"""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize("name", STATES)
def test_a_frozen_state_loads_and_resumes_where_it_stood(name: str) -> None:
    entry = MANIFEST["states"][name]
    state = json.loads(translate((HERE / entry["file"]).read_text(), LAKE_OF.get(name, "lake")))
    assert state["kind"] == entry["kind"]
    loader = ms.KINDS[name](HERE)
    try:
        loader.load_state_dict(state)
        assert ms.next_ids(loader) == entry["next_ids"]
    finally:
        loader.close()


def test_make_states_reproduces_the_committed_oracles(tmp_path: Path) -> None:
    made = ms.make_states(tmp_path)
    assert {n: (s["kind"], s["next_ids"]) for n, s in made["states"].items()} == {
        n: (s["kind"], s["next_ids"]) for n, s in MANIFEST["states"].items()
    }
