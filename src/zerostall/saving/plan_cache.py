"""The Checkpointer's plan cache: the last plan reused while the state keeps its shape.

Called from the caller's thread inside ``save()`` (:class:`PlanCache`, one per Checkpointer).
What it may never do: reuse a plan for a state whose layout, keys, tensor storage, shapes,
strides, dtypes, devices or plain values differ from the state the plan was built for (any
doubt builds the plan again through :func:`.plan.build_plan`, which checks everything), or
keep a tensor of the caller's alive between saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch

from .._util import no_gc
from ..format.frozen import FREEZE_MIN, Frozen, freeze
from ..format.tree import TensorLeaf, encode_known, new_leaves
from .plan import SavePlan, _entries_bound, build_plan, finish_tree
from .._fast import DEVICE, DTYPE, KEY, NBYTES, NUMPY
from .._fast_torch import shape_of


class Leaves(Sequence[TensorLeaf]):
    """A reused plan's leaves, kept as three parallel tuples (keys, detached tensors, numpy
    flags): a :class:`TensorLeaf` is made only for whoever indexes or iterates; ``save()``
    takes :attr:`tensors` as they are. Immutable; any thread."""

    __slots__ = ("keys", "tensors", "numpy")

    def __init__(self, keys: tuple[str, ...], tensors: tuple[torch.Tensor, ...], numpy: tuple[bool, ...]):
        self.keys, self.tensors, self.numpy = keys, tensors, numpy

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(new_leaves(zip(self.keys[i], self.tensors[i], self.numpy[i])))
        return TensorLeaf(self.keys[i], self.tensors[i], self.numpy[i])

    def __iter__(self) -> Iterator[TensorLeaf]:
        return new_leaves(zip(self.keys, self.tensors, self.numpy))

    def __add__(self, other: Any) -> tuple[TensorLeaf, ...]:
        return tuple(self) + tuple(other)


def plan_tensors(plan: SavePlan) -> list[torch.Tensor]:
    """The plan's tensors in plan order (caller's thread, ``save()``)."""
    leaves = plan.leaves
    return list(leaves.tensors) if isinstance(leaves, Leaves) else [leaf.tensor for leaf in leaves]


_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_PLAIN_TYPES = (str, int, float, bool, type(None))
_MAP_TYPES = (dict, OrderedDict)
_SEQ_TYPES = (list, tuple)
_FREEZABLE = frozenset((dict, list, tuple))
_KEY_TYPES = frozenset((str, int))
_ALL_TENSORS = "T*"
"""The marker of a container whose values are all plain tensors (taken in bulk)."""
_PLAIN = "V*"
"""The marker of a container without tensors (its contents are in the values)."""
_PTR, _STRIDE = torch.Tensor.data_ptr, torch.Tensor.stride
_COMPLEX = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_complex)
_CONJ, _NEG, _DETACH = torch.Tensor.is_conj, torch.Tensor.is_neg, torch.Tensor.detach


def _walk(x: Any, sig: list[Any], tensors: list[torch.Tensor], depth: int, vals: list[Any],
          snapshots: dict[int, bytes] | None = None) -> bool:
    """Append ``x``'s structure to ``sig``, its plain values to ``vals`` and
    its tensors to ``tensors`` (in :func:`encode_tree`'s walk order); False where ``x`` holds
    anything but dicts with str/int keys, lists, tuples, plain tensors and plain scalars (the
    cache then steps aside). A container without tensors goes to ``vals`` whole (its growing
    changes values, not the structure); a container of tensors only is taken in bulk. With
    ``snapshots``, a dict/list/tuple of builtin values only is taken whole as its
    :func:`~zerostall.format.frozen.freeze` snapshot, recorded by ``id`` for :func:`encode_tree`."""
    tx = type(x)
    if tx in _TENSOR_TYPES:
        tensors.append(x)
        return True
    if depth > 64:
        return False
    if snapshots is not None and tx in _FREEZABLE and len(x) >= FREEZE_MIN and _TENSOR_TYPES.isdisjoint(
            map(type, x.values() if tx is dict else x)):
        data = freeze(x)
        if data is not None:
            snapshots[id(x)] = data
            vals.append((tx, data))
            sig.append(_PLAIN)
            return True
    if tx in _MAP_TYPES:
        keys = tuple(x)
        if not _KEY_TYPES.issuperset(map(type, keys)):
            return False
        sig.append((tx, keys, tuple(map(type, keys))))  # 1 and True are equal keys, but encode apart
        kids = list(x.values())
    elif tx in _SEQ_TYPES:
        sig.append((tx, len(x)))
        kids = list(x)
    elif tx is float or tx in _PLAIN_TYPES:  # a float by its bits: -0.0 == 0.0 and nan != nan,
        vals.append((tx, x.hex() if tx is float else x))  # but they encode differently/alike
        sig.append(_PLAIN)  # a value here; a plain container in its place is one too
        return True
    else:
        return False
    if kids and _TENSOR_TYPES.issuperset(map(type, kids)):
        sig.append(_ALL_TENSORS)
        tensors.extend(kids)
        return True
    mark, n = len(sig), len(tensors)
    if not all(_walk(v, sig, tensors, depth + 1, vals, snapshots) for v in kids):
        return False
    if len(tensors) == n:  # no tensor inside: all of it is a value
        vals.append(tuple(sig[mark - 1:]))
        del sig[mark - 1:]
        sig.append(_PLAIN)
    return True


def _tensor_sig(tensors: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """What the plan depends on of every tensor (address, shape, stride, dtype, device), one
    tuple per attribute over all of them; None where one is a lazy conj/neg view; raises for a
    nested or non-strided one (the caller then builds the plan, which says what is wrong)."""
    dtypes = tuple(map(DTYPE, tensors))
    if not _COMPLEX.isdisjoint(dtypes) and any(map(_CONJ, tensors)):  # only complex tensors have a conj bit
        return None
    if any(map(_NEG, tensors)):
        return None
    # no layout or is_nested pass: a sparse, CSR or mkldnn tensor has no data_ptr() and a
    # nested one no sizes, so the maps below raise for them and the caller builds the plan
    return (tuple(map(_PTR, tensors)), tuple(map(shape_of, tensors)), tuple(map(_STRIDE, tensors)),
            dtypes, tuple(map(DEVICE, tensors)))


class PlanCache:
    """The last plan of one ``Checkpointer``, reused while the state keeps its shape (see the
    module docstring). :meth:`plan` walks the state once for a signature of exactly what the plan
    depends on; when it equals the last one, the last plan gets the newly walked tensors (no
    Python frame per tensor). Containers of builtin values are compared by their
    :func:`~zerostall.format.frozen.freeze` snapshots; when one changed, the tree is rebuilt
    around them and encoded off this thread, reusing the last save's encodings (``_memo``).
    Caller's thread only (``save()``/``prepare()``)."""

    def __init__(self) -> None:
        self._sig: tuple[Any, ...] | None = None
        self._plan: SavePlan | None = None
        self._first_pos: tuple[int, ...] = ()
        self._vals: list[Any] = []
        self._occ: list[int] = []
        self._bound = 0
        self._args: tuple[int, int, bool] | None = None
        self._keys: tuple[str, ...] = ()
        self._numpy: tuple[bool, ...] = ()
        self._in_order = False
        self._devices: set[str] = set()
        self._memo: dict[tuple[int, bytes], Any] = {}
        """The last save's frozen parts' encodings (:class:`~zerostall.format.frozen.DeferredTree`)."""

    @no_gc()  # see :func:`~zerostall._util.no_gc`
    def plan(self, state_dict: Any, *, rank: int = 0, world_size: int = 1, replicated: bool = False,
             early: Callable[[int], Any] | None = None) -> SavePlan:
        """The plan of ``state_dict``, the cyclic GC paused meanwhile. ``early(nbytes)``: told the
        state's tensor bytes before a plan is built anew, never for a reused one (``save()`` asks
        the staging pool for them, which faults meanwhile)."""
        sig: list[Any] = []  # the walk: structure, plain values, tensors in walk order, snapshots by id()
        vals: list[Any] = []
        tensors: list[torch.Tensor] = []
        snapshots: dict[int, bytes] = {}  # the walked objects live through this save
        fast, tsig = False, None  # whether the walk understood the whole state; the tensors' signature
        try:
            fast = _walk(state_dict, sig, tensors, 0, vals, snapshots)
            tsig = _tensor_sig(tensors) if fast else None
        except Exception:  # noqa: BLE001 - an odd tensor subclass: encode_tree reports it properly
            pass
        args = (rank, world_size, replicated)
        key = (tuple(sig), tsig) if tsig is not None else None
        cached = self._plan
        if key is not None and cached is not None and key == self._sig and args == self._args:
            if not self._in_order:  # tied weights once in the plan, or this rank's share only
                pos = self._first_pos
                tensors = [tensors[pos[it.index]] for it in cached.items]
            leaves = Leaves(self._keys, tuple(map(_DETACH, tensors)), self._numpy)
            if vals != self._vals:  # plain values changed (a step counter, a log): a new tree only
                frozen: list[Frozen] = []
                tree = encode_known(state_dict, self._occ, frozen=frozen, snapshots=snapshots)
                tree, tree_json, lazy = finish_tree(tree, len(leaves), frozen, self._bound, self._memo)
                self._plan = cached = replace(cached, tree=tree, tree_json=tree_json, lazy=lazy)
                self._vals = vals
                self._memo = lazy.memo if lazy is not None else {}
            out = replace(cached, leaves=leaves)
            out.__dict__["devices"] = set(self._devices)  # the cached_property: devices are in the signature
            return out
        if early is not None and fast:  # an early estimate of the shard file: the pool starts faulting
            try:
                nbytes = sum(map(NBYTES, tensors))
            except Exception:  # noqa: BLE001 - an odd tensor: the plan reports it
                nbytes = 0
            if nbytes:
                early(nbytes)
        occurrences: list[int] = []
        plan = build_plan(state_dict, rank=rank, world_size=world_size, replicated=replicated,
                          occurrences=occurrences, memo=self._memo, snapshots=snapshots,
                          columns=(tensors, *tsig) if tsig is not None else None)  # the signature's reads, reused
        self._memo = plan.lazy.memo if plan.lazy is not None else {}
        self._sig = self._plan = None
        if key is not None and len(occurrences) == len(tensors):
            if occurrences == list(range(len(occurrences))):  # no tied tensors: no Python loop
                self._first_pos = tuple(occurrences)
            else:
                first: dict[int, int] = {}
                for p, i in enumerate(occurrences):
                    first.setdefault(i, p)
                self._first_pos = tuple(first[i] for i in range(len(first)))
            self._sig, self._args, self._vals, self._occ = key, args, vals, occurrences
            self._bound = _entries_bound(plan.leaves)
            self._keys = tuple(map(KEY, plan.leaves))
            self._numpy = tuple(map(NUMPY, plan.leaves))
            self._in_order = [it.index for it in plan.items] == list(self._first_pos) == list(range(len(tensors)))
            self._devices = set(plan.devices)
            self._plan = replace(plan, leaves=())
        return plan


