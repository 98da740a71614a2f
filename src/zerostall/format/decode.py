"""Rebuild a state dict from its JSON tree (see :mod:`.tree` for the node encoding) and the
restored tensors; with ``build_objects=False``, check a tree's structure only (the manifest
parser). Imports no torch: ``zerostall ls``/``inspect``/``verify`` parse manifests without it.
Caller's thread (``load()``, the manifest parser).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpoint
from . import objects
from .validate import MAX_DEPTH


def decode_tree(node: Any, tensors: list[Any], where: str = "manifest", *, build_objects: bool = True) -> Any:
    """Rebuild the state dict from ``node`` and the restored ``tensors`` (index-aligned).

    ``build_objects=False`` (validation) checks object nodes without constructing anything.
    """

    def bad(msg: str) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{where}: invalid state tree: {msg}", path=where)

    def dec_key(k: Any) -> Any:
        if isinstance(k, dict) and len(k) == 1:
            if "v" in k and (k["v"] is None or isinstance(k["v"], (bool, int, float, str))):
                return k["v"]
            if "f" in k:
                return dec_float(k["f"])
            if "t" in k and isinstance(k["t"], list):
                return tuple(dec_key(x) for x in k["t"])
        raise bad(f"bad dict key {k!r:.80}")

    def dec_float(s: Any) -> float:
        if s not in ("nan", "inf", "-inf"):
            raise bad(f"bad float {s!r:.80}")
        return float(s)

    def dec(n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise bad(f"nested deeper than {MAX_DEPTH}")
        if not isinstance(n, dict) or len(n) != 1:
            raise bad(f"node {n!r:.80}")
        (tag, val), = n.items()
        if tag == "v":
            if val is None or isinstance(val, (bool, int, float, str)):
                return val
            raise bad(f"plain value {val!r:.80}")
        if tag == "f":
            return dec_float(val)
        if tag == "j":  # plain JSON, parsed with finite numbers only
            return val
        if tag in ("T", "A"):
            if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val < len(tensors):
                raise bad(f"tensor index {val!r:.80}")
            t = tensors[val]
            return t.numpy() if tag == "A" and t is not None else t
        if tag in ("l", "t"):
            if not isinstance(val, list):
                raise bad(f"{tag} node is not a list")
            items = [dec(v, depth + 1) for v in val]
            return items if tag == "l" else tuple(items)
        if tag == "d":
            if not isinstance(val, list):
                raise bad("dict node is not a list")
            out = {}
            for pair in val:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise bad(f"dict item {pair!r:.80}")
                out[dec_key(pair[0])] = dec(pair[1], depth + 1)
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
        # ``dec``/``dec_key`` refer to themselves through their cells: a reference cycle that held
        # ``tensors`` (a restore's scratch: the whole state) until the next cyclic GC, whose
        # munmap of it then ran inside whatever call triggered the GC (a ``save()`` blocked)
        del dec, dec_key
