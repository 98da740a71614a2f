"""``zerostall bench --scenario frozen-base``: incremental checkpoints of a frozen-base fine-tune.

A GPT-style model (:class:`.model.TinyGPT`) with a low-rank adapter after every block; the
base (embeddings, blocks, head) is frozen, AdamW trains the adapters and the final LayerNorm,
so the state dict (model + optimizer) is >= 90% frozen bytes. Methods, all in one process on
the same disk:

- ``zerostall-full``: a Checkpointer without ``incremental`` (the reference of every ratio);
- ``zerostall-incremental``: ``incremental=True`` (crc-confirmed, the sound default mode);
- ``zerostall-incremental-version``: ``incremental="version"`` (version counters only);
- ``torch.save``: one file, flushed and fsynced; ``dcp``: ``torch.distributed.checkpoint.save``
  with its ``FileSystemWriter`` (which fsyncs).

Each method saves once to warm up (zerostall's staging pool is faulted in, the incremental
ones write their base), then ``--repeat`` rounds: one real training step (forward, backward,
AdamW), then one save by every method in turn, so the methods see the same conditions
(this matters on a shared, noisy host). Per method: bytes written per save, time until the
save is durable (zerostall: ``SaveRecord.durable_s`` from ``save()`` to the commit; the
others are synchronous), and the restore of the last round's step with the page cache
dropped first (best of two; zerostall verifies every crc32c), compared bit for bit with the
state that was saved. Each number is also given as a ratio to ``zerostall-full``.

Targets (issue 17): an incremental save writes <= 15% of a full save's bytes, is durable in
<= 25% of its time, restores at >= 90% of a full step's rate, bit-exact.
Called by :func:`main` on the CLI's thread; everything runs in this process.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

from zerostall import _term
from zerostall.demo.model import GPTConfig, TinyGPT
from zerostall.store.files import drop_cache

from .hostinfo import machine
from .model import states_equal
from .report import write_doc

METHODS = ("zerostall-full", "zerostall-incremental", "zerostall-incremental-version", "torch.save", "dcp")
TARGETS = {"bytes_ratio_max": 0.15, "durable_ratio_max": 0.25, "restore_rate_ratio_min": 0.9}


class Adapted(nn.Module):
    """The GPT with a low-rank adapter after each block (the trainable part)."""

    def __init__(self, cfg: GPTConfig, rank: int):
        super().__init__()
        self.gpt = TinyGPT(cfg)
        d = cfg.d_model
        self.down = nn.ModuleList(nn.Linear(d, rank, bias=False) for _ in range(cfg.n_layer))
        self.up = nn.ModuleList(nn.Linear(rank, d, bias=False) for _ in range(cfg.n_layer))
        for p in self.gpt.parameters():
            p.requires_grad_(False)
        for p in self.gpt.ln.parameters():
            p.requires_grad_(True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1]))
        for b, dn, up in zip(g.blocks, self.down, self.up):
            x = b(x)
            x = x + up(dn(x))
        return g.head(g.ln(x))


def shape_for(size_bytes: float) -> tuple[int, int, int]:
    """(d_model, n_layer, vocab) of a model whose fp32 weights are about ``size_bytes``."""
    vocab = 8192
    for d in (2048, 1024, 512, 256, 128):
        fixed = 2 * vocab * d * 4  # token embedding + head
        per_layer = 12 * d * d * 4
        if fixed + per_layer <= size_bytes or d == 128:
            return d, max(1, round((size_bytes - fixed) / per_layer)), vocab
    raise AssertionError("unreachable")


class Trainer:
    """The frozen-base fine-tune; ``step()`` is one real training step."""

    def __init__(self, d_model: int, n_layer: int, vocab: int, rank: int = 64):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab=vocab, ctx=32, d_model=d_model, n_layer=n_layer, n_head=8 if d_model >= 256 else 4)
        self.model = Adapted(cfg, rank)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)
        self.vocab, self.n = vocab, 0
        self.step()

    def step(self) -> None:
        g = torch.Generator().manual_seed(self.n)
        self.n += 1
        x = torch.randint(0, self.vocab, (2, 32), generator=g)
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), x.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.n}


def nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


def _drop_cache(d: str) -> None:
    for p, _, fs in os.walk(d):
        for f in fs:
            drop_cache(os.path.join(p, f))


class _Zerostall:
    def __init__(self, root: str, incremental: Any):
        import zerostall
        self.root = root
        # full_every=None: every measured save of an incremental method is incremental
        self.ck = zerostall.Checkpointer(root, incremental=incremental, full_every=None, keep_last=2)

    def save(self, step: int, state: Any) -> dict[str, Any]:
        rec = self.ck.save(step, state).result()
        return {"bytes_written": rec.bytes_written, "bytes_referenced": rec.bytes_referenced,
                "durable_s": rec.durable_s, "stall_s": rec.stall_s}

    def load(self, step: int, expect: Any) -> Any:
        import zerostall
        return zerostall.load(self.root, step=step)

    def close(self) -> None:
        self.ck.close()


class _Sync:
    """torch.save or DCP: synchronous, one directory per step (the previous one removed)."""

    def __init__(self, root: str, save_fn: Callable[[Any, str], None], load_fn: Callable[[str, Any], Any]):
        self.root, self.save_fn, self.load_fn = root, save_fn, load_fn

    def save(self, step: int, state: Any) -> dict[str, Any]:
        d = os.path.join(self.root, f"step-{step}")
        t0 = time.perf_counter()
        self.save_fn(state, d)
        dt = time.perf_counter() - t0
        for n in os.listdir(self.root):
            if n.startswith("step-") and n != f"step-{step}" and int(n[5:]) < step - 1:
                shutil.rmtree(os.path.join(self.root, n))
        return {"bytes_written": _dir_bytes(d), "bytes_referenced": 0, "durable_s": dt, "stall_s": dt}

    def load(self, step: int, expect: Any) -> Any:
        return self.load_fn(os.path.join(self.root, f"step-{step}"), expect)

    def close(self) -> None:
        pass


def _torch_save(state: Any, d: str) -> None:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "state.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load(d: str, expect: Any) -> Any:
    return torch.load(os.path.join(d, "state.pt"), weights_only=True)


def _dcp_save(state: Any, d: str) -> None:
    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=dcp.FileSystemWriter(d), no_dist=True)


def _dcp_load(d: str, expect: Any) -> Any:
    import torch.distributed.checkpoint as dcp
    target = _map_empty(expect)
    dcp.load(target, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    return target


def _map_empty(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, dict):
        return {k: _map_empty(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_empty(v) for v in x]
    return x


def _make(name: str, root: str) -> Any:
    if name == "zerostall-full":
        return _Zerostall(root, False)
    if name == "zerostall-incremental":
        return _Zerostall(root, True)
    if name == "zerostall-incremental-version":
        return _Zerostall(root, "version")
    if name == "torch.save":
        return _Sync(root, _torch_save, _torch_load)
    if name == "dcp":
        return _Sync(root, _dcp_save, _dcp_load)
    raise SystemExit(f"zerostall bench --scenario frozen-base: unknown method {name!r} (choose from "
                     f"{', '.join(METHODS)})")


def _restore(m: Any, step: int, expect: Any, d: str) -> tuple[float, bool]:
    """Best of two restores, the page cache dropped before each; bit-exact both times."""
    best, ok = float("inf"), True
    for _ in range(2):
        _drop_cache(d)
        t0 = time.perf_counter()
        got = m.load(step, expect)
        best = min(best, time.perf_counter() - t0)
        ok = ok and states_equal(got, expect)
    return best, ok


def run(work: str, size_bytes: float, repeat: int, methods: list[str], log: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """The scenario's JSON document (see the module doc and README)."""
    d_model, n_layer, vocab = shape_for(size_bytes)
    tr = Trainer(d_model, n_layer, vocab)
    total = nbytes(tr.state())
    frozen = sum(p.numel() * p.element_size() for p in tr.model.parameters() if not p.requires_grad)
    log(f"frozen-base: GPT d_model={d_model} layers={n_layer} vocab={vocab} + rank-64 adapters; state "
        f"{total / 1e6:.1f} MB (model + AdamW), frozen {frozen / total:.1%}; {repeat} round(s), dir {work}")
    load0 = os.getloadavg()
    runs: dict[str, Any] = {}
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in methods}
    try:
        for n in methods:
            root = os.path.join(work, n)
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            runs[n] = _make(n, root)
            runs[n].save(0, tr.state())  # warm-up (and the incremental methods' base)
        expect: Any = None
        for r in range(1, repeat + 1):
            tr.step()
            expect = _clone(tr.state())
            for n in methods:
                samples[n].append(runs[n].save(r, tr.state()))
        restores = {n: _restore(runs[n], repeat, expect, os.path.join(work, n)) for n in methods}
    finally:
        for m in runs.values():
            m.close()
    results = []
    for n in methods:
        s = samples[n]
        restore_s, exact = restores[n]
        results.append({"method": n, "rounds": len(s),
                        "bytes_written": statistics.median(x["bytes_written"] for x in s),
                        "bytes_referenced": statistics.median(x["bytes_referenced"] for x in s),
                        "durable_s": statistics.median(x["durable_s"] for x in s),
                        "durable_s_all": [x["durable_s"] for x in s],
                        "stall_s": statistics.median(x["stall_s"] for x in s),
                        "restore_s": restore_s, "restore_gbps": total / restore_s / 1e9, "bit_exact": exact})
    ref = next((x for x in results if x["method"] == "zerostall-full"), None)
    for x in results:
        if ref is None:
            x["ratio_to_full"] = None
            continue
        x["ratio_to_full"] = {"bytes_written": x["bytes_written"] / ref["bytes_written"],
                              "durable": x["durable_s"] / ref["durable_s"],
                              # per round: both saves of a round ran back to back, under the same load
                              "durable_per_round": [a / b for a, b in zip(x["durable_s_all"], ref["durable_s_all"])],
                              "restore_rate": ref["restore_s"] / x["restore_s"]}
    targets = {}
    for x in results:
        if x["method"].startswith("zerostall-incremental") and x["ratio_to_full"] is not None:
            rt = x["ratio_to_full"]
            targets[x["method"]] = {
                "bytes": rt["bytes_written"] <= TARGETS["bytes_ratio_max"],
                "durable": rt["durable"] <= TARGETS["durable_ratio_max"],
                "restore_rate": rt["restore_rate"] >= TARGETS["restore_rate_ratio_min"],
                "bit_exact": x["bit_exact"]}
    return {"scenario": "frozen-base", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "machine": machine(work), "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg()),
            "model": {"d_model": d_model, "n_layer": n_layer, "vocab": vocab, "adapter_rank": 64},
            "state_bytes": total, "frozen_bytes": frozen, "frozen_fraction": frozen / total,
            "repeat": repeat, "targets": TARGETS, "targets_met": targets, "results": results}


