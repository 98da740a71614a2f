"""What a load asks for (:class:`LoadRequest`) and reports (:class:`LoadReport`), and matching a
checkpoint's state tree with the caller's state dict: ``keys=``, in-place destinations, the key
report, merging and ``map_location`` (pure functions, caller's thread).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..config import IOConfig
from ..errors import ConfigError, StateMismatchError
from ..format.decode import decode_tree


@dataclass
class LoadReport:
    """What :func:`zerostall.load` did: the step, from where, and the key report
    (``missing_keys``: left as they were; ``unexpected_keys``: added)."""

    step: int = -1
    source: str = ""
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    """One line per newer step (or copy) that failed, with the reason."""
    why: str = ""
    """Under a process group: why every rank loaded this step."""


@dataclass(frozen=True, kw_only=True)
class LoadRequest:
    """What one :func:`.pipeline.load` asks for (immutable: ``dataclasses.replace`` derives another)."""

    step: int | None = None
    """Exactly this step (None: the newest that verifies)."""
    map_location: Any = None
    """Where new tensors go, as ``torch.load`` takes it (a device, a dict or a callable)."""
    verify: bool = True
    fallback: bool = True
    """A step that fails tries the previous one."""
    keys: list[str] | None = None
    """Only these dotted keys' bytes are read (None: all)."""
    strict: bool = False
    """Keys of the state dict the checkpoint lacks raise :class:`StateMismatchError`."""
    rank: int = 0
    world_size: int = 1
    remote: Any = None
    """A URL or tier whose steps are considered too."""
    download: bool = True
    """A step only ``remote`` holds is downloaded into the root (False: streamed, nothing written)."""
    io: IOConfig | None = None
    gate: Callable[[], None] | None = None
    """Called once a step verified, before the state dict is touched (the ranks' agreement)."""


def _join(path: str, k: Any) -> str:
    return f"{path}.{k}" if path else str(k)


def decode_key(k_node: Any) -> Any:
    return decode_tree({"d": [[k_node, {"v": None}]]}, []).popitem()[0]


# -- keys=[...] --------------------------------------------------------------------------------
def select_keys(tree: Any, keys: Iterable[str], step: int) -> Any:
    """The part of ``tree`` under the dotted ``keys`` (a key inside a list, tuple or JSON value
    keeps that whole value); a key the checkpoint lacks raises :class:`StateMismatchError`."""
    wanted = [str(k) for k in keys]
    found: set[str] = set()

    def walk(n: Any, path: str) -> Any:
        if path in wanted:
            found.add(path)
            return n
        below = [k for k in wanted if not path or k.startswith(path + ".")]
        if not below:
            return None
        if isinstance(n, dict) and len(n) == 1:
            (tag, val), = n.items()
            if tag == "d" and isinstance(val, list):
                kept = []
                for k_node, v_node in val:
                    sub = walk(v_node, _join(path, decode_key(k_node)))
                    if sub is not None:
                        kept.append([k_node, sub])
                return {"d": kept} if kept else None
            if tag == "j" and isinstance(val, dict):
                out = {}
                for k, v in val.items():
                    p = _join(path, k)
                    if any(w == p or w.startswith(p + ".") for w in below):
                        found.update(w for w in below if w == p or w.startswith(p + "."))
                        out[k] = v
                return {"j": out} if out else None
            if tag in ("l", "t", "j"):
                found.update(below)
                return n
        return None

    out = walk(tree, "")
    missing = [k for k in wanted if k not in found]
    if missing:
        raise StateMismatchError(f"step {step} holds no key {missing[0]!r} "
                                 f"(top-level keys: {top_level_keys(tree)[:20]})")
    return out if out is not None else {"d": []}


def top_level_keys(tree: Any) -> list[str]:
    if isinstance(tree, dict) and "d" in tree and isinstance(tree["d"], list):
        return [str(decode_key(k)) for k, _ in tree["d"]]
    if isinstance(tree, dict) and isinstance(tree.get("j"), dict):
        return [str(k) for k in tree["j"]]
    return []


# -- in place ------------------------------------------------------------------------------------
def find_in_place(dest: Any, node: Any, out: dict[int, tuple[torch.Tensor, str]], path: str = "") -> None:
    """Map manifest tensor indices to the caller's tensors at the same key path."""
    if not isinstance(node, dict) or len(node) != 1:
        return
    (tag, val), = node.items()
    if tag == "T" and isinstance(dest, torch.Tensor):
        out.setdefault(val, (dest, path))
    elif tag == "d" and isinstance(dest, dict):
        for k_node, v_node in val:
            k = decode_key(k_node)
            if k in dest:
                find_in_place(dest[k], v_node, out, _join(path, k))
    elif tag in ("l", "t") and isinstance(dest, (list, tuple)) and len(dest) == len(val):
        for i, (d, n) in enumerate(zip(dest, val)):
            find_in_place(d, n, out, _join(path, i))


