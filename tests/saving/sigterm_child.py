"""SIGTERM at random instants of a saving loop (run by test_lifecycle.py and bench/scripts/sigterm_soak.py).

As a script: a training-like loop that calls ``save()`` back to back (200 small tensors, so
most of its time is inside ``save()``) with ``on_preemption()`` in its SIGTERM handler. The
handler answers each signal on stdout; on the last one it ends the process: ``close`` mode
calls ``close(timeout=...)`` in the handler, ``exit`` mode leaves the drain to the ``atexit``
hook. Either way ``sys.exit`` raises ``SystemExit`` inside whatever the signal interrupted.

:func:`drive` is the parent side: it sends one signal at a time, at a random delay after the
previous one was answered, and reports a hang when an answer (or the exit) does not come in
time.
"""

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

HANDLER_TIMEOUT_S = 120.0  # a hang detector, not a speed bound: a loaded host's fsync can take 20 s


def child(ckdir: str, out: str, nsig: int, mode: str) -> None:
    import torch

    import zerostall

    torch.manual_seed(0)
    state = {f"t{i}": torch.randn(64) for i in range(200)}
    ck = zerostall.Checkpointer(ckdir, keep_last=2)
    stats = {"signals": 0, "in_save": 0, "ok": 0, "max_handler_s": 0.0, "step": 0}

    def handler(signum, frame):
        f, inside = frame, False
        while f is not None:
            if f.f_code.co_name in ("save", "_save", "_hand_over", "_skip") and f.f_code.co_filename.endswith(
                    "checkpointer.py"):
                inside = True
                break
            f = f.f_back
        stats["signals"] += 1
        stats["in_save"] += inside
        last = stats["signals"] >= nsig
        t0 = time.monotonic()
        if last and mode == "close":
            ok = ck.close(timeout=HANDLER_TIMEOUT_S)
        else:
            ok = ck.on_preemption(timeout=HANDLER_TIMEOUT_S)
        stats["max_handler_s"] = max(stats["max_handler_s"], time.monotonic() - t0)
        stats["ok"] += bool(ok)
        if last:
            with open(out, "w") as fh:
                json.dump(stats, fh)
        os.write(1, f"handled {stats['signals']}\n".encode())
        if last:
            sys.exit(0)  # SystemExit inside the interrupted frame; exit mode: atexit drains

    signal.signal(signal.SIGTERM, handler)
    os.write(1, b"ready\n")
    step = 0
    while True:
        step += 1
        stats["step"] = step
        h = ck.save(step, state)
        if step % 4 == 0:
            h.wait_staged()
        if step % 16 == 0:
            ck.wait()


def drive(ckdir: str, out: str, nsig: int, mode: str, seed: int, *, answer_timeout_s: float = 180.0,
          max_gap_s: float = 0.05) -> dict:
    """Run one child; returns ``{"rc", "hung", "answered", "stats", "stderr"}``."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), ckdir, out, str(nsig), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    lines: "queue.Queue[str]" = queue.Queue()
    errs: list[bytes] = []
    threading.Thread(target=lambda: [lines.put(ln.decode().strip()) for ln in p.stdout], daemon=True).start()
    threading.Thread(target=lambda: errs.append(p.stderr.read()), daemon=True).start()
    rng = random.Random(seed)
    res = {"hung": None, "answered": 0}
    try:
        if lines.get(timeout=answer_timeout_s * 2) != "ready":
            res["hung"] = "no ready line"
        for i in range(1, nsig + 1):
            if res["hung"]:
                break
            time.sleep(rng.uniform(0.0, max_gap_s))
            p.send_signal(signal.SIGTERM)
            try:
                got = lines.get(timeout=answer_timeout_s)
            except queue.Empty:
                res["hung"] = f"signal {i} not answered within {answer_timeout_s:g} s"
                break
            if got != f"handled {i}":
                res["hung"] = f"unexpected line {got!r}"
                break
            res["answered"] = i
        try:
            p.wait(timeout=answer_timeout_s)
        except subprocess.TimeoutExpired:
            res["hung"] = res["hung"] or f"no exit within {answer_timeout_s:g} s of the last signal"
    except queue.Empty:
        res["hung"] = "no ready line"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    time.sleep(0.05)
    res["rc"] = p.returncode
    res["stderr"] = (errs[0] if errs else b"").decode(errors="replace")[-3000:]
    res["stats"] = json.load(open(out)) if os.path.exists(out) else None
    return res


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
