"""Walkers over an encoded state tree's nodes (see :mod:`.tree` for the node shapes): the
tensor indices it references, each tensor's typed path, a copy with indices remapped.
Pure functions over JSON-able data; any thread."""

from __future__ import annotations

import json
from typing import Any


def tree_tensor_indices(node: Any) -> list[tuple[int, bool]]:
    """(index, is_numpy) of every tensor leaf, in tree order (used by validation)."""
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
    """The identity of every tensor index of an encoded tree: its typed path from the root.

    The path is built from the tree's own nodes (a dict key as its key node, a list or tuple
    position with its kind, an object with its type name, then ``T`` or ``A``), so ``{"a.b": x}``
    and ``{"a": {"b": x}}``, the keys ``0`` and ``"0"``, a tuple position and a str key never
    share one, whatever they print as. An index that appears more than once (tied tensors) takes
    its first occurrence in walk order, which is the one :func:`encode_tree` gave the leaf to.
    Returned as compact JSON strings. Used by incremental saves (:mod:`..staging.incremental`)
    to match a tensor with what the base step recorded for it; no recursion (deep trees)."""
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
