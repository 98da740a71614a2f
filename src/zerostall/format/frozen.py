"""Python-object subtrees snapshotted on the caller's thread, encoded in the background.

A state's Python part (a config tree, a trainer's log history) used to be checked, copied and
JSON-encoded inside ``save()``: a 16 MiB config cost ~1 s of the caller's time, 3.75x a
``json.dumps`` of it. Now :func:`.tree.encode_tree` (caller's thread) replaces each container
made of builtin values only (exact ``dict``/``list``/``tuple``/``set``/``frozenset`` of ``str``,
``int``, ``float``, ``bool``, ``None``, ``bytes``, ``bytearray``, nested) by a :class:`Frozen`:
the container serialized by the C pickler in one pass (~10x cheaper than the JSON encoding),
which is the save's snapshot: mutating the caller's objects after ``save()`` returns changes
nothing saved. Anything else (a tensor, a dataclass, a subclass, an ``OrderedDict``) makes
:func:`freeze` give up at once, and the caller's walk goes on into the container as before,
so unknown types are still refused from ``save()`` naming the key.

:class:`DeferredTree` later (the snapshot thread, after the tensors are staged; else whoever
asks first: the committer) rebuilds each frozen container (:func:`thaw`: a private unpickler
that resolves no global, so nothing but builtin values can come back), encodes it with the
ordinary rules of :func:`.tree.encode_tree` and splices the JSON into the tree's. What only
this encoding can find (an int over ``MAX_INT_BITS``, a dict key no rule stores, nesting past
``MAX_DEPTH``, a manifest over its limit) fails the save: ``handle.result()`` raises the
:class:`~zerostall.errors.UnsupportedStateError` naming the key. An unchanged container (its
snapshot equal, byte for byte, to the previous save's) reuses the previous save's encoding.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import threading
from typing import Any, Callable

__all__ = ["DeferredTree", "Frozen", "freeze", "thaw"]


class Frozen:
    """A container snapshotted by :func:`freeze` at ``path`` (its key path, for errors)."""

    __slots__ = ("data", "path")

    def __init__(self, data: bytes, path: tuple[Any, ...]):
        self.data, self.path = data, path


class _Refuse(Exception):
    pass


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # reached for every object the C pickler does not write itself: only exact builtin
        # containers, str, bytes, bytearray, int, float, bool and None get past
        raise _Refuse


_CONTAINERS = frozenset((dict, list, tuple, set, frozenset))
FREEZE_MIN = 17
"""Containers with at least this many items are frozen whole; a smaller one (the top of a state,
``{"config": ..., "step": 3}``) is walked, each of its items frozen (or encoded) on its own: a
step counter that changes every save then leaves the large config beside it unchanged, whose
encoding the next save reuses."""


def freeze(x: Any) -> bytes | None:
    """``x`` (an exact dict/list/tuple/set/frozenset) as pickled bytes if it holds builtin
    values only, else None (a tensor, an object of another type, a cycle, nesting past the
    interpreter's recursion limit). Caller's thread. Fast mode: no memo (shared subtrees are
    written twice, as the JSON holds them twice), a cycle is refused."""
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=5)
    p.fast = True  # no memo: each object written where it occurs; cycles raise ValueError
    try:
        p.dump(x)
    except (_Refuse, ValueError, RecursionError, TypeError, pickle.PicklingError):
        return None
    return buf.getvalue()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:  # never reached for freeze()'s bytes
        raise pickle.UnpicklingError(f"frozen state names {module}.{name}")


def thaw(data: bytes) -> Any:
    """The container :func:`freeze` wrote (a private copy; builtin values only)."""
    return _Unpickler(io.BytesIO(data)).load()


_NONCE = os.urandom(6).hex()
_MARK = re.compile(re.escape(json.dumps(f"\x00zs{_NONCE}:")[:-1]) + r"(\d+)\\u0000\"")


class DeferredTree:
    """A state tree with :class:`Frozen` parts, finished on first :meth:`result` (any thread;
    the first caller does the work under a lock, later ones get the cached tree and JSON or
    the same error).

    ``encode(obj, path)`` encodes one thawed container (:func:`.tree.encode_tree`'s rules);
    ``check(tree, tree_json)`` raises if the manifest would be too large. ``prev``: the
    previous save's ``{snapshot: (node, json)}``, reused for unchanged containers; this save's
    are collected in :attr:`memo` (handed to the next save by the plan cache)."""

    def __init__(self, tree: Any, encode: Callable[[Any, tuple[Any, ...]], Any],
                 check: Callable[[Any, str], None], prev: dict[bytes, tuple[Any, str]] | None = None):
        self._tree, self._encode, self._check = tree, encode, check
        self._prev = prev or {}
        self.memo: dict[bytes, tuple[Any, str]] = {}
        self._lock = threading.Lock()
        self._done: tuple[Any, str] | None = None
        self._error: BaseException | None = None

    def result(self) -> tuple[Any, str]:
        """(tree, compact JSON of it) with every frozen part encoded; raises what encoding raised."""
        with self._lock:
            if self._done is None and self._error is None:
                try:
                    self._done = self._finish()
                except BaseException as exc:  # noqa: BLE001 - kept and raised to every caller
                    self._error = exc
                self._tree = self._encode = self._check = None  # type: ignore[assignment]
                self._prev = {}
            if self._error is not None:
                raise self._error
            return self._done  # type: ignore[return-value]

    def _piece(self, f: Frozen) -> tuple[Any, str]:
        got = self.memo.get(f.data) or self._prev.get(f.data)
        if got is None:
            node = self._encode(thaw(f.data), f.path)
            got = (node, json.dumps(node, separators=(",", ":"), allow_nan=False))
        self.memo[f.data] = got
        return got

    def _finish(self) -> tuple[Any, str]:
        pieces: list[tuple[Any, str]] = []

        def mark(o: Any) -> str:
            if type(o) is not Frozen:
                raise TypeError(f"{type(o).__name__} in a state tree")
            pieces.append(self._piece(o))
            return f"\x00zs{_NONCE}:{len(pieces) - 1}\x00"

        skeleton = json.dumps(self._tree, separators=(",", ":"), allow_nan=False, default=mark)
        text = _MARK.sub(lambda m: pieces[int(m.group(1))][1], skeleton)
        nodes = iter(pieces)
        tree = _substitute(self._tree, lambda: next(nodes)[0])  # json.dumps's order: the walk's
        self._check(tree, text)
        return tree, text


def _substitute(node: Any, nxt: Callable[[], Any]) -> Any:
    """A copy of the tree's skeleton with each :class:`Frozen` replaced by ``nxt()``, in
    ``json.dumps`` order (dict values in insertion order, lists in order)."""
    if type(node) is Frozen:
        return nxt()
    if type(node) is dict:
        return {k: _substitute(v, nxt) for k, v in node.items()}
    if type(node) is list:
        return [_substitute(v, nxt) for v in node]
    return node


def has_frozen(node: Any) -> bool:
    """Whether ``node`` (a tree being built) holds a :class:`Frozen` part."""
    if type(node) is Frozen:
        return True
    if type(node) is dict:
        return any(map(has_frozen, node.values()))
    if type(node) is list:
        return any(map(has_frozen, node))
    return False
