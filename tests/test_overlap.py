"""Where the loader's process builds batches: ahead in its thread while the loop computes,
in place when the loop asks again at once (a thread could not get ahead, only add its cost)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import lakeloader as ll
from lakeloader.pipeline import background
from tests.conftest import GLOBAL_BATCH, layout_dataset


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_built_ahead_only_while_the_loop_computes(
    lake: Path, workers: int, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    names: list[str] = []
    finish = background._finished

    def recording(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return finish(*args)

    monkeypatch.setattr(background, "_finished", recording)

    def run(step_seconds: float) -> list[int]:
        loader = ll.DataLoader(layout_dataset(lake), batch_size=GLOBAL_BATCH, num_workers=workers)
        ids: list[int] = []
        for batch in loader:
            ids.extend(batch["id"].tolist())
            if step_seconds:
                time.sleep(step_seconds)
        loader.close()
        return ids

    expected = [i for batch in reference for i in batch]
    assert run(0.0) == expected
    tight, names[:] = list(names), []
    assert run(0.002) == expected, "same rows, same order, wherever built"
    busy = list(names)
    assert len(tight) == len(busy) == len(reference)
    assert tight.count("lakeloader-build") <= len(tight) // 10, tight
    assert busy.count("lakeloader-build") >= len(busy) * 8 // 10, busy
