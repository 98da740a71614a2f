"""A peer restore that fails on one rank is heard by every rank, and all fall back together
(issue 32, items 5, 6 and 15): 2 simulated nodes x 1 rank (real processes, gloo on 127.0.0.1),
node-local roots, ``replicas=2``, the c10d store hosted by this test (as torchrun's agent).

The save job runs with the peer secret given by the launcher (``ZEROSTALL_PEER_SECRET``):
while it runs, every key of the store is listed and read, and none holds the secret -- every
value, tried as a secret, is refused by both nodes' peer servers.

Then n0 is wiped and the job restarts. n1, n0's one live holder, stops (SIGSTOP) as it starts
serving n0's step 4, and is continued only once n0's fetch timed out on it; it serves a
flipped byte in its copy of n0's step 3; n1's own step 2 is damaged. No rank may raise alone
while the other waits out its timeout: step 4 fails on n0 (the stopped holder), step 3 fails on
n0 (the flipped byte), every rank hears each and drops it; step 2 is fetched by n0 but fails
on n1 (its crc), every rank drops it; step 1 -- which n0 must still offer from its holder,
though it fetched step 2 meanwhile -- loads bit-exact on both."""

import json
import os
import signal
import subprocess
import time
import sys
from datetime import timedelta

from tests.helpers import flip_byte, free_port
from zerostall.format.layout import HEADER_BYTES
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.wire import Endpoint
from zerostall.peers.wire import PeerError

HERE = os.path.dirname(__file__)
NODES = ["n0", "n1"]
SECRET = "correct-horse-battery-staple-0123456789"


def _spawn(scenario, base, tmp_path, port, env_extra):
    """One process per node; each one's stderr goes to ``<its result file>.err``."""
    procs = []
    for r, node in enumerate(NODES):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", ZEROSTALL_NODE=node, TORCHELASTIC_USE_AGENT_STORE="True",
                   ZEROSTALL_BUDGET_BYTES=str(64 << 20),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE,
                                               os.environ.get("PYTHONPATH", "")]), **env_extra)
        out = str(tmp_path / f"{scenario}-r{r}.json")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "fallback_worker.py"), scenario, base, out],
                                       env=env, stderr=open(out + ".err", "w")), out))
    return procs


def _finish(procs, timeout=240):
    docs = []
    try:
        for p, out in procs:
            p.wait(timeout=timeout)
            assert p.returncode == 0 and os.path.exists(out), open(out + ".err").read()[-4000:]
            docs.append(json.load(open(out)))
    finally:
        _kill(procs)
    return docs


def _kill(procs):
    for p, _ in procs:  # by pid: the processes this test started
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def _wait(paths, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), \
            [open(out + ".err").read()[-3000:] for p, out in procs if p.poll() is not None]
        time.sleep(0.05)


def _store_values(master):
    out = {}
    master.set_timeout(timedelta(seconds=2))  # a key deleted since the listing: get() would wait for it
    for k in master.list_keys():
        try:
            out[k] = master.get(k)
        except Exception:  # noqa: BLE001 - deleted meanwhile
            pass
    return out


def _as_secrets(v):
    """A store value as an attacker would try it: raw, and hex-decoded when it is hex."""
    out = [v]
    try:
        out.append(bytes.fromhex(v.decode()))
    except ValueError:
        pass
    return out


def _authenticates(secret, ep):
    t = TcpTransport(secret, "n0", set(NODES), timeout_s=5, pacer=Pacer(None))
    try:
        t.list_held(ep)
        return True
    except PeerError:
        return False
    finally:
        t.close()


def test_a_failed_peer_restore_falls_back_together_and_the_secret_stays_out_of_the_store(tmp_path, monkeypatch):
    from torch.distributed import TCPStore
    base = str(tmp_path / "job")
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    go = str(tmp_path / "go")
    procs = _spawn("save", base, tmp_path, port, {"ZS_STEPS": "1,2,3,4", "ZS_GO": go, "ZS_PT": "15",
                                                   "ZEROSTALL_PEER_SECRET": SECRET})
    try:
        _wait([out + ".ready" for _, out in procs], procs)
        ready = [json.load(open(out + ".ready")) for _, out in procs]
        eps = [Endpoint(d["node"], d["endpoint"].rsplit(":", 1)[0], int(d["endpoint"].rsplit(":", 1)[1]))
               for d in ready]
        assert all(d["protected"] == {"1": True, "2": True, "3": True, "4": True} for d in ready), ready  # the secret works
        # an attacker who reaches MASTER_PORT: every key, every value, each tried as the secret
        values = _store_values(master)
        assert values and not any(SECRET.encode() in v for v in values.values()), sorted(values)
        got_in = [k for k, v in values.items() if any(_authenticates(t, ep) for t in _as_secrets(v) for ep in eps)]
        assert got_in == [], got_in  # nothing read there gets in
    finally:
        open(go, "w").close()
    _finish(procs)
    # n0 lost; its one live holder serves a flipped byte of n0's step 3; n1's own step 2 rots
    import shutil
    shutil.rmtree(os.path.join(base, "n0"))
    flip_byte(os.path.join(base, "n1", "peers", "n0", "step-3", "rank-00000.shard"), HEADER_BYTES + 8)
    flip_byte(os.path.join(base, "n1", "step-2", "rank-00001.shard"), HEADER_BYTES + 8)
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    procs = _spawn("load", base, tmp_path, port, {"ZEROSTALL_PEER_SECRET": SECRET, "ZS_PT": "2",
                                                  "ZS_STOP_SERVE": "n1"})
    try:
        (p1, out1), (_, out0) = procs[1], procs[0]
        _wait([out1 + ".stopped"], procs[:1])
        while _proc_state(p1.pid) not in ("T", "t"):
            time.sleep(0.02)
        # n0's fetch of step 4 times out on the stopped holder; n0 posts the failure and waits for n1
        deadline = time.monotonic() + 120
        while "fetching rank-00000.shard from node n1 failed" not in open(out0 + ".err").read():
            assert time.monotonic() < deadline and procs[0][0].poll() is None, open(out0 + ".err").read()[-3000:]
            time.sleep(0.05)
        assert _proc_state(p1.pid) in ("T", "t")
        os.kill(p1.pid, signal.SIGCONT)
        loaded = _finish(procs)
    finally:
        _kill(procs)
    for d in loaded:
        assert d.get("error") is None, d
        assert d["step"] == 1 and d["equal"] is True, d
        for part in ("step 4 failed on rank 0", "step 3 failed on rank 0", "step 2 failed on rank 1"):
            assert part in d["why"], (part, d["why"])
    assert [d["source"] for d in loaded] == ["peers", "local"]
    del master


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
