"""Build the save plan: what goes where in the shard file, before any byte is copied.

Called from the caller's thread inside ``save()``; pure metadata work (no tensor data is
read). What could make a save fail later for its input is checked here, before anything is
queued: the step's range, the metadata, every leaf (in ``encode_tree``) and the manifest's
size; except inside containers of builtin values encoded off this thread
(:mod:`..format.frozen`): what is wrong there fails the save at ``result()``, naming the key
(:func:`finish_tree`).
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Sequence

import torch

from ..errors import ConfigError, UnsupportedStateError
from ..format.bulk import dumps_tree
from ..format.dtypes import SUPPORTED_DTYPES, dtype_name
from ..format.layout import HEADER_BYTES, pack_offsets
from ..format.frozen import DeferredTree, Frozen, skeleton_json
from ..format.decode import decode_tree
from ..format.tree import TensorLeaf, encode_tree
from ..format.validate import MAX_STEP, NotPlain, plain_copy
from ..format.table import TensorEntry, encode_columns
from ..format import manifest as mf
from .._fast import DEVICE, DTYPE, KEY, TENSOR, tuples_maker
from .._fast_torch import shape_of


def decode_key(k_node: Any) -> Any:
    return decode_tree({"d": [[k_node, {"v": None}]]}, []).popitem()[0]


class PlanItem(NamedTuple):
    """One tensor's place in the shard file (a named tuple, made in bulk: :data:`new_items`)."""

    index: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


new_items = tuples_maker(PlanItem)
"""``new_items(rows)``: the :class:`PlanItem` of each row ``(index, key, dtype, shape, nbytes, offset)``."""


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
    """A digest of every tensor's key, dtype and shape (all ranks' shares), built for a
    replicated save only: the replicated-mode structure check compares it across ranks."""
    lazy: DeferredTree | None = field(default=None, compare=False, repr=False)
    """Set when parts of ``tree`` are :class:`~zerostall.format.frozen.Frozen` snapshots (then
    ``tree_json`` is ""): :meth:`final` encodes them (background)."""
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """What later stages derive from this layout alone (:func:`~zerostall.format.manifest.tensors_json`),
    shared by every save that reuses the layout; written by one Checkpointer's persist thread."""

    def final(self) -> tuple[Any, str]:
        """(tree, compact JSON) with every frozen part encoded: at once when nothing was
        deferred, else the first call encodes (the snapshot thread, after staging; or the
        committer); raises :class:`UnsupportedStateError` naming the key if that encoding fails."""
        return (self.tree, self.tree_json) if self.lazy is None else self.lazy.result()

    @property
    def payload_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @cached_property
    def devices(self) -> set[str]:
        """The device types of the leaves (C-level maps; the few distinct devices typed)."""
        return {d.type for d in set(map(DEVICE, map(TENSOR, self.leaves)))}


def repack(plan: SavePlan, items: Sequence[PlanItem], leaves: Sequence[TensorLeaf], start: int = HEADER_BYTES,
           keep: int = 0) -> SavePlan:
    """``plan`` with its first ``keep`` items as they are, then ``items`` (whose leaves are
    ``leaves``) packed from ``start`` on: an incremental save's smaller plan, or its extension
    (:mod:`.incremental`, snapshot thread)."""
    offsets, end = pack_offsets([it.nbytes for it in items], start)
    new = tuple(PlanItem(it.index, it.key, it.dtype, it.shape, it.nbytes, o) for it, o in zip(items, offsets))
    return SavePlan(plan.items[:keep] + new, end, plan.tree, plan.leaves[:keep] + tuple(leaves), plan.n_tensors,
                    plan.tree_json, lazy=plan.lazy)


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


