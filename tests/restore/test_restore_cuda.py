"""Restore into CUDA tensors through the read pipeline (restore/device_copy.py), on a real
device (skipped without one: marker ``gpu``, see tests/conftest.py).

In place into the caller's CUDA tensors (zerostall.load with the shared bounce, and
Checkpointer.load through the staging pool), new dicts with ``map_location`` a CUDA device,
a state larger than the scratch (verify first, then H2D through the ring), a mixed CPU/CUDA
state, and a corrupt step or failing gate leaving every CUDA tensor exactly as it was.
``last_stats.device_bytes`` proves the bytes went through the device copier (not a CPU
tensor and ``copy_`` afterwards). Written without a device at hand: small tensors, no
timing, every value compared bit for bit.
"""


import pytest
import torch

import zerostall
from zerostall.errors import CorruptCheckpoint, DistributedError
from zerostall.restore import LoadRequest
from zerostall.restore import load as restore_load
from zerostall.restore import step as rstep
from zerostall.memory.arena import Arena
from tests.helpers import two_steps
from tests.restore.test_restore_pipeline import _flip_tensor

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]


def _state(v: float, device="cuda") -> dict:
    g = torch.Generator().manual_seed(int(v * 10))
    cpu = {"w": torch.randn(1024, 1031, generator=g) + v,  # 4.2 MB, not a multiple of 4 KiB
           "b": (torch.randn(3000, generator=g) + v).to(torch.bfloat16), "s": torch.tensor(v),
           "mask": torch.arange(5001) % 3 == int(v) % 3, "i64": torch.arange(777, dtype=torch.int64) * int(v),
           "empty": torch.empty(0, 4)}
    return {k: t.to(device) for k, t in cpu.items()}


def _dest(device="cuda") -> dict:
    return {k: torch.full_like(t, 7) if t.dtype != torch.bool else torch.ones_like(t)
            for k, t in _state(1.0, device).items()}


def _bits(t):
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype != torch.bool and t.numel() else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _nbytes(sd, device="cuda"):
    return sum(t.nbytes for t in sd.values() if t.device.type == device)


@pytest.fixture
def small_bounce():
    """A 1 MiB scratch (a step larger than it is verified first, then copied through the
    ring); closed after the test, which unregisters it before unmapping it."""
    a = Arena(1 << 20, mlock=False)
    yield a
    a.close()


def _ck(tmp_path):
    return two_steps(tmp_path, _state)


def _flip(root, step, key, at=1000):
    _flip_tensor(root, step, key, at)


def test_in_place_into_cuda_tensors_is_bit_exact_and_goes_through_the_device_copier(tmp_path):
    root = _ck(tmp_path)
    sd = _dest()
    ptrs = {k: t.data_ptr() for k, t in sd.items()}
    zerostall.load(root, sd, step=2)
    assert _same(sd, _state(2.0))
    assert {k: t.data_ptr() for k, t in sd.items()} == ptrs  # filled in place, not replaced
    assert rstep.last_stats.device_bytes == _nbytes(sd)
    bounce = rstep.shared_bounce()
    assert bounce.cuda_registered and bounce.cuda_pinned_bytes > 0 and bounce.cuda_error is None


def test_in_place_through_the_checkpointers_pool(tmp_path):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        ck.save(1, _state(1.0)).result()
        ck.save(2, _state(2.0)).result()
        sd = _dest()
        ck.load(sd, step=2)
        assert _same(sd, _state(2.0))
        assert rstep.last_stats.device_bytes == _nbytes(sd)
        ck.load(sd, step=1)
        assert _same(sd, _state(1.0))


@pytest.mark.parametrize("where", ["cuda", "cuda:0", 0, {"cpu": "cuda:0"}, torch.device("cuda", 0)],
                         ids=["cuda", "cuda:0", "int", "dict", "device"])
def test_new_dict_with_map_location_cuda_lands_on_the_device(tmp_path, where):
    root = _ck(tmp_path)
    out = zerostall.load(root, step=2, map_location=where)
    assert all(t.device == torch.device("cuda", 0) for t in out.values())
    assert _same(out, _state(2.0))
    assert rstep.last_stats.device_bytes == _nbytes(out)


