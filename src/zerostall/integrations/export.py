"""``zerostall export --format lightning|transformers|accelerate|safetensors``: an adapter's
checkpoint as the files its framework's own checkpointing reads (docs/integrations.md), or every
tensor flattened into safetensors (:func:`flatten`, :func:`save_safetensors`).

Imports no framework. Called by the CLI on its thread; writes into ``out``'s directory only.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from ..errors import ConfigError, ZerostallError
from ..extend import TaggedData, as_numpy_state, as_python_state

def _need(state: Any, key: str, kind: str) -> Any:
    if not isinstance(state, dict) or key not in state:
        keys = sorted(state)[:20] if isinstance(state, dict) else type(state).__name__
        raise ConfigError(f"this checkpoint has no {key!r} entry, so it was not written by the {kind} adapter "
                          f"(top-level keys: {keys}); export --format safetensors writes its tensors")
    return state[key]


def flatten(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a nested dict/list state under dotted keys (``model.net.weight``, ``optim.0``)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(x: Any, prefix: str) -> None:
        if isinstance(x, torch.Tensor):
            if prefix in flat:
                raise ZerostallError(f"key {prefix!r} appears twice after flattening; cannot export")
            flat[prefix] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(state, "")
    return flat


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """``tensors`` as a safetensors file (tied weights cloned: safetensors refuses aliases)."""
    from safetensors.torch import save_file
    seen: set[int] = set()
    flat = {}
    for k, v in tensors.items():
        v = v.detach().contiguous()
        if v.numel() and v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        elif v.numel():
            seen.add(v.untyped_storage().data_ptr())
        flat[k] = v
    save_file(flat, path, metadata={"format": "pt"} if metadata is None else metadata)


def _fields(obj: Any) -> Any:
    if isinstance(obj, TaggedData):
        return obj.data
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return obj


def write(kind: str, state: Any, out: str, *, rank: int = 0, world_size: int = 1) -> list[str]:
    """Write ``state`` (a loaded checkpoint of the ``kind`` adapter: lightning, transformers or
    accelerate, the CLI checks which) at ``out``; the files written."""
    if kind == "lightning":
        _need(state, "state_dict", kind)
        torch.save({k: v for k, v in state.items() if k != "zerostall_rng"}, out)
        return [out]
    os.makedirs(out, exist_ok=True)
    files: list[str] = []

    def save(obj: Any, name: str) -> None:
        torch.save(obj, os.path.join(out, name))
        files.append(name)

    rng = state.get("rng") if isinstance(state, dict) else None
    if kind == "transformers":
        save_safetensors(_need(state, "model", kind), os.path.join(out, "model.safetensors"))
        files.append("model.safetensors")
        for key, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
            if key in state:
                save(state[key], name)
        if rng is not None:
            hf = {"python": as_python_state(rng["python"]), "numpy": as_numpy_state(rng["numpy"]),
                  "cpu": rng["torch"]}
            if rng.get("cuda"):
                hf["cuda"] = list(rng["cuda"])
            save(hf, "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth")
        ts = _fields(_need(state, "trainer_state", kind))
        with open(os.path.join(out, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(ts, indent=2, sort_keys=True) + "\n")
        files.append("trainer_state.json")
        return files
    for i, sd in enumerate(_need(state, "models", kind)):
        name = "model.safetensors" if i == 0 else f"model_{i}.safetensors"
        save_safetensors(sd, os.path.join(out, name))
        files.append(name)
    for key, stem in (("optimizers", "optimizer"), ("schedulers", "scheduler")):
        for i, sd in enumerate(state.get(key, [])):
            save(sd, f"{stem}.bin" if i == 0 else f"{stem}_{i}.bin")
    if "scaler" in state:
        save(state["scaler"], "scaler.pt")
    for i, sd in enumerate(state.get("custom", [])):
        save(sd, f"custom_checkpoint_{i}.pkl")
    if rng is not None:
        acc = {"step": int(state.get("step", 0)), "random_state": as_python_state(rng["python"]),
               "numpy_random_seed": as_numpy_state(rng["numpy"]), "torch_manual_seed": rng["torch"]}
        if rng.get("cuda"):
            acc["torch_cuda_manual_seed"] = list(rng["cuda"])
        save(acc, f"random_states_{rank}.pkl")
    return files
