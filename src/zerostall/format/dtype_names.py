"""The tensor dtype names the format stores and their element sizes: the on-disk contract.

A name not in :data:`ITEMSIZE_BY_NAME` is corruption, never a lookup by ``getattr(torch, name)``
on untrusted input. Imports no torch (the manifest parser checks names here; :mod:`.dtypes`
maps them to this torch's dtypes).
"""

from __future__ import annotations

from ..errors import CorruptCheckpoint

ITEMSIZE_BY_NAME: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
DTYPE_NAMES: tuple[str, ...] = tuple(ITEMSIZE_BY_NAME)


def unknown_dtype(name: object, where: str = "manifest") -> CorruptCheckpoint:
    """The error for a dtype name the format does not define."""
    return CorruptCheckpoint(f"{where}: unknown dtype {name!r}", path=where)
