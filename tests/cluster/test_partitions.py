"""Network partitions, Jepsen style, on the namespace cluster (4-5 nodes, one rank each).

A node (or a minority, together) is cut off at a named moment -- during a commit round, during
replication, during a restore fetch, while it coordinates -- then healed (or the job killed and
restarted). After every run the job is restarted and loads; the properties:

- all ranks load one step, bit-exact;
- every handle that said durable loads: the agreed step is no older than the newest step any
  handle called durable;
- a partitioned node never commits a step on its own that the others then load as agreed:
  no step is durable on one rank and aborted (``SaveFailed``) on another, and the loaded step
  was aborted nowhere;
- no rank waits past the documented deadline: the partitioned rank's handle is done while the
  partition still holds (the order of events in the log, never a seconds threshold).

Slow (1-2 min per test): deselected by default; run with
``PYTHONPATH=$PWD/src python -m pytest -m partitions tests/cluster -v``.
"""

import os

import pytest

from .job import Job, index, of

pytestmark = pytest.mark.partitions

CT = 6.0  # commit_timeout_s
GRACE = 10.0  # how long the test gives a documented deadline to pass before it heals regardless
START = 400.0  # how long a job may take to start (torch imports on a loaded machine: minutes)


def _env(**kw):
    env = {"ZS_REPLICAS": "2", "ZS_PT": "2", "ZS_RT": "6", "ZS_CT": str(CT)}
    env.update({k: str(v) for k, v in kw.items()})
    return env


DURABLE_GAP = ("issue #32 item 1: a step committed by the decision but not finished on every rank (a rank cut "
              "off before it learnt the decision, or the coordinator cut off after committing alone) is not "
              "completed by the next start, which loads the step before it: a handle said durable for a step "
              "the job no longer loads")


def _restart_and_check(c, tmp_path, save, name="load", env=None, wipe=(), launcher="bare", gap=None):
    """Restart the job (after wiping ``wipe``) and check the properties of the module
    docstring against the save run's events. Returns the load events by node. ``gap``: the
    known issue that makes "every durable handle loads" fail here (an xfail with that reason,
    checked after every safety property held)."""
    for nd in wipe:
        c.wipe(nd)
    ev = save.events()
    job = Job(c, str(tmp_path / name), "load", env or _env(), launcher=launcher)
    codes = job.wait(START)
    assert codes == [0] * len(c.nodes), job.tail()
    loaded = {e["node"]: e for e in of(job.events(), "loaded")}
    assert set(loaded) == {nd.name for nd in c.nodes}, (of(job.events(), "load-failed"), job.tail())
    steps = {e["step"] for e in loaded.values()}
    assert len(steps) == 1 and all(e["equal"] for e in loaded.values()), loaded
    (step,) = steps
    outcomes = {}
    for e in of(ev, "done"):
        outcomes.setdefault(e["step"], {})[e["node"]] = e
    durable = [s for s, by in outcomes.items() if any(e["durable"] for e in by.values())]
    for s, by in outcomes.items():
        kinds = {"durable" if e["durable"] else e["error_type"] for e in by.values()}
        assert not ({"durable", "SaveFailed"} <= kinds), (s, by)  # durable somewhere, aborted elsewhere
    assert not any(e["error_type"] == "SaveFailed" for e in outcomes.get(step, {}).values()), outcomes[step]
    said = {s: {n: e["durable"] for n, e in by.items()} for s, by in outcomes.items()}
    if step < max(durable) and gap:
        pytest.xfail(f"{gap} (loaded step {step}; durable: {said})")
    assert step >= max(durable), (step, said)
    return loaded


def _done_before_heal(job, node, step, what="done"):
    ev = job.events()
    i = index(ev, what, node=node, step=step)
    assert i != -1, f"{node}'s handle of step {step} never finished\n{job.tail()}"
    assert i < index(ev, "healed"), (f"{node}'s handle of step {step} finished only after the heal "
                                     f"({ev[i]})")
    return ev[i]


