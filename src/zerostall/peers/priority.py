"""CPU and disk priority of the threads that copy replicas, so that copies take only what the
training leaves over.

Called by a replication thread on itself (Linux applies scheduling policy, nice value and I/O
class per thread; a thread it creates later inherits them): the replicator's sender thread
(and so its per-holder put threads) and a holder's connection thread once it knows it is
receiving a copy (``put``). Never by the threads serving or fetching a restore (someone is
waiting for those) nor by the caller's or persist threads.

``cpu``:

* ``"idle"``: ``SCHED_IDLE``: the thread runs only when a core would otherwise be idle (its
  weight is 3 against a normal thread's 1024).
* ``"nice"``: nice 19 (weight 15).
* ``"normal"``: unchanged.

An unprivileged thread cannot undo either (raising a nice value or leaving ``SCHED_IDLE``
needs ``RLIMIT_NICE``/``CAP_SYS_NICE``), which is why only threads that do nothing but copy
replicas call this; the helper threads a copy starts (the sender's read-ahead, the
receiver's receiving thread) inherit it (a Linux thread starts with its creator's policy, nice
value and I/O priority). They hold the GIL only between the C calls that release it (the
O_DIRECT read, ``send``, ``recv_into``, crc32c of a 4 MiB chunk, the O_DIRECT write), so a
training thread of the same process waits for a de-prioritised holder of the GIL at most that short
stretch of Python (plus the time the scheduler takes to run it: on a core that the training
leaves idle while it waits, at once).
"""

from __future__ import annotations

import logging
import os
import threading

from ..io._sys import set_idle_io_priority

__all__ = ["background"]
log = logging.getLogger("zerostall")


def background(cpu: str) -> None:
    """Idle I/O class and ``cpu`` priority for the calling thread (best effort: a platform or
    sandbox that refuses leaves the thread as it was, logged at debug)."""
    set_idle_io_priority()
    tid = threading.get_native_id()
    try:
        if cpu == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif cpu == "nice":
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError) as exc:
        log.debug("zerostall: cannot lower the CPU priority (%s) of replication thread %d: %s", cpu, tid, exc)
