"""What ``lakeloader inspect`` adds for a table, a filter and a followed lake.

For a checkpoint of a followed lake: the increment it stands in (``k`` increments consumed
before it), the increment's mark, and the lag: the files and rows appended after that mark and
not yet consumed (found by asking the source for the following increments, as the loader
would: a listing for a folder, the log for a Delta table).
"""

from __future__ import annotations

import logging
from typing import Any

from lakeloader.checkpoint.layout import Checkpoint
from lakeloader.io.retry import RetryPolicy
from lakeloader.lake.increments import Increment, SourceRequest
from lakeloader.lake.source import FolderSource, Growing
from lakeloader.lake.tables.delta import DeltaSource
from lakeloader.lake.tables.options import delta_options, fsspec_options

logger = logging.getLogger(__name__)

#: Increments looked ahead at most for the lag (a Delta table gives one per commit).
MAX_LAG_INCREMENTS = 10_000


def lake_details(
    ckpt: Checkpoint, storage_options: dict[str, Any], lag: bool, retry: RetryPolicy
) -> dict[str, Any]:
    """The table version, the filter and, for a followed lake, its increment and lag.

    ``retry`` is how long the lake's store is retried while the lag is looked up.
    """
    snap = ckpt.snapshot
    out: dict[str, Any] = {
        "table": None if snap.table is None else snap.table.describe(),
        "filter": snap.row_filter,
        "increment": None,
    }
    if snap.increment is None:
        return out
    inc = snap.increment
    out["increment"] = {
        "index": inc.index,
        "increments_consumed": inc.index,
        "mark": [inc.upto.position, inc.upto.path],
        "lag": _lag(ckpt, inc, storage_options, retry) if lag else None,
    }
    return out


def _lag(
    ckpt: Checkpoint, after: Increment, storage_options: dict[str, Any], retry: RetryPolicy
) -> dict[str, int]:
    """Files and rows appended after an increment (the increments that would follow it)."""
    source: Growing
    where = ckpt.source
    if ckpt.snapshot.table is not None and ckpt.snapshot.table.format == "delta":
        options = tuple(sorted(delta_options(storage_options).items()))
        source = DeltaSource(ckpt.snapshot.table.location, None, options)
    else:
        source = FolderSource.of(where)
    request = SourceRequest(fsspec_options(storage_options), None, False, retry, False, "skip")
    files = rows = increments = 0
    now: Increment | None = after
    while now is not None and increments < MAX_LAG_INCREMENTS:
        found = source.increment(now, request)
        if found is None:
            break
        snapshot = found[1]
        files, rows, increments = (
            files + len(snapshot.files),
            rows + snapshot.num_rows,
            increments + 1,
        )
        now = snapshot.increment
    return {"increments": increments, "files": files, "rows": rows}


def render_details(details: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's lines for :func:`lake_details` (none for a plain folder)."""
    lines = []
    if details["table"]:
        lines.append(("table", details["table"]))
    if details["filter"]:
        lines.append(("filter", details["filter"]))
    inc = details["increment"]
    if inc is not None:
        lines.append(
            ("increment", f"{inc['index']:,} ({inc['increments_consumed']:,} consumed before it)")
        )
        lag = inc["lag"]
        lines.append(
            (
                "lag",
                "-"
                if lag is None
                else f"{lag['files']:,} files, {lag['rows']:,} rows in {lag['increments']:,} "
                "increments appended after this one",
            )
        )
    return lines
