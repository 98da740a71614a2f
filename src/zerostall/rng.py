"""Random-number-generator state of the process, as a plain state tree (no pickle).

Caller's thread. ``rng_state()`` captures Python's ``random``, numpy's legacy global
generator, torch's CPU generator and every CUDA device's; ``set_rng_state(state)`` restores
what the dict holds. Store it in the checkpoint (``{"rng": zerostall.rng_state(), ...}``) to
make a resumed run draw the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from .errors import ConfigError

log = logging.getLogger("zerostall")

__all__ = ["rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """``{"python": ..., "numpy": ..., "torch": ByteTensor, "cuda": [ByteTensor per device]}``."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any) -> None:
    """Restore a dict from :func:`rng_state`. Absent keys are left alone; with fewer CUDA
    devices than were saved, the first ones are restored and a warning names the difference."""
    if not isinstance(state, dict):
        raise ConfigError(f"set_rng_state expects the dict rng_state() returned, got {type(state).__name__}")
    unknown = set(state) - {"python", "numpy", "torch", "cuda"}
    if unknown:
        raise ConfigError(f"set_rng_state: unknown generator(s) {sorted(unknown)}; expected python, numpy, "
                          "torch, cuda")
    try:
        if "python" in state:
            random.setstate(as_python_state(state["python"]))
        if "numpy" in state:
            np.random.set_state(as_numpy_state(state["numpy"]))
        if "torch" in state:
            torch.set_rng_state(_byte_tensor(state["torch"], "torch"))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"set_rng_state: the saved generator state does not fit: {exc}") from exc
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            log.warning("zerostall: the checkpoint holds CUDA RNG states for %d device(s) but CUDA is not "
                        "available; they are not restored", len(cuda))
            return
        n = torch.cuda.device_count()
        if n != len(cuda):
            log.warning("zerostall: the checkpoint holds CUDA RNG states for %d device(s), this process sees %d; "
                        "restoring the first %d", len(cuda), n, min(n, len(cuda)))
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_byte_tensor(s, f"cuda[{i}]"), i)


def _byte_tensor(t: Any, name: str) -> torch.Tensor:
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise ConfigError(f"set_rng_state: {name!r} is not a uint8 tensor")
    return t.cpu().contiguous()


def as_python_state(s: Any) -> tuple[Any, ...]:
    """``random.getstate()``'s form of a saved Python state (lists after a JSON round trip are
    tolerated): (version, tuple of 625 ints, gauss_next)."""
    version, internal, gauss = s
    return (int(version), tuple(int(x) for x in internal), gauss)


def as_numpy_state(s: Any) -> Any:
    """``np.random.get_state()``'s form of a saved numpy state (a tensor or list as the key)."""
    if isinstance(s, dict):
        return s
    name, keys, pos, has_gauss, gauss = s
    return (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(gauss))
