"""One rank = one simulated node of adv1's peer-replica checks (run by test_adv_peers.py).

argv: scenario base out. Env as peers_worker.py (ZEROSTALL_NODE, ZS_REPLICAS, ZS_STEPS) plus
ZS_KW: extra Checkpointer keywords as JSON (e.g. {"incremental": true}); ZS_KILL_RANK and
ZS_KILL_STEP: that rank's node dies (SIGKILL, at the transport seam) as it starts copying that
step to a peer, i.e. right after the step committed everywhere. The state
(:func:`workers.frozen_state`) has a tensor that never changes (``frozen``: an incremental step
references it) and one that does.
"""

import json
import os
import signal

from workers import env_checkpointer, frozen_state, leave, load_into, report, save_steps, start


def main():
    scenario, base, out, rank, node = start()
    kw = json.loads(os.environ.get("ZS_KW", "{}"))
    res = {"rank": rank, "node": node}
    kill = int(os.environ.get("ZS_KILL_RANK", -1))
    if rank == kill:
        from zerostall.peers.tcp import TcpTransport
        put = TcpTransport.put

        def dying_put(self, ep, src, step, *a, **k):
            if step == int(os.environ["ZS_KILL_STEP"]):
                report(res, out)
                os.kill(os.getpid(), signal.SIGKILL)
            return put(self, ep, src, step, *a, **k)
        TcpTransport.put = dying_put
    ck = env_checkpointer(base, **kw)
    if scenario == "save":
        res["protected"] = {}
        save_steps(ck, rank, [int(s) for s in os.environ.get("ZS_STEPS", "1,2").split(",")], res, frozen_state)
    elif scenario == "load":
        load_into(ck, frozen_state(rank + 100, 0), lambda step: frozen_state(rank, step), res)
    ck.close()
    report(res, out)
    leave(out, absent=[kill])


if __name__ == "__main__":
    main()
