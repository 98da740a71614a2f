"""Pure pieces of the remote tier: what gets replicated, what retention may delete, I/O
priority of the replicator thread."""

import threading

import psutil
import pytest

import zerostall
from zerostall.errors import RemoteError

from zerostall.io._sys import set_idle_io_priority
from zerostall.store.retention import RetentionPolicy


def test_to_replicate_skips_what_remote_retention_would_drop():
    p = RetentionPolicy(keep_last_remote=2, keep_every_remote=100)
    assert p.to_replicate([50, 100, 150, 200, 250], []) == [100, 200, 250]
    assert p.to_replicate([200, 250, 300], [100, 200, 250]) == [300]
    assert RetentionPolicy().to_replicate([1, 2, 3], [2]) == [1, 3]  # keep everything: upload every gap


def test_local_retention_protects_only_pending_steps():
    p = RetentionPolicy(keep_last_local=1)
    local, pending = [1, 2, 3, 4], [3]
    assert p.local_doomed(local, set(local) - set(pending)) == [1, 2]  # never 3 (not on the remote), never 4


def test_replicator_thread_runs_at_idle_io_priority():
    got = {}

    def run():
        got["ok"] = set_idle_io_priority()
        got["class"] = psutil.Process(threading.get_native_id()).ionice().ioclass
        child = threading.Thread(target=lambda: got.__setitem__(
            "child", psutil.Process(threading.get_native_id()).ionice().ioclass))
        child.start()
        child.join()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got["ok"] and got["class"] == psutil.IOPRIO_CLASS_IDLE and got["child"] == psutil.IOPRIO_CLASS_IDLE
    assert psutil.Process().ionice().ioclass != psutil.IOPRIO_CLASS_IDLE  # the caller's thread is untouched


def test_bad_remote_url_fails_at_construction(tmp_path):
    with pytest.raises(zerostall.errors.ConfigError, match="nope://"):
        zerostall.Checkpointer(str(tmp_path / "a"), remote="nope://bucket/x")
    with pytest.raises(RemoteError, match="no bucket"):
        zerostall.Checkpointer(str(tmp_path / "b"), remote="s3:///just-a-path")


def test_an_s3_listing_refused_as_not_found_is_an_error_unless_the_bucket_is_missing():
    """A missing bucket lists as nothing replicated yet; any other not-found answer to a listing
    (an endpoint that is not the S3 server, a wrong path) is a RemoteError, not an empty tier."""
    pytest.importorskip("boto3")
    from botocore.exceptions import ClientError
    from zerostall.store.s3 import S3Tier

    class Pages:
        def __init__(self, code):
            self.code = code

        def paginate(self, **kw):
            raise ClientError({"Error": {"Code": self.code, "Message": "Not Found"}}, "ListObjectsV2")

    tier = S3Tier("s3://zerostall-adv-bucket/run")
    for code, empty in (("NoSuchBucket", True), ("404", False), ("NoSuchKey", False)):
        tier.client.get_paginator = lambda name, code=code: Pages(code)
        if empty:
            assert tier.steps() == []
        else:
            with pytest.raises(RemoteError, match="listing"):
                tier.steps()
