"""Every wait of a save ends at its documented deadline (issue 32, items 7-9): real processes,
gloo on 127.0.0.1, the trust tests' worker (trust_worker.py).

* the process hosting the store (rank 0 under a bare ``MASTER_ADDR`` launch) stopped: the other
  rank's handle is done, ``OutcomeUnknown``, while it is still stopped (at ``commit_timeout_s``
  plus the stated grace, not at the resume), and the next step commits everywhere;
* a rank cut off from the store (its requests hang, as over a link that is down) longer than
  ``commit_timeout_s``: its handle ends before the link heals; after the heal the next step
  commits everywhere and loads bit-exact;
* one rank skips a save while saves run back to back: only that step fails.

No timing thresholds: the stopped process (or the cut link) is continued only once the other
rank wrote its outcome, which must happen first (bounded by a generous ``settle_timeout``, far
above the deadline plus grace and far below the 60 s a plain store request waits)."""

import threading
import time

from .test_dist_trust import _wait_file, check_consistent, run

SETTLE_S = 30  # commit_timeout_s=3 plus its 1 s grace, many times over


def test_a_stopped_store_host_and_a_cut_link_end_handles_at_their_deadline(tmp_path):
    """Two nodes, node-local roots (each a whole copy), rank 0 hosting the store; saves 1-5.

    * step 2: rank 0 is stopped in the round before rank 1 entered it: every request of rank
      1's round meets a store that does not answer; rank 1's handle must be done, unknown,
      while rank 0 is still stopped (run() continues it only then);
    * step 4: rank 1's link to the store is cut (its requests hang) from the save on; its
      handle must be done before the link heals (this test heals it only then);
    * steps 1, 3, 5 commit on every copy; every rank then loads step 5 bit-exact."""
    out = tmp_path / "out"
    out.mkdir()
    seen = {}

    def heal():  # a thread of this test: run() waits for the processes meanwhile
        try:
            for path, wait_s in ((out / "s3-r1.json", 240), (out / "s4-r1.json", SETTLE_S)):
                deadline = time.monotonic() + wait_s
                while not path.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            seen["before_heal"] = path.exists()
        finally:
            (out / "heal").touch()
    th = threading.Thread(target=heal, daemon=True)
    th.start()
    res, roots = run(tmp_path, 2, agent=False, mode="replicated", scenario="steps", steps=[1, 2, 3, 4, 5],
                     timeout=3, pause={"0": [["entered", 2]], "1": [["begin", 2]]},
                     signals=[(1, 2, "hold"), (0, 2, "stop")], settle_timeout=SETTLE_S, partition=[1, 4], load=True)
    th.join()
    for rc, doc, err in res:
        assert rc == 0, err[-3000:]
    r0, r1 = res[0][1], res[1][1]
    assert r1["2"]["state"] == "unknown" and "deleted nothing" in r1["2"]["error"], r1["2"]
    assert seen["before_heal"], "the cut-off rank's handle of step 4 waited for the link to heal"
    assert r1["4"]["state"] == "unknown" and r0["4"]["state"] == "failed", (r0["4"], r1["4"])
    assert "rank(s) 1 did not report" in r0["4"]["error"], r0["4"]
    assert check_consistent(res, roots, [1, 3, 5]) == {1: "committed", 3: "committed", 5: "committed"}
    for doc in (r0, r1):  # the job recovered: all load the newest step, bit-exact
        assert doc["loaded"] == 5 and doc["exact"] is True, doc


def test_one_skipped_save_among_back_to_back_saves_fails_only_that_step(tmp_path):
    """commit_timeout_s=3, saves 1-3 back to back, each rank's persist of steps 2 and 3 slow
    (3.5 s, a large state): rank 1 skips step 2 and so runs ahead into step 3's round while
    rank 0 still persists step 2, then 3. Step 3 must not fail for it."""
    res, roots = run(tmp_path, 2, shared=True, scenario="skip", steps=[1, 2, 3], skip_rank=1, skip_step=2,
                     timeout=3, ck={"backpressure": "skip"}, slow_persist={"steps": [2, 3], "s": 3.5})
    for rc, doc, err in res:
        assert rc == 0, err[-3000:]
    assert res[1][1]["2"].get("error") == "skipped here"
    assert check_consistent(res, roots, [1, 2, 3]) == {1: "committed", 2: "failed", 3: "committed"}, res
