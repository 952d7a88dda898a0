"""The checkpoint a command-line path names, or what the path is instead (and what to pass).

Paths are shown as the URL a user would pass (``s3://bucket/...``).
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

from lakeloader.checkpoint.layout import STEP_DIR_RE, Checkpoint, split_checkpoint_path
from lakeloader.checkpoint.manager import CheckpointManager
from lakeloader.checkpoint.reading import newest_usable
from lakeloader.cli.tables import full_urls
from lakeloader.errors import CheckpointError
from lakeloader.io.fetch import url_of
from lakeloader.io.retry import RetryPolicy

#: Names in a folder that make it a lake (or a table) rather than a checkpoint root.
_LAKE_SUFFIXES = (".parquet", ".parq")
_LAKE_NAMES = ("_delta_log", "metadata")
#: Names of a folder listed in the message that it holds no checkpoint.
NAMES_SHOWN = 5
#: What a command takes, for the messages.
ROOT_HINT = "the checkpoints' root folder, the URL given to CheckpointManager"


@dataclasses.dataclass(frozen=True)
class Found:
    """A checkpoint a command opened (its ``path`` is its folder's URL), and its root's steps.

    ``steps``: the committed ones; ``skipped``: a line per newer checkpoint passed over as damaged.
    """

    checkpoint: Checkpoint
    steps: list[int]
    skipped: list[str]


def open_checkpoint(
    path: str,
    step: int | None = None,
    storage_options: dict[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> Found:
    """Read the checkpoint a path names: a step folder, or a root (newest usable, or ``step``).

    Raises:
        CheckpointError: If ``step`` contradicts the step folder given.
    """
    root, folder_step = split_checkpoint_path(path)
    if folder_step is not None and step is not None and step != folder_step:
        raise CheckpointError(f"{path} is the checkpoint of step {folder_step}, not {step}")
    with CheckpointManager(
        root, storage_options=storage_options, retry=retry, ledger=False
    ) as manager:
        return find_checkpoint(manager, folder_step if folder_step is not None else step)


def find_checkpoint(manager: CheckpointManager, step: int | None = None) -> Found:
    """The checkpoint of ``step``, or the newest usable one, under a manager's root.

    Raises:
        CheckpointError: If it is not there or damaged, or every checkpoint is damaged.
    """
    steps = manager.steps()
    url = url_of(manager.fs, manager.root)
    if not steps:
        raise CheckpointError(_nothing_there(manager, url, step))
    if step is not None:
        if step not in steps:
            raise CheckpointError(
                f"no committed checkpoint of step {step} under {url}; steps saved there: "
                f"{', '.join(map(str, steps))}"
            )
        try:
            ckpt, skipped = manager.read(step), list[str]()
        except CheckpointError as exc:
            raise CheckpointError(full_urls(str(exc), manager.url)) from exc
    else:
        ckpt, skipped = newest_usable(manager.read, steps, url)
    folder = url_of(manager.fs, manager.folders.step_folder(ckpt.step))
    return Found(dataclasses.replace(ckpt, path=folder), steps, skipped)


def _nothing_there(manager: CheckpointManager, url: str, step: int | None) -> str:
    """Why a root holds no committed checkpoint: what it is, and what to pass instead."""
    root, fs = manager.root, manager.fs
    try:
        kind = manager.store.retry.call(lambda: fs.info(root), url)["type"]
    except FileNotFoundError:
        return f"no such folder: {url}; give {ROOT_HINT}"
    if kind != "directory":
        step_folder = posixpath.dirname(root)
        guess = STEP_DIR_RE.search(step_folder) and url_of(fs, posixpath.dirname(step_folder))
        return (
            f"{url} is a file, not a folder: give {ROOT_HINT} (the folder of the step-*/ "
            f"folders){f', here {guess}' if guess else ''}"
        )
    paths = [p.rstrip("/") for p in manager.store.ls(root)]
    names = sorted(posixpath.basename(p) for p in paths if p != root)
    if not names:
        return f"{url} is empty: no checkpoint was saved here; give {ROOT_HINT}"
    if any(n.endswith(_LAKE_SUFFIXES) or n in _LAKE_NAMES or "=" in n for n in names):
        return (
            f"{url} is a lake (Parquet files), not a checkpoint folder: `lakeloader plan "
            f"{url}` describes it; inspect and audit take {ROOT_HINT}"
        )
    if step is not None:
        return f"no committed checkpoint of step {step} under {url}; steps saved there: none"
    torn = sorted(manager.folders.step_dirs())
    if torn:
        return (
            f"no committed checkpoint under {url}: the step folder(s) of step(s) "
            f"{', '.join(map(str, torn))} have no COMMIT (a save that did not finish)"
        )
    shown = ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
    return f"no checkpoint under {url}: it holds no step-*/ folder ({shown}); give {ROOT_HINT}"
