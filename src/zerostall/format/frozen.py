"""Python-object subtrees snapshotted on the caller's thread, encoded in the background.

:func:`.tree.encode_tree` replaces each container of :data:`FREEZE_MIN` items or more made of
builtin values only by a :class:`Frozen` (:func:`freeze`: C-pickled slices, the save's
snapshot); :class:`DeferredTree` later thaws them with an unpickler that resolves only builtin
types and splices their JSON into the tree's. The rules, threads and errors: docs/objects.md.
"""

from __future__ import annotations

import io
import json
import pickle
import threading
from dataclasses import dataclass
from itertools import chain, islice
from typing import Any, Callable

import numpy as np

from .._fast import SECOND, Splice
from .._util import no_gc
from .validate import NotPlain, plain_copy

__all__ = ["DeferredTree", "Frozen", "freeze", "skeleton_json", "thaw"]


@dataclass(eq=False, slots=True)
class Frozen:
    """A container of type ``kind`` as :func:`freeze`'s ``parts``, at key ``path``. Compared by identity."""

    kind: type
    parts: tuple[bytes, ...]
    path: tuple[Any, ...]


class _Refuse(Exception):
    pass


_NUMPY_AS = {"b": bool, "i": int, "u": int, "f": float, "U": str, "S": bytes}
"""numpy scalar kinds and the Python type the tree stores them as (as :func:`.tree._np_plain`)."""
_TO = frozenset(_NUMPY_AS.values())


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # every object the C pickler does not write itself: only numpy scalars get past, as Python values
        if isinstance(obj, np.generic):
            to = _NUMPY_AS.get(obj.dtype.kind)
            if to is not None and not (to is float and obj.dtype.itemsize > 8):
                return to, (obj.item(),)
        if type(obj) is type and obj in _TO:  # the type named by the reduction above: a global
            return NotImplemented
        raise _Refuse


FREEZE_MIN = 17
"""Containers with at least this many items are frozen whole; a smaller one is walked."""
PART_BYTES = 1 << 20
"""About the size of one slice: the GIL is let go between slices, and an unchanged slice reuses
the previous save's encoding."""
PROBE_ITEMS = 64


def _no_buffer(buf: pickle.PickleBuffer) -> bool:
    # a PickleBuffer would thaw as bytes or bytearray, a type change the walk refuses (naming the key)
    raise _Refuse


def _dump(x: Any) -> bytes | None:
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=5, buffer_callback=_no_buffer)
    p.fast = True  # no memo: each object written where it occurs; cycles raise ValueError
    try:
        p.dump(x)
    except (_Refuse, ValueError, RecursionError, TypeError, pickle.PicklingError):
        return None
    return buf.getvalue()