def _heal_when(job, c, nodes, pred, what):
    """Heal ``nodes`` once ``pred(events)`` holds or GRACE seconds after the documented
    deadline (the assertions then say who waited)."""
    try:
        job.wait_for(pred, CT + GRACE + 30, what)
    except AssertionError:
        pass
    c.heal(nodes)
    job.event("healed")


MAJORITY = ("n0", "n1", "n3")  # of 4 nodes, without n2


def _cut_off_n2(job, c, gate):
    """Cut n2 off, then open ``gate``: the majority's handles of step 2 must end (within the
    round's deadline); n2 is healed once its own handle ended (see :func:`_heal_when`)."""
    n2 = c.nodes[2]
    c.partition([n2])
    job.event("partitioned", node="n2")
    job.gate(gate)
    job.wait_for(lambda e: all(of(e, "done", node=n, step=2) for n in MAJORITY), CT + 60, "majority's step 2")
    _heal_when(job, c, [n2], lambda e: of(e, "done", node="n2", step=2), "n2's step 2")


def _step_3_everywhere(job, nodes):
    """Open step 3's gate once all ``nodes`` ranks are ready for it; the job must end well."""
    job.wait_for(lambda e: len(of(e, "ready", step=3)) == nodes, 120, "every rank ready for step 3")
    job.gate("step-3")
    assert job.wait(START) == [0] * nodes, job.tail()


# -- a node cut off during a commit round -------------------------------------------------------
@pytest.mark.parametrize("point", ["entered", "reported"])
def test_node_partitioned_during_commit_round(cluster, tmp_path, point):
    """n2 is cut off inside the round of step 2 (``entered``: before it reports; ``reported``:
    after): the majority's handles end at the round's deadline; so must n2's (it cannot learn
    the decision: ``OutcomeUnknown``, or ``SaveFailed``/``DistributedError``, never durable
    alone); after the heal step 3 commits everywhere and the restarted job loads one step."""
    c = cluster(4)
    job = Job(c, str(tmp_path / "save"), "save", _env(ZS_STEPS="1,2,3", ZS_GATE_BEFORE="3",
                                                        ZS_FAULT=f"{point}:n2:2"))
    job.wait_for(lambda e: of(e, f"at-{point}", node="n2"), START, f"n2 at {point} of step 2")
    _cut_off_n2(job, c, point)
    _step_3_everywhere(job, 4)
    ev = job.events()
    for n in MAJORITY:
        assert of(ev, "done", node=n, step=2)[0]["trained"] > 0
    mine = of(ev, "done", node="n2", step=2)[0]
    if point == "entered":  # n2 never reported: nothing of step 2 committed anywhere
        assert not any(e["durable"] for e in of(ev, "done", step=2)), of(ev, "done", step=2)
    assert all(e["durable"] for e in of(ev, "done", step=3)), of(ev, "done", step=3)
    _restart_and_check(c, tmp_path, job)
    _done_before_heal(job, "n2", 2)
    assert mine["durable"] is False


def test_node_cut_off_before_it_learns_a_commit_still_loads_the_step_after_restart(cluster, tmp_path):
    """n2 reported step 2 and is cut off before it reads the decision: the coordinator commits,
    n2 ends OutcomeUnknown (before the heal) with its shard fdatasync'ed in ``step-2.partial``.
    After the heal the job ends and restarts and loads one step bit-exact; if any handle said
    step 2 was durable, that step (n2's copy completed from the decision or its files fetched),
    not the one before it."""
    c = cluster(4)
    job = Job(c, str(tmp_path / "save"), "save", _env(ZS_STEPS="1,2", ZS_FAULT="reported:n2:2"))
    job.wait_for(lambda e: of(e, "at-reported", node="n2"), START, "n2 reported step 2")
    _cut_off_n2(job, c, "reported")
    assert job.wait(START) == [0] * 4, job.tail()
    ev = job.events()
    _done_before_heal(job, "n2", 2)
    loaded = _restart_and_check(c, tmp_path, job, gap=DURABLE_GAP)
    if any(e["durable"] for e in of(ev, "done", step=2)):  # a rank that said durable: step 2 loads
        assert {e["step"] for e in loaded.values()} == {2}, loaded


