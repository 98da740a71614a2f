"""The per-stage records of a save (staging/job.py) and the Committer protocol."""

import inspect
import threading

from zerostall.saving.commit import Committer, LocalCommitter, StoreCommitter
from zerostall.saving.job import Handoff, SaveStatus


def test_the_first_failure_wins_and_a_claimed_commit_refuses_later_ones():
    st = SaveStatus()
    first, second = RuntimeError("first"), RuntimeError("second")
    assert st.fail(first, in_save=True) and st.fail(second)  # both say "failed"
    assert st.error is first and st.error_in_save  # but only the first is the save's error
    assert not st.claim_commit()  # failed first: nothing may be committed

    st = SaveStatus()
    assert st.claim_commit()
    assert not st.fail(RuntimeError("too late")) and st.error is None  # the commit began first
    st.commit_failed(OSError("rename failed"))  # the persist thread's own error still counts
    assert isinstance(st.error, OSError)


def test_skip_sets_every_event_and_guard_waits_add_up_from_any_thread():
    st = SaveStatus()
    st.skip(0.25)
    assert st.skipped and st.staged.is_set() and st.durable.is_set() and st.done.is_set()
    assert st.save_block_s == 0.25 and st.nbytes == 0
    threads = [threading.Thread(target=lambda: [st.add_guard_wait(0.001) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert abs(st.guard_wait_s - 4.0) < 1e-6


def test_a_handoff_is_put_once():
    h = Handoff()
    assert not h.ready()
    h.put("layout")
    h.put("ignored")  # the writer's finally-clause puts again on every path: the first value stays
    assert h.ready() and h.get() == "layout"


def test_both_committers_implement_the_protocol_with_its_signatures():
    for name, proto in inspect.getmembers(Committer, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = list(inspect.signature(proto).parameters)
        for cls in (LocalCommitter, StoreCommitter):
            impl = getattr(cls, name, None)
            assert impl is not None, f"{cls.__name__} lacks Committer.{name}"
            got = [p for p, v in inspect.signature(impl).parameters.items() if v.kind != v.KEYWORD_ONLY]
            assert got == want, (cls.__name__, name, got, want)
