"""The crash seam the framework apps share (hf_app, accelerate_app, lightning_app): SIGKILL the
app at a chosen save boundary, named by ``ZS_KILL_AT``. Called once from the app's main thread
before training; the hook runs on whichever thread crosses the boundary (persist, publisher)."""

import os
import signal
import time


def install_kill_hook(listed):
    """``ZS_KILL_AT=BOUNDARY:N[:SUBSTR]``: SIGKILL this process at the N-th crossing of a
    save's boundary (of a checkpoint whose path holds SUBSTR, if given): a commit boundary of
    zerostall's local tier ("manifest", "rename", ...) or the integrations' "publish"
    (committed, not yet renamed to the framework's name). For N > 1 it first waits (bounded)
    until ``listed()`` is true: the earlier save is visible."""
    spec = os.environ.get("ZS_KILL_AT")
    if not spec:
        return
    name, n, sub = (spec.split(":") + [""])[:3]
    seen = []

    def hook(owner, boundary):  # set on the class: called as a method of the tier or publisher
        if boundary != name or sub not in str(getattr(owner, "root", "")):
            return
        seen.append(boundary)
        if len(seen) == int(n):
            deadline = time.monotonic() + 120
            while int(n) > 1 and name != "publish" and not listed() and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)

    if name == "publish":
        from zerostall.integrations._common import Publisher
        Publisher._hook = hook
    else:
        from zerostall.store.local import LocalTier
        LocalTier._hook = hook
