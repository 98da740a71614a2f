"""Dicts of plain tensors taken in bulk: one C-level ``map`` per tensor attribute instead of a
Python frame per tensor. Called by :func:`.tree.encode_tree` (caller's thread, inside
``save()``). Decides nothing on its own: anything unusual (nested, quantized, sparse, conj/neg
view, empty, aliased, not on cpu/cuda) returns None and the per-tensor path encodes the dict
and raises its precise errors. Never mutates its input.
"""

from __future__ import annotations

import json
import operator
from itertools import repeat
from typing import Any, Sequence

import torch

from .._fast import DEVICE, DTYPE, INDEX, IS_NESTED, LAYOUT, TYPE, Splice
from .._fast_torch import shape_of

TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
BULK_MIN = 32
"""Smaller containers take the per-tensor path (the maps' setup would cost more)."""

_T = torch.Tensor
_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if hasattr(torch, n))

Columns = tuple[Sequence[Any], ...]
"""(tensors, data addresses, sizes, strides, dtypes, devices) in walk order, as the plan cache's
signature took them (it refuses a state with a non-strided tensor or a conj/neg view)."""


def bulk_tensors(x: dict[Any, Any], seen: dict[tuple[Any, ...], int], cols: Columns | None = None
                 ) -> tuple[list[str], list[torch.Tensor], list[tuple[Any, ...]]] | None:
    """(keys, detached tensors, identities) of ``x``, a dict of plain tensors; None where the
    per-tensor path must decide, also when two values, or a value and one in ``seen``, share an
    identity (tied weights). ``cols``: :data:`Columns` of ``x``'s slice of the walk, used only
    where its tensors are ``x``'s values, object for object."""
    if len(x) < BULK_MIN:
        return None
    keys = list(x)
    if any(type(k) is not str for k in keys):
        return None
    vals = list(x.values())
    if not TENSOR_TYPES.issuperset(map(type, vals)):
        return None
    if cols is not None and len(cols[0]) == len(vals) and all(map(operator.is_, vals, cols[0])):
        return _from_columns(keys, vals, cols, seen)
    if _odd(set(map(DTYPE, vals))) or any(map(IS_NESTED, vals)) or any(map(_T.is_neg, vals)):
        return None
    if set(map(LAYOUT, vals)) != {torch.strided} or 0 in map(_T.numel, vals):
        return None
    devices = list(map(DEVICE, vals))
    types = list(map(TYPE, devices))
    if not {"cpu", "cuda"}.issuperset(types):
        return None
    tensors = list(map(_T.detach, vals))
    return _unaliased(keys, tensors, seen, types, map(INDEX, devices), map(_T.data_ptr, tensors),
                      map(shape_of, tensors), map(_T.stride, tensors), map(DTYPE, tensors))


def _odd(dtypes: set[torch.dtype]) -> bool:
    """Whether a complex (maybe a conj view) or quantized dtype is among them (per tensor then)."""
    return any(d.is_complex or d in _QUANTIZED for d in dtypes)


def _unaliased(keys: list[str], tensors: list[torch.Tensor], seen: dict[tuple[Any, ...], int], *columns: Any
               ) -> tuple[list[str], list[torch.Tensor], list[tuple[Any, ...]]] | None:
    """(keys, tensors, identities from ``columns``) unless two are one or one is in ``seen``."""
    idents = list(zip(*columns, repeat(False)))
    if len(set(idents)) != len(idents) or any(map(seen.__contains__, idents)):
        return None
    return keys, tensors, idents


def _from_columns(keys: list[str], vals: list[torch.Tensor], cols: Columns, seen: dict[tuple[Any, ...], int]
                  ) -> tuple[list[str], list[torch.Tensor], list[tuple[Any, ...]]] | None:
    """:func:`bulk_tensors` with the attributes read from ``cols`` (nested, layout and neg/conj
    checks held where the plan cache took them)."""
    _, ptrs, sizes, strides, dtypes, devices = cols
    if _odd(set(dtypes)) or 0 in map(_T.numel, vals):
        return None
    kinds = {d: (d.type, d.index) for d in set(devices)}
    if not {"cpu", "cuda"}.issuperset(t for t, _ in kinds.values()):
        return None
    if len(kinds) == 1:  # one device (the usual case): no map over it
        (kind, index), = kinds.values()
        types, indices = repeat(kind), repeat(index)
    else:
        types, indices = map(TYPE, devices), map(INDEX, devices)
    return _unaliased(keys, list(map(_T.detach, vals)), seen, types, indices, ptrs, sizes, strides, dtypes)


def known_node(x: dict[Any, Any], known: list[int], met: list[int]) -> Any:
    """The tree node of ``x``, a dict of plain tensors with str keys whose leaf indices are
    ``known`` from ``met[0]`` on (advanced), with no tensor looked at; None for any other dict."""
    vals = x.values()
    if not vals or not TENSOR_TYPES.issuperset(map(type, vals)) or any(type(k) is not str for k in x):
        return None
    i = met[0]
    met[0] = i + len(x)
    return {"d": [[{"v": k}, {"T": j}] for k, j in zip(x, known[i:met[0]])]}


TEXT_MIN = 1024
"""A dict of at least this many tensors taken in bulk also gets its JSON made here (:func:`pairs_json`)."""
_PAIR = '[{{"v":{}}},{{"T":{}}}]'.format
_SPLICE = Splice("bulk")


def pairs_json(keys: list[str], start: int) -> str:
    """The compact JSON of ``[[{"v": key}, {"T": start + i}], ...]``, exactly as ``json.dumps`` writes it."""
    return "[" + ",".join(map(_PAIR, map(json.encoder.encode_basestring_ascii, keys),
                              range(start, start + len(keys)))) + "]"


def dumps_tree(tree: Any, texts: list[tuple[dict[str, Any], str]]) -> str:
    """``json.dumps(tree, separators=(",", ":"), allow_nan=False)``, each ``(node, text)`` of
    ``texts`` written as its text: the node's pairs are swapped for a marker meanwhile (caller's
    thread; the tree is a plan's own, seen by no other thread yet)."""
    saved = [node["d"] for node, _ in texts]
    try:
        for i, (node, _) in enumerate(texts):
            node["d"] = _SPLICE.mark(i)
        out = json.dumps(tree, separators=(",", ":"), allow_nan=False)
    finally:
        for (node, _), pairs in zip(texts, saved):
            node["d"] = pairs
    return _SPLICE.splice(out, [text for _, text in texts])
