"""Signal-safe lifecycle: on_preemption()/close() at any instant of save(), and the guard's scope."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import zerostall
from zerostall.errors import ZerostallError
from zerostall.io import register_engine
from zerostall.saving.job import Committed, Job, SaveRequest, SaveStatus, Slot, Source
from zerostall.store import open_root
from zerostall.store.local import LocalTier

from ..engines import FaultyEngine
from .sigterm_child import drive


def _held_job(tensors):
    """An in-flight snapshot that reads ``tensors`` until the test sets ``staged``."""
    status = SaveStatus()
    status.mark_queued()
    status.done.set()  # wait()/close() need not wait for it
    return Job(SaveRequest(step=99, plan=None), status, Slot(0, 0, None), Source(list(tensors)))


def test_guard_waits_only_for_snapshots_of_its_own_optimizer(ckdir):
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    for m in (a, b):
        m(torch.randn(2, 4)).sum().backward()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(opt_a)
        ck.guard(opt_b)
        job = _held_job(a.state_dict().values())  # state_dict tensors share the parameters' storage
        ck._inflight.append(job)
        opt_b.step()  # reads nothing of b: does not wait
        done = threading.Event()
        t = threading.Thread(target=lambda: (opt_a.step(), done.set()), daemon=True)
        t.start()
        assert not done.wait(0.3)  # a's parameters are still being copied
        job.status.staged.set()
        t.join(10)
        assert done.is_set()
        ck._inflight.remove(job)


@pytest.mark.parametrize("where", ["plan", "reserve", "between_queues"])
@pytest.mark.parametrize("call", ["on_preemption", "close"])
def test_handler_call_inside_save_returns(ckdir, where, call):
    """The handler's call runs on the thread that is inside save(), at three instants."""
    state = {"w": torch.randn(1000)}
    ck = zerostall.Checkpointer(ckdir)
    ck.save(1, state).result()
    earlier = ck.save(2, state)
    results = []

    def handler():
        if call == "on_preemption":
            results.append(ck.on_preemption(timeout=30))
        else:
            results.append(ck.close(timeout=30))

    if where == "plan":
        orig = ck._plan
        ck._plan = lambda sd: (handler(), orig(sd))[1]
    elif where == "reserve":
        orig_reserve = ck.ring.reserve
        ck.ring.reserve = lambda n: (handler(), orig_reserve(n))[1]
    else:  # right after the job was queued (one queue now: the snapshot thread hands it on)
        orig_queue = ck._lease.queue
        ck._lease.queue = lambda job: (orig_queue(job), handler())[0]
    if call == "close":
        with pytest.raises(ZerostallError, match="closed") if where != "between_queues" else _nothing():
            h = ck.save(3, state)
        if where == "between_queues":
            assert isinstance(h.exception(timeout=30), ZerostallError)  # handed over as failed
    else:
        h = ck.save(3, state)
        assert h.result(timeout=60).ok
        ck.close()
    assert results == [True]
    assert earlier.done() and earlier.exception() is None  # the earlier save finished
    assert 2 in ck.tier.steps()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.timeout(600)
def test_sigterm_soak_on_preemption_at_random_instants(tmp_path):
    """>= 100 SIGTERMs at random instants of a loop that saves back to back; the handler calls
    on_preemption() (and, on each process's last signal, close() or the atexit drain). None
    may hang: every signal is answered and every process exits."""
    runs = [(i, 26, "close" if i % 2 else "exit") for i in range(4)]  # 104 signals

    def one(run):
        i, nsig, mode = run
        return drive(str(tmp_path / f"ck{i}"), str(tmp_path / f"out{i}.json"), nsig, mode, seed=i)

    with ThreadPoolExecutor(2) as pool:  # 2 cores: two processes at a time
        results = list(pool.map(one, runs))
    total = in_save = 0
    for (i, nsig, mode), r in zip(runs, results):
        assert r["hung"] is None, (mode, r["hung"], r["stderr"])
        assert r["rc"] == 0, (mode, r["stderr"])
        st = r["stats"]
        assert st["signals"] == nsig and st["ok"] == nsig, st
        total += st["signals"]
        in_save += st["in_save"]
        steps = LocalTier(str(tmp_path / f"ck{i}")).steps()
        assert steps, "nothing committed"
        out = zerostall.load(str(tmp_path / f"ck{i}"))  # the newest committed step verifies
        assert len(out) == 200
    print(f"\nSIGTERM soak: {total} signals, {in_save} landed inside save(), none hung")
    assert total >= 100 and in_save > 0