def test_node_partitioned_while_every_rank_saves_ends_at_its_deadline(cluster, tmp_path):
    """Issue #32 item 8: n2's link is down while every rank saves step 2; the majority's
    round fails at its deadline, and n2's handle must end at it too (OutcomeUnknown), not at
    the heal. After the heal step 3 commits everywhere and loads bit-exact."""
    c = cluster(4)
    job = Job(c, str(tmp_path / "save"), "save", _env(ZS_STEPS="1,2,3", ZS_GATE_BEFORE="2,3"))
    job.wait_for(lambda e: len(of(e, "ready", step=2)) == 4, START, "every rank ready for step 2")
    _cut_off_n2(job, c, "step-2")
    _step_3_everywhere(job, 4)
    ev = job.events()
    assert all(e["durable"] for e in of(ev, "done", step=3)), of(ev, "done", step=3)
    assert not any(e["durable"] for e in of(ev, "done", step=2))
    loaded = _restart_and_check(c, tmp_path, job)
    assert {e["step"] for e in loaded.values()} == {3}
    _done_before_heal(job, "n2", 2)


# -- the coordinator cut off ---------------------------------------------------------------------
def test_coordinator_partitioned_mid_round_then_killed_and_restarted(cluster, tmp_path):
    """n0 (rank 0: it coordinates and hosts the c10d store) is cut off after every report
    arrived, before it decides step 2. Every other rank's handle ends at the deadline (the
    store is gone for them); n0 alone may commit -- the job must then never load a step the
    others did not commit. The job is killed during the partition, the network healed and the
    job restarted: every rank loads one step bit-exact."""
    c = cluster(4)
    n0 = c.nodes[0]
    job = Job(c, str(tmp_path / "save"), "save", _env(ZS_STEPS="1,2", ZS_FAULT="prepared:n0:2"))
    job.wait_for(lambda e: of(e, "at-prepared", node="n0"), START, "n0 coordinating step 2")
    c.partition([n0])
    job.event("partitioned", node="n0")
    job.gate("prepared")
    others = ("n1", "n2", "n3")
    try:
        job.wait_for(lambda e: all(of(e, "done", node=n, step=2) for n in others), CT + GRACE + 30,
                     "the others' step 2")
    except AssertionError:
        pass
    job.event("killing")
    for nd in c.nodes:
        c.kill(nd)
    c.heal([n0])
    job.event("healed")
    ev = job.events()
    for n in others:
        e = _done_before_heal(job, n, 2)
        assert e["durable"] is False, e  # the decision never reached them
    _restart_and_check(c, tmp_path, job, gap=DURABLE_GAP)


