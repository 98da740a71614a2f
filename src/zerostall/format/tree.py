"""The state dict's structure as JSON, with tensors replaced by indices.

``encode_tree`` walks a nested state dict on the caller's thread and returns a JSON-able tree
plus the tensor leaves; :func:`.decode.decode_tree` does the reverse (without torch). Nothing
is pickled: a leaf no rule stores is rejected with the key that holds it. Dict keys may be
str, int, float, bool, None or tuples of those.

Node encoding (one key per node): ``{"v": x}`` plain value, ``{"f": "nan"|"inf"|"-inf"}``
non-finite float, ``{"T": i}`` tensor i, ``{"A": i}`` numpy array stored as tensor i,
``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"d": [[key, node], ...]}`` dict,
``{"j": x}`` a subtree that is plain JSON as it stands (:func:`.validate.plain_copy`),
``{"o": [type, node]}`` a Python object (:mod:`.objects`). Inside ``save()`` a large container
of builtin values is left as a :class:`.frozen.Frozen`, encoded later, off the caller's thread.

Views are saved by value (a conjugate or negative view resolved first); two keys that view
the same bytes with one shape, stride and dtype (tied weights) are stored once and restored
as one shared tensor.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import torch

from .._fast import tuples_maker
from ..errors import UnsupportedStateError
from .validate import MAX_DEPTH, MAX_INT_BITS, NotPlain, plain_copy
from . import objects
from .bulk import BULK_MIN, TENSOR_TYPES as _TENSOR_TYPES, TEXT_MIN, Columns, bulk_tensors, known_node, pairs_json
from .frozen import FREEZE_MIN, Frozen, freeze
from .kinds import STANDARD_TYPES

_FREEZABLE = frozenset((dict, list, tuple))


class TensorLeaf(NamedTuple):
    """One tensor to store: its display key, the tensor, and whether it was a numpy array."""

    key: str
    tensor: torch.Tensor
    numpy: bool = False


new_leaves = tuples_maker(TensorLeaf)


def _fmt_key(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


def _check_int(x: int, path: tuple[Any, ...]) -> int:
    x = int(x)
    if x.bit_length() > MAX_INT_BITS:
        raise UnsupportedStateError(
            f"{_fmt_key(path)!r} holds an int of {x.bit_length()} bits; plain ints are limited to "
            f"{MAX_INT_BITS} bits (store big numbers as a str or a tensor)")
    return x


def _np_plain(x: Any, path: tuple[Any, ...]) -> Any:
    """The Python value a numpy bool/int/uint/float/complex/str/bytes scalar is stored as (docs/usage.md);
    :class:`UnsupportedStateError` for a long double and the other kinds."""
    kind, size = x.dtype.kind, x.dtype.itemsize
    if (kind == "f" and size > 8) or (kind == "c" and size > 16):
        raise UnsupportedStateError(
            f"{_fmt_key(path)!r} holds a numpy {x.dtype} (long double), which has no exact stored form; "
            "convert it with float(x) or complex(x), or keep it in a float64 tensor or array")
    if kind in "biufcUS":
        return x.item()
    raise UnsupportedStateError(
        f"{_fmt_key(path)!r} holds a numpy scalar of dtype {x.dtype}, which cannot be stored; "
        "convert it to a plain value or store it as an array")


def _encode_key(k: Any, path: tuple[Any, ...]) -> Any:
    tk = type(k)  # exact types, inline (per key of every small dict: no helper frame per tensor)
    if k is None or tk is bool or tk is str or tk is float:  # a non-finite float by name
        return {"v": k} if tk is not float or k - k == 0.0 else {"f": repr(k)}
    if tk is int:
        return {"v": _check_int(k, path)}
    if tk is tuple:
        return {"t": [_encode_key(x, path) for x in k]}
    if isinstance(k, np.generic) and k.dtype.kind in "biufU":
        return _encode_key(_np_plain(k, path), path)
    raise UnsupportedStateError(
        f"dict key {k!r} of type {tk.__module__}.{tk.__qualname__} under {_fmt_key(path)!r} cannot be stored "
        "(it would not load back as itself); use str, int, float, bool, None or tuples of those as keys "
        "(numpy bool/int/float/str scalars are stored as the Python value)")


_STORED_BASES = (dict, list, tuple, str, int, float, torch.Size, np.ndarray) + STANDARD_TYPES
"""Types a subclass of which is refused as such (it would load back as its base)."""


def _refusal(x: Any, path: tuple[Any, ...]) -> UnsupportedStateError:
    """The error for a value no rule stores, saying what to do."""
    t, key = type(x), _fmt_key(path)
    name = f"{t.__module__}.{t.__qualname__}"
    hint = "or register it with zerostall.register_type"
    if isinstance(x, tuple) and hasattr(t, "_fields"):
        return UnsupportedStateError(
            f"{key!r} holds the namedtuple {name}, which would load back as a plain tuple: register it with "
            f"zerostall.register_type({t.__name__}) (it then loads back as {t.__name__}) or convert it with tuple(x)")
    if isinstance(x, dict) and hasattr(x, "default_factory"):
        return UnsupportedStateError(
            f"{key!r} holds a defaultdict whose default_factory {x.default_factory!r} cannot be stored "
            "(a builtin type such as list, int or dict, or None, can): convert it with dict(x)")
    base = next((b for b in t.__mro__[1:] if b in _STORED_BASES), None)
    if base is not None:
        return UnsupportedStateError(
            f"{key!r} holds a {name}, a subclass of {base.__name__} that would load back as a plain "
            f"{base.__name__}: convert it ({base.__name__}(x)) {hint} (it then loads back as itself)")
    return UnsupportedStateError(
        f"{key!r} holds a {name}, which cannot be stored without pickle; convert it to a tensor or to plain "
        f"values (dict/list/str/int/float), {hint}")


def _storable(t: torch.Tensor, key: str, is_np: bool) -> torch.Tensor:
    """``t`` detached and resolved (a lazy conj/neg view's storage holds the other tensor's
    bytes), or :class:`UnsupportedStateError` naming ``key`` and what to do."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not is_np:
        raise UnsupportedStateError(
            f"{key!r} is a {type(t).__name__}; zerostall stores plain tensors only "
            "(for DTensor/ShardedTensor state use zerostall.dcp with torch.distributed.checkpoint)")
    if t.is_nested:
        raise UnsupportedStateError(
            f"{key!r} is a nested tensor; store its components (t.unbind()) or a padded tensor instead")
    if t.device.type == "meta":
        raise UnsupportedStateError(
            f"{key!r} is a meta tensor and has no data to save; materialize it first")
    if t.device.type not in ("cpu", "cuda"):
        raise UnsupportedStateError(
            f"{key!r} is on device {t.device}; zerostall stages cpu and cuda tensors only "
            "(move it with .cpu() first)")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedStateError(f"{key!r} has layout {t.layout}; convert it with .to_dense()")
    if t.is_quantized:
        raise UnsupportedStateError(f"{key!r} is quantized; dequantize it first")
    t = t.detach()
    return t.resolve_conj().resolve_neg() if t.is_conj() or t.is_neg() else t