def test_exception_between_reserve_and_queueing_leaves_the_ring_moving(ckdir):
    """A handler that raises (sys.exit, KeyboardInterrupt) right after save() reserved its
    blocks: the job is handed over as failed, so its blocks drain and the next save (through a
    ring smaller than the abandoned reservation) completes."""
    MiB = 1 << 20
    state = {"w": torch.randn(MiB)}  # 4 MiB = 4 blocks, the arena holds 2
    ck = zerostall.Checkpointer(ckdir, staging=zerostall.StagingConfig(budget_bytes=2 * MiB, block_bytes=MiB))
    ck.save(1, state).result(timeout=60)
    orig = ck.ring.reserve

    def reserve_then_interrupt(n):
        orig(n)
        ck.ring.reserve = orig
        raise KeyboardInterrupt

    ck.ring.reserve = reserve_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        ck.save(2, state)
    assert ck.save(3, state).result(timeout=60).ok
    assert ck.wait(timeout=60)
    ck.close()  # no background error re-raised for the save that raised in save()
    assert ck.tier.steps() == [1, 3]


def test_interrupt_inside_the_shared_ring_reserve_does_not_stall_other_checkpointers(tmp_path):
    """A signal handler raising while the pool's ring is being reserved (the ring moved, the job
    not yet marked): the pool drains those blocks itself, so another Checkpointer sharing the
    process's pool still saves (it used to wait forever on blocks nobody would release)."""
    MiB = 1 << 20
    st = zerostall.StagingConfig(budget_bytes=2 * MiB, block_bytes=MiB)
    state = {"w": torch.randn(MiB)}
    a = zerostall.Checkpointer(str(tmp_path / "a"), staging=st)
    b = zerostall.Checkpointer(str(tmp_path / "b"), staging=st)
    try:
        a.save(1, state).result(timeout=60)
        ring = a.ring
        assert b.ring is ring  # one pool per process
        orig = type(ring).reserve

        def reserve_then_interrupt(self, n):
            orig(self, n)
            raise KeyboardInterrupt  # after the ring moved, before the pool marked the job

        ring.reserve = reserve_then_interrupt.__get__(ring)
        with pytest.raises(KeyboardInterrupt):
            a.save(2, state)
        del ring.reserve
        assert b.save(7, state).result(timeout=60).ok
        assert a.save(3, state).result(timeout=60).ok
    finally:
        assert a.close(timeout=60) and b.close(timeout=60)
    assert LocalTier(str(tmp_path / "a")).steps() == [1, 3]
    assert LocalTier(str(tmp_path / "b")).steps() == [7]


_FORK_CHILD = r"""
import os, sys, threading, time, torch, zerostall
ck = zerostall.Checkpointer(sys.argv[1])
hold = threading.Event()
ck.tier._hook = lambda name: hold.wait(60) if name == "latest_tmp" else None  # the save stays in flight
h = ck.save(0, {"w": torch.arange(1000.)})
while not h.durable():
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: atexit hooks run in the child
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("CHILD HUNG")
hold.set()
h.result()
ck.close()
print("OK", zerostall.load(sys.argv[1])["w"].sum().item())
"""


def test_a_forked_child_exits_while_the_parent_saves(tmp_path):
    """A child forked while a save is in flight exits normally: its atexit hook closed the
    parent's Checkpointer copy and waited for saves whose threads exist only in the parent
    (the child never exited). The parent's save commits and loads."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=90)
    assert "CHILD HUNG" not in out.stdout, out.stdout + out.stderr
    assert out.returncode == 0 and "OK 499500.0" in out.stdout, out.stdout + out.stderr



_EXIT_SAVE = """
import atexit, sys, torch, zerostall
ck = zerostall.Checkpointer(sys.argv[1])
# registered after the Checkpointer's own hook, so it runs first: the save is staged at exit
atexit.register(lambda: ck.save(1, {"w": torch.arange(64.0).reshape(8, 8).t()}))
"""


def test_a_save_staged_at_interpreter_exit_is_drained_and_commits(tmp_path):
    """Found by adv3: the atexit hook drains saves in flight (docs/usage.md), but staging a
    non-contiguous CPU tensor then ran in a ThreadPoolExecutor, which refuses new work once the
    interpreter is shutting down: the save failed ("cannot schedule new futures")."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _EXIT_SAVE, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0 and "failed" not in out.stderr, out.stdout + out.stderr
    assert torch.equal(zerostall.load(str(tmp_path / "ck"))["w"], torch.arange(64.0).reshape(8, 8).t())

# ------------------------------------------------------------------------------------------------
# close() under adversity: a second close() finishes the first one's work; close() from another thread never strands a save.
#
# close(timeout) that gives up, then close() again: the second call finishes the job.
#
# Found by adv2: the second ``close()`` returned True at once (``_closed`` was set) without
# waiting for the work the first one left in flight nor releasing the root lock, the staging
# lease and the engine, so the root stayed locked for as long as the object lived.

