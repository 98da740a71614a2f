"""Writes tests/data/layout1: a checkpoint in shard layout 1 (every tensor on its own page), by
zerostall before layout 2 (main at the time), for test_packed_layout.py to read."""
import sys, torch, zerostall
def state(v):
    return {"model": {"w": torch.arange(3000, dtype=torch.float32) * v, "b": torch.arange(3, dtype=torch.int64),
                      "h": (torch.arange(100) * v).to(torch.bfloat16)},
            "optim": {"s": torch.tensor(float(v)), "m": torch.arange(20000, dtype=torch.float32) + v},
            "step": int(v)}
root = sys.argv[1]
with zerostall.Checkpointer(root, incremental=True) as c:
    s = state(1)
    c.save(1, s).result()
    s["model"]["w"].mul_(2)
    s["step"] = 2
    c.save(2, s).result()
