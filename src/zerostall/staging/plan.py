"""Build the save plan: what goes where in the shard file, before any byte is copied.

Called from the caller's thread inside ``save()``; pure metadata work (no tensor data is
read), so its cost is proportional to the number of tensors and plain values, not their
size. Everything that could make a save fail later for its input is checked here, before
anything is queued: the step's range, the metadata, every leaf (in ``encode_tree``) and the
manifest's size.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import threading

import json
import operator
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterator

import torch

from ..errors import ConfigError, UnsupportedStateError
from ..format.dtypes import dtype_name
from ..format.layout import HEADER_BYTES, align_up, place
from ..format.tree import TensorLeaf, decode_tree, encode_tree
from ..format.validate import MAX_STEP, NotPlain, plain_copy


def decode_key(k_node: Any) -> Any:
    return decode_tree({"d": [[k_node, {"v": None}]]}, []).popitem()[0]


@dataclass(frozen=True)
class PlanItem:
    index: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True)
class SavePlan:
    """The frozen layout of one rank's shard file."""

    items: tuple[PlanItem, ...]
    file_bytes: int
    tree: Any
    leaves: tuple[TensorLeaf, ...]
    n_tensors: int = 0
    """Tensors in the whole state (all ranks' shares when replicated)."""
    tree_json: str = ""
    """``tree`` as compact JSON, encoded once on the caller's thread (size check, manifest)."""
    shapes_digest: str = ""
    """A digest of every tensor's key, dtype and shape (all ranks' shares when replicated): the
    replicated-mode structure check compares it across ranks."""

    @property
    def payload_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @cached_property
    def devices(self) -> set[str]:
        return {leaf.tensor.device.type for leaf in self.leaves}


def owners_by_size(leaves: tuple[TensorLeaf, ...] | list[TensorLeaf], world_size: int) -> list[int]:
    """A deterministic owner rank per tensor, balancing bytes (largest first, least loaded)."""
    load = [0] * world_size
    owner = [0] * len(leaves)
    sizes = [leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves]
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_TYPES = (str, int, float, bool, type(None))
_MAP_TYPES = (dict, OrderedDict)
_SEQ_TYPES = (list, tuple)
_KEY_TYPES = frozenset((str, int))
_ALL_TENSORS = "T*"
"""The marker of a container whose values are all plain tensors (taken in bulk)."""
_DTYPE, _DEVICE = operator.attrgetter("dtype"), operator.attrgetter("device")
_LAYOUT, _NESTED = operator.attrgetter("layout"), operator.attrgetter("is_nested")
_PTR, _SIZE, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.size, torch.Tensor.stride
_CONJ, _NEG, _DETACH = torch.Tensor.is_conj, torch.Tensor.is_neg, torch.Tensor.detach


def _walk(x: Any, sig: list[Any], tensors: list[torch.Tensor], depth: int = 0) -> bool:
    """Append ``x``'s structure and plain values to ``sig`` and its tensors to ``tensors`` (in
    :func:`encode_tree`'s walk order); False where ``x`` holds anything but dicts with str/int
    keys, lists, tuples, plain tensors and plain scalars (the cache then steps aside and
    :func:`encode_tree` decides). A container of tensors only is taken in bulk (C-level
    ``map``s, no Python frame per tensor); the tensors' own attributes are :func:`_tensor_sig`'s."""
    tx = type(x)
    if tx in _TENSOR_TYPES:
        tensors.append(x)
        return True
    if depth > 64:
        return False
    if tx in _MAP_TYPES:
        keys = tuple(x)
        if not _KEY_TYPES.issuperset(map(type, keys)):
            return False
        sig.append((tx, keys, tuple(map(type, keys))))  # 1 and True are equal keys, but encode apart
        vals = list(x.values())
    elif tx in _SEQ_TYPES:
        sig.append((tx, len(x)))
        vals = list(x)
    elif tx is float:  # by its bits: -0.0 == 0.0 and nan != nan, but they encode differently/alike
        sig.append((tx, x.hex()))
        return True
    elif tx in _PLAIN_TYPES:
        sig.append((tx, x))
        return True
    else:
        return False
    if vals and _TENSOR_TYPES.issuperset(map(type, vals)):
        sig.append(_ALL_TENSORS)
        tensors.extend(vals)
        return True
    return all(_walk(v, sig, tensors, depth + 1) for v in vals)