def overlapping(dests: dict[int, torch.Tensor]) -> set[int]:
    """The indices of ``dests`` (the caller's contiguous tensors, by manifest index) whose bytes
    overlap another's (tied weights held as two tensors): two copiers would write them at once,
    so ``load_step`` reads them into new tensors, which ``merge`` copies in key order (the last
    wins, as in ``load_state_dict``). C-level maps only (100k tensors per load)."""
    idx = [i for i, t in dests.items() if t.numel()]
    if len(idx) < 2:
        return set()
    starts = list(map(torch.Tensor.data_ptr, map(dests.__getitem__, idx)))
    ends = list(map(operator.add, starts, map(torch.Tensor.nbytes.__get__, map(dests.__getitem__, idx))))
    order = sorted(range(len(idx)), key=starts.__getitem__)
    s = list(map(starts.__getitem__, order))
    reach = list(itertools.accumulate(map(ends.__getitem__, order), max))  # furthest end so far
    if not any(map(operator.lt, s[1:], reach)):
        return set()
    out: set[int] = set()
    owner = order[0]  # the tensor reaching furthest so far
    for k in order[1:]:  # rare: only states with aliased tensors get here
        if starts[k] < ends[owner]:
            out.update((idx[k], idx[owner]))
        if ends[k] > ends[owner]:
            owner = k
    return out


def leaf_paths(x: Any, path: str = "", out: set[str] | None = None) -> set[str]:
    """Dotted paths of the non-container leaves of a state dict (empty containers count)."""
    out = set() if out is None else out
    if isinstance(x, dict) and x:
        for k, v in x.items():
            leaf_paths(v, _join(path, k), out)
    elif isinstance(x, (list, tuple)) and x and not isinstance(x, torch.Size):
        for i, v in enumerate(x):
            leaf_paths(v, _join(path, i), out)
    else:
        out.add(path)
    return out


def key_report(dest: Any, skeleton: Any, selected: list[str] | None) -> tuple[list[str], list[str]]:
    """(missing, unexpected) leaf paths of ``dest`` vs the checkpoint's ``skeleton``."""
    have, got = leaf_paths(dest), leaf_paths(skeleton)
    inner = set()
    for p in got:
        while "." in p:
            p = p.rsplit(".", 1)[0]
            if p in inner:
                break
            inner.add(p)
    missing = sorted(p for p in have - got if p not in inner)
    if selected is not None:
        missing = [m for m in missing if any(m == k or m.startswith(k + ".") for k in selected)]
    return missing, sorted(got - have)


def merge(dest: Any, restored: Any) -> Any:
    """Copy ``restored`` into ``dest`` where both are containers/tensors (once the whole step
    verified); return the result."""
    if isinstance(dest, dict) and isinstance(restored, dict):
        for k, v in restored.items():
            dest[k] = merge(dest[k], v) if k in dest else v
        return dest
    if isinstance(dest, list) and isinstance(restored, list) and len(dest) == len(restored):
        for i, v in enumerate(restored):
            dest[i] = merge(dest[i], v)
        return dest
    if isinstance(dest, torch.Tensor) and isinstance(restored, torch.Tensor):
        if dest is restored:
            return dest
        if dest.shape != restored.shape or dest.dtype != restored.dtype:
            return restored  # a different tensor at this key (checked earlier for in-place ones)
        with torch.no_grad():
            dest.copy_(restored)
        return dest
    return restored


# -- map_location ------------------------------------------------------------------------------
def location_mapper(map_location: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``torch.load`` accepts: None, a device or its name, a dict of location names
    (restored tensors come from ``"cpu"``), or ``callable(storage, location)``."""
    if map_location is None:
        return lambda t: t
    if isinstance(map_location, (str, torch.device, int)):
        try:
            dev = torch.device(map_location)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ConfigError(f"map_location={map_location!r} is not a device: {exc}") from None
        return lambda t: t.to(dev)
    if isinstance(map_location, dict):  # no entry for "cpu": None, tensors stay where they are
        return location_mapper(map_location.get("cpu", map_location.get(torch.device("cpu"))))
    if callable(map_location):
        fn = map_location

        def call(t: torch.Tensor) -> torch.Tensor:
            r = fn(t.untyped_storage(), "cpu")
            if r is None:
                return t
            if isinstance(r, torch.Tensor):
                return r
            dev = getattr(r, "device", None)
            if dev is None:
                raise ConfigError(f"map_location callable returned {type(r).__name__}, not a storage or None")
            return t if torch.device(dev) == t.device else t.to(dev)

        return call
    raise ConfigError(f"map_location={map_location!r} is not a device, a dict or a callable")
