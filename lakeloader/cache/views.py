"""String and binary columns as Arrow binary views in the arena, and back to values."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

#: Bytes of one Arrow binary view: length, then 12 inline bytes or (prefix, buffer, offset).
VIEW_BYTES = 16
#: A binary view as a numpy field.
VIEW_DTYPE = np.dtype((np.void, VIEW_BYTES))
#: Column types kept as binary views in the arena, and the view type each becomes.
VIEW_TYPES: dict[pa.DataType, pa.DataType] = {
    pa.string(): pa.string_view(),
    pa.large_string(): pa.string_view(),
    pa.binary(): pa.binary_view(),
    pa.large_binary(): pa.binary_view(),
}
#: The largest data buffer a view can point into (its offset is an int32).
VIEW_MAX_BUFFER = 2**31 - 1
#: Values of at most this many bytes sit inside their view (no data buffer).
VIEW_INLINE_BYTES = 12
#: The data buffer of views that are all inline, and of unused buffer indices.
EMPTY_BUFFER = pa.py_buffer(b"")


def write_views(col: pa.Array, out: np.ndarray, buffer_index: int) -> pa.Buffer | None:
    """Write a unit's string or binary column's Arrow binary views into ``out`` (its arena field).

    A null is a length of -1 (the arena has no room for a validity bitmap); the views point
    into the data buffer of index ``buffer_index`` in :func:`views_array`.

    Returns:
        The data buffer the views point into, the column's own (an empty one when every
        value is inline), or None, writing nothing, when the values do not fit one
        int32-addressed buffer or the cast had to copy them.
    """
    views = col.cast(VIEW_TYPES[col.type])
    buffers = views.buffers()
    data = buffers[2] if len(buffers) == 3 else EMPTY_BUFFER
    if len(buffers) > 3 or data.size > VIEW_MAX_BUFFER:
        return None
    if len(buffers) == 3 and data.address != data_buffer(col).address:
        return None  # the views would point into a copy, not into the column's own data
    ints = np.frombuffer(buffers[1], dtype=np.int32).reshape(-1, 4)
    ints = ints[views.offset : views.offset + len(views)].copy()
    ints[ints[:, 0] > VIEW_INLINE_BYTES, 2] = buffer_index
    if views.null_count:
        nulls = ~np.asarray(views.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        ints[nulls] = 0
        ints[nulls, 0] = -1
    out[...] = ints.view(VIEW_DTYPE).reshape(-1)
    return data


def data_buffer(col: pa.Array) -> pa.Buffer:
    """The buffer holding a string or binary column's values (empty when it has none)."""
    buffers = col.buffers()
    return buffers[2] if len(buffers) > 2 and buffers[2] is not None else EMPTY_BUFFER


def views_array(views: np.ndarray, typ: pa.DataType, buffers: Sequence[pa.Buffer]) -> pa.Array:
    """Gathered views (a copy: nulls are rewritten in it) as an Arrow array of ``typ``'s values.

    ``buffers`` holds every data buffer a view may point into, by its index.
    """
    ints = views.view(np.int32).reshape(-1, 4)
    nulls = ints[:, 0] < 0
    validity = None
    if nulls.any():
        ints[nulls] = 0
        validity = pa.py_buffer(np.packbits(~nulls, bitorder="little"))
    gathered = pa.Array.from_buffers(
        VIEW_TYPES[typ], len(ints), [validity, pa.py_buffer(views), *buffers]
    )
    # A view that pointed outside the buffers would read stray memory: raise instead. A full
    # check beat checking the views' numbers only (benchmarks/results/profile.md).
    gathered.validate(full=True)
    return gathered


class ViewBuffers:
    """The data buffers that a rank's views point into, by index (thread-safe).

    Indices are reused once freed. ``snapshot`` is a tuple replaced on every change, so a
    batch builder reads it without a lock while decodes complete in other threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self.snapshot: tuple[pa.Buffer, ...] = ()

    def reserve(self) -> int:
        """An index for a data buffer to come (see :meth:`put`)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.snapshot = (*self.snapshot, EMPTY_BUFFER)
            return len(self.snapshot) - 1

    def put(self, index: int, buffer: pa.Buffer) -> None:
        """Make ``buffer`` the one at ``index``."""
        with self._lock:
            self.snapshot = (*self.snapshot[:index], buffer, *self.snapshot[index + 1 :])

    def free(self, indices: Sequence[int]) -> None:
        """Drop the buffers at ``indices`` and let the indices be reused."""
        if not indices:
            return
        with self._lock:
            snap = list(self.snapshot)
            for index in indices:
                snap[index] = EMPTY_BUFFER
            self.snapshot = tuple(snap)
            self._free.extend(indices)
