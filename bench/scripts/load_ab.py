"""Two revisions' ``zerostall.load`` in one run: the pool-less one-shot restore in a process that
holds a Checkpointer (the restore bench's ``zerostall.load-uring in place`` row), and the first
``zerostall.load`` of a fresh process with its imports timed apart from the load.

    python bench/scripts/load_ab.py OLD_REV [--rounds 3] [--size-gib 0.5] [--json OUT]

OLD_REV is checked out into a temporary git worktree (removed after); "new" is this tree. Each
round runs, per revision (order alternating between rounds), one process of the in-process
sequence (Checkpointer save, staging pool faulted, then per repeat ``ck.load`` in place, a new
dict, and the timed ``zerostall.load`` in place) and ``--fresh`` fresh processes (import
``zerostall`` and bind ``zerostall.load``: timed; drop the page cache; one load: timed). Every
load is checked bit for bit. Wall seconds are noisy on a shared host; process CPU seconds and
bytes read say whether the work itself changed. Prints a table of medians and new/old; about
3 minutes at 0.5 GiB, 3 rounds, on a quiet host (8 at load 15-20: --rounds 2 there). Data under --dir (default /tmp), deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _flat(s):
    import torch
    if isinstance(s, torch.Tensor):
        return [s]
    if isinstance(s, dict):
        return [t for v in s.values() for t in _flat(v)]
    return []


def _same(a, b) -> bool:
    import torch
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(fa, fb))


def _drop(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _state(size_gib: float):
    import torch
    from zerostall_bench.model import gpt_state_for_size, settle_gc
    state = gpt_state_for_size(int(size_gib * (1 << 30)))
    target = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items()}
    settle_gc()
    return state, target


def _bytes_read() -> int | None:
    from zerostall.restore import step
    return step.last_stats.bytes_read if step.last_stats else None


def child_inproc(a: argparse.Namespace) -> dict:
    """The restore bench's sequence, its pool-less ``zerostall.load`` timed (wall and process CPU)."""
    state, target = _state(a.size_gib)
    import zerostall
    from zerostall import Checkpointer
    from zerostall.config import IOConfig
    try:
        from zerostall.saving import pool
    except ImportError:  # a tree from before the package moves
        from zerostall.staging import pool
    out: dict = {"load_s": [], "load_cpu_s": [], "ck_load_s": [], "bytes_read": [], "verified": True}
    io = IOConfig(engine=a.engine)
    with Checkpointer(a.path, io=io, keep_last=1) as ck:
        ck.save(1, state).result()
        p = pool.current()
        if p is not None:
            p.arena.wait_ready(min(p.arena.target, p.arena.nbytes))
        for _ in range(a.repeat):
            for t in _flat(target):
                t.zero_()
            _drop(a.path)
            t0 = time.perf_counter()
            ck.load(target, step=1)
            out["ck_load_s"].append(time.perf_counter() - t0)
            _drop(a.path)
            ck.load(step=1)
            for t in _flat(target):
                t.zero_()
            _drop(a.path)
            c0, t0 = time.process_time(), time.perf_counter()
            zerostall.load(a.path, target, step=1, io=io)
            out["load_s"].append(time.perf_counter() - t0)
            out["load_cpu_s"].append(time.process_time() - c0)
            out["bytes_read"].append(_bytes_read())
            out["verified"] = out["verified"] and _same(state, target)
    return out


def child_fresh(a: argparse.Namespace) -> dict:
    """A fresh process: the state built first, then the imports a first ``zerostall.load`` needs
    (timed), then the load alone (timed)."""
    state, target = _state(a.size_gib)
    c0, t0 = time.process_time(), time.perf_counter()
    import zerostall
    load = zerostall.load  # binds the lazily imported name where the package has one
    import_s, import_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    _drop(a.path)
    c0, t0 = time.process_time(), time.perf_counter()
    load(a.path, target, step=1)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"import_s": import_s, "import_cpu_s": import_cpu_s, "load_s": [dt], "load_cpu_s": [cpu],
            "bytes_read": [_bytes_read()], "verified": _same(state, target)}


def child_save(a: argparse.Namespace) -> dict:
    import zerostall
    state, _ = _state(a.size_gib)
    zerostall.save(a.path, state, step=1)
    return {}