def test_close_after_a_timed_out_close_waits_and_releases_the_root(ckdir):
    box, gate = {}, threading.Event()
    register_engine("adv2-gated", lambda cfg: box.setdefault("e", FaultyEngine(cfg)))
    ck = zerostall.Checkpointer(ckdir, io=zerostall.IOConfig(engine="adv2-gated"), lock_timeout_s=0)
    ck.save(1, {"x": torch.ones(1 << 16)}).result()
    box["e"].gate = gate  # the next save's write waits for the gate
    h = ck.save(2, {"x": torch.full((1 << 16,), 2.0)})
    assert box["e"].writes_started.wait(30)
    assert ck.close(timeout=0.2) is False  # gives up: the write is held
    gate.set()
    assert ck.close() is True  # waits for step 2, then releases everything
    assert h.done()
    with zerostall.Checkpointer(ckdir, lock_timeout_s=0) as ck2:  # the root is free again
        assert ck2.steps() == [1, 2]
    assert zerostall.load(ckdir)["x"][0].item() == 2.0


# close() from another thread while save() is between its closed-check and the queue.
#
# Found by adv2: close() skipped a job not queued yet (right for a signal handler that
# interrupted save() on the same thread, wrong for another thread), stopped the persist thread
# and released the root lock and staging lease; save() then queued the job anyway, and its
# handle never finished (no thread left to persist it): wait() and result() hung for good.

@pytest.mark.timeout(120)
def test_close_from_another_thread_during_save_never_strands_the_save(ckdir):
    state = {"w": torch.ones(4096)}
    ck = zerostall.Checkpointer(ckdir)
    ck.save(1, state).result()
    results, closer = [], []
    orig_queue = ck._lease.queue

    def queue_after_a_close_elsewhere(job):
        t = threading.Thread(target=lambda: results.append(ck.close(timeout=10)))
        closer.append(t)
        t.start()
        t.join(1)  # close() runs meanwhile on its own thread (it may wait for this save)
        orig_queue(job)

    ck._lease.queue = queue_after_a_close_elsewhere
    try:
        h = ck.save(2, {"w": torch.zeros(4096)})
    except ZerostallError:
        h = None
    if h is not None:
        assert h.wait(timeout=30)  # was: never finished
    closer[0].join(30)
    assert results == [True]
    assert ck.wait(timeout=30)
    with zerostall.Checkpointer(ckdir, lock_timeout_s=0) as again:  # the root lock is free
        assert 1 in again.steps()
    if h is not None and h.exception() is None:  # it committed: before close() released the root
        assert zerostall.load(ckdir)["w"].sum() == 0


# ---- subscribers: Post-commit stages subscribe to Committed records (the seam peer replicas use next).


class Recorder:
    name = "recorder"

    def __init__(self, fail_on=None):
        self.seen, self.fail_on = [], fail_on

    def on_committed(self, record):
        self.seen.append(record)
        if record.step == self.fail_on:
            raise RuntimeError("the peer is gone")


def test_subscribers_get_each_commit_in_order_and_a_failing_one_never_fails_the_save(ckdir):
    state = {"w": torch.randn(10_000)}
    first, second = Recorder(fail_on=2), Recorder()
    with zerostall.Checkpointer(ckdir, keep_last=2) as ck:
        ck.subscribe(first)
        ck.subscribe(second)
        handles = [ck.save(s, state) for s in (1, 2, 3)]
        recs = [h.result(timeout=60) for h in handles]
    for sub in (first, second):
        assert [r.step for r in sub.seen] == [1, 2, 3]  # every commit, in commit order
        assert all(isinstance(r, Committed) and r.status.durable.is_set() for r in sub.seen)
    assert open_root(ckdir).read_manifest(3).checkpoint_id == first.seen[2].checkpoint_id  # the step committed
    assert recs[1].ok and any("recorder after step 2 failed: the peer is gone" in e
                              for e in recs[1].post_commit_errors)
    assert recs[0].post_commit_errors == () and recs[2].post_commit_errors == ()
    assert zerostall.load(ckdir, step=2)["w"].equal(state["w"])  # committed all the same


# ---- subscriber_exits: A post-commit subscriber that raises a BaseException (``sys.exit()`` in a hook) must not
# turn a committed, durable step into a failed save.
#
# Found by adv2: the persist thread's subscriber loop caught ``Exception`` only; a
# ``SystemExit`` reached the save's failure path after the commit point: the handle raised
# SaveFailed for a step that was committed, the log said "nothing committed", the next
# ``save()`` raised it again as a background failure, and the subscribers after it (retention,
# replication) never saw the step.


class Exits:
    name = "exits"

    def on_committed(self, record):
        raise SystemExit(3)


class subexit_Recorder:
    def __init__(self):
        self.steps = []

    def on_committed(self, record):
        self.steps.append(record.step)


def test_subscriber_raising_systemexit_leaves_the_save_durable(ckdir):
    state = {"w": torch.randn(1000)}
    after = subexit_Recorder()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.subscribe(Exits())
        ck.subscribe(after)
        rec = ck.save(1, state).result(timeout=60)  # was SaveFailed
        assert rec.ok and any("exits after step 1 failed" in e for e in rec.post_commit_errors)
        ck.save(2, state).result(timeout=60)  # was SaveFailed: "an earlier background save (step 1) failed"
    assert after.steps == [1, 2]
    assert zerostall.load(ckdir, step=1)["w"].equal(state["w"])
