"""``zerostall plan``: checkpoint volume, bandwidth, stall and MFU cost, before a run.

Volume ``V = P x bytes_per_param`` (14: bf16 weights, fp32 master, Adam's two moments),
synchronous stall ``V / B`` at the slowest layer (storage or the NICs), the fraction of an
interval lost to it, the bandwidth a budget needs, and whether staging fits 40% of a node's
RAM. Units: bytes, seconds, GB/s = 1e9 bytes/s; NICs in Gbit/s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_count(text: str | float | int, what: str = "value") -> float:
    """``70e9``, ``175B``, ``7.5M``, ``2.4T``, ``2x100`` (a product) -> a number."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower().replace("_", "")
    if "x" in s and not s.startswith("0x"):
        total = 1.0
        for part in s.split("x"):
            total *= parse_count(part, what)
        return total
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgtp]?)", s)
    if not m:
        raise ConfigError(f"{what}={text!r} is not a number (examples: 70e9, 175B, 7.5M, 2x100)")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


@dataclass(frozen=True, kw_only=True)
class PlanInput:
    params: float | None = None
    bytes_per_param: float = 14.0
    checkpoint_bytes: float | None = None
    ranks: int = 1
    nodes: int = 1
    interval_min: float = 30.0
    budget_s: float | None = None
    fs_gbps: float | None = None
    nic_gbit: float | None = None
    node_ram_gib: float | None = None
    staging_fraction: float = 0.4


@dataclass(frozen=True)
class PlanResult:
    checkpoint_bytes: float
    bytes_per_rank: float
    bytes_per_node: float
    sync_stall_s: float | None
    lost_fraction: float | None
    required_gbps: float | None
    nic_gbytes_per_s: float | None
    effective_gbps: float | None
    staging_fits_ram: bool | None
    bottleneck: str


def plan(p: PlanInput) -> PlanResult:
    if p.checkpoint_bytes is None and p.params is None:
        raise ConfigError("give --params (e.g. 70e9) or --checkpoint-bytes")
    if p.ranks < 1 or p.nodes < 1:
        raise ConfigError("--ranks and --nodes must be >= 1")
    v = p.checkpoint_bytes if p.checkpoint_bytes is not None else p.params * p.bytes_per_param  # type: ignore[operator]
    per_rank, per_node = v / p.ranks, v / p.nodes
    nic = p.nic_gbit / 8 if p.nic_gbit else None  # GB/s per node
    net = nic * p.nodes if nic else None
    layers = {k: b for k, b in (("storage", p.fs_gbps), ("network", net)) if b}
    eff = min(layers.values()) if layers else None
    stall = v / (eff * 1e9) if eff else None
    lost = stall / (p.interval_min * 60) if stall is not None and p.interval_min > 0 else None
    required = v / p.budget_s / 1e9 if p.budget_s else None
    fits = per_node <= p.staging_fraction * p.node_ram_gib * 2**30 if p.node_ram_gib else None
    if not layers:
        bottleneck = "unknown (give --fs-gbps and/or --nic-gbps)"
    else:
        name = min(layers, key=layers.__getitem__)
        others = ", ".join(f"{k} {b:.1f} GB/s" for k, b in layers.items() if k != name)
        bottleneck = f"{name} ({layers[name]:.1f} GB/s" + (f" < {others})" if others else ")")
        if required is not None and layers[name] < required:
            bottleneck += f"; misses the {required:.1f} GB/s the budget needs"
    return PlanResult(v, per_rank, per_node, stall, lost, required, nic, eff, fits, bottleneck)
