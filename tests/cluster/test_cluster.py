"""The 4-node job on network namespaces (tests/cluster/harness.py), on every CI run: each node
its own address, root and ZEROSTALL_NODE; c10d, gloo and the peer tier over a bridge.

Saves steps 1-3 with replicas=2 (the save job's peer servers on a fixed port, as behind a
firewall); n2's link goes down while it copies step 2 to its holder
(the majority's handles finish and it trains on), then heals; step 3 is saved by every node;
n3's root is wiped and the job restarted: every rank loads step 3 bit-exact, n3 from peers."""

import errno
import os
import subprocess
import sys
import time

import pytest

from .harness import unavailable
from .job import Job, index, of
from .store_round import run


def test_four_nodes_partition_during_replication_heal_wipe_restore(cluster, tmp_path):
    c = cluster(4)
    n2, n3 = c.nodes[2], c.nodes[3]
    env = {"ZS_REPLICAS": "2", "ZS_STEPS": "1,2,3", "ZS_GATE_BEFORE": "3", "ZS_FAULT": "send:n2:2",
           "ZS_PT": "2", "ZS_RT": "6", "ZS_CT": "10", "ZEROSTALL_PEER_PORT": "7700"}
    job = Job(c, str(tmp_path / "run1"), "save", env)
    # the peer tier on each node listens on its own address (reachable from the other
    # namespaces) and publishes it: the route to MASTER_ADDR, n0's 10.x address
    serving = job.wait_for(lambda e: len(of(e, "serving")) == 4 and of(e, "serving"), 400, "peer servers")
    for s in serving:
        assert s["endpoints"] == {nd.name: [nd.addr, 7700] for nd in c.nodes}, s
    started = {e["node"]: e for e in of(job.events(), "started")}
    assert all(e["master"] == c.nodes[0].addr for e in started.values())
    # n2 is half way through copying step 2 to its holder: cut it off
    job.wait_for(lambda e: of(e, "at-send", node="n2"), 120, "n2 copying step 2")
    c.partition([n2])
    job.event("partitioned", node="n2")
    job.gate("send")
    # the majority: step 2 durable, its peer stage over (n2's copies cannot be confirmed), trained on
    majority = ("n0", "n1", "n3")
    job.wait_for(lambda e: all(of(e, "peers-done", node=n, step=2) for n in majority), 120, "majority's step 2")
    c.heal([n2])
    job.event("healed", node="n2")
    ev = job.events()
    cut, healed = index(ev, "partitioned"), index(ev, "healed")
    for n in majority:
        done = of(ev, "peers-done", node=n, step=2)[0]
        assert cut < index(ev, "peers-done", node=n, step=2) < healed
        assert of(ev, "done", node=n, step=2)[0]["durable"] is True
        assert done["trained"] > 0  # the majority trained on while n2 was cut off
    # everyone through step 2 (n2 after the heal), then step 3 on the healed network
    job.wait_for(lambda e: len(of(e, "ready", step=3)) == 4, 120, "every rank ready for step 3")
    job.gate("step-3")
    assert job.wait(300) == [0, 0, 0, 0], job.tail()
    ev = job.events()
    for nd in c.nodes:
        (d3,) = of(ev, "peers-done", node=nd.name, step=3)
        assert d3["protected"] is True, (d3, job.tail())
        assert of(ev, "done", node=nd.name, step=1)[0]["durable"] is True
    # a partitioned node's step 2 is never presented as protected
    assert all(e["protected"] is False for e in of(ev, "peers-done", node="n2", step=2))
    # n3 is lost and replaced by an empty node: the restarted job loads step 3 everywhere
    c.wipe(n3)
    assert os.listdir(n3.root) == []
    job2 = Job(c, str(tmp_path / "run2"), "load", {"ZS_REPLICAS": "2", "ZS_PT": "2", "ZS_RT": "6"},
               launcher="torchrun")
    assert job2.wait(400) == [0, 0, 0, 0], job2.tail()
    loaded = {e["node"]: e for e in of(job2.events(), "loaded")}
    assert set(loaded) == {nd.name for nd in c.nodes}, job2.tail()
    for nd in c.nodes:
        assert loaded[nd.name]["step"] == 3 and loaded[nd.name]["equal"] is True, loaded
        assert loaded[nd.name]["rank"] == c.nodes.index(nd)
    assert loaded["n3"]["source"] == "peers" and loaded["n0"]["source"] == "local"


