"""What ``lakeloader inspect`` shows of a checkpoint's training context (weights, generators)."""

from __future__ import annotations

from typing import Any

from lakeloader.checkpoint.training import CodeVersion, TrainingRecord


def training_details(record: TrainingRecord | None) -> dict[str, Any] | None:
    """The training context as plain data (None for a checkpoint without one)."""
    return None if record is None else record.to_dict()


def render_training(details: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Lines of the readable report.

    >>> render_training(None)
    [('training context', 'none (saved without one)')]
    """
    if details is None:
        return [("training context", "none (saved without one)")]
    held = [name for name in ("model", "optimizer") if details[name]]
    code = CodeVersion(
        details["code_commit"], details["code_modified"], details["code_root"]
    ).describe()
    cuda = details["rng_cuda_devices"]
    return [
        ("weights", " and ".join(held) + " (torch.distributed.checkpoint)" if held else "none"),
        (
            "generators",
            f"{details['rng_ranks']} rank(s): python, numpy, torch"
            + (f", {cuda} CUDA device(s)" if cuda else ""),
        ),
        ("saved by", f"{details['world_size']} rank(s), attempt {details['attempt']}"),
        ("torch version", details["torch_version"]),
        ("training code", code),
    ]
