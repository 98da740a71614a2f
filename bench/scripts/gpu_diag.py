"""Facts about this host's CUDA staging path, printed once by scripts/gpu-check.sh (~10 s).

Not a test: nothing here passes or fails; each section prints what it measured, or its error.
What it answers (all questions the code was written around without a device at hand):

* the pool's arena after a CUDA save: registered? how many bytes, any registration error;
* device-to-host GB/s into torch's pinned memory, into the registered arena, and a copy that
  spans two separately registered ranges versus the same bytes as two copies (does the driver
  treat a spanning copy as pageable?); cudaHostRegister time per GiB;
* host-to-device GB/s (the restore side) from pageable, pinned and registered memory on a
  side stream, and the same spanning-copy question;
* fork after cudaHostRegister of anonymous memory: does the kernel copy the pinned pages into
  the child at fork (the reason the pool's arenas are MADV_DONTFORK), and how long fork takes.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import time
import traceback

import torch

MiB = 1 << 20


def section(name):
    def wrap(fn):
        def run():
            print(f"== {name}", flush=True)
            try:
                fn()
            except Exception:  # noqa: BLE001 - a diagnostic reports, it does not stop
                traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        return run
    return wrap


def gbps(nbytes, fn, repeat=3):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


@section("versions")
def versions():
    import zerostall
    print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0),
          "zerostall", zerostall.__file__)


@section("pool arena after a CUDA save")
def pool_after_save():
    import zerostall
    from zerostall.saving import pool as zpool
    x = torch.randn(64 * MiB, device="cuda")  # 256 MiB
    with tempfile.TemporaryDirectory() as d:
        with zerostall.Checkpointer(d) as ck:
            t0 = time.perf_counter()
            h = ck.save(1, {"x": x})
            t1 = time.perf_counter()
            h.wait_staged()
            t2 = time.perf_counter()
            rec = h.result()
            a = zpool.current().arena
            print(f"save() {1e3 * (t1 - t0):.1f} ms, staged after {1e3 * (t2 - t0):.1f} ms "
                  f"({x.numel() * 4 / (t2 - t0) / 1e9:.2f} GB/s incl. first-save setup), ok={rec.ok}")
            print(f"arena: {a.nbytes >> 20} MiB reserved, ready {a.ready >> 20} MiB, cuda_registered="
                  f"{a.cuda_registered}, pinned {a.cuda_pinned_bytes >> 20} MiB in {len(a._cuda_chunks)} chunks, "
                  f"device {a.cuda_device}, error {a.cuda_error}")
            h = ck.save(2, {"x": x})
            t0 = time.perf_counter()
            h.wait_staged()
            print(f"second save staged in {1e3 * (time.perf_counter() - t0):.1f} ms "
                  f"({x.numel() * 4 / (time.perf_counter() - t0) / 1e9:.2f} GB/s)")
            h.result()
        ok = torch.equal(zerostall.load(d)["x"], x.cpu())
        print("loaded back bit-exact:", ok)


def _spanning_vs_split(dst, src, n, wrap=lambda fn: fn):
    """GB/s (as text) of one async copy ``src`` -> ``dst`` spanning the two halves' separate
    cudaHostRegister ranges, and of two copies split at the boundary; ``wrap`` runs a copy
    (e.g. on a side stream). Measured on an H200, torch 2.11: the spanning copy fails with
    cudaErrorInvalidValue."""
    half = n // 2
    try:
        spanning = f"{gbps(n, wrap(lambda: dst.copy_(src, non_blocking=True))):.1f} GB/s"
    except Exception as exc:  # noqa: BLE001 - reported
        torch.cuda.synchronize()
        spanning = f"FAILS ({type(exc).__name__}: {str(exc).splitlines()[0]})"

    def split():
        dst[:half].copy_(src[:half], non_blocking=True)
        dst[half:].copy_(src[half:], non_blocking=True)
    return spanning, f"{gbps(n, wrap(split)):.1f} GB/s"


@section("device-to-host bandwidth")
def d2h():
    from zerostall.memory.arena import Arena, CUDA_HOST_REGISTER_PORTABLE
    n = 256 * MiB
    src = torch.randn(n // 4, device="cuda").view(torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    print(f"torch pinned: {gbps(n, lambda: pinned.copy_(src, non_blocking=True)):.1f} GB/s; "
          f"pageable: {gbps(n, lambda: pageable.copy_(src)):.1f} GB/s")
    a = Arena(n, mlock=False, prefault=True)
    cudart = torch.cuda.cudart()
    half = n // 2
    t0 = time.perf_counter()
    errs = [int(cudart.cudaHostRegister(a.address, half, CUDA_HOST_REGISTER_PORTABLE)),
            int(cudart.cudaHostRegister(a.address + half, half, CUDA_HOST_REGISTER_PORTABLE))]
    reg_s = time.perf_counter() - t0
    print(f"cudaHostRegister of {n >> 20} MiB in two ranges: {reg_s * 1e3:.1f} ms "
          f"({reg_s / (n / (1 << 30)) * 1e3:.0f} ms/GiB), errors {errs}")
    spanning_txt, split_txt = _spanning_vs_split(a.u8, src, n)
    print(f"registered arena: one copy spanning both ranges {spanning_txt}; split at the boundary {split_txt}")
    for off in (0, half):
        cudart.cudaHostUnregister(a.address + off)
    a.close()


@section("host-to-device (restore into CUDA tensors)")
def h2d():
    """The restore side: H2D GB/s from pageable memory, torch's pinned memory and the
    registered arena (one range; a copy spanning two registrations versus split, as for D2H),
    from one side stream as restore/device_copy.py copies."""
    from zerostall.memory.arena import Arena, CUDA_HOST_REGISTER_PORTABLE
    n = 256 * MiB
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)

    def on_side(fn):
        def run():
            with torch.cuda.stream(s):
                fn()
            s.synchronize()
        return run
    print(f"torch pinned: {gbps(n, on_side(lambda: dst.copy_(pinned, non_blocking=True))):.1f} GB/s; "
          f"pageable non_blocking: {gbps(n, on_side(lambda: dst.copy_(pageable, non_blocking=True))):.1f} GB/s")
    a = Arena(n, mlock=False, prefault=True)
    cudart = torch.cuda.cudart()
    half = n // 2
    errs = [int(cudart.cudaHostRegister(a.address, half, CUDA_HOST_REGISTER_PORTABLE)),
            int(cudart.cudaHostRegister(a.address + half, half, CUDA_HOST_REGISTER_PORTABLE))]
    spanning_txt, split_txt = _spanning_vs_split(dst, a.u8, n, on_side)
    print(f"registered arena (errors {errs}): one copy spanning both ranges {spanning_txt}; "
          f"split at the boundary {split_txt}")
    for off in (0, half):
        cudart.cudaHostUnregister(a.address + off)
    a.close()


@section("fork after cudaHostRegister (no MADV_DONTFORK)")
def fork_pinned():
    from zerostall.memory.arena import Arena, CUDA_HOST_REGISTER_PORTABLE
    n = 512 * MiB
    a = Arena(n, mlock=False, prefault=True)
    ctypes.memset(a.address, 1, n)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(a.address, n, CUDA_HOST_REGISTER_PORTABLE))
    lo = a.address
    with open("/proc/self/smaps") as f:
        flags = _smaps_entry(f, lo).get("VmFlags", "?")
    print(f"registered {n >> 20} MiB (error {err}); VmFlags of the mapping: {flags}")
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            with open("/proc/self/smaps") as f:
                e = _smaps_entry(f, lo)
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    fork_s = time.perf_counter() - t0
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    print(f"fork took {fork_s * 1e3:.1f} ms; the child's view of the range: {out.decode()[:400]}")
    print("(Private_Dirty ~ the whole range in the child = the pinned pages were copied at fork; "
          "an empty entry = the driver made it DONTFORK itself)")
    cudart.cudaHostUnregister(a.address)
    a.close()


def _smaps_entry(f, address):
    entry, inside = {}, False
    for line in f:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if inside:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            if inside:
                entry["range_mib"] = (hi - lo) >> 20
        elif inside:
            k, _, v = line.partition(":")
            if k in ("Rss", "Private_Dirty", "Shared_Dirty", "Locked", "VmFlags"):
                entry[k] = v.strip()
    return entry


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to diagnose")
        sys.exit(0)
    for fn in (versions, pool_after_save, d2h, h2d, fork_pinned):
        fn()