# ---- harness: The namespace cluster itself (no torch, a few seconds): nodes reach each other over the
# bridge and only over it, partition/heal and a `together` split do what they say, a rate is
# applied with tc, a full disk is full, and close() leaves no namespace, mount or process.


SERVE = ("import socket\ns = socket.create_server(('0.0.0.0', 5001))\nwhile True:\n    c, _ = s.accept()\n"
         "    c.sendall(b'ok')\n    c.close()\n")


def _reach(frm, to):
    r = frm.run([sys.executable, "-c", f"import socket\ns = socket.create_connection(('{to.addr}', 5001), timeout=1)\n"
                                       "print(s.recv(2).decode())"])
    return r.stdout.strip() == "ok"


def test_nodes_partition_heal_rate_full_disk_and_cleanup(cluster):
    c = cluster(3, disk_bytes=16 << 20)
    n0, n1, n2 = c.nodes
    assert [n.addr.rsplit(".", 1)[1] for n in c.nodes] == ["101", "102", "103"]
    assert n0.env["MASTER_ADDR"] == n0.addr and n1.env["ZEROSTALL_NODE"] == "n1"
    for nd in c.nodes:
        nd.spawn([sys.executable, "-c", SERVE])
    end = time.monotonic() + 120
    while not all(_reach(n0, nd) for nd in (n1, n2)):  # the servers are starting
        assert time.monotonic() < end, "the nodes never reached each other"
        time.sleep(0.2)
    c.partition([n2])
    assert _reach(n0, n1) and not _reach(n0, n2) and not _reach(n2, n1)
    c.heal([n2])
    assert _reach(n2, n1)
    c.partition([n1, n2], together=True)
    assert _reach(n1, n2) and not _reach(n0, n1) and not _reach(n2, n0)
    c.heal()
    assert _reach(n0, n2)
    c.set_rate(n1, 100)
    shown = subprocess.run(["tc", "-n", c.bridge_ns, "qdisc", "show", "dev", n1.port], capture_output=True, text=True)
    assert "tbf" in shown.stdout and "100Mbit" in shown.stdout, shown.stdout
    assert c.fill_disk(n2) > 0
    with pytest.raises(OSError) as e:
        with open(os.path.join(n2.root, "more"), "wb") as f:
            f.write(b"x" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    assert e.value.errno == errno.ENOSPC
    c.unfill(n2)
    pids = [p.pid for nd in c.nodes for p in nd.procs]
    c.close()
    assert not [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
                if ln.startswith(c.tag)]
    assert c.tag not in open("/proc/mounts").read()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


# ---- store_round: The commit round of many ranks through one real c10d TCPStore across namespaces, CI-sized
# (:mod:`.store_round`; the 512-rank run is its command line): 4 nodes x 16 ranks, the store
# in n0's namespace on its 10.x address, every rank the library's start-up round and commit
# strategy over the bridge.
#
# Step 1 commits on every rank, every node's copy holds one manifest of all 64 files; in step 2
# n2's link goes down after its ranks entered the round: every rank's handle fails before the
# heal (the others with one abort decision naming n2's ranks, n2's own ``OutcomeUnknown``), no
# node commits step 2; after the heal step 3 commits everywhere.


def test_64_ranks_on_4_nodes_commit_through_one_store_a_cut_node_fails_the_round_everywhere(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)

    res = run(4, 16, str(tmp_path), timeout=60.0, fault=True, fault_timeout=2.0)
    assert res["problems"] == [], res
    assert res["step1"]["outcomes"] == {"durable": 64} and res["step3"]["outcomes"] == {"durable": 64}
    assert res["step2"]["outcomes"] == {"failed": 48, "unknown": 16}
    assert res["fault"]["cut_node"] == "n2" and "rank(s) 32, 33" in res["fault"]["decision"]
    assert res["step1"]["on_disk"] == "4 copies, checkpoint id ['store-round-1'], 64 files each"
    assert res["step2"]["on_disk"] == "step-2 committed on 0 of 4 nodes"
