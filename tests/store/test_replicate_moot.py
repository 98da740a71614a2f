"""A step remote retention would not keep is never uploaded, and close() does not wait for it."""

import torch

import zerostall


def test_step_older_than_remote_retention_keeps_is_settled_not_pending(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with zerostall.Checkpointer(str(tmp_path / "a"), remote=url) as ck:
        ck.save(100, {"w": torch.ones(4)}).wait(tier="remote")
    ck = zerostall.Checkpointer(str(tmp_path / "b"), remote=url, keep_last_remote=1, close_timeout_s=5)
    h = ck.save(5, {"w": torch.zeros(4)})
    h.result()
    ck.close()
    # keep_last_remote=1 with step 100 on the remote: step 5 would be deleted at once, so it is not
    # uploaded, and it is not reported as a replication failure
    assert ck.unreplicated == []
    assert h.replicated() and h.replication_error() is None
    assert zerostall.load(str(tmp_path / "b"))["w"].sum() == 0
