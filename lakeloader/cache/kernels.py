"""Arrow kernels that give wrong values on some inputs, and how the loader avoids them.

pyarrow 26.0.1's ``take`` and ``filter`` silently return wrong values from a sliced array
whose type holds a fixed-size list of fixed-size lists (``docs/pyarrow-sliced-nested-take.md``).
If the installed pyarrow has the bug, such columns are copied to offset 0 once per unit and
checked before each take.
"""

from __future__ import annotations

import functools
import logging

import pyarrow as pa
import pyarrow.compute as pc

logger = logging.getLogger(__name__)


@functools.cache
def sliced_nested_take_is_wrong() -> bool:
    """Whether this pyarrow's ``take`` is wrong on a sliced fixed-size list of fixed-size lists."""
    values = pa.array(range(48), pa.float32())
    nested = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(values, 2), 2)
    sliced = nested.slice(3, 6)
    taken = pc.take(sliced, pa.array([0, 5])).to_pylist()
    wrong = bool(taken != [sliced[0].as_py(), sliced[5].as_py()])
    if wrong:
        logger.debug(
            "pyarrow %s takes wrong values from sliced nested fixed-size lists: such columns "
            "are copied to offset 0 before they are taken from",
            pa.__version__,
        )
    return wrong


@functools.cache
def is_affected(typ: pa.DataType) -> bool:
    """Whether ``typ`` holds a fixed-size list of fixed-size lists, directly or in structs.

    Lists, large lists and maps reset the offsets of what they hold, so what lies inside them
    is not affected.

    >>> fsl = pa.list_(pa.float32(), 4)
    >>> [is_affected(t) for t in (fsl, pa.list_(fsl, 3), pa.struct([("m", pa.list_(fsl, 3))]))]
    [False, True, True]
    >>> is_affected(pa.list_(pa.list_(fsl, 3)))
    False
    """
    if pa.types.is_fixed_size_list(typ):
        inner = typ.value_type
        return pa.types.is_fixed_size_list(inner) or is_affected(inner)
    if pa.types.is_struct(typ):
        return any(is_affected(typ.field(i).type) for i in range(typ.num_fields))
    return False


def unsliced(array: pa.Array) -> pa.Array:
    """``array``, or a copy of it at offset 0 when this pyarrow would take wrong values from it.

    >>> fsl = pa.FixedSizeListArray.from_arrays(pa.array(range(8), pa.int8()), 2)
    >>> unsliced(pa.FixedSizeListArray.from_arrays(fsl, 2).slice(1, 1)).offset
    0
    """
    if array.offset and is_affected(array.type) and sliced_nested_take_is_wrong():
        return pa.concat_arrays([array])
    return array


def unsliced_table(table: pa.Table) -> pa.Table:
    """``table`` with every chunk of an affected column copied to offset 0 where needed."""
    if not any(is_affected(f.type) for f in table.schema):
        return table
    columns = [
        pa.chunked_array([unsliced(c) for c in col.chunks], col.type) for col in table.columns
    ]
    return pa.Table.from_arrays(columns, schema=table.schema)