def build_plan(state_dict: Any, *, rank: int = 0, world_size: int = 1, replicated: bool = False,
               occurrences: list[int] | None = None, memo: dict[tuple[int, bytes], Any] | None = None,
               columns: Any = None, snapshots: dict[int, Any] | None = None) -> SavePlan:
    """Flatten ``state_dict`` and assign every tensor its offset after the header (packed:
    :func:`~zerostall.format.layout.pack_offsets`, the layout's one rule).

    With ``replicated`` (every rank holds the same state), this rank's plan holds only the
    tensors it owns (:func:`owners_by_size`); ``PlanItem.index`` stays the global index.
    ``occurrences``, ``columns`` and ``snapshots`` (the plan cache's walk already froze those
    containers): see :func:`encode_tree`; ``memo``: see :func:`finish_tree`.
    """
    frozen: list[Frozen] = []
    texts: list[tuple[dict[str, Any], str]] = []
    tree, all_leaves = encode_tree(state_dict, occurrences, frozen=frozen, columns=columns, texts=texts,
                                   snapshots=snapshots)
    tree, tree_json, lazy = finish_tree(tree, all_leaves, frozen, memo=memo, texts=texts)
    if replicated and world_size > 1:
        owner = owners_by_size(all_leaves, world_size)
        index: Sequence[int] = [i for i, r in enumerate(owner) if r == rank]
        leaves = [all_leaves[i] for i in index]
    else:
        index, leaves = range(len(all_leaves)), list(all_leaves)
    items, file_bytes = _items_in_bulk(leaves, index)
    digest = ""
    if replicated:  # only the replicated mode's commit compares it (across ranks of one run: any stable text will do)
        ts = list(map(TENSOR, all_leaves))
        digest = hashlib.sha256(repr((tuple(map(KEY, all_leaves)), tuple(map(str, map(DTYPE, ts))),
                                      tuple(map(shape_of, ts)))).encode()).hexdigest()
    return SavePlan(tuple(items), file_bytes, tree, tuple(leaves), len(all_leaves), tree_json, digest, lazy=lazy)


def _items_in_bulk(leaves: list[TensorLeaf], index: Sequence[int]) -> tuple[list[PlanItem], int]:
    """Every leaf's item (``index``: their global tensor indices) and the file's length
    (:func:`~zerostall.format.layout.pack_offsets`), attribute by attribute over all leaves
    (no Python frame per tensor but the offsets')."""
    ts = list(map(TENSOR, leaves))
    keys = list(map(KEY, leaves))
    dtypes = list(map(DTYPE, ts))
    names = {d: dtype_name(d, keys[dtypes.index(d)]) for d in set(dtypes)}  # refuses naming a key
    nbytes = list(map(operator.mul, map(torch.Tensor.numel, ts), map(torch.Tensor.element_size, ts)))
    offsets, file_bytes = pack_offsets(nbytes)
    items = list(new_items(zip(index, keys, map(names.__getitem__, dtypes), map(shape_of, ts), nbytes, offsets)))
    return items, file_bytes


def _entry_bytes() -> int:
    """The most a tensor entry adds to the manifest's tensor table (:mod:`~zerostall.format.table`)
    besides its key and shape: every field at its widest and a comma in each column."""
    e = TensorEntry("", "float32", (), "f", 10 ** 19, 10 ** 19, 0xFFFFFFFF)  # 20 digits > MAX_DIM
    one = encode_columns([e], ["f"])
    one.update(dtypes=[], dtype=[len(SUPPORTED_DTYPES)], file=[1 << 25])
    empty = {k: [] for k in one}
    dumps = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731
    return len(dumps(one)) - len(dumps(empty)) + len(one) - 1  # a comma in each column but dtypes


ENTRY_BYTES = _entry_bytes()
"""A bound on what one tensor entry adds to the manifest besides its key and shape; each shape
dimension adds at most ``DIM_BYTES`` (:func:`check_manifest_size`)."""
DIM_BYTES = len(str(1 << 62)) + 1
"""The widest dimension (``MAX_DIM``) and its comma."""


