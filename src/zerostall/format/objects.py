"""Common Python objects in a state tree, stored as tagged JSON: no pickle, no code on load.

Called by :mod:`.tree` for a leaf that is not a tensor, an array, a plain value or a
container. Node: ``{"o": [TYPE, PAYLOAD]}``, PAYLOAD an ordinary tree node.

**The decoding rule.** Decoding never imports a module named by the checkpoint and never
calls anything off an allow-list: the standard kinds of :mod:`.kinds` (by exact type) and the
types registered with :func:`register_type`. Anything else comes back as :class:`TaggedData`,
which saves again as the original node. Objects with ``state_dict()`` are stored as their
state dict (no tag; :mod:`zerostall.stateful`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError
from .kinds import STANDARD as _STANDARD, Enc, _fields, _str, encode_standard

log = logging.getLogger("zerostall")

__all__ = ["TaggedData", "decode_object", "encode_object", "register_type", "unregister_type"]

Dec = Callable[[Any], Any]  # decodes a child tree node


@dataclass(frozen=True)
class TaggedData:
    """A stored object whose type this program did not allow: ``type`` and plain ``data`` (a
    dataclass's fields, an Enum's ``{"name", "value"}``, a class reference's dotted name).
    Register the type (:func:`register_type`) to get the object back."""

    type: str
    data: Any

    def __getattr__(self, attr: str) -> Any:
        # reached only for what code that expected the original object asks for ('cfg.width')
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
    - a namedtuple is stored as its fields and rebuilt with ``cls(*fields)``;
    - a class (the class object itself, e.g. an optimizer class in hyper-parameters) is
      stored by name and returned as the class;
    - any other class is stored with ``encode(obj) -> plain tree`` / ``decode(tree) -> obj``,
      or as its attributes (``vars(obj)`` and the set ``__slots__``), rebuilt with
      ``cls.__new__(cls)``; without either (a C type) it is refused here.

    ``name`` (default ``module.QualName``) is what the checkpoint records; keep it stable if
    the class moves (a script's ``__main__`` class: docs/integrations.md). Registration is
    per process: do it before ``load``. Raises :class:`ConfigError`.
    """
    if not isinstance(cls, type):
        raise ConfigError(f"register_type expects a class, got {cls!r}")
    reg = _Registered(cls, name or _qualname(cls), encode, decode)
    if (encode is None or decode is None) and not (issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls)
                                                   or _is_namedtuple(cls)):
        if not getattr(cls, "__dictoffset__", 0) and not _slot_names(cls):
            raise ConfigError(f"register_type({cls.__qualname__}): its instances have neither a __dict__ nor "
                              "__slots__ to store; pass encode= and decode= (obj -> plain tree -> obj)")
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
    """The registration for a recorded type ``name``: exact, else by qualified name when one
    side's module is ``__main__`` (see :func:`register_type`). Ambiguous: None."""
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


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def _slot_names(cls: type) -> list[str]:
    out: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for n in ((slots,) if isinstance(slots, str) else slots):
            if n not in ("__dict__", "__weakref__") and n not in out:
                out.append(n)
    return out


def _attributes(x: Any) -> dict[str, Any]:
    """A registered plain class's stored form: its ``__dict__`` and the ``__slots__`` that are set."""
    out = dict(vars(x)) if hasattr(x, "__dict__") else {}
    for n in _slot_names(type(x)):
        if n not in out and hasattr(x, n):
            out[n] = getattr(x, n)
    return out


def encode_object(x: Any, enc: Enc) -> Any | None:
    """The ``{"o": ...}`` node for ``x`` (or its state dict's node), or None if unsupported."""
    t = type(x)
    reg = _by_cls.get(t)
    if reg is not None and reg.encode is not None:
        return {"o": [reg.name, enc(reg.encode(x))]}
    if isinstance(x, TaggedData):
        return {"o": [x.type, enc(x.data)]}
    if isinstance(x, type):
        reg = _by_cls.get(x)
        return {"o": ["class", {"v": reg.name if reg is not None else _qualname(x)}]}
    name = reg.name if reg is not None else _qualname(t)
    if isinstance(x, enum.Enum):
        return {"o": [name, enc({"name": x.name, "value": x.value})]}
    if reg is not None and _is_namedtuple(t):
        return {"o": [name, enc(dict(zip(t._fields, x)))]}
    if dataclasses.is_dataclass(x) and (reg is not None or not isinstance(x, (dict, list, tuple))):
        return {"o": [name, enc({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})]}
    if reg is not None:
        return {"o": [name, enc(_attributes(x))]}
    node = encode_standard(x, enc)  # by exact type: a subclass would load back as its base
    if node is not None:
        return node
    # a defaultdict whose factory is not a builtin type falls through: refused by the caller
    sd = getattr(x, "state_dict", None)
    if callable(sd) and callable(getattr(x, "load_state_dict", None)):
        return enc(sd())
    return None


def decode_object(val: Any, dec: Dec, *, build: bool = True) -> Any:
    """Rebuild an ``{"o": val}`` node; ``ValueError`` if it is malformed. ``build=False``
    (manifest validation) constructs nothing and returns :class:`TaggedData`."""
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
    known = (cls._fields if _is_namedtuple(cls) else
             {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else fields)
    dropped = sorted(set(fields) - set(known))
    if dropped:  # then missing ones take their defaults
        log.warning("zerostall: %s no longer has field(s) %s; dropped on load", reg.name, dropped)
    if _is_namedtuple(cls):
        missing = [f for f in cls._fields if f not in fields and f not in cls._field_defaults]
        if missing:
            raise ValueError(f"namedtuple {reg.name} needs field(s) {missing} the checkpoint lacks")
        return cls(**{f: fields[f] for f in cls._fields if f in fields})
    if dataclasses.is_dataclass(cls):
        obj = cls(**{k: v for k, v in fields.items() if k in known and known[k].init})
        for k, v in fields.items():
            if k in known and not known[k].init:
                object.__setattr__(obj, k, v)
        return obj
    obj = cls.__new__(cls)
    slots = set(_slot_names(cls))
    for k, v in fields.items():
        if k in slots:
            object.__setattr__(obj, k, v)
        elif hasattr(obj, "__dict__"):
            obj.__dict__[k] = v
        else:
            raise ValueError(f"{reg.name} has no attribute slot {k!r}")
    return obj