def _from_numpy(x: Any, path: tuple[Any, ...]) -> torch.Tensor:
    """A tensor over the numpy array ``x`` (a C-contiguous copy if it is not), or
    :class:`UnsupportedStateError` naming its key."""
    if x.dtype.hasobject:
        raise UnsupportedStateError(
            f"{_fmt_key(path)!r} is a numpy array of Python objects; it cannot be stored without pickle")
    if not x.dtype.isnative:
        raise UnsupportedStateError(
            f"{_fmt_key(path)!r} is a numpy array with non-native byte order ({x.dtype.str}); "
            "convert it with arr.astype(arr.dtype.newbyteorder('='))")
    try:  # np.ascontiguousarray would turn a 0-d array into shape (1,)
        return torch.from_numpy(x if x.flags.c_contiguous else x.copy(order="C"))
    except TypeError as exc:
        raise UnsupportedStateError(f"{_fmt_key(path)!r}: numpy dtype {x.dtype} is not supported ({exc})") from None


def encode_tree(obj: Any, occurrences: list[int] | None = None, *, frozen: list[Frozen] | None = None,
                snapshots: dict[int, bytes] | None = None, path: tuple[Any, ...] = (),
                columns: Columns | None = None, texts: list[tuple[dict[str, Any], str]] | None = None
                ) -> tuple[Any, list[TensorLeaf]]:
    """Encode ``obj``: ``(tree, leaves)``; raise :class:`UnsupportedStateError` naming the first bad key.

    ``occurrences`` receives the leaf index of every tensor met, in walk order (for
    :mod:`..saving.plan_cache`). ``frozen``: receives each large container of builtin values,
    left in the tree as a :class:`.frozen.Frozen` (``snapshots``: ``{id(container): bytes}``
    already taken in this ``save()``). ``path``: where ``obj`` sits (errors name the full key).
    ``columns``: :data:`.bulk.Columns` of ``obj``'s tensors in walk order. ``texts``: receives
    (node, its pairs' JSON) for each large dict taken in bulk (:func:`.bulk.dumps_tree`).
    """
    walk = _Walk(occurrences, None, frozen, snapshots, columns, texts)
    return walk.node(obj, path, len(path)), walk.leaves