def freeze(x: Any) -> tuple[bytes, ...] | None:
    """``x`` (an exact dict/list/tuple) as pickled slices of its items if it holds builtin
    values only, else None. Caller's thread. The first slice holds :data:`PROBE_ITEMS` items,
    the others about :data:`PART_BYTES` at the first's size per item (so equal leading items
    slice alike, save after save)."""
    n = len(x)
    if n <= PROBE_ITEMS:
        one = _dump(x)
        return None if one is None else (one,)
    items = iter(x.items()) if type(x) is dict else None
    cut: Callable[[int, int], Any] = (lambda i, j: dict(islice(items, j - i))) if items is not None else (
        lambda i, j: x[i:j])
    first = _dump(cut(0, PROBE_ITEMS))
    if first is None:
        return None
    per = max(PROBE_ITEMS, PROBE_ITEMS * PART_BYTES // len(first))
    parts = (first, *(_dump(cut(i, i + per)) for i in range(PROBE_ITEMS, n, per)))
    return None if None in parts else parts


_BUILTINS = {t.__name__: t for t in _TO}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # freeze()'s bytes name only the builtin types numpy scalars are stored as
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise pickle.UnpicklingError(f"frozen state names {module}.{name}")


def thaw(data: bytes) -> Any:
    """The container :func:`freeze` wrote (a private copy; builtin values only)."""
    return _Unpickler(io.BytesIO(data)).load()


_SPLICE = Splice("frozen")


def skeleton_json(tree: Any, frozen: list[Frozen]) -> str:
    """The tree's compact JSON with a marker where each of ``frozen`` (all the tree's
    :class:`Frozen` parts) sits (caller's thread: its length bounds the manifest's)."""
    pos = {id(f): i for i, f in enumerate(frozen)}

    def mark(f: Frozen) -> str:  # nothing else in a tree is not JSON
        return _SPLICE.mark(pos[id(f)])
    return json.dumps(tree, separators=(",", ":"), allow_nan=False, default=mark)


class DeferredTree:
    """A state tree with :class:`Frozen` parts, finished by the first :meth:`result` (any thread,
    under a lock; later calls get the cached result or error).

    ``skeleton``: :func:`skeleton_json`. ``encode(obj, path)`` encodes a thawed container that
    is not plain JSON; ``check(tree, tree_json)`` raises if the manifest would be too large.
    ``prev``: the previous save's :attr:`memo`, reused for unchanged slices."""

    def __init__(self, tree: Any, skeleton: str, frozen: list[Frozen], encode: Callable[[Any, tuple[Any, ...]], Any],
                 check: Callable[[Any, str], None],
                 prev: dict[tuple[int, bytes], tuple[Any, str | None]] | None = None):
        self._tree, self._skeleton, self._frozen = tree, skeleton, frozen
        self._encode, self._check = encode, check
        self._prev = prev or {}
        self.memo: dict[tuple[int, bytes], tuple[Any, str | None]] = {}
        self._lock = threading.Lock()
        self._done: tuple[Any, str] | None = None
        self._error: BaseException | None = None

    def result(self) -> tuple[Any, str]:
        """(tree, compact JSON of it) with every frozen part encoded; raises what encoding raised."""
        with self._lock:
            if self._done is None and self._error is None:
                try:
                    with no_gc():  # acyclic copies: a gen-2 collection would scan the heap, GIL held
                        self._done = self._finish()
                except BaseException as exc:  # noqa: BLE001 - kept and raised to every caller
                    self._error = exc
                self._tree = self._skeleton = self._frozen = None  # type: ignore[assignment]
                self._encode = self._check = None  # type: ignore[assignment]
                self._prev = {}
            if self._error is not None:
                raise self._error
            return self._done  # type: ignore[return-value]
    def _part(self, data: bytes, depth: int) -> tuple[Any, str | None]:
        """(the slice's private copy, its JSON or None if not plain), the previous save's if
        the bytes are equal at the same depth."""
        key = (depth, data)
        got = self.memo.get(key) or self._prev.get(key)
        if got is None:
            obj = thaw(data)
            try:
                got = (obj, json.dumps(plain_copy(obj, depth), separators=(",", ":"), allow_nan=False))
            except NotPlain:
                got = (obj, None)
        self.memo[key] = got
        return got

    def _piece(self, f: Frozen) -> tuple[Any, str]:
        """The node of one frozen container and its JSON (``{"j": ...}`` when all slices are plain)."""
        parts = [self._part(p, len(f.path)) for p in f.parts]
        objs = [o for o, _ in parts]
        if len(objs) == 1:
            whole = objs[0]
        else:  # the slices of one container, in order
            whole = f.kind(chain.from_iterable(o.items() if f.kind is dict else o for o in objs))
        if f.kind is not tuple and all(t is not None for _, t in parts):
            inner = ",".join(t[1:-1] for _, t in parts if len(t) > 2)  # type: ignore[index]
            text = "[%s]" % inner if f.kind is list else "{%s}" % inner
            return {"j": whole}, '{"j":%s}' % text
        node = self._encode(whole, f.path)
        return node, json.dumps(node, separators=(",", ":"), allow_nan=False)

    def _finish(self) -> tuple[Any, str]:
        pieces = [self._piece(f) for f in self._frozen]
        text = _SPLICE.splice(self._skeleton, [p[1] for p in pieces])
        nodes = {id(f): p[0] for f, p in zip(self._frozen, pieces)}
        tree = _substitute(self._tree, nodes)
        self._check(tree, text)
        return tree, text


_LEAF_TAGS = frozenset(("T", "A", "v", "f", "j"))


def _substitute(node: Any, nodes: dict[int, Any]) -> Any:
    """The tree with each :class:`Frozen` replaced by its node (``nodes`` by ``id``); subtrees
    without one are shared, found by C-level passes (no frame per tensor)."""
    if type(node) is Frozen:
        return nodes[id(node)]
    if type(node) is not dict or len(node) != 1:
        return node
    (tag, val), = node.items()
    if tag in ("l", "t", "d"):
        kids = list(map(SECOND, val)) if tag == "d" else val
        if Frozen not in set(map(type, kids)) and _LEAF_TAGS.issuperset(map(next, map(iter, kids))):
            return node
        if tag == "d":
            return {tag: [[k, _substitute(v, nodes)] for k, v in val]}
        return {tag: [_substitute(v, nodes) for v in val]}
    if tag == "o":
        return {tag: [val[0], _substitute(val[1], nodes)]}
    return node
