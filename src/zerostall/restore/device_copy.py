"""The copy stage of the restore read pipeline: *how* verified bytes leave the scratch
(:mod:`.stream` decides *when*). Called by :class:`.stream._Run`: :meth:`CudaCopier.copy` and
:func:`swap` from its copier threads, :func:`copy_staged` (after the gate), :func:`rollback`
(on failure) and :meth:`CudaCopier.sync` (at the end) from the caller's thread.

- CPU destinations (addresses): ``ctypes.memmove``, which releases the GIL, never a torch op
  (OpenMP teams: :mod:`zerostall.saving.snapshot`).
- CUDA destinations: :class:`CudaCopier`, ``non_blocking`` copies from the registered scratch
  (never across two registered chunks) on a side stream per device that first waits for the
  caller's current stream. Every ``copy`` waits for its copies, even when one raised, so a
  ring slot is reused only once its DMA is done; :meth:`CudaCopier.sync` waits for every
  stream before the load returns (no ``record_stream`` needed).

The caller's CUDA tensors are *staged*, never swapped (a swap moves every byte three times
over the bus and its rollback could fail on the device): a failed step touches no device
byte. A device copy failing *after* the gate may leave CUDA destinations part written, the
CPU ones as they were (:func:`copy_staged` copies to the devices first). New tensors are
copied as soon as their window verified.
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch

SWAP_PIECE = 512 << 10  # a swap's bytes at a time, through a cache-resident temporary

HostJob = tuple[int, int, int]  # (destination address, source address in the scratch, bytes)
DeviceJob = tuple[torch.Tensor, int, int]  # (flat uint8 CUDA destination bytes, source address, bytes)


def _copy(jobs: Iterable[HostJob]) -> None:
    for dst, src, n in jobs:  # ctypes.memmove releases the GIL
        ctypes.memmove(dst, src, n)


def _copy_split(jobs: Sequence[HostJob], piece: int = 16 << 20) -> None:
    if not jobs:
        return
    parts: list[list[HostJob]] = [[], []]
    sizes = [0, 0]
    for dst, src, n in jobs:
        for p in range(0, n, piece):
            k = 0 if sizes[0] <= sizes[1] else 1
            parts[k].append((dst + p, src + p, min(piece, n - p)))
            sizes[k] += min(piece, n - p)
    with ThreadPoolExecutor(2, thread_name_prefix="zerostall-restore-copy") as ex:
        for f in [ex.submit(_copy, p) for p in parts if p]:
            f.result()


def swap(dst: int, src: int, n: int, swapped: list[HostJob]) -> None:
    """Exchange ``n`` bytes at ``dst`` (the caller's) and ``src`` (the verified window), a
    cache-resident piece at a time; each piece exchanged is appended to ``swapped``."""
    tmp = ctypes.create_string_buffer(min(n, SWAP_PIECE))
    for p in range(0, n, SWAP_PIECE):
        k = min(SWAP_PIECE, n - p)
        ctypes.memmove(tmp, dst + p, k)
        ctypes.memmove(dst + p, src + p, k)
        ctypes.memmove(src + p, tmp, k)
        swapped.append((dst + p, src + p, k))


def rollback(swapped: Sequence[HostJob]) -> None:
    """Copy the swapped pieces' old bytes back, newest first."""
    for dst, old, n in reversed(swapped):
        ctypes.memmove(dst, old, n)


def cuda_target(map_location: Any) -> torch.device | None:
    """The CUDA device a new-dict load's tensors end on when ``map_location`` (checked by
    :func:`.state.location_mapper`) names one; None: read into CPU tensors, mapped after."""
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu", map_location.get(torch.device("cpu")))
    if isinstance(map_location, (str, torch.device, int)) and not isinstance(map_location, bool):
        dev = torch.device("cuda", map_location) if isinstance(map_location, int) else torch.device(map_location)
        if dev.type == "cuda" and torch.cuda.is_available():  # else mapped after (which raises)
            return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    return None


def register_scratch(scratch: Any, device: int) -> None:
    """Pin the scratch for DMA once, kept from forked children first (a transient scratch
    stays pageable: the driver stages its copies)."""
    arena = getattr(scratch, "arena", None) or scratch
    if hasattr(arena, "register_cuda") and not arena.cuda_registered:
        arena.keep_from_fork()  # the kernel copies pinned pages into every forked child (DataLoader workers)
        arena.register_cuda(device)


class CudaCopier:
    """Host-to-device copies from ``scratch`` to CUDA destinations on ``devices``. Built on the
    caller's thread (it records the caller's streams); ``copy`` from any thread; ``sync`` from
    the caller's thread. ``cuda``: ``torch.cuda``, the seam a test fakes."""

    def __init__(self, scratch: Any, devices: Iterable[int], cuda: Any = torch.cuda):
        self.cuda = cuda
        self.u8: torch.Tensor = scratch.u8
        self.base = self.u8.data_ptr()
        self.arena = getattr(scratch, "arena", None) or scratch
        self.copied = 0
        """Bytes copied to the device so far (under ``_lock``: two copier threads add)."""
        self._lock = threading.Lock()
        self.streams: dict[int, Any] = {}
        for i in sorted(set(devices)):
            register_scratch(scratch, i)
            with cuda.device(i):
                s = cuda.Stream(device=i)
                s.wait_event(cuda.current_stream(i).record_event())  # after the caller's queued work
            self.streams[i] = s

    def _pieces(self, src: int, n: int) -> list[tuple[int, int]]:
        """``n`` bytes at ``src`` as (scratch offset, length) pieces, each in one registered chunk."""
        off = src - self.base
        if not (0 <= off and off + n <= self.u8.numel()):
            raise ValueError(f"a device copy's source [{src:#x}, +{n}) lies outside the restore scratch")
        pinned = getattr(self.arena, "pinned_pieces", None)
        return pinned(off, n) if pinned is not None else [(off, n)]

    def copy(self, jobs: Sequence[DeviceJob]) -> None:
        """Queue every job's copy on its device's side stream, then wait for them (also when
        queuing one raised)."""
        by_dev: dict[int, list[DeviceJob]] = {}
        for job in jobs:
            by_dev.setdefault(job[0].device.index, []).append(job)
        used: list[Any] = []
        done = 0
        try:
            for i, part in by_dev.items():
                s = self.streams[i]
                used.append(s)
                with self.cuda.device(i), self.cuda.stream(s):
                    for dst, src, n in part:
                        at = 0
                        for off, k in self._pieces(src, n):
                            dst[at:at + k].copy_(self.u8[off:off + k], non_blocking=True)
                            at += k
                        done += n
        finally:
            self._wait(used)
            with self._lock:
                self.copied += done

    def _wait(self, streams: Sequence[Any]) -> None:
        events = []
        for s in streams:
            ev = self.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning a core
            ev.record(s)
            events.append(ev)
        for ev in events:
            ev.synchronize()  # releases the GIL

    def sync(self) -> None:
        """Wait for every copy queued on the side streams (none should be left)."""
        self._wait(list(self.streams.values()))


def copy_staged(host: Sequence[HostJob], dev: Sequence[DeviceJob], copier: CudaCopier | None) -> None:
    """The staged part of an in-place load, after the gate (caller's thread): the CUDA
    destinations first (a device copy can fail, a memmove cannot: the CPU destinations are
    then as they were), then the CPU ones by two threads. Raises what a copy raised."""
    if dev and copier is not None:
        copier.copy(dev)
    _copy_split(host)
