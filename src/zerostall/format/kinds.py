"""The standard kinds of Python objects in a state tree (the keys of :data:`STANDARD`), each
encoded and rebuilt by this module's own code and matched by exact type. :mod:`.objects` calls
:func:`encode_standard` and the decoders of :data:`STANDARD`; nothing here imports a module a
checkpoint names, and torch only to build or encode a torch kind.
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime as _dt
import functools
import pathlib
import re
import uuid
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

Enc = Callable[[Any], Any]  # encodes a child value into a tree node


def _b64(b: bytes | bytearray) -> str:
    return base64.b64encode(bytes(b)).decode("ascii")


def _of(kind: type, x: Any) -> Any:
    """``x``, a payload (or part of one) that must be a ``kind``; else ValueError naming both."""
    if not isinstance(x, kind):
        raise ValueError(f"expected a {kind.__name__}, got {type(x).__name__}")
    return x


_str = functools.partial(_of, str)


def _unb64(s: Any) -> bytes:
    return base64.b64decode(_str(s).encode("ascii"), validate=True)


def _items(p: Any, n: int) -> list[Any]:
    if not isinstance(p, list) or len(p) != n:
        raise ValueError(f"expected a list of {n} numbers")
    return p


def _dtype(name: Any) -> torch.dtype:
    import torch
    # only names already bound in the torch namespace: getattr(torch, "_inductor") would import
    d = vars(torch).get(_str(name))
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return d


def _device(s: Any) -> torch.device:
    import torch
    try:
        return torch.device(_str(s))
    except RuntimeError as exc:  # torch reports a bad device string as RuntimeError
        raise ValueError(str(exc).splitlines()[0]) from None


def _path(cls: type, s: Any) -> pathlib.PurePath:
    try:
        return cls(_str(s))
    except NotImplementedError:  # a WindowsPath on POSIX (or back): the pure flavour, not an error
        return (pathlib.PureWindowsPath if issubclass(cls, pathlib.PureWindowsPath)
                else pathlib.PurePosixPath)(s)


def _omegaconf(kind: type, payload: Any) -> Any:
    _of(kind, payload)  # never a string: OmegaConf.create would parse it as YAML
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return None
    try:
        return OmegaConf.create(payload)
    except Exception as exc:  # omegaconf's own errors (bad interpolation grammar, ...)
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


_PATHS = {c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath,
                                  pathlib.WindowsPath, pathlib.Path, pathlib.PurePath)}

_DT64_RE = re.compile(r"^[<>=|]?[Mm]8(\[\d{0,9}(Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])?$")


def _np_time(kind: str, p: Any) -> Any:
    import numpy as np
    s, v = _items(p, 2)
    if not isinstance(s, str) or not _DT64_RE.match(s) or type(v) is not int or not -(1 << 63) <= v < (1 << 63):
        raise ValueError(f"expected [dtype, int64], got {p!r:.80}")
    dtype = np.dtype(s)
    if dtype.kind != kind:
        raise ValueError(f"dtype {s!r} is not a {'datetime64' if kind == 'M' else 'timedelta64'}")
    return np.array(v, dtype=np.int64).view(dtype)[()]


_FACTORIES: dict[str, Any] = {f"builtins.{f.__name__}": f for f in (int, float, str, bool, list, dict, set, frozenset,
                                                                     tuple, bytes, bytearray, complex)}


def _defaultdict(p: Any) -> collections.defaultdict:
    name, items = _items(p, 2)
    if name is not None and name not in _FACTORIES:
        raise ValueError(f"default_factory {name!r:.80} is not one of {sorted(_FACTORIES)}")
    return collections.defaultdict(None if name is None else _FACTORIES[name], _of(dict, items))


def _torch_size(p: Any) -> torch.Size:
    if not isinstance(p, list) or not all(type(d) is int and d >= 0 for d in p):
        raise ValueError(f"expected a list of sizes, got {p!r:.80}")
    import torch
    return torch.Size(p)


def _sorted(x: Any) -> list[Any]:
    try:
        return sorted(x)  # a stable order when the items allow one
    except TypeError:
        return list(x)


def _factory_payload(x: collections.defaultdict) -> list[Any] | None:
    f = x.default_factory
    name = None if f is None else f"builtins.{getattr(f, '__name__', '')}"
    if name is not None and _FACTORIES.get(name) is not f:
        return None  # refused by the caller, naming the key and the factory
    return [name, dict(x)]


def _np_payload(x: Any) -> list[Any]:
    import numpy as np
    return [x.dtype.str, int(np.array(x).view(np.int64))]


# name -> (the exact type, or "module.name" of a torch/numpy type; encoder to the payload, None: refused;
# decoder of the *decoded* payload)
_KINDS: dict[str, tuple[Any, Callable[[Any], Any] | None, Callable[[Any], Any]]] = {
    "argparse.Namespace": (argparse.Namespace, lambda x: dict(vars(x)), lambda d: argparse.Namespace(**_fields(d))),
    "set": (set, _sorted, set),
    "frozenset": (frozenset, _sorted, frozenset),
    "bytes": (bytes, _b64, _unb64),
    "bytearray": (bytearray, _b64, lambda s: bytearray(_unb64(s))),
    "complex": (complex, lambda x: [x.real, x.imag], lambda p: complex(*(float(x) for x in _items(p, 2)))),
    "datetime.datetime": (_dt.datetime, _dt.datetime.isoformat, lambda s: _dt.datetime.fromisoformat(_str(s))),
    "datetime.date": (_dt.date, _dt.date.isoformat, lambda s: _dt.date.fromisoformat(_str(s))),
    "datetime.time": (_dt.time, _dt.time.isoformat, lambda s: _dt.time.fromisoformat(_str(s))),
    "datetime.timedelta": (_dt.timedelta, lambda x: [x.days, x.seconds, x.microseconds],  # days, s, us
                           lambda p: _dt.timedelta(*map(int, _items(p, 3)))),
    "datetime.timezone": (_dt.timezone, lambda x: x.utcoffset(None).total_seconds(),
                          lambda p: _dt.timezone(_dt.timedelta(seconds=float(p)))),
    "uuid.UUID": (uuid.UUID, str, lambda s: uuid.UUID(_str(s))),
    "torch.dtype": ("torch.dtype", lambda x: str(x).removeprefix("torch."), _dtype),
    "torch.device": ("torch.device", str, _device),
    "omegaconf.DictConfig": (None, None, lambda p: _omegaconf(dict, p)),  # encoded by isinstance
    "omegaconf.ListConfig": (None, None, lambda p: _omegaconf(list, p)),
    "torch.Size": ("torch.Size", list, _torch_size),
    "collections.defaultdict": (collections.defaultdict, _factory_payload, _defaultdict),
    "collections.Counter": (collections.Counter, dict, lambda p: collections.Counter(_of(dict, p))),
    "numpy.datetime64": ("numpy.datetime64", _np_payload, lambda p: _np_time("M", p)),
    "numpy.timedelta64": ("numpy.timedelta64", _np_payload, lambda p: _np_time("m", p)),
    **{f"pathlib.{n}": (c, str, (lambda s, c=c: _path(c, s))) for n, c in _PATHS.items()},
}
STANDARD: dict[str, Callable[[Any], Any]] = {name: dec for name, (_, _, dec) in _KINDS.items()}
"""name -> decoder of the decoded payload."""
_BY_TYPE: dict[Any, tuple[str, Callable[[Any], Any]]] = {t: (n, e) for n, (t, e, _) in _KINDS.items() if e}
_LAZY_MODULES = ("torch", "numpy")  # their types are looked up by name: neither is imported here


STANDARD_TYPES: tuple[type, ...] = tuple(t for t, _, _ in _KINDS.values() if isinstance(t, type))
"""The standard kinds' own types: :mod:`.tree` refuses a subclass of one, naming it."""


def _fields(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError("fields payload is not a dict with str keys")
    return d


def encode_standard(x: Any, enc: Enc) -> Any | None:
    """The ``{"o": ...}`` node of a standard kind, or None if ``x`` is not one (by exact type)."""
    t = type(x)
    kind = _BY_TYPE.get(f"{t.__module__}.{t.__name__}" if t.__module__ in _LAZY_MODULES else t)
    if kind is not None:
        payload = kind[1](x)
        return None if payload is None else {"o": [kind[0], enc(payload)]}
    if t.__module__.startswith("omegaconf"):
        from omegaconf import DictConfig, ListConfig, OmegaConf
        for name, cls in (("omegaconf.DictConfig", DictConfig), ("omegaconf.ListConfig", ListConfig)):
            if isinstance(x, cls):
                return {"o": [name, enc(OmegaConf.to_container(x, resolve=False))]}
    return None
