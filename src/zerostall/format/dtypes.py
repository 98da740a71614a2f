"""The torch dtypes of the names the format stores (:data:`.validate.ITEMSIZE_BY_NAME`); a name
this torch lacks (a newer float8) fails as unknown when a tensor of it is loaded.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedStateError
from .validate import ITEMSIZE_BY_NAME, unknown_dtype

_BY_NAME: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in ITEMSIZE_BY_NAME if isinstance(getattr(torch, n, None), torch.dtype)
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
        raise unknown_dtype(name, where)
    return _BY_NAME[name]


SUPPORTED_DTYPES: tuple[torch.dtype, ...] = tuple(_BY_NAME.values())
"""The dtypes this torch can save and load."""
