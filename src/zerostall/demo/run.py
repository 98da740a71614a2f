"""``zerostall demo``: three runs of the same seeded training (a pure function of seed and step):
a reference run in this process, one line per checkpoint; a child killed with SIGKILL while a
checkpoint is being persisted; a child resuming from the newest committed checkpoint. Exit
status 0 only if the resumed losses and final parameters match the reference bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import _term, load, save
from .._term import safe
from ..checkpointer import Checkpointer
from ..saving.handle import SaveHandle
from .model import GPTConfig, TinyGPT, batch, corpus, encode

DEMO_CFG = GPTConfig(vocab=96, ctx=64, d_model=256, n_layer=4, n_head=4)
TINY_CFG = GPTConfig(vocab=96, ctx=32, d_model=64, n_layer=1, n_head=2)
BATCH = 16


def train(cfg: GPTConfig, ckpt_dir: str, steps: int, every: int, seed: int, resume: bool = False,
          on_save: Callable[[int, SaveHandle], None] = lambda step, h: None,
          on_step: Callable[[int, float], None] = lambda step, loss: None,
          ) -> tuple[dict[int, float], TinyGPT]:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    data = encode(corpus(), cfg.vocab)
    losses: dict[int, float] = {}
    start = 0
    with Checkpointer(ckpt_dir, keep_last=3) as ck:
        ck.guard(opt)  # optimizer.step() waits only while a snapshot is still being copied
        if resume:
            st = ck.load()
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optim"])
            torch.set_rng_state(st["rng"])
            start = st["step"] + 1
        for step in range(start, steps):
            x, y = batch(data, step, seed, BATCH, cfg.ctx)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                     "rng": torch.get_rng_state()}
            if step == start:  # AdamW state exists now: allocate and pre-fault the arena once
                ck.prepare(state)
            losses[step] = loss.item()
            on_step(step, losses[step])
            if (step + 1) % every == 0:
                on_save(step, ck.save(step, state))
    return losses, model


def loop_cost(step_ends: list[float], saves: list[tuple[float, SaveHandle]]) -> tuple[float, float]:
    """Training time lost per checkpoint (ms) and as a fraction of the whole loop: the excess over
    the median uncharged step of each step overlapping [save() called, durable]. ``step_ends``:
    perf_counter at the start and after every step; ``saves``: (perf_counter after ``save()``
    returned, handle)."""
    import statistics
    called = [(t_ret - h.result().stall_s, h.result()) for t_ret, h in saves]
    spans = [(t_call, t_call + r.durable_s) for t_call, r in called]
    durs = list(zip(step_ends, step_ends[1:]))
    charged = [any(a < e and s < b for s, e in spans) for a, b in durs]
    free = [b - a for (a, b), c in zip(durs, charged) if not c] or [b - a for a, b in durs]
    med = statistics.median(free)
    lost = sum((b - a) - med for (a, b), c in zip(durs, charged) if c)
    total = step_ends[-1] - step_ends[0]
    n = max(1, len(saves))
    return lost / n * 1e3, max(0.0, lost) / total if total > 0 else 0.0


def _child(a: argparse.Namespace) -> int:
    cfg = TINY_CFG if a.tiny else DEMO_CFG
    losses, model = train(cfg, a.dir, a.steps, a.every, a.seed, resume=a.resume,
                          on_save=lambda step, h: print(f"SAVED {step}", flush=True))
    Path(a.out).write_text(json.dumps({"losses": {str(k): v.hex() for k, v in losses.items()}}))
    save(a.out + ".params", dict(model.state_dict()), step=0)
    return 0


def _spawn(args: dict[str, Any]) -> subprocess.Popen[str]:
    """A child run of :func:`_child`, its arguments as one JSON document."""
    return subprocess.Popen([sys.executable, "-m", "zerostall.demo.run", json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_demo(steps: int, every: int, ckdir: str, seed: int, tiny: bool, console: Any) -> bool:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    cfg = TINY_CFG if tiny else DEMO_CFG
    ref_dir, crash_dir, work = (os.path.join(ckdir, n) for n in ("reference", "crashed", "work"))
    os.makedirs(work, exist_ok=True)
    kill_step = ((steps * 2 // 3) // every) * every - 1
    if kill_step < every:
        raise SystemExit("demo: --steps must be at least 3 x --every")
    n_params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    console.print(Text.assemble(("zerostall demo", "bold"), f": GPT ({n_params / 1e6:.2f} M params, AdamW state "
                                f"{n_params * 12 / 2**20:.0f} MiB per checkpoint), {steps} steps, a checkpoint "
                                f"every {every}, into {safe(ckdir)}"))

    # 1. the reference run, in this process
    lines: list[tuple[int, SaveHandle]] = []
    with Progress(TextColumn("[1/3] training", markup=False), BarColumn(),
                  TextColumn("{task.completed}/{task.total} steps", markup=False),
                  TextColumn("loss {task.fields[loss]}", markup=False), TimeElapsedColumn(), console=console) as prog:
        task = prog.add_task("train", total=steps, loss="-")

        def show_done() -> None:
            for step, h in list(lines):
                if h.done():
                    lines.remove((step, h))
                    r = h.result()
                    prog.console.print(
                        f"  ckpt {step:>4} | stall {r.stall_s * 1e3:5.1f} ms | {r.persist_gbps:4.2f} GB/s "
                        f"{r.engine} | durable {r.durable_s * 1e3:4.0f} ms | nr_dirty +{r.dirty_rise_bytes >> 20} MiB")

        step_ends: list[float] = [time.perf_counter()]
        saves: list[tuple[float, SaveHandle]] = []

        def on_step(step: int, loss: float) -> None:
            step_ends.append(time.perf_counter())
            prog.update(task, completed=step + 1, loss=f"{loss:.3f}")
            show_done()

        def on_save(step: int, h: SaveHandle) -> None:
            saves.append((time.perf_counter(), h))
            lines.append((step, h))

        ref_losses, ref_model = train(cfg, ref_dir, steps, every, seed, on_step=on_step, on_save=on_save)
        show_done()
    lost_ms, frac = loop_cost(step_ends, saves)
    console.print(f"  measured: checkpoints cost the training loop {lost_ms:.1f} ms each (time blocked in save() "
                  f"+ extra step time while a save was in flight, vs the median step), {frac:.2%} of training time")

    # 2. the crash: kill a child while it persists the checkpoint of kill_step
    console.print(f"[2/3] training in a child process; SIGKILL when the checkpoint of step {kill_step} "
                  "is being persisted")
    args = {"dir": crash_dir, "steps": steps, "every": every, "seed": seed, "tiny": tiny, "resume": False}
    child = _spawn({**args, "out": os.path.join(work, "crashed.json")})
    assert child.stdout is not None
    partial_dir = os.path.join(crash_dir, f"step-{kill_step}.partial")
    for line in child.stdout:
        if line.strip() == f"SAVED {kill_step}":
            deadline = time.monotonic() + 2.0  # kill once the persist thread has started writing
            while not os.path.isdir(partial_dir) and time.monotonic() < deadline:
                time.sleep(0.0005)
            child.send_signal(signal.SIGKILL)
            break
    if child.wait() != -signal.SIGKILL:
        err = child.stderr.read() if child.stderr else ""
        console.print(Text(f"the child ended before step {kill_step}: {safe(err)}", style="red"))
        return False
    committed = sorted(int(n[5:]) for n in os.listdir(crash_dir) if n.startswith("step-") and n[5:].isdigit())
    partial = os.path.isdir(partial_dir)
    console.print(Text.assemble(f"  killed (exit {child.returncode}); committed steps on disk: {committed}; "
                                f"step {kill_step}: ",
                                ("caught mid-persist (a .partial directory, not a checkpoint)", "yellow") if partial
                                else "committed before the kill landed" if kill_step in committed else "not started"))

    # 3. resume from the newest committed checkpoint and finish
    resumed_from = max(committed) if committed else None
    console.print(f"[3/3] resuming in a new process from step {resumed_from} and training to {steps}")
    out = os.path.join(work, "resumed.json")
    child = _spawn({**args, "out": out, "resume": True})
    _, err = child.communicate()
    if child.returncode != 0:
        console.print(Text.assemble(("resume failed:", "red"), f"\n{safe(err)}"))
        return False
    resumed = {int(k): float.fromhex(v) for k, v in json.loads(Path(out).read_text())["losses"].items()}
    params = load(out + ".params")
    ref_params = ref_model.state_dict()
    loss_ok = bool(resumed) and all(resumed[s] == ref_losses[s] for s in resumed)
    diff = [k for k in ref_params if not torch.equal(ref_params[k], params[k])]
    console.print(Text.assemble(f"  resumed steps {min(resumed)}..{max(resumed)}: losses ",
                                ("bit-identical", "green") if loss_ok else ("DIFFER", "red"),
                                " to the uninterrupted run; final parameters: ",
                                ("bit-identical", "green") if not diff else (f"{len(diff)} tensors differ", "red")))
    ok = loss_ok and not diff
    console.print(Text.assemble(("VERDICT: PASS", "bold green"), f" — checkpoints cost the loop {lost_ms:.1f} ms each "
                                f"({frac:.2%} of training time, measured) and survived a SIGKILL") if ok
                  else Text("VERDICT: FAIL", style="bold red"))
    return ok


def main(a: argparse.Namespace) -> int:
    console = _term.console()
    ckdir = a.dir or tempfile.mkdtemp(prefix="zerostall-demo-")
    t0 = time.time()
    try:
        ok = run_demo(a.steps, a.every, ckdir, a.seed, getattr(a, "tiny", False), console)
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(ckdir, ignore_errors=True)
    kept = f"; checkpoints kept in {safe(ckdir)}" if a.keep or a.dir else ""
    console.print(f"demo finished in {time.time() - t0:.1f} s{kept}")
    return 0 if ok else 1


if __name__ == "__main__":  # the child runs of run_demo
    sys.exit(_child(argparse.Namespace(**json.loads(sys.argv[1]))))
