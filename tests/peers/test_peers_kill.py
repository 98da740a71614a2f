"""The peer-transfer kill sweep: 4 simulated nodes x 1 rank (real processes, gloo), step 1
protected, then one node SIGKILLs itself (the ``peers.stream.fault_hook`` seam, by its own pid)
at each state of a copy of step 2 -- as the sender of its files, or as a holder receiving
another node's. After each: the previous protected step is intact on every holder, every file
a holder keeps under its final name verifies byte for byte, and no step is presented as
protected unless the nodes it names hold verified copies (never the killed node's unacknowledged
one). Placement with 4 nodes and replicas=2: n1's files go to n3, n0's to n2 (rank 0 hosts the
store, so it is never the one killed)."""

import os
import signal
import time

import pytest

from zerostall.format.manifest import Manifest
from zerostall.peers.verify import StreamCheck

from .test_peers import NODES, _collect, _holder_of, _kill_all, _launch, _spawn

SEND = ["send:connect", "send:handshake", "send:mid-stream", "send:sent"]
RECV = ["recv:handshake", "recv:mid-stream", "recv:before-fsync", "recv:before-rename", "recv:before-ack"]


def _verified_copies(base):
    """{(src, step): {holder, ...}} for every complete file a holder keeps; every such file
    verifies against its step's manifest (a torn or unverified final file fails here)."""
    out = {}
    for holder in NODES:
        area = os.path.join(base, holder, "peers")
        for src in os.listdir(area) if os.path.isdir(area) else []:
            if src.startswith(".") or not os.path.isdir(os.path.join(area, src)):
                continue  # the status hint, a directory being deleted
            for sd in os.listdir(os.path.join(area, src)):
                d = os.path.join(area, src, sd)
                if not sd.startswith("step-"):
                    continue
                man = Manifest.from_bytes(open(os.path.join(d, "manifest.json"), "rb").read())
                for name in os.listdir(d):
                    if not name.endswith(".shard"):
                        assert name == "manifest.json" or name.startswith(".incoming-"), (d, name)
                        continue
                    check = StreamCheck(man, name, os.path.join(d, name))
                    check.feed(memoryview(open(os.path.join(d, name), "rb").read()))
                    check.digest()
                    out.setdefault((src, man.step), set()).add(holder)
    return out


def sweep_victim(point):
    """The rank a sweep stops or kills at ``point``: n1 sends its files to n3; n3 receives them."""
    assert _holder_of("n1", 2) == ("n3",) and _holder_of("n0", 2) == ("n2",)
    return 1 if point.startswith("send") else 3


@pytest.mark.parametrize("point", SEND + RECV)
def test_kill_at_each_peer_transfer_state(tmp_path, point):
    base = str(tmp_path / "job")
    victim = sweep_victim(point)
    res = _launch("kill", base, tmp_path, {"ZS_REPLICAS": "2", "ZS_KILL": str(victim), "ZS_KILL_AT": point,
                                          "ZS_RT": "8", "ZS_PT": "3"}, timeout=120)
    assert res[victim][0] == -signal.SIGKILL, res[victim][2][-2000:]  # it died there, not elsewhere
    docs = {}
    for r, (rc, doc, err) in enumerate(res):
        if r != victim:
            assert rc == 0 and doc is not None, err[-3000:]
            docs[r] = doc
    copies = _verified_copies(base)
    for r, doc in docs.items():  # step 1 was protected, and still is on every holder
        assert doc["protected"]["1"] is True
        assert copies.get((f"n{r}", 1), set()) >= set(doc["replica_nodes"]["1"]) - {f"n{r}"}
    for src in NODES:
        assert len(copies.get((src, 1), ())) >= 1, f"step 1 of {src} lost its copy"
    for r, doc in docs.items():  # step 2: protected only where verified copies back it
        named = set(doc["replica_nodes"]["2"]) - {f"n{r}"}
        assert f"n{victim}" not in named  # it died before acknowledging anything of step 2
        if point.startswith("send"):  # the victim's own files never reached its holders acknowledged
            assert doc["protected"]["2"] is False, (r, doc)
        elif doc["protected"]["2"]:
            assert named and named <= copies.get((f"n{r}", 2), set()), (r, doc, copies)


def test_holders_over_quota_leave_the_step_unprotected_never_failing_the_save(tmp_path):
    """Every holder's quota (peers.quota_bytes=4096) is smaller than any file: every copy is
    refused and logged, the steps stay durable and unprotected, saving goes on."""
    base = str(tmp_path / "job")
    res = _launch("save", base, tmp_path, {"ZS_REPLICAS": "2", "ZS_QUOTA": "4096", "ZS_STEPS": "1,2"}, timeout=120)
    for rc, doc, err in res:
        assert rc == 0 and doc is not None, err[-3000:]
        assert doc["durable"] == {"1": True, "2": True}
        assert doc["protected"] == {"1": False, "2": False}
        assert "quota" in doc["unprotected_error"]
        assert "beyond its quota" in err
    from zerostall.peers.status import doctor_checks  # `zerostall doctor ROOT`: each node says it refused
    for n in NODES:  # (a node's own row is taken once every report is in: after every refusal)
        rows = {r[0]: r for r in doctor_checks(os.path.join(base, n), timeout_s=0.2)}
        assert rows[f"peer_quota {n}"][2] == "warn" and "over its quota" in rows[f"peer_quota {n}"][3], rows
        assert "copies refused" in rows[f"peer_quota {n}"][1], rows
    assert not any(os.path.exists(os.path.join(base, n, "peers", src)) and
                   any(f.endswith(".shard") for _, _, fs in os.walk(os.path.join(base, n, "peers", src)) for f in fs)
                   for n in NODES for src in NODES)


