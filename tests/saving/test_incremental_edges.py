"""Incremental saves at their edges (issue 23): identity comes from the typed tree path, a lost
or damaged base never stops saving, and the content check stays within the staging budget."""

import logging
import os
import shutil

import pytest
import torch

import zerostall
from zerostall.store.local import LocalTier
from tests.helpers import flip_byte

pytestmark = pytest.mark.timeout(120)


def _distinct(n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("mode", ["version", True])
@pytest.mark.parametrize("layout", ["dotted_vs_nested", "int_vs_str", "tuple_vs_list"])
def test_keys_that_print_alike_are_different_tensors(ckdir, mode, layout):
    """Two tensors whose key paths print the same string never share a record: the unchanged
    second save loads each one's own bytes (version mode referenced one for the other)."""
    t1, t2 = _distinct()
    state = {"dotted_vs_nested": {"a.b": t1, "a": {"b": t2}},
             "int_vs_str": {0: t1, "0": t2},
             "tuple_vs_list": {"x": (t1,), "x.0": t2}}[layout]  # "x.0": a tuple position and a str key
    with zerostall.Checkpointer(ckdir, incremental=mode, full_every=None) as ck:
        ck.save(0, state).result()
        r = ck.save(1, state).result()
        assert r.bytes_referenced == 2 * t1.numel() * 4  # both unchanged: both referenced
    for step in (0, 1):
        got = zerostall.load(ckdir, step=step)
        if layout == "dotted_vs_nested":
            assert torch.equal(got["a.b"], t1) and torch.equal(got["a"]["b"], t2), step
        elif layout == "int_vs_str":
            assert torch.equal(got[0], t1) and torch.equal(got["0"], t2), step
        else:
            assert torch.equal(got["x"][0], t1) and torch.equal(got["x.0"], t2), step


def test_identity_survives_a_restart(ckdir):
    """A base read from disk (a new Checkpointer) is matched by the same typed paths."""
    t1, t2 = _distinct(seed=1)
    state = {"a.b": t1, "a": {"b": t2}, 0: t2.clone(), "0": t1.clone()}
    with zerostall.Checkpointer(ckdir, incremental="version", full_every=None) as ck:
        ck.save(0, state).result()
    with zerostall.Checkpointer(ckdir, incremental="version", full_every=None) as ck:
        ck.save(1, state).result()
        r = ck.save(2, state).result()
        assert r.bytes_referenced == 4 * t1.numel() * 4
    for step in (1, 2):
        got = zerostall.load(ckdir, step=step)
        assert torch.equal(got["a.b"], t1) and torch.equal(got["a"]["b"], t2)
        assert torch.equal(got[0], t2) and torch.equal(got["0"], t1)


def _frozen_state(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"frozen": torch.randn(64 << 10, generator=g), "head": torch.randn(256, generator=g)}


def _damage(ckdir, how):
    step0 = os.path.join(ckdir, "step-0")
    shard = next(os.path.join(step0, n) for n in os.listdir(step0) if n.endswith(".shard"))
    if how == "deleted":
        shutil.rmtree(step0)
    elif how == "manifest_removed":
        os.unlink(os.path.join(step0, "manifest.json"))
    elif how == "truncated":
        os.truncate(shard, os.path.getsize(shard) - 4096)
    elif how == "shard_removed":
        os.unlink(shard)
    elif how == "symlinked":
        os.rename(shard, shard + ".moved")
        os.symlink(shard + ".moved", shard)
    elif how == "header_replaced":  # another file of the same size in its place
        with open(shard, "r+b") as f:
            f.write(b"\0" * 4096)
    elif how == "payload_bit_flipped":  # written to in place: only its mtime says so
        before = os.stat(shard).st_mtime_ns
        flip_byte(shard, 4096 + 5)
        st = os.stat(shard)
        if st.st_mtime_ns == before:  # the same coarse clock tick as the commit: as if a tick later
            os.utime(shard, ns=(st.st_atime_ns, before + 1))


@pytest.mark.parametrize("mode", ["version", True])
@pytest.mark.parametrize("how", ["deleted", "manifest_removed", "truncated", "shard_removed", "symlinked",
                                 "header_replaced", "payload_bit_flipped"])
def test_a_lost_base_never_stops_saving(ckdir, mode, how, caplog):
    """Step 0 (the base steps 1.. borrow from) is lost or damaged: the next saves write the
    bytes themselves, commit and load exactly; one warning names the base step."""
    state = _frozen_state()
    with zerostall.Checkpointer(ckdir, incremental=mode, full_every=None, keep_last=None) as ck:
        ck.save(0, state).result()
        state["head"].add_(1)
        assert ck.save(1, state).result().bytes_referenced > 0
        _damage(ckdir, how)
        with caplog.at_level(logging.WARNING, logger="zerostall"):
            for step in (2, 3, 4):
                state["head"].add_(1)
                r = ck.save(step, state).result()
                want = {k: v.clone() for k, v in state.items()}
                got = zerostall.load(ckdir, step=step)
                assert all(torch.equal(got[k], want[k]) for k in want), step
                if step == 2:
                    assert r.bytes_referenced == 0
                else:  # the new base is step 2: referenced again
                    assert {s.step for s in LocalTier(ckdir).read_manifest(step).ref_files} == {2}
    lost = [r.getMessage() for r in caplog.records if "base step 0" in r.getMessage()]
    assert len(lost) == 1, lost
    assert "gone or damaged" in lost[0]


_RSS_PROBE = """
import resource, sys, torch, zerostall
v = torch.randn(1, generator=torch.Generator().manual_seed(0)).expand(64 << 20)  # a 256 MiB stride-0 view
t = torch.randn(4096, 2048, generator=torch.Generator().manual_seed(1)).t()   # 32 MiB transposed
with zerostall.Checkpointer(sys.argv[1], incremental=True, full_every=None) as ck:
    ck.save(0, {"v": v, "t": t}).result()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = ck.save(1, {"v": v, "t": t}).result()  # unchanged: the content check reads both
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(r.bytes_referenced, (peak - base) * 1024)
"""


def test_content_check_of_strided_tensors_stays_within_the_budget(ckdir, tmp_path):
    """incremental=True checks an unchanged non-contiguous tensor by crc32c of its bytes: it
    was copied whole first (.contiguous()), 256 MiB of RSS against a 32 MiB staging budget; now
    it streams through one small buffer. Measured by the process's own peak RSS (getrusage)."""
    import subprocess
    import sys
    script = tmp_path / "probe.py"
    script.write_text(_RSS_PROBE)
    env = {**os.environ, "ZEROSTALL_BUDGET_BYTES": str(32 << 20)}
    res = subprocess.run([sys.executable, str(script), ckdir], capture_output=True, text=True, timeout=110, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    referenced, grew = (int(x) for x in res.stdout.split())
    assert referenced == (256 << 20) + (32 << 20)  # both checked and found unchanged (the crc matched)
    assert grew < 128 << 20, f"peak RSS +{grew >> 20} MiB for a save whose staging budget is 32 MiB"
    got = zerostall.load(ckdir, step=1)
    assert got["v"].shape == (64 << 20,) and bool((got["v"] == got["v"][0]).all())
