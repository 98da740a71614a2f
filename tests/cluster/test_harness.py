"""The namespace cluster itself (no torch, a few seconds): nodes reach each other over the
bridge and only over it, partition/heal and a `together` split do what they say, a rate is
applied with tc, a full disk is full, and close() leaves no namespace, mount or process."""

import errno
import os
import subprocess
import sys
import time

import pytest

SERVE = ("import socket\ns = socket.create_server(('0.0.0.0', 5001))\nwhile True:\n    c, _ = s.accept()\n"
         "    c.sendall(b'ok')\n    c.close()\n")


def _reach(frm, to):
    r = frm.run([sys.executable, "-c", f"import socket\ns = socket.create_connection(('{to.addr}', 5001), timeout=1)\n"
                                       "print(s.recv(2).decode())"])
    return r.stdout.strip() == "ok"


def test_nodes_partition_heal_rate_full_disk_and_cleanup(cluster):
    c = cluster(3, disk_bytes=16 << 20)
    n0, n1, n2 = c.nodes
    assert [n.addr.rsplit(".", 1)[1] for n in c.nodes] == ["101", "102", "103"]
    assert n0.env["MASTER_ADDR"] == n0.addr and n1.env["ZEROSTALL_NODE"] == "n1"
    for nd in c.nodes:
        nd.spawn([sys.executable, "-c", SERVE])
    end = time.monotonic() + 120
    while not all(_reach(n0, nd) for nd in (n1, n2)):  # the servers are starting
        assert time.monotonic() < end, "the nodes never reached each other"
        time.sleep(0.2)
    c.partition([n2])
    assert _reach(n0, n1) and not _reach(n0, n2) and not _reach(n2, n1)
    c.heal([n2])
    assert _reach(n2, n1)
    c.partition([n1, n2], together=True)
    assert _reach(n1, n2) and not _reach(n0, n1) and not _reach(n2, n0)
    c.heal()
    assert _reach(n0, n2)
    c.set_rate(n1, 100)
    shown = subprocess.run(["tc", "-n", c.bridge_ns, "qdisc", "show", "dev", n1.port], capture_output=True, text=True)
    assert "tbf" in shown.stdout and "100Mbit" in shown.stdout, shown.stdout
    assert c.fill_disk(n2) > 0
    with pytest.raises(OSError) as e:
        with open(os.path.join(n2.root, "more"), "wb") as f:
            f.write(b"x" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    assert e.value.errno == errno.ENOSPC
    c.unfill(n2)
    pids = [p.pid for nd in c.nodes for p in nd.procs]
    c.close()
    assert not [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
                if ln.startswith(c.tag)]
    assert c.tag not in open("/proc/mounts").read()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