def main(a: argparse.Namespace) -> int:
    """Entry point of ``zerostall bench --scenario frozen-base`` (CLI thread)."""
    from rich.table import Table
    console = _term.console()
    methods = a.methods.split(",") if a.methods else list(METHODS)
    for n in methods:
        if n not in METHODS:
            raise SystemExit(f"zerostall bench --scenario frozen-base: unknown method {n!r} (choose from "
                             f"{', '.join(METHODS)})")
    if a.device != "cpu":
        raise SystemExit("zerostall bench --scenario frozen-base runs on the CPU only (omit --device)")
    base = a.dir or os.getcwd()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="zerostall-frozen-", dir=base)
    try:
        doc = run(work, a.size_gib * (1 << 30), a.repeat, methods, log=console.print)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    t = Table(title=f"frozen-base: {doc['state_bytes'] / 1e6:.0f} MB state, {doc['frozen_fraction']:.1%} frozen; "
                    f"load {doc['load_avg_start'][0]:.1f}")
    for col in ("method", "written", "durable", "restore", "bit-exact"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for x in doc["results"]:
        rt = x["ratio_to_full"] or {}

        def pct(k: str) -> str:
            return f" ({rt[k]:.1%})" if k in rt else ""
        t.add_row(x["method"], f"{x['bytes_written'] / 1e6:.1f} MB{pct('bytes_written')}",
                  f"{x['durable_s']:.3f} s{pct('durable')}",
                  f"{x['restore_gbps']:.2f} GB/s{pct('restore_rate')}", "yes" if x["bit_exact"] else "NO")
    console.print(t)
    console.print("ratios in parentheses: to zerostall-full (restore: rate ratio); targets for the incremental "
                  "methods: bytes <= 15%, durable <= 25%, restore rate >= 90%, bit-exact")
    if a.json:
        write_doc(doc, a.json)
        console.print(f"wrote {a.json}")
    return 0 if all(x["bit_exact"] for x in doc["results"]) else 1
