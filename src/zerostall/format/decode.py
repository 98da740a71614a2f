"""Read an encoded state tree (node shapes: :mod:`.tree`): rebuild or check it, list its tensor
indices and paths, remap them. Imports no torch (``zerostall ls``/``inspect``/``verify``).
Pure functions; any thread.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptCheckpoint
from . import objects
from .validate import MAX_DEPTH, NUMPY_DTYPES


def decode_tree(node: Any, tensors: list[Any], where: str = "manifest", *, build_objects: bool = True) -> Any:
    """Rebuild the state dict from ``node`` and the restored ``tensors`` (index-aligned).
    ``build_objects=False`` (validation; ``tensors``: dtype names) checks without constructing."""

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: invalid state tree: {msg}", path=where)

    def dec(n: Any, depth: int, key: bool = False) -> Any:
        """``key``: a dict key's node (``v``, ``f``, or ``t`` of those)."""
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(n, dict) or len(n) != 1:
            raise bad(f"node {n!r:.80}")
        (tag, val), = n.items()
        if key and tag not in ("v", "f", "t"):
            raise bad(f"bad dict key {n!r:.80}")
        if tag == "v":
            if val is None or isinstance(val, (bool, int, float, str)):
                return val
            raise bad(f"plain value {val!r:.80}")
        if tag == "f":
            if val not in ("nan", "inf", "-inf"):
                raise bad(f"bad float {val!r:.80}")
            return float(val)
        if tag == "j":  # plain JSON, parsed with finite numbers only
            return val
        if tag in ("T", "A"):
            if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < len(tensors):
                raise bad(f"it refers to tensor {val!r:.40}, which is not in 'tensors'")
            t = tensors[val]
            if not build_objects:
                if tag == "A" and t not in NUMPY_DTYPES:
                    raise bad(f"a numpy array over tensor {val} of dtype {t}, which numpy cannot represent")
                return None
            return t.numpy() if tag == "A" and t is not None else t
        if tag in ("l", "t"):
            if not isinstance(val, list):
                raise bad(f"{tag} node is not a list")
            items = [dec(v, depth + 1, key) for v in val]
            return items if tag == "l" else tuple(items)
        if tag == "d":
            if not isinstance(val, list):
                raise bad("dict node is not a list")
            out = {}
            for pair in val:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise bad(f"dict item {pair!r:.80}")
                out[dec(pair[0], depth + 1, True)] = dec(pair[1], depth + 1)
            return out
        if tag == "o":
            try:
                return objects.decode_object(val, lambda v: dec(v, depth + 1), build=build_objects)
            except ValueError as exc:
                raise bad(str(exc)) from None
        raise bad(f"unknown node tag {tag!r:.20}")

    try:
        return dec(node, 0)
    finally:
        # break the closures' self-reference cycle: it held ``tensors`` (the whole state) until
        # a cyclic GC, whose munmap then blocked whatever call triggered it
        del dec


def tree_tensor_indices(node: Any) -> list[tuple[int, bool]]:
    """(index, is_numpy) of every tensor leaf, in tree order."""
    out: list[tuple[int, bool]] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            for tag, val in n.items():
                if tag in ("T", "A"):
                    out.append((val, tag == "A"))
                elif tag in ("l", "t"):
                    stack.extend(val if isinstance(val, list) else [])
                elif tag == "d" and isinstance(val, list):
                    stack.extend(p[1] for p in val if isinstance(p, list) and len(p) == 2)
                elif tag == "o" and isinstance(val, list) and len(val) == 2:
                    stack.append(val[1])
    return out


def tensor_paths(node: Any) -> dict[int, str]:
    """Each tensor index's typed path from the root as compact JSON (built from the tree's own
    nodes, so ``{"a.b": x}`` and ``{"a": {"b": x}}``, or ``0`` and ``"0"``, never share one; a tied
    index takes its first occurrence), for :mod:`..saving.incremental` to match tensors."""
    out: dict[int, str] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(node, ())]
    while stack:
        n, path = stack.pop()
        if not isinstance(n, dict) or len(n) != 1:
            continue
        (tag, val), = n.items()
        if tag in ("T", "A"):
            if isinstance(val, int) and val not in out:
                out[val] = json.dumps([*path, [tag]], separators=(",", ":"), allow_nan=False)
        elif tag in ("l", "t") and isinstance(val, list):
            stack.extend((v, path + ([tag, i],)) for i, v in reversed(list(enumerate(val))))
        elif tag == "d" and isinstance(val, list):
            stack.extend((p[1], path + (["d", p[0]],)) for p in reversed(val) if isinstance(p, list) and len(p) == 2)
        elif tag == "o" and isinstance(val, list) and len(val) == 2:
            stack.append((val[1], path + (["o", val[0]],)))
    return out


def remap_tree(node: Any, mapping: Any) -> Any:
    """A copy of ``node`` with every tensor index ``i`` replaced by ``mapping(i)``."""
    if isinstance(node, dict) and len(node) == 1:
        (tag, val), = node.items()
        if tag in ("T", "A"):
            return {tag: mapping(val)}
        if tag in ("l", "t"):
            return {tag: [remap_tree(v, mapping) for v in val]}
        if tag == "d":
            return {tag: [[k, remap_tree(v, mapping)] for k, v in val]}
        if tag == "o":
            return {tag: [val[0], remap_tree(val[1], mapping)]}
    return node
