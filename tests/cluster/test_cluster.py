"""The 4-node job on network namespaces (tests/cluster/harness.py), on every CI run: each node
its own address, root and ZEROSTALL_NODE; c10d, gloo and the peer tier over a bridge.

Saves steps 1-3 with replicas=2 (the save job's peer servers on a fixed port, as behind a
firewall); n2's link goes down while it copies step 2 to its holder
(the majority's handles finish and it trains on), then heals; step 3 is saved by every node;
n3's root is wiped and the job restarted: every rank loads step 3 bit-exact, n3 from peers."""

import os

from .job import Job, index, of


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
