"""``zerostall bench --scenario every-step``: what checkpointing every step costs a training loop
in the same process, against the one-pass limit (one copy and one crc32c of the bytes).

The trainer (:class:`Trainer`): ``--size-gib`` of state (half parameters, half SGD momentum
buffers, 64 tensors by default) and a step of ``--matmuls`` 1024x1024 matmuls followed by an
optimizer step that writes every tensor. For each trainer thread count (all cores, then all but
one: ``torch.set_num_threads``) it runs each mode for ``--seconds`` and reports steps/s:

* ``none``: no checkpoint (the baseline);
* ``zs-block``: ``Checkpointer.save`` every step, ``backpressure="block"`` (save() waits for room);
* ``zs-skip``: every step with ``backpressure="skip"`` (a step is skipped while the previous save
  holds the arena): the interval it reached is steps / saves committed;
* ``zs-every-K``: every ``--every`` steps, blocking;
* ``dcp-async``: ``dcp.async_save`` every step with one reused ``DefaultStager`` (async
  staging), waiting for the previous save first and for staging before the optimizer step (as
  DCP's documentation asks);
* ``zs-block-2slots`` (only when named in ``--methods``): ``zs-block`` with a staging arena of
  two snapshots (``StagingConfig(slots=2)``: twice the state's bytes of host memory).

Beside steps/s each mode reports what explains its loss within the run: the time the trainer
waited per step (zerostall: ``save()`` plus the optimizer guard, from each save's record;
DCP: its wait for staging and for the previous save), and the save cycle: the persist
thread's time per save (zerostall: ``persist_s + commit_s + post_commit_s`` of the records,
the least interval between saves it keeps up with; DCP: start to finish of each async save).
When the cycle is longer than the step, ``block`` waits and ``skip`` skips.

Then, with one torch thread and no matmuls, the CPU cost (:func:`cpu_per_gib`): process CPU
seconds per GiB saved of back-to-back saves (the optimizer step, timed on its own thread,
subtracted), beside the one-pass limit of the same bytes measured between its rounds
(:func:`one_pass_limit`: a memmove into a reused buffer plus a crc32c pass, one thread each).
Runs on the caller's thread; the saves' own threads are the library's.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from .everystep_cpu import cpu_per_gib, one_pass_limit, process_cpu_s
from .report import write_doc

MODES = ("none", "zs-block", "zs-skip", "zs-every-K", "dcp-async")
EXTRA_MODES = ("zs-block-2slots",)


class Trainer:
    """A state of ``size_bytes`` in ``n_tensors`` tensors (parameters + momentum buffers) and
    its step: ``matmuls`` matmuls of ``dim`` x ``dim`` (the forward/backward stand-in), then
    an SGD step with momentum that writes every tensor. Caller's thread only."""

    def __init__(self, size_bytes: int, n_tensors: int = 64, matmuls: int = 5, dim: int = 1024):
        n_params = max(1, n_tensors // 2)
        per = max(1, size_bytes // (2 * n_params) // 4)
        g = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(per, generator=g)) for _ in range(n_params)]
        for p in self.params:
            p.grad = torch.randn(per, generator=g) * 1e-3
        self.opt = torch.optim.SGD(self.params, lr=1e-3, momentum=0.9)
        self.opt.step()  # the momentum buffers exist from now on
        self.matmuls, self.x = matmuls, torch.randn(dim, dim, generator=g)
        self.nbytes = sum(t.numel() * 4 for t in self.params) * 2

    def forward(self) -> None:
        y = self.x
        for _ in range(self.matmuls):
            y = torch.mm(self.x, y) * 1e-3

    def state(self) -> dict[str, Any]:
        return {"model": {f"p{i}": p for i, p in enumerate(self.params)}, "optim": self.opt.state_dict()}


