"""peers.cpu_priority: the replication threads lower their own CPU priority (per thread, never
the process's other threads) and their disk I/O class; the config refuses other values."""

import os
import threading

import psutil
import pytest

from zerostall import PeersConfig
from zerostall.errors import ConfigError
from zerostall.peers.stream import background


def _in_thread(cpu):
    seen = {}

    def run():
        tid = threading.get_native_id()
        background(cpu)
        seen["policy"] = os.sched_getscheduler(tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["ioclass"] = psutil.Process(tid).ionice().ioclass
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_each_mode_lowers_only_the_calling_thread():
    me = threading.get_native_id()
    before = (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me), psutil.Process(me).ionice().ioclass)
    idle = _in_thread("idle")
    assert idle["policy"] == os.SCHED_IDLE and idle["ioclass"] == psutil.IOPRIO_CLASS_IDLE
    nice = _in_thread("nice")
    assert nice["policy"] == os.SCHED_OTHER and nice["nice"] == 19 and nice["ioclass"] == psutil.IOPRIO_CLASS_IDLE
    normal = _in_thread("normal")
    assert normal["policy"] == before[0] and normal["nice"] == before[1]
    # the calling (training) thread is untouched by any of them
    assert (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me),
            psutil.Process(me).ionice().ioclass) == before


def test_config_names_the_bad_value():
    assert PeersConfig().cpu_priority == "idle"
    with pytest.raises(ConfigError, match="peers.cpu_priority.*'idle', 'nice' or 'normal'"):
        PeersConfig(cpu_priority="low")
