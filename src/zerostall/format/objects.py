"""Common Python objects in a state tree, stored as tagged JSON: no pickle, no code on load.

Called by :mod:`.tree` (on the caller's thread, inside ``save()``/``load()``) for a leaf that
is not a tensor, an array, a plain value or a container. One node shape::

    {"o": [TYPE, PAYLOAD]}     TYPE a string naming the kind, PAYLOAD an ordinary tree node

**The decoding rule.** Decoding never imports a module named by the checkpoint and never
calls anything that is not on an allow-list:

- the standard kinds below, rebuilt by code in this module: ``argparse.Namespace``,
  ``pathlib`` paths, ``datetime``/``date``/``time``/``timedelta``, ``set``/``frozenset``,
  ``bytes``/``bytearray``, ``complex``, ``uuid.UUID``, ``torch.dtype``/``torch.device``,
  OmegaConf ``DictConfig``/``ListConfig`` (rebuilt with ``OmegaConf.create`` when omegaconf is
  installed);
- the types the program registered with :func:`register_type` (dataclasses, enums, any
  class): those, and only those, are constructed (a registered dataclass through its
  ``__init__``).

Anything else (a dataclass, Enum member or class reference whose type is not registered, or
a kind this version does not know) comes back as :class:`TaggedData` (the type name and the
decoded payload: plain dicts/lists/values/tensors); saving a ``TaggedData`` again writes the
original node, so such values survive a load/save round trip unchanged.

Objects with ``state_dict()`` (modules, optimizers, schedulers, scalers, any ``Stateful``)
are stored as their state dict (no tag): they load back as that dict, or into the object
itself when it is passed to ``load`` (see :mod:`zerostall.stateful`).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as _dt
import enum
import logging
import pathlib
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError

log = logging.getLogger("zerostall")

__all__ = ["TaggedData", "decode_object", "encode_object", "register_type", "registered_types",
           "unregister_type"]

Enc = Callable[[Any], Any]  # encodes a child value into a tree node
Dec = Callable[[Any], Any]  # decodes a child tree node


@dataclass(frozen=True)
class TaggedData:
    """A stored object whose type this program did not allow: ``type`` and plain ``data``.

    For a dataclass or a registered-by-default class ``data`` is a dict of its fields, for an
    Enum member ``{"name": ..., "value": ...}``, for a class reference (``type == "class"``)
    the class's dotted name. Register the type (:func:`register_type`) to get the object back.
    """

    type: str
    data: Any

    def __getattr__(self, attr: str) -> Any:
        # reached only for attributes a TaggedData lacks: what code that expected the
        # original object asks for ('cfg.width'); say which type and how to get it back
        if attr.startswith("__"):
            raise AttributeError(attr)
        short = self.type.rsplit(".", 1)[-1] if self.type != "class" else "TheClass"
        raise AttributeError(
            f"{attr!r}: this {self.type!r} was loaded as TaggedData (its stored fields are in .data), not "
            f"rebuilt, because the type is not registered; call zerostall.register_type({short}) before "
            "loading (a class of a script's __main__ matches by its qualified name)")


@dataclass(frozen=True)
class _Registered:
    cls: type
    name: str
    encode: Callable[[Any], Any] | None
    decode: Callable[[Any], Any] | None


_lock = threading.Lock()
_by_name: dict[str, _Registered] = {}
_by_cls: dict[type, _Registered] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_type(cls: type, *, name: str | None = None, encode: Callable[[Any], Any] | None = None,
                  decode: Callable[[Any], Any] | None = None) -> type:
    """Allow ``cls`` to be rebuilt when a checkpoint is loaded; returns ``cls`` (a decorator).

    - a dataclass is stored as its fields and rebuilt with ``cls(**init_fields)`` (fields
      the class no longer has are dropped with a warning; missing ones take their defaults);
    - an Enum is stored as its member name and rebuilt with ``cls[name]``;
    - a class (the class object itself, e.g. an optimizer class in hyper-parameters) is
      stored by name and returned as the class;
    - any other class needs ``encode(obj) -> plain tree`` and ``decode(tree) -> obj``, or is
      stored as ``vars(obj)`` and rebuilt with ``cls.__new__(cls)`` + ``__dict__.update``.

    ``name`` (default ``module.QualName``) is what the checkpoint records; keep it stable if
    the class moves. A class of a script's ``__main__`` matches by its qualified name: saved
    by ``python train.py`` as ``__main__.Cfg``, it loads in a program that registers
    ``train.Cfg`` (and the reverse), unless two registered classes share that qualified name.
    Registration is per process: do it before ``load``.
    """
    if not isinstance(cls, type):
        raise ConfigError(f"register_type expects a class, got {cls!r}")
    reg = _Registered(cls, name or _qualname(cls), encode, decode)
    if reg.name in _STANDARD or reg.name in ("class", "enum"):
        raise ConfigError(f"type name {reg.name!r} is reserved; pass another name=")
    with _lock:
        old = _by_name.get(reg.name)
        if old is not None and old.cls is not cls:
            raise ConfigError(f"type name {reg.name!r} is already registered for {old.cls!r}; pass name=")
        _by_name[reg.name] = reg
        _by_cls[cls] = reg
    return cls


def unregister_type(cls: type) -> None:
    """Undo :func:`register_type` (tests, plugins that unload)."""
    with _lock:
        reg = _by_cls.pop(cls, None)
        if reg is not None:
            _by_name.pop(reg.name, None)


def _lookup(name: str) -> _Registered | None:
    """The registration for a recorded type ``name``: exact, else matched by qualified name
    when one side's module is ``__main__`` (a script's class is ``__main__.Cfg`` when the
    script runs and ``train.Cfg`` when another program imports it). Ambiguous: None."""
    reg = _by_name.get(name)
    if reg is not None:
        return reg
    with _lock:
        regs = [r for r in _by_cls.values() if r.name == _qualname(r.cls)]  # default names only
    if name.startswith("__main__."):
        qual = name[len("__main__."):]
        hits = [r for r in regs if r.cls.__qualname__ == qual]
    else:
        hits = [r for r in regs if r.cls.__module__ == "__main__" and name.endswith(f".{r.cls.__qualname__}")]
    return hits[0] if len(hits) == 1 else None


def registered_types() -> dict[str, type]:
    with _lock:
        return {n: r.cls for n, r in _by_name.items()}


# -- the standard kinds: name -> (encode payload, decode payload) --------------------------

def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: Any) -> bytes:
    if not isinstance(s, str):
        raise ValueError("bytes payload is not a string")
    return base64.b64decode(s.encode("ascii"), validate=True)


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise ValueError(f"expected a string, got {type(x).__name__}")
    return x


def _items(p: Any, n: int) -> list[Any]:
    if not isinstance(p, list) or len(p) != n:
        raise ValueError(f"expected a list of {n} numbers")
    return p


def _timedelta(days: Any, seconds: Any, us: Any) -> _dt.timedelta:
    return _dt.timedelta(days=int(days), seconds=int(seconds), microseconds=int(us))


def _dtype(name: Any) -> torch.dtype:
    # only names already bound in the torch namespace: getattr(torch, "_inductor") would import
    d = vars(torch).get(_str(name))
    if not isinstance(d, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return d


def _device(s: Any) -> torch.device:
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
    if not isinstance(payload, kind):  # never a string: OmegaConf.create would parse it as YAML
        raise ValueError(f"expected a {kind.__name__}, got {type(payload).__name__}")
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

# name -> decoder of the *decoded* payload. Order of the encoders is in encode_object.
_STANDARD: dict[str, Callable[[Any], Any]] = {
    "argparse.Namespace": lambda d: argparse.Namespace(**_fields(d)),
    "set": lambda items: set(items),
    "frozenset": lambda items: frozenset(items),
    "bytes": _unb64,
    "bytearray": lambda s: bytearray(_unb64(s)),
    "complex": lambda p: complex(*(float(x) for x in _items(p, 2))),
    "datetime.datetime": lambda s: _dt.datetime.fromisoformat(_str(s)),
    "datetime.date": lambda s: _dt.date.fromisoformat(_str(s)),
    "datetime.time": lambda s: _dt.time.fromisoformat(_str(s)),
    "datetime.timedelta": lambda p: _timedelta(*_items(p, 3)),
    "datetime.timezone": lambda p: _dt.timezone(_dt.timedelta(seconds=float(p))),
    "uuid.UUID": lambda s: uuid.UUID(_str(s)),
    "torch.dtype": _dtype,
    "torch.device": _device,
    "omegaconf.DictConfig": lambda p: _omegaconf(dict, p),
    "omegaconf.ListConfig": lambda p: _omegaconf(list, p),
    **{f"pathlib.{n}": (lambda s, c=c: _path(c, s)) for n, c in _PATHS.items()},
}


def _fields(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
        raise ValueError("fields payload is not a dict with str keys")
    return d


def _is_omegaconf(x: Any) -> str | None:
    mod = type(x).__module__
    if not mod.startswith("omegaconf"):
        return None
    from omegaconf import DictConfig, ListConfig
    if isinstance(x, DictConfig):
        return "omegaconf.DictConfig"
    if isinstance(x, ListConfig):
        return "omegaconf.ListConfig"
    return None


def encode_object(x: Any, enc: Enc) -> Any | None:
    """The ``{"o": ...}`` node for ``x`` (or its state dict's node), or None if unsupported."""
    t = type(x)
    reg = _by_cls.get(t)
    if reg is not None:
        if reg.encode is not None:
            return {"o": [reg.name, enc(reg.encode(x))]}
        if isinstance(x, enum.Enum):
            return {"o": [reg.name, enc({"name": x.name, "value": x.value})]}
        if dataclasses.is_dataclass(x):
            return {"o": [reg.name, enc(_dc_fields(x))]}
        return {"o": [reg.name, enc(dict(vars(x)))]}
    if isinstance(x, TaggedData):
        return {"o": [x.type, enc(x.data)]}
    if isinstance(x, type):
        reg = _by_cls.get(x)
        return {"o": ["class", {"v": reg.name if reg is not None else _qualname(x)}]}
    if isinstance(x, enum.Enum):
        return {"o": [_qualname(t), enc({"name": x.name, "value": x.value})]}
    if isinstance(x, argparse.Namespace):
        return {"o": ["argparse.Namespace", enc(dict(vars(x)))]}
    if isinstance(x, pathlib.PurePath):
        return {"o": [f"pathlib.{t.__name__}" if t.__name__ in _PATHS else "pathlib.PurePath", enc(str(x))]}
    if isinstance(x, (set, frozenset)):
        items = list(x)
        try:
            items.sort()  # a stable order when the items allow one
        except TypeError:
            pass
        return {"o": ["frozenset" if isinstance(x, frozenset) else "set", enc(items)]}
    if isinstance(x, (bytes, bytearray)):
        return {"o": ["bytearray" if isinstance(x, bytearray) else "bytes", enc(_b64(bytes(x)))]}
    if isinstance(x, complex):
        return {"o": ["complex", enc([x.real, x.imag])]}
    if isinstance(x, _dt.datetime):
        return {"o": ["datetime.datetime", enc(x.isoformat())]}
    if isinstance(x, _dt.date):
        return {"o": ["datetime.date", enc(x.isoformat())]}
    if isinstance(x, _dt.time):
        return {"o": ["datetime.time", enc(x.isoformat())]}
    if isinstance(x, _dt.timedelta):
        return {"o": ["datetime.timedelta", enc([x.days, x.seconds, x.microseconds])]}
    if isinstance(x, _dt.timezone):
        off = x.utcoffset(None)
        return {"o": ["datetime.timezone", enc(off.total_seconds())]}
    if isinstance(x, uuid.UUID):
        return {"o": ["uuid.UUID", enc(str(x))]}
    if isinstance(x, torch.dtype):
        return {"o": ["torch.dtype", enc(str(x).removeprefix("torch."))]}
    if isinstance(x, torch.device):
        return {"o": ["torch.device", enc(str(x))]}
    oc = _is_omegaconf(x)
    if oc is not None:
        from omegaconf import OmegaConf
        return {"o": [oc, enc(OmegaConf.to_container(x, resolve=False))]}
    if dataclasses.is_dataclass(x):
        return {"o": [_qualname(t), enc(_dc_fields(x))]}
    sd = getattr(x, "state_dict", None)
    if callable(sd) and callable(getattr(x, "load_state_dict", None)):
        return enc(sd())
    return None


def _dc_fields(x: Any) -> dict[str, Any]:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}