def _tensor_sig(tensors: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """What the plan depends on of every tensor (address, shape, stride, dtype, device, layout),
    taken attribute by attribute over all of them (one tuple each, no tuple per tensor: less for
    the GC to track); None where one is a lazy conj/neg view, nested or not strided."""
    if any(map(_CONJ, tensors)) or any(map(_NEG, tensors)) or any(map(_NESTED, tensors)):
        return None
    if tensors and set(map(_LAYOUT, tensors)) != {torch.strided}:
        return None
    return (tuple(map(_PTR, tensors)), tuple(map(_SIZE, tensors)), tuple(map(_STRIDE, tensors)),
            tuple(map(_DTYPE, tensors)), tuple(map(_DEVICE, tensors)))


_gc_lock = threading.Lock()
_gc_paused = [0, False]  # [planners inside _no_gc, whether the GC was enabled before the first]


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC: a plan allocates an object or more per tensor (leaves, detached
    tensors, sizes), which triggered gen-2 collections of the whole heap inside ``save()``
    (1-2 per save at 100k tensors, each scanning the caller's state). None of it is cyclic;
    the counts carry over, so a collection due runs after the plan is built. A GC the caller
    disabled stays disabled; Checkpointers planning on several threads at once re-enable it
    when the last one is done (a count under a lock: no thread sees the others' pause)."""
    with _gc_lock:
        if _gc_paused[0] == 0:
            _gc_paused[1] = gc.isenabled()
            gc.disable()
        _gc_paused[0] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused[0] -= 1
            if _gc_paused[0] == 0 and _gc_paused[1]:
                gc.enable()


class PlanCache:
    """The last plan of one ``Checkpointer``, reused while the state keeps its shape.

    A training loop saves the same tensors (same storage, shapes, strides, dtypes, devices)
    under the same keys with the same plain values, save after save; flattening, validating
    and laying it out again cost ~5 us per tensor on the caller's thread. :meth:`plan` walks
    the state once for a signature of exactly what the plan depends on and, when it equals
    the last one, returns the last plan with the newly walked tensors in it. Any difference
    (a new key, a changed plain value such as a learning rate, a reallocated tensor) or
    anything outside the simple types builds the plan again. The walk takes containers of
    tensors in bulk and each tensor attribute with one C-level ``map`` over all tensors (~1 us
    per tensor in all; the plan's leaves are detached the same way), so a reused plan costs
    no Python frame per tensor. The cache holds no tensor (the signature holds addresses,
    shapes and dtypes), so it keeps no memory of the state alive.
    Caller's thread only (``save()``/``prepare()``, serialised by the Checkpointer).
    """

    def __init__(self) -> None:
        self._sig: tuple[Any, ...] | None = None
        self._plan: SavePlan | None = None
        self._first_pos: tuple[int, ...] = ()
        self._args: tuple[int, int, bool] | None = None
        self._keys: tuple[str, ...] = ()
        self._numpy: tuple[bool, ...] = ()
        self._in_order = False
        self._devices: set[str] = set()

    def plan(self, state_dict: Any, *, rank: int = 0, world_size: int = 1, replicated: bool = False) -> SavePlan:
        """The plan of ``state_dict``; Python's cyclic GC is paused meanwhile (see :func:`_no_gc`)."""
        with _no_gc():
            return self._plan_of(state_dict, rank, world_size, replicated)

    def _plan_of(self, state_dict: Any, rank: int, world_size: int, replicated: bool) -> SavePlan:
        sig: list[Any] = []
        tensors: list[torch.Tensor] = []
        try:
            fast = _walk(state_dict, sig, tensors)
            tsig = _tensor_sig(tensors) if fast else None
        except Exception:  # noqa: BLE001 - an odd tensor subclass: encode_tree reports it properly
            tsig = None
        args = (rank, world_size, replicated)
        key = (tuple(sig), tsig) if tsig is not None else None
        cached = self._plan
        if key is not None and cached is not None and key == self._sig and args == self._args:
            if not self._in_order:  # tied weights once in the plan, or this rank's share only
                pos = self._first_pos
                tensors = [tensors[pos[it.index]] for it in cached.items]
            out = replace(cached, leaves=tuple(map(TensorLeaf, self._keys, map(_DETACH, tensors), self._numpy)))
            out.__dict__["devices"] = set(self._devices)  # the cached_property: devices are in the signature
            return out
        occurrences: list[int] = []
        plan = build_plan(state_dict, rank=rank, world_size=world_size, replicated=replicated,
                          occurrences=occurrences)
        self._sig = self._plan = None
        if key is not None and len(occurrences) == len(tensors):
            first: dict[int, int] = {}
            for p, i in enumerate(occurrences):
                first.setdefault(i, p)
            self._first_pos = tuple(first[i] for i in range(len(first)))
            self._sig, self._args = key, args
            self._keys = tuple(leaf.key for leaf in plan.leaves)
            self._numpy = tuple(leaf.numpy for leaf in plan.leaves)
            self._in_order = [it.index for it in plan.items] == list(self._first_pos) == list(range(len(tensors)))
            self._devices = set(plan.devices)
            self._plan = replace(plan, leaves=())
        return plan



def build_plan(state_dict: Any, *, rank: int = 0, world_size: int = 1, replicated: bool = False,
               occurrences: list[int] | None = None) -> SavePlan:
    """Flatten ``state_dict`` and assign every tensor its offset after the header (packed:
    :func:`~zerostall.format.layout.place`, the layout's one rule).

    With ``replicated`` (every rank holds the same state), this rank's plan holds only the
    tensors it owns (:func:`owners_by_size`); ``PlanItem.index`` stays the global index.
    ``occurrences``: see :func:`encode_tree`.
    """
    tree, all_leaves = encode_tree(state_dict, occurrences)
    tree_json = check_manifest_size(state_dict, tree, all_leaves)
    owner = owners_by_size(all_leaves, world_size) if replicated and world_size > 1 else None
    items = []
    leaves = []
    pos = HEADER_BYTES
    for i, leaf in enumerate(all_leaves):
        if owner is not None and owner[i] != rank:
            continue
        leaves.append(leaf)
        t: torch.Tensor = leaf.tensor
        nbytes = t.numel() * t.element_size()
        off, pos = place(pos, nbytes)
        items.append(PlanItem(i, leaf.key, dtype_name(t.dtype, leaf.key), tuple(t.shape), nbytes, off))
    digest = hashlib.sha256(repr([(leaf.key, str(leaf.tensor.dtype), tuple(leaf.tensor.shape))
                                  for leaf in all_leaves]).encode()).hexdigest()
    return SavePlan(tuple(items), max(align_up(pos), HEADER_BYTES), tree, tuple(leaves), len(all_leaves),
                    tree_json, digest)


def _entry_bytes() -> int:
    """The longest a tensor entry's manifest JSON can be besides its key and shape: every
    field at its widest (the longest dtype name, a shard name up to rank 10**10, offset and
    size up to ``MAX_DIM``, the crc32c, a reference's step) and the comma between entries.
    Entries of real states measure 110-170 B with their key."""
    from ..format.dtypes import SUPPORTED_DTYPES
    from ..format.layout import shard_name
    from ..format.manifest import TensorEntry
    from ..format.validate import MAX_DIM
    widest = max((dtype_name(d) for d in SUPPORTED_DTYPES), key=len)
    e = TensorEntry("", widest, (), shard_name(10 ** 10), MAX_DIM, MAX_DIM, 0xFFFFFFFF, MAX_STEP)
    return len(json.dumps(e.to_json(), separators=(",", ":"))) + 1


ENTRY_BYTES = _entry_bytes()
"""A bound on one tensor entry's JSON in the manifest besides its key and shape (185 B);
each shape dimension adds at most ``DIM_BYTES``. The manifest limit is checked on these
(:func:`check_manifest_size`): 1M tensors with 30-character keys need ~0.25 GB of the 512 MiB."""
DIM_BYTES = len(str(1 << 62)) + 1
"""The widest dimension (``MAX_DIM``) and its comma."""


def entry_bound(key: str, ndim: int) -> int:
    """An upper bound on the manifest JSON of a tensor entry with this key and rank."""
    n = len(key)
    if not (key.isascii() and key.isprintable()) or '"' in key or "\\" in key:
        n *= 6  # json.dumps escapes to at most \uXXXX per character
    return ENTRY_BYTES + n + DIM_BYTES * ndim


def check_step(step: Any) -> int:
    """``step`` is an int in [0, 2**63) (what a manifest and a directory name can hold)."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ConfigError(f"step={step!r:.60} is invalid: must be an int in [0, 2**63)")
    return int(step)


def check_metadata(metadata: Any) -> dict[str, Any]:
    """A snapshot of ``metadata`` if it is plain JSON (dict with str keys, lists, str, bounded
    ints, finite floats, bool, None), else :class:`UnsupportedStateError`."""
    if metadata is None:
        return {}
    try:
        out = plain_copy(metadata)
    except NotPlain:
        out = None
    if not isinstance(out, dict):
        where = _not_plain_at(metadata, ()) if type(metadata) is dict else None
        at = f": {'.'.join(map(str, where[0])) or '<top>'!r} {where[1]}" if where else ""
        raise UnsupportedStateError(
            "metadata= must be a dict of plain JSON values (str keys; lists, str, int, finite float, bool, None)"
            + at)
    return out


def _not_plain_at(x: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], str] | None:
    """(key path, what is wrong) of the first value in ``x`` that :func:`plain_copy` refuses;
    None if it is plain. The error path only."""
    if len(path) >= 200:
        return path, "is nested deeper than 200"
    if type(x) is dict:
        bad = [k for k in x if type(k) is not str]
        if bad:
            return path, f"has a key that is not a str: {bad[0]!r:.80}"
        items: Any = x.items()
    elif type(x) is list:
        items = enumerate(x)
    else:
        try:
            plain_copy(x, 199)  # a leaf: one level, no recursion
            return None
        except NotPlain:
            return path, f"holds {x!r:.80} ({type(x).__module__}.{type(x).__qualname__})"
    for k, v in items:
        hit = _not_plain_at(v, path + (k,))
        if hit is not None:
            return hit
    return None


def check_manifest_size(state_dict: Any, tree: Any, leaves: Any) -> str:
    """The tree's JSON; raise :class:`UnsupportedStateError` naming the key that dominates if
    the manifest would exceed the limit every reader enforces (``MAX_MANIFEST_BYTES``)."""
    from ..format import manifest as mf
    tree_json = json.dumps(tree, separators=(",", ":"), allow_nan=False)
    est = len(tree_json) + sum(entry_bound(leaf.key, leaf.tensor.dim()) for leaf in leaves)
    limit = mf.MAX_MANIFEST_BYTES
    if est <= limit:
        return tree_json
    tensors_part = est - len(tree_json)
    if tensors_part > len(tree_json):
        what = f"its {len(leaves)} tensor entries (~{tensors_part >> 20} MiB)"
    else:
        key, size = _dominant(tree)
        what = f"key {key!r} (~{size >> 20} MiB of JSON)"
    raise UnsupportedStateError(
        f"this state's manifest would be ~{est >> 20} MiB, over the {limit >> 20} MiB limit readers accept; "
        f"most of it is {what}: store large data as tensors (or numpy arrays), not as Python values")


def _dominant(tree: Any) -> tuple[str, int]:
    """The deepest key path whose encoding holds more than half of its parent's."""
    path: list[str] = []
    node = tree
    size = len(json.dumps(node, separators=(",", ":")))
    while True:
        kids: list[tuple[str, Any]] = []
        if isinstance(node, dict) and len(node) == 1:
            (tag, val), = node.items()
            if tag == "d":
                kids = [(str(decode_key(k)), v) for k, v in val]
            elif tag in ("l", "t"):
                kids = [(str(i), v) for i, v in enumerate(val)]
            elif tag == "j" and isinstance(val, dict):
                kids = [(k, {"j": v}) for k, v in val.items()]
            elif tag == "j" and isinstance(val, list):
                kids = [(str(i), {"j": v}) for i, v in enumerate(val)]
        if not kids:
            break
        sized = [(len(json.dumps(v, separators=(",", ":"))), k, v) for k, v in kids]
        big, k, v = max(sized, key=lambda x: x[0])
        if big * 2 < size:
            break
        path.append(k)
        node, size = v, big
    return (".".join(path) or "<root>"), size