def test_a_state_larger_than_the_scratch_verifies_first_then_copies_through_the_ring(tmp_path, small_bounce):
    root = _ck(tmp_path)
    sd = _dest()
    restore_load(root, sd, LoadRequest(step=2), bounce=small_bounce)  # 1 MiB: verify, then the ring
    assert _same(sd, _state(2.0)) and rstep.last_stats.device_bytes == _nbytes(sd)
    assert small_bounce.cuda_registered and small_bounce.cuda_pinned_bytes == small_bounce.nbytes
    out = restore_load(root, None, LoadRequest(step=1, map_location="cuda"), bounce=small_bounce)
    assert _same(out, _state(1.0))


def test_mixed_cpu_and_cuda_destinations(tmp_path):
    root = _ck(tmp_path)
    sd = _dest()
    for k in ("b", "mask"):
        sd[k] = sd[k].cpu()
    zerostall.load(root, sd, step=2)
    want = _state(2.0)
    assert _same({k: t.cpu() for k, t in sd.items()}, {k: t.cpu() for k, t in want.items()})
    assert sd["b"].device.type == "cpu" and sd["w"].device.type == "cuda"
    assert rstep.last_stats.device_bytes == _nbytes(sd)


@pytest.mark.parametrize("small", [False, True], ids=["staged", "verify-first"])
def test_a_corrupt_step_leaves_the_cuda_tensors_unchanged(tmp_path, small, small_bounce):
    root = _ck(tmp_path)
    _flip(root, 2, "w", at=4_000_000)  # late in the step: earlier windows verified first
    sd = _dest()
    before = {k: t.clone() for k, t in sd.items()}
    kw = {"bounce": small_bounce} if small else {}
    with pytest.raises(CorruptCheckpoint, match="'w'"):
        restore_load(root, sd, LoadRequest(step=2, fallback=False), **kw)
    torch.cuda.synchronize()
    assert _same(sd, before)
    restore_load(root, sd, **kw)  # falls back to step 1
    assert _same(sd, _state(1.0))


def test_a_failing_gate_leaves_the_cuda_tensors_unchanged(tmp_path):
    root = _ck(tmp_path)
    sd = _dest()
    before = {k: t.clone() for k, t in sd.items()}

    def gate():
        raise DistributedError("injected: another rank failed")
    with pytest.raises(DistributedError):
        restore_load(root, sd, LoadRequest(step=2, gate=gate))
    torch.cuda.synchronize()
    assert _same(sd, before)


def test_the_callers_queued_kernels_run_before_the_copies(tmp_path):
    """A kernel queued on the caller's stream before the load writes the destination first;
    the restored bytes win (the side stream waits for the caller's stream)."""
    root = _ck(tmp_path)
    sd = _dest()
    torch.cuda._sleep(500_000_000)  # keep the caller's stream busy (~0.3 s, longer than the read)
    sd["w"].fill_(3.0)  # queued behind the sleep
    zerostall.load(root, sd, step=2)
    torch.cuda.synchronize()
    assert _same(sd, _state(2.0))


def test_bench_restore_scenario_on_cuda(tmp_path):
    """``zerostall bench --scenario restore --device cuda`` at a small size: every row on the
    device, bit-exact, with its fraction of the read line rate (no timing threshold)."""
    import json
    from zerostall.cli import main as cli
    out = tmp_path / "restore-cuda.json"
    assert cli(["bench", "--scenario", "restore", "--device", "cuda", "--size-gib", "0.01", "--repeat", "1",
                "--dir", str(tmp_path / "work"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["device"] == "cuda" and doc["device_name"]
    res = {r["method"]: r for r in doc["results"]}
    for name in ("zerostall-threads in place", "zerostall-threads new dict", "zerostall.load-threads in place",
                 "zerostall.load-threads new dict", "dcp.load in place", "torch.load"):
        assert res[name]["verified"] is True and res[name]["device"] == "cuda", name
        assert res[name]["fraction_of_read_line_rate"] > 0
