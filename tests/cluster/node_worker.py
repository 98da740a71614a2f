"""One rank of a job on the namespace cluster (run by tests/cluster/ through :mod:`.job`), on
its node's own network: the c10d store, gloo and the peer tier go over the bridge.

argv: ``scenario ctl``. ``ctl`` is a directory the test and every rank share: the events log
``events.jsonl`` (one JSON line per event, appended; its order is the order of events) and
gate files (``gate-<name>``) the test creates to let a rank go on.

Env: ``ZS_ROOT`` (this node's root), ``ZS_ADDR`` (its address), ``ZS_REPLICAS``,
``ZS_STEPS`` (``1,2,3``), ``ZS_MIB`` (MiB of state per rank), ``ZS_PT`` / ``ZS_RT``
(``peers.timeout_s`` / ``replica_timeout_s``), ``ZS_CT`` (``commit_timeout_s``),
``ZS_GATE_BEFORE`` (steps before whose save every rank says ``ready`` and waits for the gate
``step-<s>``), ``ZS_FAULT`` (``where:node:step``, see :func:`arm`), ``ZS_LOAD_STEP`` (load:
that step, not the newest), ``ZS_REPAIR_BARRIER`` (load: wait for this node's repair pass,
then a barrier, so no holder leaves before the others' repairs are over).

Scenarios: ``save`` (each step saved, "training" while it commits and replicates; every
handle's outcome an event) and ``load`` (the collective load; the restored state compared with
what was saved).
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from zerostall import PeersConfig

CTL = ""
NODE = os.environ.get("ZEROSTALL_NODE", "?")
RANK = -1


def ev(name, **kw):
    line = json.dumps({"ev": name, "node": NODE, "rank": RANK, "t": time.monotonic(), **kw}) + "\n"
    fd = os.open(os.path.join(CTL, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one O_APPEND write: lines of concurrent writers never interleave
    finally:
        os.close(fd)


def gate(name, timeout=120.0):
    path = os.path.join(CTL, f"gate-{name}")
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"gate {name} never opened")
        time.sleep(0.02)


def state_for(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    n = int(float(os.environ.get("ZS_MIB", "2")) * (1 << 20)) // 4
    return {"w": torch.randn(n, generator=g), "b": torch.randn(257, generator=g).to(torch.bfloat16),
            "meta": {"rank": rank, "step": step}}


def equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a == b


def checkpointer():
    # "normal": the copies are the thing under test, not their cost to the training; at "idle" a
    # loaded machine starves them past replica_timeout_s
    peers = PeersConfig(timeout_s=float(os.environ.get("ZS_PT", 2)), replica_timeout_s=float(os.environ.get("ZS_RT", 8)),
                        cpu_priority=os.environ.get("ZS_CPU", "normal"),
                        listen_port=int(os.environ.get("ZEROSTALL_PEER_PORT", 0)))  # the env twin, kept
    return zerostall.Checkpointer(os.environ["ZS_ROOT"], dist_name="cluster-test",
                                  replicas=int(os.environ.get("ZS_REPLICAS", 2)), peers=peers,
                                  commit_timeout_s=float(os.environ.get("ZS_CT", 8)), close_timeout_s=4,
                                  raise_on_background_error=False,  # a failed step is an outcome here
                                  join_timeout_s=float(os.environ.get("ZS_JT", 30)))


def arm(fault):
    """``ZS_FAULT`` = ``where:node:step``: on that node, at that step, say ``at-<where>`` and
    wait for the gate ``<where>`` (the test cuts the network meanwhile). ``where``: ``send``
    (the node's copy to a holder, half sent), ``reported``/``entered``/... (a commit round
    point, :data:`zerostall.distributed.commit.fault_hook`), ``fetch`` (a restore fetch from
    a holder other than the store's host, the first chunk in)."""
    if not fault:
        return
    where, node, step = fault.split(":")
    if node != NODE:
        return
    step, fired = int(step), []

    def pause(**kw):
        if not fired:
            fired.append(1)
            ev(f"at-{where}", step=step, **kw)
            gate(where)
    if where == "send":
        from zerostall.peers import stream
        armed = {}
        stream.fault_hook = lambda p: pause() if p == "send:mid-stream" and armed.get("on") else None
        return armed
    if where == "fetch":
        from zerostall.peers import stream, tcp
        orig = tcp.fill_from

        class Pausing:
            """The socket as fill_from's receiving thread sees it: pauses that thread once the
            first buffer's bytes are in, so nothing more is taken off the link until the gate."""

            def __init__(self, sock, size):
                self.sock, self.size, self.got = sock, size, 0

            def recv_into(self, mv):
                k = self.sock.recv_into(mv)
                self.got += k
                # never the store's host: cutting it off would cut off the whole job; and a
                # transfer with bytes still to come (not a range done in one buffer)
                if self.got >= min(stream.FETCH_BUF_BYTES, self.size) and self.size > self.got and \
                        self.sock.getpeername()[0] != os.environ.get("MASTER_ADDR"):
                    pause(bytes=self.got, size=self.size, peer=self.sock.getpeername()[0])
                return k

            def __getattr__(self, name):
                return getattr(self.sock, name)

        def fill_from(sock, size, w, check, *a, **k):
            return orig(sock if k.get("point") else Pausing(sock, size), size, w, check, *a, **k)
        tcp.fill_from = fill_from
        return None
    from zerostall.distributed import commit
    commit.fault_hook = lambda p, r, s: pause() if p == where and s == step else None
    return None


def train_until(pred, budget=600.0):
    """'Training': matmuls on this rank until ``pred()``; returns the iterations run."""
    x, n, end = torch.randn(64, 64), 0, time.monotonic() + budget
    while not pred() and time.monotonic() < end:
        x = torch.tanh(x @ x)
        n += 1
        time.sleep(0.005)
    return n


def outcome(h):
    exc = h.exception(timeout=0)
    return {"durable": h.durable(), "error_type": type(exc).__name__ if exc else None,
            "error": str(exc)[:500] if exc else None}


def save(ck):
    steps = [int(s) for s in os.environ.get("ZS_STEPS", "1,2,3").split(",")]
    before = {int(s) for s in os.environ.get("ZS_GATE_BEFORE", "").split(",") if s}
    fault = os.environ.get("ZS_FAULT", "")
    armed = arm(fault)
    fault_step = int(fault.split(":")[2]) if fault else None
    v = ck._peers.view
    srv = ck._peers.transport._srv
    ev("serving", listen=list(srv.getsockname()[:2]) if srv else None,
       endpoints={n: [e.host, e.port] for n, e in v.endpoints.items()})
    for s in steps:
        if s in before:
            ev("ready", step=s)
            gate(f"step-{s}")
        if armed is not None:
            armed["on"] = s == fault_step
        ev("saving", step=s)
        h = ck.save(s, state_for(RANK, s))
        trained = train_until(lambda: h.wait(timeout=0))
        ev("done", step=s, trained=trained, **outcome(h))
        if h.durable():
            trained = train_until(lambda: h.wait(timeout=0, tier="peers"))
            ev("peers-done", step=s, trained=trained, protected=h.protected(),
               nodes=list(h.result().replica_nodes) if h.protected() else [])
    ev("finished")
    last_out()


def last_out(timeout=120.0):
    """Rank 0 hosts the c10d store (bare launch): it leaves only once every rank said
    ``finished`` (through the events file, not the store), so no rank loses the store while
    it still needs it."""
    if RANK != 0:
        return
    end, world = time.monotonic() + timeout, dist.get_world_size()
    while time.monotonic() < end:
        with open(os.path.join(CTL, "events.jsonl")) as f:
            if sum('"ev": "finished"' in ln for ln in f) >= world:
                return
        time.sleep(0.05)


def load(ck):
    report = zerostall.LoadReport()
    state = state_for(RANK, 0)
    arm(os.environ.get("ZS_FAULT", ""))
    step = int(os.environ["ZS_LOAD_STEP"]) if os.environ.get("ZS_LOAD_STEP") else None
    try:
        ck.load(state, step=step, report=report)
        ev("loaded", step=report.step, source=report.source, equal=equal(state, state_for(RANK, report.step)))
    except zerostall.errors.ZerostallError as exc:
        ev("load-failed", error_type=type(exc).__name__, error=str(exc)[:800])
    ev("finished")
    last_out()
    if os.environ.get("ZS_REPAIR_BARRIER"):  # holders stay up until every node's repair pass is over
        ev("repaired", ok=ck._peers.replicator.repaired.wait(300))
        dist.barrier()


def main():
    global CTL, RANK
    scenario, CTL = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
    ev("started", host=socket.gethostname(), master=os.environ.get("MASTER_ADDR"))
    ck = checkpointer()
    try:
        {"save": save, "load": load}[scenario](ck)
    finally:
        t0 = time.monotonic()
        ck.close()
        ev("closed", close_s=time.monotonic() - t0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: a peer that was cut off may never answer it


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{NODE}] %(message)s")
    main()
