"""What ``lakeloader inspect`` adds: table, filter, a followed lake's lag, training context."""

from __future__ import annotations

from typing import Any

from lakeloader.checkpoint.training import CodeVersion
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.increments import Increment, SourceRequest
from lakeloader.lake.snapshot import Snapshot
from lakeloader.lake.source import FolderSource, Growing
from lakeloader.lake.tables.delta import DeltaSource
from lakeloader.lake.tables.options import delta_options, fsspec_options

#: Increments looked ahead at most for the lag (a Delta table gives one per commit).
MAX_LAG_INCREMENTS = 10_000


def lake_details(
    snap: Snapshot, given: Any, storage_options: dict[str, Any], lag: bool, retry: RetryPolicy
) -> dict[str, Any]:
    """The table version, the filter and, for a followed lake, its increment and lag.

    ``given``: what the lake's dataset was given as source.
    """
    inc, increment = snap.increment, None
    if inc is not None:
        increment = {
            "index": inc.index,
            "increments_consumed": inc.index,
            "mark": [inc.upto.position, inc.upto.path],
            "lag": _lag(snap, given, inc, storage_options, retry) if lag else None,
        }
    table = None if snap.table is None else snap.table.describe()
    return {"table": table, "filter": snap.row_filter, "increment": increment}


def _lag(
    snap: Snapshot,
    given: Any,
    after: Increment,
    storage_options: dict[str, Any],
    retry: RetryPolicy,
) -> dict[str, Any]:
    """Files and rows appended after an increment (the increments that would follow it).

    Counting stops after :data:`MAX_LAG_INCREMENTS` increments; ``capped`` then says so.
    """
    source: Growing
    if snap.table is not None and snap.table.format == "delta":
        options = tuple(sorted(delta_options(storage_options).items()))
        source = DeltaSource(snap.table.location, None, options)
    else:
        source = FolderSource.of(given)
    request = SourceRequest(fsspec_options(storage_options), None, False, retry, False, "skip")
    files = rows = increments = 0
    now: Increment | None = after
    while now is not None and increments < MAX_LAG_INCREMENTS:
        found = source.increment(now, request)
        if found is None:
            break
        snapshot = found[1]
        files += len(snapshot.files)
        rows += snapshot.num_rows
        increments += 1
        now = snapshot.increment
    capped = now is not None and increments == MAX_LAG_INCREMENTS
    capped = capped and source.increment(now, request) is not None  # one more after the last
    return {"increments": increments, "files": files, "rows": rows, "capped": capped}


def render_details(details: dict[str, Any], of: str = "") -> list[tuple[str, str]]:
    """The report's lines for :func:`lake_details` (none for a plain folder); ``of``: its leaf."""
    name = f" of {of}" if of else ""
    lines = [(key + name, details[key]) for key in ("table", "filter") if details[key]]
    inc = details["increment"]
    if inc is not None:
        lag, behind = inc["lag"], "-"
        if lag is not None:
            more = "+" if lag["capped"] else ""  # counting stopped: at least that many
            behind = (
                f"{lag['files']:,}{more} files, {lag['rows']:,}{more} rows in "
                f"{lag['increments']:,}{more} increments appended after this one"
            )
        consumed = f"{inc['index']:,} ({inc['increments_consumed']:,} consumed before it)"
        lines += [("increment" + name, consumed), ("lag" + name, behind)]
    return lines


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