# ---- peers_stop: The peer-transfer SIGSTOP sweep: 4 simulated nodes x 1 rank (real processes, gloo), step 1
# protected, then one node SIGSTOPs itself (the ``peers.stream.fault_hook`` seam, by its own pid)
# at each state of a copy of step 2 -- as the sender of its files (n1 -> n3), or as the holder
# receiving them (n3). The stopped node stays stopped until every other node has trained, waited
# for step 2's protection and closed; then the test continues it (SIGCONT, by pid) and it runs to
# its end. After each:
#
# * no other node's training, ``save()`` or ``close()`` was held by the stopped peer (close
#   returns within its ``close_timeout_s`` budget, plus the ``peers.timeout_s`` of a transfer cut
#   at that moment: a hang would be unbounded, the bound here is loose on purpose);
# * the pairs that do not involve the stopped node go on: their copies of step 2 are held,
#   verified, and protect their steps where the placement does not name the stopped node;
# * no node -- the continued one included -- presents a step as protected unless the nodes it
#   names hold verified copies of it, and step 1 stays protected and intact on every holder.
#
# Placement with 4 nodes and replicas=2: n1's files go to n3, n0's to n2 (rank 0 hosts the c10d
# store, so it is never the one stopped).


CLOSE_TIMEOUT_S, PEER_TIMEOUT_S = 4, 3  # workers.checkpointer's close_timeout_s; ZS_PT below


def _state(pid):
    """The process's scheduler state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_stopped(p, deadline):
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return False
        if _state(p.pid) in ("T", "t"):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("point", SEND + RECV)
def test_a_peer_stopped_at_each_transfer_state(tmp_path, point):
    base = str(tmp_path / "job")
    victim = sweep_victim(point)
    procs = _spawn("stopat", base, tmp_path, {"ZS_REPLICAS": "2", "ZS_STOP_RANK": str(victim), "ZS_STOP_AT": point,
                                              "ZS_RT": "8", "ZS_PT": str(PEER_TIMEOUT_S)})
    try:
        vp = procs[victim][0]
        assert _wait_stopped(vp, time.monotonic() + 120), f"n{victim} never stopped at {point}"
        # the others finish while it is stopped (rank 0 then waits for its result: the store's host)
        for r, (p, out) in enumerate(procs):
            if r not in (0, victim):
                p.wait(timeout=120)
        deadline = time.monotonic() + 120
        while not os.path.exists(procs[0][1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(vp.pid) in ("T", "t")  # still stopped: nobody waited for it
        os.kill(vp.pid, signal.SIGCONT)  # by pid: the process this test started
        res = _collect(procs, 150)
    finally:
        _kill_all(procs)
    docs = {}
    for r, (rc, doc, err) in enumerate(res):
        assert rc == 0 and doc is not None, (r, err[-3000:])
        docs[r] = doc
    for r, doc in docs.items():
        assert doc["durable"] == {"1": True, "2": True} and doc["protected"]["1"] is True, (r, doc)
        if r != victim:
            assert doc["trained"] == 20, doc
            assert doc["close_s"] < CLOSE_TIMEOUT_S + PEER_TIMEOUT_S + 10, doc  # bounded, not a hang
    copies = _verified_copies(base)
    for src in NODES:  # step 1: held by its placement holder, verified, on every holder still
        assert _holder_of(src, 2)[0] in copies.get((src, 1), set()), (src, copies)
    for r, doc in docs.items():  # never presented as protected without verified copies behind it
        for s in ("1", "2"):
            named = set(doc["replica_nodes"][s]) - {f"n{r}"}
            if doc["protected"][s]:
                assert named and named <= copies.get((f"n{r}", int(s)), set()), (r, s, doc, copies)
    # the pairs without the stopped node went on: n0 -> n2 always; n2's and n3's files when
    # their holder is not the stopped node and they are not it
    for src in NODES:
        (holder,) = _holder_of(src, 2)
        if f"n{victim}" not in (src, holder):
            assert holder in copies.get((src, 2), set()), (src, holder, copies)
    if point.startswith("send"):  # the stopped sender's files were not held while the others judged step 2
        for r, doc in docs.items():
            if r != victim:
                assert doc["protected"]["2"] is False and 2 in doc["unprotected"], doc
