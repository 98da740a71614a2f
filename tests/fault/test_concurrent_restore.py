"""Processes restoring from the remote into one local directory at once (the ranks of a node
calling ``load(node_dir, remote=...)``) all load the newest step.

Each used to remove the others' ``step-N.partial`` and swap their commits away, so some
raised CorruptCheckpoint ("no checkpoint verifies") or silently loaded an older step. The
seam: the remote's first download, once done, starts a second restore (another process) into the same
directory and waits until it has finished or is waiting for the first one (a blocked
``flock`` shows in /proc/locks).
"""

import os
import subprocess
import sys
import time

import pytest
import torch

import zerostall
from zerostall import LoadReport
from zerostall.restore import FETCH_LOCK_NAME
from zerostall.store.tier import open_tier

SECOND = """
import sys, zerostall
from zerostall import LoadReport
r = LoadReport()
got = zerostall.load(sys.argv[1], remote=sys.argv[2], report=r)
print(r.step, float(got["a"][0]), len(r.failed))
"""


def _waiting_on(path):
    """True if some process waits for a flock on ``path`` (a '->' line in /proc/locks)."""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[-3].endswith(f":{ino}") for line in f)


class _StartsASecondRestore:
    def __init__(self, inner, root, url):
        self.inner, self.root, self.url, self.second = inner, root, url, None

    def download(self, rel, local_path, size):
        self.inner.download(rel, local_path, size)
        if self.second is None:  # downloaded, not yet committed
            self.second = subprocess.Popen([sys.executable, "-c", SECOND, self.root, self.url],
                                           stdout=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120  # only a bound against hanging: either outcome ends it sooner
            while self.second.poll() is None and not _waiting_on(os.path.join(self.root, FETCH_LOCK_NAME)):
                assert time.monotonic() < deadline, "the second restore neither finished nor waited"
                time.sleep(0.05)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(300)
def test_two_processes_restoring_into_one_directory(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with zerostall.Checkpointer(str(tmp_path / "writer"), remote=url) as ck:
        ck.save(1, {"a": torch.full((1 << 16,), 1.0)})
        ck.save(2, {"a": torch.full((1 << 16,), 2.0)})
    root = str(tmp_path / "node")
    remote = _StartsASecondRestore(open_tier(url), root, url)
    report = LoadReport()
    got = zerostall.load(root, remote=remote, report=report)
    out, _ = remote.second.communicate(timeout=120)
    assert remote.second.returncode == 0
    assert (report.step, report.failed) == (2, [])
    assert torch.equal(got["a"], torch.full((1 << 16,), 2.0))
    assert out.split() == ["2", "2.0", "0"]