def entry_bound(key: str, ndim: int) -> int:
    """An upper bound on the manifest JSON of a tensor entry with this key and rank."""
    n = len(key)
    if not (key.isascii() and key.isprintable()) or '"' in key or "\\" in key:
        n *= 6  # json.dumps escapes to at most \uXXXX per character
    return ENTRY_BYTES + n + DIM_BYTES * ndim


def _entries_bound(leaves: Any) -> int:
    """The sum of :func:`entry_bound` over ``leaves``, in bulk where no key needs escaping
    (one check of all keys joined, C-level sums)."""
    keys = list(map(KEY, leaves))
    joined = "".join(keys)
    if not (joined.isascii() and joined.isprintable()) or '"' in joined or "\\" in joined:
        return sum(entry_bound(leaf.key, leaf.tensor.dim()) for leaf in leaves)
    return ENTRY_BYTES * len(keys) + len(joined) + DIM_BYTES * sum(map(torch.Tensor.dim, map(TENSOR, leaves)))


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


FROZEN_GROWTH = 8
"""What :func:`finish_tree` assumes a frozen snapshot's bytes may grow to as JSON: a state whose
estimate reaches the manifest limit is encoded on the caller's thread, so ``save()`` raises."""


def finish_tree(tree: Any, leaves: Any, frozen: list[Frozen], bound: int | None = None,
                memo: dict[tuple[int, bytes], Any] | None = None, texts: list[Any] | None = None
                ) -> tuple[Any, str, DeferredTree | None]:
    """(tree, tree_json, lazy) for a plan (caller's thread). Without frozen parts: the tree,
    its JSON and None (the manifest's size checked here). With them: a
    :class:`~zerostall.format.frozen.DeferredTree` that encodes them later (``memo``: the
    previous save's encodings) and checks the manifest's size then, unless the estimate
    (:data:`FROZEN_GROWTH`) says it may not fit: then it is finished now and raises here.
    ``texts``: large bulk nodes' JSON made by :func:`encode_tree` (spliced, not encoded again)."""
    bound = _entries_bound(leaves) if bound is None else bound
    if not frozen:
        return tree, check_manifest_size(tree, leaves, bound, dumps_tree(tree, texts) if texts else None), None
    n = leaves if isinstance(leaves, int) else len(leaves)
    skeleton = skeleton_json(tree, frozen)
    lazy = DeferredTree(tree, skeleton, frozen, _encode_part, lambda t, j: check_manifest_size(t, n, bound, j),
                        memo)
    if len(skeleton) + bound + FROZEN_GROWTH * sum(len(p) for f in frozen for p in f.parts) > mf.MAX_MANIFEST_BYTES:
        tree, tree_json = lazy.result()
        return tree, tree_json, None
    return tree, "", lazy


def _encode_part(obj: Any, path: tuple[Any, ...]) -> Any:
    """One thawed container's node (:class:`~zerostall.format.frozen.DeferredTree`)."""
    node, leaves = encode_tree(obj, path=path)
    assert not leaves, "a frozen snapshot holds no tensor"
    return node


def check_manifest_size(tree: Any, leaves: Any, bound: int | None = None,
                        tree_json: str | None = None) -> str:
    """The tree's JSON; raise :class:`UnsupportedStateError` naming the key that dominates if
    the manifest would exceed the limit every reader enforces (``MAX_MANIFEST_BYTES``).
    ``bound``: the leaves' entries bound if known (:func:`_entries_bound`); ``leaves`` may be
    their count when ``bound`` is given; ``tree_json``: the tree's JSON if already encoded."""
    if tree_json is None:
        tree_json = json.dumps(tree, separators=(",", ":"), allow_nan=False)
    est = len(tree_json) + (_entries_bound(leaves) if bound is None else bound)
    limit = mf.MAX_MANIFEST_BYTES
    if est <= limit:
        return tree_json
    tensors_part = est - len(tree_json)
    if tensors_part > len(tree_json):
        what = f"its {leaves if isinstance(leaves, int) else len(leaves)} tensor entries (~{tensors_part >> 20} MiB)"
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

