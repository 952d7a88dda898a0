"""A built batch's tensors and arrays come back from a worker's file as they were sent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lakeloader.workers.shipping import receive, ship


def test_shapes_dtypes_and_values_survive_the_trip(tmp_path: Path) -> None:
    sent = {
        "scalar_array": np.array(7, dtype=np.int16),  # 0-d: came back as shape (1,) before
        "scalar_tensor": torch.tensor(2.5),
        "strided": np.arange(12, dtype=np.float32).reshape(3, 4).T,
        "bf16": torch.arange(4, dtype=torch.bfloat16),
        "empty": np.zeros((0, 3), dtype=np.int64),
        "nested": [np.array([True, False]), (torch.ones(2, 2),)],
    }
    got = receive(ship(sent, str(tmp_path)))
    assert list(tmp_path.iterdir()) == []  # the file is unlinked
    for name in ("scalar_array", "strided", "empty"):  # numpy arrays come back as arrays
        assert isinstance(got[name], np.ndarray)
        assert got[name].shape == sent[name].shape and got[name].dtype == sent[name].dtype
        assert np.array_equal(got[name], sent[name])
    assert np.array_equal(got["nested"][0], sent["nested"][0])
    tensors = [
        (got["scalar_tensor"], sent["scalar_tensor"]),
        (got["bf16"], sent["bf16"]),
        (got["nested"][1][0], sent["nested"][1][0]),
    ]
    for back, expected in tensors:
        assert back.shape == expected.shape and back.dtype == expected.dtype
        assert torch.equal(back, expected)
