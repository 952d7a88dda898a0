"""Plain-text tables and JSON output for the command line."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Align columns; numbers right-aligned with thousands separators, None as a dash.

    >>> print(format_table(["file", "rows"], [["a.parquet", 1200], ["b.parquet", 7]]))
    file        rows
    ---------  -----
    a.parquet  1,200
    b.parquet      7
    """
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def record_table(records: Sequence[dict[str, Any]], keys: Sequence[str], title: str = "") -> str:
    """The table of the records' ``keys`` (headed by the keys, ``_`` as space), under ``title``."""
    headers = [key.replace("_", " ") for key in keys]
    table = format_table(headers, [[r[k] for k in keys] for r in records])
    return f"{title}\n{table}" if title else table


def format_pairs(pairs: Sequence[tuple[str, Any]]) -> str:
    """Key/value lines with aligned values.

    >>> print(format_pairs([("rows", 1200), ("fingerprint", "ab12")]))
    rows         1,200
    fingerprint  ab12
    """
    width = max((len(k) for k, _ in pairs), default=0)
    return "\n".join(f"{k.ljust(width)}  {_cell(v)}" for k, v in pairs)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def to_json(data: Any) -> str:
    """Indented JSON with sorted keys, for ``--json``."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def full_urls(text: str, url: str) -> str:
    """``text`` with the paths in ``url``'s bucket (fsspec's ``bucket/key``) written as URLs.

    >>> full_urls("b/ckpt/step-000000000001: torn; see 's3://b/x'", "s3://b/ckpt")
    "s3://b/ckpt/step-000000000001: torn; see 's3://b/x'"
    >>> full_urls("/runs/ckpt: empty", "/runs/ckpt")
    '/runs/ckpt: empty'
    """
    scheme, sep, rest = url.partition("://")
    bucket = rest.split("/", 1)[0]
    if not sep or scheme == "file" or not bucket:
        return text
    return re.sub(rf"(?<![\w/.:-]){re.escape(bucket)}(?=/|$)", f"{scheme}://{bucket}", text)


def lake_url(source: str | list[str], path: str) -> str:
    """The URL of a lake file's path (snapshots keep ``bucket/key``, without ``s3://``).

    >>> lake_url(["gs://bucket/lake"], "bucket/lake/a.parquet"), lake_url("/data", "/data/a")
    ('gs://bucket/lake/a.parquet', '/data/a')
    """
    first = source if isinstance(source, str) else (source[0] if source else "")
    head, sep, _ = first.partition("://")
    return f"{head}{sep}{path}" if sep and head != "file" and "://" not in path else path
