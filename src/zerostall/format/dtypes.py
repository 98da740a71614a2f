"""Names of the tensor dtypes the format stores, and their torch equivalents.

The names are the on-disk contract: an unknown name in a manifest is corruption, never a
lookup by ``getattr(torch, name)`` on untrusted input.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpoint, UnsupportedStateError

_CANDIDATES = (
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
)

_BY_NAME: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _CANDIDATES if isinstance(getattr(torch, n, None), torch.dtype)
}
_BY_DTYPE: dict[torch.dtype, str] = {d: n for n, d in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    """The on-disk name of ``dtype``; raises for dtypes the format does not store."""
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {key!r} has dtype {dtype}, which zerostall cannot store "
            f"(supported: {', '.join(sorted(_BY_NAME))}); convert it first") from None


def dtype_from_name(name: object, where: str = "manifest") -> torch.dtype:
    """The torch dtype for an on-disk name; unknown names are corruption."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}", path=where)
    return _BY_NAME[name]


_ITEMSIZE: dict[torch.dtype, int] = {d: torch.empty((), dtype=d).element_size() for d in _BY_NAME.values()}


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element (a dict lookup: the manifest parser asks once per tensor entry)."""
    size = _ITEMSIZE.get(dtype)
    return size if size is not None else torch.empty((), dtype=dtype).element_size()


SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_BY_NAME.values())
DTYPE_NAMES: tuple[str, ...] = tuple(_BY_NAME)
"""The on-disk names this torch knows (the manifest parser's table)."""
