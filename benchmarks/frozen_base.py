"""Frozen-base fine-tuning: incremental vs full zerostall saves vs torch.save vs DCP, one run.

Usage: python benchmarks/frozen_base.py [DIR] [--d-model 1024] [--layers 8] [--rank 64]
       [--saves 3] [--json FILE]

The model is the GPT of ``zerostall.bench.model`` (token/position embeddings, attention + MLP
blocks, head) with a LoRA-style adapter (``d x rank`` and ``rank x d``) after every block.
The base (embeddings, blocks, head) is frozen; AdamW trains the adapters and the final
LayerNorm, so the
state dict (model + optimizer) is >= 90% frozen bytes. For each method: one warm-up save
(zerostall's arena is allocated and, for incremental, the base is written once), then
``--saves`` measured saves, each after a real training step (forward, backward, AdamW).
Reported per method (medians): bytes written per save, time until the save is durable (for
zerostall: ``SaveRecord.durable_s``; the others are synchronous and fsync), and the restore
of the last measured step (page cache dropped first, zerostall verifies every crc32c):
seconds and GB/s of state restored, compared bit for bit with the state that was saved.

Targets (issue 17): incremental writes <= 15% of a full save's bytes, is durable in <= 25% of
its time, and restores at >= 90% of a full step's rate, bit-exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import zerostall
from zerostall.bench.model import GPTConfig, TinyGPT

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.helpers import clone, equal  # noqa: E402  (the tests' deep clone / bit-exact compare)


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


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(d) for f in fs)


def drop_cache(d: str) -> None:
    for p, _, fs in os.walk(d):
        for f in fs:
            fd = os.open(os.path.join(p, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Trainer:
    def __init__(self, a: argparse.Namespace):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab=a.vocab, ctx=32, d_model=a.d_model, n_layer=a.layers, n_head=8)
        self.model = Adapted(cfg, a.rank)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)
        self.vocab, self.n = a.vocab, 0
        self.step()

    def step(self) -> None:
        g = torch.Generator().manual_seed(self.n)
        self.n += 1
        x = torch.randint(0, self.vocab, (2, 32), generator=g)
        loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), x.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.n}


def _best_of_two(fn, d: str):
    """Restore twice, page cache dropped before each (the first pays one-time costs: the
    restore buffer, the engine probe, lazy imports); the faster one."""
    best, got = float("inf"), None
    for _ in range(2):
        drop_cache(d)
        t0 = time.perf_counter()
        got = fn()
        best = min(best, time.perf_counter() - t0)
    return best, got


def bench_zerostall(tr: Trainer, root: str, saves: int, incremental) -> dict:
    """Without ``incremental``: full saves. With it, ``full_every=2``: full and incremental
    saves alternate in one run, so both are measured under the same conditions (this host
    is shared and noisy), and so are restores of a full and of an incremental step."""
    recs, expect = [], {}
    with zerostall.Checkpointer(root, incremental=incremental, full_every=2 if incremental else None) as ck:
        ck.prepare(tr.state())
        ck.save(0, tr.state()).result()  # warm-up: the arena is faulted in; a full save
        for i in range(1, 2 * saves + 1):
            tr.step()
            recs.append(ck.save(i, tr.state()).result())
            expect[i] = clone(tr.state())
    incr = [r for r in recs if r.bytes_referenced] if incremental else recs
    full = [r for r in recs if not r.bytes_referenced]
    last_incr, last_full = incr[-1].step, full[-1].step
    t_incr, t_full = float("inf"), float("inf")
    ok = True
    for _ in range(3):  # alternate: the same conditions for both
        s, got = _best_of_two(lambda: zerostall.load(root, step=last_full), root)
        t_full, ok = min(t_full, s), ok and equal(got, expect[last_full])
        s, got = _best_of_two(lambda: zerostall.load(root, step=last_incr), root)
        t_incr, ok = min(t_incr, s), ok and equal(got, expect[last_incr])
    return {"bytes_written": statistics.median(r.bytes_written for r in incr),
            "bytes_referenced": statistics.median(r.bytes_referenced for r in incr),
            "durable_s": statistics.median(r.durable_s for r in incr),
            "stall_s": statistics.median(r.stall_s for r in incr),
            "full_in_same_run": {"bytes_written": statistics.median(r.bytes_written for r in full),
                                 "durable_s": statistics.median(r.durable_s for r in full),
                                 "restore_s": t_full},
            "restore_s": t_incr, "bit_exact": ok}


def bench_sync(tr: Trainer, root: str, saves: int, save_fn, load_fn) -> dict:
    times, sizes = [], []
    save_fn(tr.state(), os.path.join(root, "step-0"))
    for i in range(1, saves + 1):
        tr.step()
        d = os.path.join(root, f"step-{i}")
        t0 = time.perf_counter()
        save_fn(tr.state(), d)
        times.append(time.perf_counter() - t0)
        sizes.append(dir_bytes(d))
    expect = clone(tr.state())
    d = os.path.join(root, f"step-{saves}")
    restore_s, got = _best_of_two(lambda: load_fn(d, expect), d)
    return {"bytes_written": statistics.median(sizes), "bytes_referenced": 0, "durable_s": statistics.median(times),
            "stall_s": statistics.median(times), "restore_s": restore_s, "bit_exact": equal(got, expect)}


def torch_save(state, d):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "state.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(d, expect):
    return torch.load(os.path.join(d, "state.pt"), weights_only=True)


def dcp_save(state, d):
    import torch.distributed.checkpoint as dcp
    dcp.save(state, storage_writer=dcp.FileSystemWriter(d), no_dist=True)


def dcp_load(d, expect):
    import torch.distributed.checkpoint as dcp
    target = {"model": {k: torch.empty_like(v) for k, v in expect["model"].items()}, "optim": clone(expect["optim"]),
              "step": expect["step"]}
    dcp.load(target, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    return target


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--saves", type=int, default=3, help="measured saves of each kind")
    p.add_argument("--methods", default="zerostall-full,zerostall-incremental,zerostall-incremental-version,"
                                        "torch.save,dcp")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="zerostall-frozen-", dir=os.getcwd())
    tr = Trainer(a)
    st = tr.state()
    total = nbytes(st)
    frozen = sum(p.numel() * p.element_size() for p in tr.model.parameters() if not p.requires_grad)
    print(f"state {total / 1e6:.1f} MB (model + AdamW), frozen base {frozen / 1e6:.1f} MB = {frozen / total:.1%}; "
          f"{a.saves} measured saves per method, dir {work}")
    methods = {
        "zerostall-full": lambda r: bench_zerostall(tr, r, a.saves, False),
        "zerostall-incremental": lambda r: bench_zerostall(tr, r, a.saves, True),
        "zerostall-incremental-version": lambda r: bench_zerostall(tr, r, a.saves, "version"),
        "torch.save": lambda r: bench_sync(tr, r, a.saves, torch_save, torch_load),
        "dcp": lambda r: bench_sync(tr, r, a.saves, dcp_save, dcp_load),
    }
    out: dict[str, dict] = {}
    try:
        for name in a.methods.split(","):
            root = os.path.join(work, name)
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            res = methods[name](root)
            res["restore_gbps"] = total / res["restore_s"] / 1e9
            out[name] = res
            shutil.rmtree(root, ignore_errors=True)
            print(f"{name:30s} written {res['bytes_written'] / 1e6:8.1f} MB  referenced "
                  f"{res['bytes_referenced'] / 1e6:7.1f} MB  durable {res['durable_s']:6.3f} s  stall "
                  f"{res['stall_s'] * 1e3:7.1f} ms  restore {res['restore_s']:6.3f} s "
                  f"({res['restore_gbps']:5.2f} GB/s)  bit-exact {res['bit_exact']}", flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    verdict = {}
    for name in ("zerostall-incremental", "zerostall-incremental-version"):
        if name not in out:
            continue
        i = out[name]
        f = i["full_in_same_run"]
        v = {"bytes_ratio": i["bytes_written"] / f["bytes_written"],
             "durable_ratio": i["durable_s"] / f["durable_s"],
             "restore_rate_ratio": f["restore_s"] / i["restore_s"],
             "bit_exact": all(r["bit_exact"] for r in out.values())}
        v["targets_met"] = (v["bytes_ratio"] <= 0.15 and v["durable_ratio"] <= 0.25
                            and v["restore_rate_ratio"] >= 0.9 and v["bit_exact"])
        verdict[name] = v
        print(f"{name} vs full saves of the same run (full: durable {f['durable_s']:.3f} s, restore "
              f"{f['restore_s']:.3f} s): bytes {v['bytes_ratio']:.1%} (target <= 15%), durable "
              f"{v['durable_ratio']:.1%} (<= 25%), restore rate {v['restore_rate_ratio']:.0%} (>= 90%), "
              f"bit-exact {v['bit_exact']}: {'PASS' if v['targets_met'] else 'FAIL'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"state_bytes": total, "frozen_bytes": frozen, "methods": out, "verdict": verdict}, f, indent=1)
    return 0 if all(v["targets_met"] for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
