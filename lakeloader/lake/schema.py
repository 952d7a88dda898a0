"""Unifying the schemas of a lake's files: safe widening, nulls for missing columns, or an error.

Columns match by name; a column some files lack reads as nulls if it is nullable; two types
unify only when both widen safely (:func:`is_safe_widening`) to the wider one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from lakeloader.errors import SchemaMismatchError

if TYPE_CHECKING:
    from lakeloader.lake.files import FileInfo

#: Mantissa bits of each float width: the widest integer it holds exactly.
_MANTISSA_BITS = {16: 11, 32: 24, 64: 53}


def _int_bits(t: pa.DataType) -> int:
    """Value bits of an integer type (sign excluded)."""
    return int(t.bit_width) - (1 if pa.types.is_signed_integer(t) else 0)


def is_safe_widening(src: pa.DataType, dst: pa.DataType) -> bool:
    """Whether every value of ``src`` is exactly representable in ``dst``.

    >>> is_safe_widening(pa.int32(), pa.int64()), is_safe_widening(pa.int64(), pa.float64())
    (True, False)
    >>> is_safe_widening(pa.list_(pa.float32()), pa.list_(pa.float64()))
    True
    """
    if src == dst or pa.types.is_null(src):
        return True
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        signed_ok = pa.types.is_signed_integer(dst) or not pa.types.is_signed_integer(src)
        return signed_ok and _int_bits(src) <= _int_bits(dst)
    if pa.types.is_floating(src) and pa.types.is_floating(dst):
        return bool(src.bit_width <= dst.bit_width)
    if pa.types.is_integer(src) and pa.types.is_floating(dst):
        return _int_bits(src) <= _MANTISSA_BITS[dst.bit_width]
    if (src, dst) in ((pa.string(), pa.large_string()), (pa.binary(), pa.large_binary())):
        return True
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        units = ["s", "ms", "us", "ns"]
        return bool(src.tz == dst.tz and units.index(src.unit) <= units.index(dst.unit))
    if _is_list(src) and _is_list(dst):
        return is_safe_widening(src.value_type, dst.value_type)
    if pa.types.is_struct(src) and pa.types.is_struct(dst):
        fields = {f.name: f.type for f in dst}
        return all(f.name in fields and is_safe_widening(f.type, fields[f.name]) for f in src)
    return False


def without_views(schema: pa.Schema) -> pa.Schema:
    """The schema with ``string_view`` and ``binary_view`` as ``string`` and ``binary``.

    >>> views = pa.schema([("s", pa.string_view()), ("l", pa.list_(pa.binary_view()))])
    >>> plain = without_views(views)
    >>> [str(t) for t in plain.types]
    ['string', 'list<item: binary>']
    """
    return pa.schema([f.with_type(_plain(f.type)) for f in schema], metadata=schema.metadata)


def _plain(t: pa.DataType) -> pa.DataType:
    if t == pa.string_view():
        return pa.string()
    if t == pa.binary_view():
        return pa.binary()
    if _is_list(t):
        inner = t.value_field.with_type(_plain(t.value_type))
        return pa.list_(inner) if pa.types.is_list(t) else pa.large_list(inner)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_plain(f.type)) for f in t])
    return t


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _selected(f: FileInfo, columns: Sequence[str] | None) -> pa.Schema:
    assert f.schema is not None
    if columns is None:
        return f.schema
    return pa.schema([field for field in f.schema if field.name in columns])


def unify_schemas(files: Sequence[FileInfo], columns: Sequence[str] | None = None) -> pa.Schema:
    """Unify the file schemas (of ``columns``; None: all of them) by the rules of this module.

    Raises:
        SchemaMismatchError: If two files hold a column in incompatible types (naming both
            files and both types), or a non-nullable column is missing from some files.
    """
    with_schema = [f for f in files if f.schema is not None]
    unified = pa.schema([])
    set_by: dict[str, FileInfo] = {}
    seen: set[pa.Schema] = set()
    for f in with_schema:
        schema = _selected(f, columns)
        if schema in seen:  # most files of a lake share a schema: unify each one once
            continue
        seen.add(schema)
        try:
            merged = pa.unify_schemas([unified, schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            raise _conflict(unified, schema, f, set_by) from exc
        for field in schema:
            have = unified.field(field.name).type if field.name in unified.names else None
            now = merged.field(field.name).type
            if have is not None and not (
                is_safe_widening(have, now) and is_safe_widening(field.type, now)
            ):
                raise _conflict(unified, schema, f, set_by)
            if have != now:
                set_by[field.name] = f
        unified = merged
    _check_missing(with_schema, unified, columns)
    return unified


def _check_missing(
    files: Sequence[FileInfo], unified: pa.Schema, columns: Sequence[str] | None
) -> None:
    selected = [(f.path, _selected(f, columns)) for f in files]
    for field in unified:
        if field.nullable:
            continue
        lacking = [path for path, schema in selected if field.name not in schema.names]
        if lacking:
            held = [(p, s.field(field.name)) for p, s in selected if field.name in s.names]
            requiring = next((p for p, f in held if not f.nullable), "a file")
            raise SchemaMismatchError(
                f"column {field.name!r} is required (not nullable) in {requiring}, but "
                f"{len(lacking)} file(s) lack it, e.g. {lacking[:3]}; nulls cannot stand in for "
                "it. Leave it out with columns=[...], or rewrite those files"
            )


def _conflict(
    unified: pa.Schema, schema: pa.Schema, f: FileInfo, set_by: dict[str, FileInfo]
) -> SchemaMismatchError:
    for field in schema:
        if field.name in unified.names:
            have = unified.field(field.name).type
            if have != field.type and not is_safe_widening(field.type, have):
                other = set_by[field.name]
                return SchemaMismatchError(
                    f"column {field.name!r} is {have} in {other.path} but {field.type} in "
                    f"{f.path}, and neither widens safely to the other:\n--- {other.path}\n"
                    f"{other.schema}\n--- {f.path}\n{f.schema}\n"
                    "rewrite one of them, or leave the column out with columns=[...]"
                )
    return SchemaMismatchError(f"{f.path}: its schema cannot be unified with the lake's:\n{schema}")