# -- replication -----------------------------------------------------------------------------------
def test_minority_partitioned_together_during_replication(cluster, tmp_path):
    """5 nodes; n3 and n4 move to a bridge of their own (they reach each other, not the
    majority) while n3 copies step 2 to its holder. Every handle's peer stage ends by
    replica_timeout_s with step 2 reported unprotected wherever a copy is unconfirmed --
    the minority's too, while the partition holds; after the heal step 3 is protected
    everywhere, and with n4 wiped the restarted job loads step 3 bit-exact (n4 from peers)."""
    c = cluster(5)
    minority = c.nodes[3:]
    job = Job(c, str(tmp_path / "save"), "save", _env(ZS_STEPS="1,2,3", ZS_GATE_BEFORE="3", ZS_FAULT="send:n3:2"))
    job.wait_for(lambda e: of(e, "at-send", node="n3"), START, "n3 copying step 2")
    c.partition(minority, together=True)
    job.event("partitioned", nodes=["n3", "n4"])
    job.gate("send")
    job.wait_for(lambda e: all(of(e, "peers-done", node=n, step=2) for n in ("n0", "n1", "n2")), 60,
                 "majority's step 2")
    _heal_when(job, c, minority, lambda e: all(of(e, "peers-done", node=n, step=2) for n in ("n3", "n4")),
               "the minority's step 2")
    _step_3_everywhere(job, 5)
    ev = job.events()
    assert all(e["protected"] for e in of(ev, "peers-done", step=3)), of(ev, "peers-done", step=3)
    # step 2 is presented as protected only where verified copies back it: every holder named
    # holds the node's files (a rank that heard every report after the heal may say so)
    for e in of(ev, "peers-done", step=2):
        for holder in e["nodes"][1:] if e["protected"] else ():
            assert os.path.isdir(os.path.join(c.node(holder).root, "peers", e["node"], "step-2")), e
    late = [n for n in ("n3", "n4") if index(ev, "peers-done", node=n, step=2) > index(ev, "healed")]
    loaded = _restart_and_check(c, tmp_path, job, wipe=[c.nodes[4]])
    assert loaded["n4"]["source"] == "peers" and loaded["n4"]["step"] == 3
    if late:
        pytest.xfail(f"{', '.join(late)}: the peer stage of a partitioned node waits for the heal, not "
                     "replica_timeout_s (its watcher's store check is bounded only by the store's 60 s call "
                     "timeout, and the deadline is looked at only when the check answers)")


# -- a restore fetch ---------------------------------------------------------------------------------
def test_holder_partitioned_during_restore_fetch(cluster, tmp_path):
    """replicas=3: n0 is wiped (its holders are n1 and n2; n0's namespace keeps hosting the
    c10d store for the restarted job); while it fetches its 64 MiB file of step 2, the holder
    it fetches from is cut off after the first chunk. n0 takes the rest from its other holder
    and commits step 2 while the partition holds; the network heals (the cut-off holder is a
    rank of the collective load too) and every rank loads step 2 bit-exact."""
    c = cluster(4)
    save = Job(c, str(tmp_path / "save"), "save", _env(ZS_REPLICAS=3, ZS_STEPS="1,2", ZS_RT=30, ZS_MIB=64))
    assert save.wait(START) == [0] * 4, save.tail()
    assert all(e["protected"] for e in of(save.events(), "peers-done", step=2)), save.tail()
    n0 = c.nodes[0]
    c.wipe(n0)
    job = Job(c, str(tmp_path / "load"), "load", _env(ZS_REPLICAS=3, ZS_FAULT="fetch:n0:2", ZS_PT=3, ZS_MIB=64,
                                                        ZS_JT=120))
    at = job.wait_for(lambda e: of(e, "at-fetch", node="n0"), START, "n0 fetching")[0]
    holder = next(nd for nd in c.nodes if nd.addr == at["peer"])
    c.partition([holder])
    job.event("partitioned", node=holder.name)
    job.gate("fetch")
    job.wait_for(lambda e: os.path.isdir(os.path.join(n0.root, "step-2")), 120, "n0's step 2 committed")
    job.event("fetched", node="n0")
    c.heal([holder])
    job.event("healed")
    assert job.wait(START) == [0] * 4, job.tail()
    ev = job.events()
    loaded = {e["node"]: e for e in of(ev, "loaded")}
    assert set(loaded) == {nd.name for nd in c.nodes}, (of(ev, "load-failed"), job.tail())
    assert {e["step"] for e in loaded.values()} == {2} and all(e["equal"] for e in loaded.values()), loaded
    assert loaded["n0"]["source"] == "peers"
    other = ({"n1", "n2"} - {holder.name}).pop()
    log = open(os.path.join(str(tmp_path / "load"), "load-n0.log")).read()
    assert at["bytes"] < at["size"]  # cut off mid-transfer
    assert f"served by peer {other}" in log, log[-3000:]  # the rest came from the other holder
    assert index(ev, "fetched") < index(ev, "healed")