def _run(tree: str, mode: str, path: str, a: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree}/src:{REPO}/bench"}
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--path", path, "--out", out,
                        "--size-gib", str(a.size_gib), "--repeat", str(a.repeat), "--engine", a.engine],
                       check=True, env=env, cwd="/tmp")
        with open(out) as fh:
            return json.load(fh)
    finally:
        os.unlink(out)


def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3, help="timed loads per in-process run")
    p.add_argument("--fresh", type=int, default=2, help="fresh processes per revision and round")
    p.add_argument("--size-gib", type=float, default=0.5)
    p.add_argument("--engine", default="uring")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--json")
    p.add_argument("--child", choices=("inproc", "fresh", "save"))
    p.add_argument("--path")
    p.add_argument("--out")
    a = p.parse_args()
    if a.child:
        import warnings
        warnings.filterwarnings("ignore")
        doc = {"inproc": child_inproc, "fresh": child_fresh, "save": child_save}[a.child](a)
        with open(a.out, "w") as f:
            json.dump(doc, f)
        return 0
    if not a.old:
        p.error("OLD_REV is required")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still removes the worktree
    work = tempfile.mkdtemp(prefix="zerostall-load-ab-", dir=a.dir)
    old_tree = os.path.join(work, "old")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "-q", "--detach", old_tree, a.old], check=True)
    trees = {"old": old_tree, "new": REPO}
    res: dict = {v: {"inproc": [], "fresh": []} for v in trees}
    try:
        cold = {v: os.path.join(work, f"cold-{v}") for v in trees}
        for v, tree in trees.items():  # each revision reads a checkpoint it wrote
            _run(tree, "save", cold[v], a)
        for r in range(a.rounds):
            for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
                print(f"round {r + 1}: {v} (load {os.getloadavg()[0]:.1f})", flush=True)
                res[v]["inproc"].append(_run(trees[v], "inproc", os.path.join(work, f"zs-{v}"), a))
                shutil.rmtree(os.path.join(work, f"zs-{v}"), ignore_errors=True)
                for _ in range(a.fresh):
                    res[v]["fresh"].append(_run(trees[v], "fresh", cold[v], a))
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], check=False)
        shutil.rmtree(work, ignore_errors=True)
    rows = {}
    for v in trees:
        ip, fr = res[v]["inproc"], res[v]["fresh"]
        rows[v] = {
            "in process: zerostall.load in place, s": _med([x for d in ip for x in d["load_s"]]),
            "in process: its process CPU s": _med([x for d in ip for x in d["load_cpu_s"]]),
            "in process: its bytes read, GiB": _med([x / 2**30 for d in ip for x in d["bytes_read"] if x is not None]),
            "in process: Checkpointer.load in place (control), s": _med([x for d in ip for x in d["ck_load_s"]]),
            "fresh process: import + bind zerostall.load, s": _med([d["import_s"] for d in fr]),
            "fresh process: the import's process CPU s": _med([d["import_cpu_s"] for d in fr]),
            "fresh process: first zerostall.load, s": _med([x for d in fr for x in d["load_s"]]),
            "fresh process: the load's process CPU s": _med([x for d in fr for x in d["load_cpu_s"]]),
            "fresh process: import + load, s": _med([d["import_s"] + d["load_s"][0] for d in fr]),
        }
    ok = all(d["verified"] for v in trees for kind in ("inproc", "fresh") for d in res[v][kind])
    print(f"\n{a.size_gib} GiB, {a.rounds} rounds, engine {a.engine}; old {a.old}, new this tree; "
          f"load {os.getloadavg()[0]:.1f}; bit-exact: {ok}")
    print(f"| figure | old | new | new / old |\n|---|---:|---:|---:|")
    for k in rows["old"]:
        o, n = rows["old"][k], rows["new"][k]
        ratio = f"{n / o:.2f}" if o and n else "-"
        print(f"| {k} | {'-' if o is None else f'{o:.3f}'} | {'-' if n is None else f'{n:.3f}'} | {ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"old": a.old, "size_gib": a.size_gib, "rounds": a.rounds, "medians": rows, "runs": res,
                       "load_avg": os.getloadavg(), "verified": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
