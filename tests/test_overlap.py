"""Where the loader's process builds batches: ahead in its thread while the loop computes,
in place when the loop asks again at once (a thread could not get ahead, only add its cost)."""

from __future__ import annotations

import gc
import math
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import lakeloader as ll
from lakeloader.pipeline import background
from lakeloader.pipeline.background import BUILD_AHEAD_AWAY_SECONDS, Pace
from tests.conftest import GLOBAL_BATCH, layout_dataset


def paced(intervals: list[float], busy: float = 20e-6) -> Pace:
    """A pace after a loop that stays away ``intervals`` and spends ``busy`` inside next()."""
    pace, now = Pace(), 0.0
    for away in intervals:
        pace.returned(now)
        now += away
        pace.asked(now)
        now += busy
    return pace


def test_a_loop_that_computes_gets_batches_built_ahead() -> None:
    assert not Pace().builds_ahead, "no evidence yet: build in place"
    assert paced([0.002] * 30).builds_ahead  # a 2 ms accelerator step
    assert paced([0.0005] * 30).builds_ahead  # 0.5 ms
    assert not paced([30e-6] * 100).builds_ahead  # a loop that only counts rows


@given(
    st.lists(
        st.tuples(st.integers(min_value=2, max_value=30), st.floats(min_value=0.0, max_value=10.0)),
        max_size=60,
    )
)
def test_pauses_of_a_tight_loop_do_not_move_it_to_the_thread(
    pauses: list[tuple[int, float]],
) -> None:
    """A collection or a descheduled moment (of any length), one step in three at most, is not
    a loop that computes."""
    tight = BUILD_AHEAD_AWAY_SECONDS / 8
    intervals = [tight] * 10
    for gap, pause in pauses:
        intervals += [pause] + [tight] * gap
    pace, now = Pace(), 0.0
    for away in intervals:
        pace.returned(now)
        now += away
        pace.asked(now)
        assert not pace.builds_ahead, intervals
        now += 20e-6


def test_the_pace_follows_the_loop_when_it_changes() -> None:
    pace = paced([0.002] * 30)
    assert pace.builds_ahead
    intervals = [0.002] * 30 + [30e-6] * 30  # an evaluation loop after training steps
    assert not paced(intervals).builds_ahead
    assert paced(intervals + [0.002] * 30).builds_ahead


@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_in_place_or_in_the_thread(
    lake: Path, workers: int, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wherever steps are built, the loop gets the same rows in the same order."""
    names: list[str] = []
    finish = background._finished

    def recording(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return finish(*args)

    monkeypatch.setattr(background, "_finished", recording)

    def run(threshold: float) -> tuple[list[int], list[str]]:
        monkeypatch.setattr(background, "BUILD_AHEAD_AWAY_SECONDS", threshold)
        names.clear()
        loader = ll.DataLoader(layout_dataset(lake), batch_size=GLOBAL_BATCH, num_workers=workers)
        ids = [i for batch in loader for i in batch["id"].tolist()]
        loader.close()
        return ids, list(names)

    expected = [i for batch in reference for i in batch]
    ids, in_place = run(math.inf)
    assert ids == expected
    assert in_place == ["MainThread"] * len(reference)
    ids, ahead = run(0.0)
    assert ids == expected, "same rows, same order, wherever built"
    assert len(ahead) == len(reference)
    assert ahead.count("lakeloader-build") >= len(ahead) - 1, ahead  # all but the first


def test_a_loop_that_computes_gets_its_later_steps_planned_in_the_thread(
    lake: Path, slot_order: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning a chunk of steps costs milliseconds: past the first lookahead, the build
    thread plans the next chunk while the loop computes; the steps are the same."""
    from lakeloader.pipeline import iterator

    where: list[tuple[int, str]] = []
    plan = iterator.batch_specs

    def recording(*args: Any, **kwargs: Any) -> Any:
        where.append((kwargs["first_step"], threading.current_thread().name))
        return plan(*args, **kwargs)

    monkeypatch.setattr(iterator, "batch_specs", recording)
    monkeypatch.setattr(background, "BUILD_AHEAD_AWAY_SECONDS", 0.0)
    loader = ll.DataLoader(layout_dataset(lake), batch_size=1)  # 1,500 steps: 24 chunks
    ids = [i for batch in loader for i in batch["id"].tolist()]
    loader.close()
    assert ids == slot_order
    firsts = [first for first, _ in where]
    assert firsts == list(range(0, len(slot_order), iterator.PLAN_CHUNK)), "each chunk once"
    in_thread = [first for first, name in where if name == "lakeloader-build"]
    lookahead = iterator.LOOKAHEAD_STEPS
    assert in_thread == [f for f in firsts if f >= lookahead], where


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_the_loop_is_done_with_are_freed_in_the_thread(
    lake: Path, workers: int, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While it builds ahead, freeing a batch's tensors is the thread's work, not the loop's
    (tens of microseconds a step); the builder keeps only the newest batches, so none leaks."""
    monkeypatch.setattr(background, "BUILD_AHEAD_AWAY_SECONDS", 0.0)
    freed: list[tuple[str, int]] = []  # (thread, batches received by then)
    received = 0

    def on_free() -> None:
        freed.append((threading.current_thread().name, received))

    loader = ll.DataLoader(layout_dataset(lake), batch_size=GLOBAL_BATCH, num_workers=workers)
    ids: list[int] = []
    for batch in loader:
        received += 1
        weakref.finalize(batch["id"], on_free)
        ids.extend(batch["id"].tolist())
    del batch
    loader.close()
    gc.collect()
    assert ids == [i for b in reference for i in b]
    assert len(freed) == len(reference), "every batch freed once the loop is done"
    in_loop = [name for name, seen in freed if seen < len(reference)]
    assert set(in_loop) == {"lakeloader-build"}, freed
    assert len(in_loop) >= len(reference) - 4 * background.KEPT_HANDED, freed
