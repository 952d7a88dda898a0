"""Sizes in human units, for messages and reports."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Bytes with a binary unit.

    >>> human_bytes(1536), human_bytes(3 * 2**30)
    ('1.5 KiB', '3.0 GiB')
    """
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