def decode_object(val: Any, dec: Dec, *, build: bool = True) -> Any:
    """Rebuild an ``{"o": val}`` node; ``ValueError`` if it is malformed.

    ``build=False`` checks the structure only and returns :class:`TaggedData` (manifest
    validation: nothing is constructed).
    """
    if not isinstance(val, list) or len(val) != 2 or not isinstance(val[0], str):
        raise ValueError(f"object node {val!r:.80}")
    name, payload = val[0], dec(val[1])
    if not build:
        return TaggedData(name, payload)
    if name == "class":
        reg = _lookup(_str(payload))
        return reg.cls if reg is not None else TaggedData("class", payload)
    std = _STANDARD.get(name)
    if std is not None:
        try:
            out = std(payload)
        except (TypeError, ValueError, LookupError, OverflowError) as exc:
            raise ValueError(f"{name} payload {payload!r:.80}: {exc}") from None
        return TaggedData(name, payload) if out is None else out
    reg = _lookup(name)
    if reg is None:
        return TaggedData(name, payload)
    try:
        return _build_registered(reg, payload)
    except ValueError:
        raise
    except Exception as exc:  # the registered class refused its stored fields
        raise ValueError(f"rebuilding registered type {name} failed: {type(exc).__name__}: {exc}") from exc


def _build_registered(reg: _Registered, payload: Any) -> Any:
    cls = reg.cls
    if reg.decode is not None:
        return reg.decode(payload)
    if issubclass(cls, enum.Enum):
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ValueError(f"enum {reg.name} payload {payload!r:.80}")
        try:
            return cls[payload["name"]]
        except KeyError:
            raise ValueError(f"{reg.name} has no member {payload['name']!r}") from None
    fields = _fields(payload)
    if dataclasses.is_dataclass(cls):
        known = {f.name: f for f in dataclasses.fields(cls)}
        dropped = sorted(set(fields) - set(known))
        if dropped:
            log.warning("zerostall: %s no longer has field(s) %s; dropped on load", reg.name, dropped)
        obj = cls(**{k: v for k, v in fields.items() if k in known and known[k].init})
        for k, v in fields.items():
            if k in known and not known[k].init:
                object.__setattr__(obj, k, v)
        return obj
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj
