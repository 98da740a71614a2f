"""Objects with ``state_dict()``/``load_state_dict()`` inside a state tree, and wrapped optimizers.

Saving: :mod:`.format.objects` stores such an object as its ``state_dict()``. Loading into a
state dict that holds such objects: :func:`load_into` loads into their state dicts (tensors in
place), then calls each object's ``load_state_dict``, as ``torch.distributed.checkpoint`` does
for ``Stateful`` objects. Caller's thread only.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import ConfigError

__all__ = ["is_stateful", "load_into", "unwrap_optimizer"]


def is_stateful(x: Any) -> bool:
    return (not isinstance(x, (dict, list, tuple, type)) and callable(getattr(x, "state_dict", None))
            and callable(getattr(x, "load_state_dict", None)))


def unwrap_optimizer(opt: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer`` or any wrapper that keeps it as ``.optimizer`` (whose hooks run)."""
    inner = opt
    for _ in range(8):
        nxt = getattr(inner, "optimizer", None)
        if nxt is None or nxt is inner or not callable(getattr(nxt, "register_step_pre_hook", None)):
            break
        inner = nxt
    if not callable(getattr(inner, "register_step_pre_hook", None)):
        raise ConfigError(f"guard() needs a torch.optim.Optimizer (or a wrapper exposing it as .optimizer); "
                          f"got {type(opt).__module__}.{type(opt).__qualname__}")
    return inner


def _swap(tree: Any) -> Any:
    """``tree`` with every stateful object replaced by its state dict (containers copied only
    along the way to one); ``tree`` itself when there is none."""
    if is_stateful(tree):
        return tree.state_dict()
    if isinstance(tree, dict):
        out = {k: _swap(v) for k, v in tree.items()}
        return tree if all(out[k] is v for k, v in tree.items()) else out
    return tree


def _merge(orig: dict[Any, Any], loaded: dict[Any, Any]) -> None:
    for k, v in loaded.items():
        o = orig.get(k)
        if is_stateful(o):
            o.load_state_dict(v)
        elif isinstance(o, dict) and isinstance(v, dict) and o is not v:
            _merge(o, v)
        else:
            orig[k] = v


def load_into(state_dict: Any, load: Callable[[Any], Any]) -> Any:
    """Run ``load(tree)`` on ``state_dict`` with stateful objects swapped for their state dicts,
    then hand each object its loaded state. Returns what ``load`` would (the same dict)."""
    plain = _swap(state_dict) if isinstance(state_dict, dict) else state_dict
    if plain is state_dict:
        return load(state_dict)
    _merge(state_dict, load(plain))
    return state_dict