def encode_known(obj: Any, known: list[int], *, frozen: list[Frozen] | None = None,
                 snapshots: dict[int, bytes] | None = None) -> Any:
    """The tree of ``obj`` alone, for a state with the very same tensors as an earlier walk
    whose ``occurrences`` were ``known`` (checked by the plan cache): no tensor is checked again."""
    return _Walk(None, known, frozen, snapshots, None, None).node(obj, (), 0)


class _Walk:
    """One walk of a state on the caller's thread, used once. Not a recursive closure: that
    would be a reference cycle holding the caller's tensors until the cyclic GC."""

    __slots__ = ("occurrences", "known", "frozen", "snapshots", "columns", "texts", "leaves", "seen", "met")

    def __init__(self, occurrences: list[int] | None, known: list[int] | None, frozen: list[Frozen] | None,
                 snapshots: dict[int, bytes] | None, columns: Columns | None,
                 texts: list[tuple[dict[str, Any], str]] | None):
        self.occurrences, self.known, self.frozen, self.snapshots = occurrences, known, frozen, snapshots
        self.columns, self.texts = columns, texts
        self.leaves: list[TensorLeaf] = []
        self.seen: dict[tuple[Any, ...], int] = {}  # a tensor's identity -> its leaf index
        self.met = [0]  # tensors met so far, in walk order (``known``, ``columns``)

    def node(self, x: Any, path: tuple[Any, ...], depth: int) -> Any:
        """The tree node of ``x`` at ``path``: the rules of the module docstring, in order."""
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(f"state is nested deeper than {MAX_DEPTH} at {_fmt_key(path)!r}")
        if isinstance(x, torch.Tensor):
            return {"T": self.tensor(x, path, False)}
        if type(x) is np.ndarray:  # a subclass (np.matrix, masked) would lose its type
            return {"A": self.tensor(_from_numpy(x, path), path, True)}
        if isinstance(x, enum.Enum):  # before int/str: IntEnum and StrEnum members keep their type
            return objects.encode_object(x, lambda v: self.node(v, path, depth + 1))
        # exact types from here: a subclass is stored by a rule of its own (objects.py) or refused
        tx = type(x)
        if x is None or tx is bool or tx is str or tx is float:  # a non-finite float by name
            return {"v": x} if tx is not float or x - x == 0.0 else {"f": repr(x)}
        if tx is int:
            return {"v": _check_int(x, path)}
        if (frozen := self.frozen) is not None:  # a large container of builtin values: snapshotted, encoded later
            if tx in _FREEZABLE and len(x) >= FREEZE_MIN and (got := self.snapshot(x, tx, path, frozen)) is not None:
                return got
        elif tx is dict or tx is list:
            try:
                return {"j": plain_copy(x, depth)}
            except NotPlain:
                pass
        if tx is dict or tx is OrderedDict:  # the rule: an OrderedDict (a module's state_dict()) loads as a dict
            return self.dict_node(x, path, depth)
        if tx is list:
            return {"l": [self.node(v, path + (i,), depth + 1) for i, v in enumerate(x)]}
        if tx is tuple:
            return {"t": [self.node(v, path + (i,), depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, np.generic) and x.dtype.kind not in "Mm":
            return self.node(_np_plain(x, path), path, depth)
        node = objects.encode_object(x, lambda v: self.node(v, path, depth + 1))
        if node is not None:
            return node
        raise _refusal(x, path)

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...], is_np: bool) -> int:
        """The leaf index of ``t`` (a view of bytes met before shares that leaf)."""
        self.met[0] += 1
        if self.known is not None:
            return self.known[self.met[0] - 1]
        key = _fmt_key(path)
        t = _storable(t, key, is_np)
        # the data address stands for (storage, offset): one address, dtype, shape and strides is one set of bytes
        ident = (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype,
                 is_np) if t.numel() else None
        if ident is not None and ident in self.seen:
            i = self.seen[ident]
        else:
            self.leaves.append(TensorLeaf(key, t, is_np))
            i = len(self.leaves) - 1
            if ident is not None:
                self.seen[ident] = i
        if self.occurrences is not None:
            self.occurrences.append(i)
        return i

    def snapshot(self, x: Any, tx: type, path: tuple[Any, ...], frozen: list[Frozen]) -> Frozen | None:
        """``x`` as a :class:`.frozen.Frozen` appended to ``frozen``, or None (then it is walked)."""
        data = self.snapshots.get(id(x)) if self.snapshots else None
        if data is None and _TENSOR_TYPES.isdisjoint(map(type, x.values() if tx is dict else x)):
            data = freeze(x)
        if data is None:
            return None
        frozen.append(Frozen(tx, data, path))
        return frozen[-1]

    def dict_node(self, x: dict[Any, Any], path: tuple[Any, ...], depth: int) -> Any:
        """A dict's node: from the known walk, in bulk, or key by key."""
        if self.known is not None and (node := known_node(x, self.known, self.met)) is not None:
            return node
        if depth < MAX_DEPTH and len(x) >= BULK_MIN:  # (no column slices for the many small dicts)
            m, cols = self.met[0], self.columns
            got = bulk_tensors(x, self.seen, cols and tuple(c[m:m + len(x)] for c in cols))
            if got is not None:
                return self.bulk_node(got, path)
        return {"d": [[_encode_key(k, path), self.node(v, path + (k,), depth + 1)] for k, v in x.items()]}

    def bulk_node(self, got: tuple[list[str], list[torch.Tensor], list[tuple[Any, ...]]],
                  path: tuple[Any, ...]) -> Any:
        """A dict of plain tensors taken in bulk (:func:`.bulk.bulk_tensors`): :meth:`tensor` for all at once."""
        keys, tensors, idents = got
        self.met[0] += len(keys)
        leaves = self.leaves
        start = len(leaves)
        prefix = _fmt_key(path) + "." if path else ""
        leaves.extend(new_leaves(zip([prefix + k for k in keys] if prefix else keys, tensors, repeat(False))))
        self.seen.update(zip(idents, range(start, len(leaves))))
        if self.occurrences is not None:
            self.occurrences.extend(range(start, len(leaves)))
        node = {"d": [[{"v": k}, {"T": i}] for k, i in zip(keys, range(start, len(leaves)))]}
        if self.texts is not None and len(keys) >= TEXT_MIN:
            self.texts.append((node, pairs_json(keys, start)))
        return node