class Saver:
    """One mode's checkpointing, called by the loop: ``after_step(step)`` once per step
    (after the optimizer step), ``drain()`` at the end; counts what was saved."""

    saves = 0
    skips = 0
    bytes_saved = 0
    waited_s = 0.0
    """The trainer's waits for checkpointing (save() and the optimizer guard)."""
    cycles_s: list[float]
    """Per save: the pipeline's time per save (see the module docstring)."""
    writes_s: list[float]

    def reset(self) -> None:
        self.saves = self.skips = self.bytes_saved = 0
        self.waited_s, self.cycles_s, self.writes_s = 0.0, [], []

    def after_step(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class ZsSaver(Saver):
    def __init__(self, tr: Trainer, root: str, every: int = 1, backpressure: str = "block", slots: int = 1):
        from zerostall.checkpointer import Checkpointer
        from zerostall.config import StagingConfig
        self.tr, self.every = tr, every
        self.reset()
        self.ck = Checkpointer(root, keep_last=2, backpressure=backpressure, staging=StagingConfig(slots=slots))
        self.ck.guard(tr.opt)  # the optimizer step waits only while a snapshot still reads the state
        self.ck.prepare(tr.state(), wait=True)
        self.handles: list[Any] = []

    def after_step(self, step: int) -> None:
        if step % self.every == 0:
            self.handles.append(self.ck.save(step, self.tr.state()))
            self._count()

    def _count(self, wait: bool = False) -> None:
        keep = []
        for h in self.handles:
            if not (wait or h.done()):
                keep.append(h)
                continue
            rec = h.result()
            self.waited_s += rec.stall_s  # save() and the guard's wait for this snapshot
            if h.skipped:
                self.skips += 1
            else:
                self.saves += 1
                self.bytes_saved += rec.bytes
                self.cycles_s.append(rec.persist_s + rec.commit_s + getattr(rec, "post_commit_s", 0.0))  # 0: an older library
                self.writes_s.append(rec.persist_s)
        self.handles = keep

    def drain(self) -> None:
        self.ck.wait()
        self._count(wait=True)

    def close(self) -> None:
        self.ck.close()


class DcpSaver(Saver):
    """``dcp.async_save`` every step with one reused async ``DefaultStager``."""

    def __init__(self, tr: Trainer, root: str):
        from .methods import DCPAsync
        self.tr, self.m = tr, DCPAsync()
        self.reset()
        self.m.setup(root, tr.state())
        self.pending: Any = None
        self.started = 0.0
        self.hook = tr.opt.register_step_pre_hook(lambda *a: self._wait_staged())
        self.last = -1

    def _wait_staged(self) -> None:
        p = self.pending
        if p is not None:
            t0 = time.perf_counter()
            while not p.staged_s:  # polls staging_completion
                if p.poll():
                    break
                time.sleep(0.0005)
            self.waited_s += time.perf_counter() - t0

    def _finish(self) -> None:
        if self.pending is not None:
            t0 = time.perf_counter()
            self.pending.wait()
            t1 = time.perf_counter()
            self.waited_s += t1 - t0
            self.cycles_s.append(t1 - self.started)  # an upper bound: done at latest when waited for
            self.saves += 1
            self.bytes_saved += self.tr.nbytes
            self.m.cleanup(self.last - 2)  # keep the newest two, as the Checkpointer does
            self.pending = None

    def after_step(self, step: int) -> None:
        self._finish()  # DCP: the previous async_save must finish before the next starts
        self.started = time.perf_counter()
        self.pending, self.last = self.m.start(step, self.tr.state()), step

    def drain(self) -> None:
        self._finish()

    def close(self) -> None:
        self.hook.remove()
        self.m.close()


def run_mode(tr: Trainer, saver: Saver, seconds: float, warmup_steps: int = 3) -> dict[str, Any]:
    """The training loop with ``saver`` for ``seconds`` after ``warmup_steps``: steps/s, the
    process CPU per step, what was saved (the drain after the window is not timed)."""
    step = 0
    for _ in range(warmup_steps):
        tr.forward()
        tr.opt.step()
        saver.after_step(step)
        step += 1
    saver.drain()
    saver.reset()
    first = step
    c0, t0 = process_cpu_s(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tr.forward()
        tr.opt.step()
        saver.after_step(step)
        step += 1
    wall, cpu = time.perf_counter() - t0, process_cpu_s() - c0
    saver.drain()
    n = step - first
    med = (lambda xs: statistics.median(xs) if xs else None)
    return {"steps": n, "wall_s": wall, "steps_per_s": n / wall, "cpu_s_per_step": cpu / max(n, 1),
            "saves": saver.saves, "skips": saver.skips, "bytes_saved": saver.bytes_saved,
            "interval_steps": n / saver.saves if saver.saves else None,
            "waited_s_per_step": saver.waited_s / max(n, 1), "save_cycle_s": med(saver.cycles_s),
            "write_s": med(saver.writes_s)}


def run_every_step(size_gib: float, seconds: float, every: int, repeat: int, workdir: str | None,
                   modes: tuple[str, ...] = MODES, n_tensors: int = 64, matmuls: int = 5, dim: int = 1024,
                   cpu_saves: int = 20, console: Any = None, spare_core_only: bool = False) -> dict[str, Any]:
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="zerostall-bench-everystep-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    say = console.print if console is not None else (lambda *a: None)
    threads0 = torch.get_num_threads()
    cores = os.cpu_count() or 1
    doc: dict[str, Any] = {"scenario": "every-step", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "cores": cores, "seconds": seconds, "every": every, "repeat": repeat,
                           "load_avg_start": list(os.getloadavg()), "runs": {}}
    try:
        tr = Trainer(int(size_gib * (1 << 30)), n_tensors, matmuls, dim)
        doc.update(state_bytes=tr.nbytes, tensors=len(tr.params) * 2, matmuls=matmuls)
        n = 0

        def make(mode: str) -> Saver:
            nonlocal n
            n += 1
            root = os.path.join(workdir, f"{mode}-{n}")
            if mode == "none":
                return Saver()
            if mode == "dcp-async":
                return DcpSaver(tr, root)
            if mode == "zs-every-K":
                return ZsSaver(tr, root, every=every)
            return ZsSaver(tr, root, backpressure="skip" if mode == "zs-skip" else "block",
                           slots=2 if mode == "zs-block-2slots" else 1)

        counts = {max(1, cores - 1)} if spare_core_only else {cores, max(1, cores - 1)}
        for threads in sorted(counts, reverse=True):
            torch.set_num_threads(threads)
            rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for r in range(repeat):
                for mode in (modes if r % 2 == 0 else tuple(reversed(modes))):  # alternate the order
                    saver = make(mode)
                    try:
                        rows[mode].append(run_mode(tr, saver, seconds))
                    finally:
                        saver.close()
                        shutil.rmtree(os.path.join(workdir, f"{mode}-{n}"), ignore_errors=True)
                    last = rows[mode][-1]
                    say(f"threads={threads} {mode}: {last['steps_per_s']:.2f} steps/s, interval "
                        f"{last['interval_steps']}, waited {last['waited_s_per_step'] * 1e3:.1f} ms/step, save "
                        f"cycle {_ms(last['save_cycle_s'])} ms")
            doc["runs"][str(threads)] = _summarise(rows)
        torch.set_num_threads(1)
        tensors = [p.detach() for p in tr.params] + [tr.opt.state[p]["momentum_buffer"] for p in tr.params]
        doc["one_pass"] = one_pass_limit(tensors)
        doc["cpu"] = {}
        for m in ("zs-block", "dcp-async"):
            if m in modes:
                doc["cpu"][m] = cpu_per_gib(tr, lambda m=m: make(m), cpu_saves, tensors)
                shutil.rmtree(os.path.join(workdir, f"{m}-{n}"), ignore_errors=True)
    finally:
        torch.set_num_threads(threads0)
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    doc["load_avg_end"] = list(os.getloadavg())
    return doc


def _summarise(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Median steps/s per mode and the throughput loss against ``none``."""
    out: dict[str, Any] = {}
    for mode, rs in rows.items():
        if not rs:
            continue
        med = statistics.median(r["steps_per_s"] for r in rs)
        ivals = [r["interval_steps"] for r in rs if r["interval_steps"]]
        cyc = [r["save_cycle_s"] for r in rs if r["save_cycle_s"] is not None]
        wr = [r["write_s"] for r in rs if r["write_s"] is not None]
        out[mode] = {"steps_per_s": med, "cpu_s_per_step": statistics.median(r["cpu_s_per_step"] for r in rs),
                     "interval_steps": statistics.median(ivals) if ivals else None,
                     "step_s": 1 / med if med else None,
                     "waited_s_per_step": statistics.median(r["waited_s_per_step"] for r in rs),
                     "save_cycle_s": statistics.median(cyc) if cyc else None,
                     "write_s": statistics.median(wr) if wr else None,
                     "saves": sum(r["saves"] for r in rs), "skips": sum(r["skips"] for r in rs), "runs": rs}
    base = out.get("none", {}).get("steps_per_s")
    for mode, v in out.items():
        v["loss"] = 1 - v["steps_per_s"] / base if base else None
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def main(a: Any) -> int:
    """``zerostall bench --scenario every-step``."""
    import warnings

    from rich.console import Console
    from rich.table import Table
    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    console = Console(width=150)
    size = a.size_gib if a.size_gib != 2.0 else 0.25  # the scenario's default: 256 MiB
    modes = tuple(m for m in a.methods.split(",")) if a.methods else MODES
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad:
        console.print(f"unknown every-step modes {bad}: choose from {', '.join(MODES + EXTRA_MODES)}")
        return 2
    doc = run_every_step(size, a.seconds, a.every, a.repeat, a.dir, modes, console=console,
                         matmuls=getattr(a, "matmuls", 5), dim=getattr(a, "dim", 1024),
                         cpu_saves=getattr(a, "cpu_saves", 20), spare_core_only=getattr(a, "spare_core_only", False))
    for threads, run in doc["runs"].items():
        t = Table(title=f"every-step, {doc['state_bytes'] / 2**20:.0f} MiB in {doc['tensors']} tensors, "
                        f"trainer on {threads} of {doc['cores']} cores, {doc['date']}")
        for c in ("mode", "steps/s", "loss vs none", "step ms", "waited ms/step", "save cycle ms", "write ms",
                  "interval (steps)", "saves", "skips", "CPU s/step"):
            t.add_column(c, justify="left" if c == "mode" else "right")
        for mode, v in run.items():
            t.add_row(mode, f"{v['steps_per_s']:.2f}", "-" if v["loss"] is None else f"{v['loss'] * 100:.1f}%",
                      _ms(v["step_s"]), f"{v['waited_s_per_step'] * 1e3:.1f}", _ms(v["save_cycle_s"]),
                      _ms(v["write_s"]), "-" if v["interval_steps"] is None else f"{v['interval_steps']:.2f}",
                      str(v["saves"]), str(v["skips"]), f"{v['cpu_s_per_step']:.3f}")
        console.print(t)
    console.print("waited: the trainer's time in save() and the optimizer guard (DCP: its staging and previous-save "
                  "waits) per step; save cycle: the persist thread's time per save (DCP: start to done)")
    op = doc["one_pass"]
    console.print(f"one-pass limit: {op['limit_s_per_gib']:.3f} CPU s/GiB (copy {op['copy_s_per_gib']:.3f} + "
                  f"crc32c {op['crc_s_per_gib']:.3f})")
    for m, v in doc["cpu"].items():
        console.print(f"{m}: {v['cpu_s_per_gib']:.3f} CPU s/GiB saved, {v['x_one_pass']:.2f}x the one-pass limit of "
                      f"its rounds ({v['limit_s_per_gib']:.3f}), {v['cpu_s_per_save'] * 1e3:.1f} ms per save")
    write_doc(doc, a.json)
    return 0
