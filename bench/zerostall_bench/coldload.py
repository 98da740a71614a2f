"""A restore in a fresh process: what a job pays after a restart (no faulted staging pool).

Run by :func:`run_cold_loads` (``zerostall bench --scenario restore``, and the ``cold-load``
rows) as ``python -m zerostall_bench.coldload --method M --path P --size-gib S --out F``:
builds the bench model's state (the checkpoint's bytes, to compare) and a zeroed target of
the same shapes, times the imports method ``M`` needs beyond torch (``import_s``: the package
and, for zerostall, the modules ``zerostall.load`` binds on first use), drops the page cache of
``P``, then times one load of ``P`` (``s``; ``zerostall``: ``zerostall.load(P, target)`` in
place; ``dcp``: ``dcp.load`` in place; ``torch``: ``torch.load``) and checks it bit for bit.
Writes one JSON object to ``--out``.
The parent alternates the methods, one fresh process per run, on the caller's thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

METHODS = ("zerostall", "dcp", "torch")


def _child(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from .model import gpt_state_for_size
    from .restore import _drop, _equal
    torch.set_num_threads(1)
    state = gpt_state_for_size(int(a.size_gib * (1 << 30)))
    target = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items()}
    t0 = time.perf_counter()
    if a.method == "zerostall":
        import zerostall
        zs_load = zerostall.load  # bound on first use: its modules import here, not in the timed load
        load = lambda: zs_load(a.path, target, step=1)  # noqa: E731
    elif a.method == "dcp":
        import torch.distributed.checkpoint as dcp
        load = lambda: (dcp.load(target, storage_reader=dcp.FileSystemReader(a.path), no_dist=True), target)[1]  # noqa: E731
    else:
        load = lambda: torch.load(os.path.join(a.path, "state.pt"), weights_only=True)  # noqa: E731
    import_s = time.perf_counter() - t0
    _drop(a.path)
    load_avg = os.getloadavg()[0]
    t0 = time.perf_counter()
    out = load()
    dt = time.perf_counter() - t0
    doc: dict[str, Any] = {"method": a.method, "s": dt, "import_s": import_s, "load_avg": load_avg,
                           "verified": _equal(state, out)}
    if a.method == "zerostall":
        from zerostall.restore import step
        s = step.last_stats
        doc.update(bytes_read=s.bytes_read if s else None, rollback_bytes=s.rollback_bytes if s else None)
    return doc


def save_all(size_gib: float, workdir: str) -> dict[str, str]:
    """The bench model's state saved by each method under ``workdir``: {method: path}."""
    import torch
    import torch.distributed.checkpoint as dcp

    import zerostall

    from .model import gpt_state_for_size
    state = gpt_state_for_size(int(size_gib * (1 << 30)))
    paths = {m: os.path.join(workdir, f"cold-{m}") for m in METHODS}
    zerostall.save(paths["zerostall"], state, step=1)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"]), no_dist=True)
    os.makedirs(paths["torch"], exist_ok=True)
    torch.save(state, os.path.join(paths["torch"], "state.pt"))
    return paths


def run_cold_loads(size_gib: float, repeat: int, paths: dict[str, str], methods: tuple[str, ...] = METHODS,
                   env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``repeat`` rounds, each a fresh process per method in turn (alternating: the machine's
    load hits them alike). Returns every run's JSON."""
    out = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(repeat):
            for m in methods:
                f = os.path.join(d, f"{m}-{r}.json")
                subprocess.run([sys.executable, "-m", "zerostall_bench.coldload", "--method", m, "--path", paths[m],
                                "--size-gib", str(size_gib), "--out", f], check=True,
                               env={**os.environ, **(env or {})})
                with open(f) as fh:
                    out.append(json.load(fh))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True, choices=METHODS)
    p.add_argument("--path", required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    doc = _child(a)
    with open(a.out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
