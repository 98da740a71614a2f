"""The snapshot thread: copies each save's tensors into the arena ring, in file order.

Runs in one daemon thread owned by the process's staging pool (:mod:`.pool`); jobs arrive through ``submit()``
from the caller's thread and are staged strictly in order. For each job it writes the shard
header, every tensor's bytes (zero-padding each to 4 KiB) and the zero tail, and publishes
finished blocks to the persist thread (which checksums them while its writes are in flight,
keeping crc32c off the path that the training loop may wait on).
CPU tensors are copied with ``Tensor.copy_`` (which releases the GIL); CUDA tensors are
copied non-blocking on a dedicated low-priority stream into the registered arena, after an
event recorded on the caller's stream at ``save()`` time.

Never mutates the caller's tensors; drops its references to them once the job is staged.

CPU bytes move with ``memmove``/``memset`` through ctypes (which releases the GIL), never
with a torch op: a long-lived thread that has run an OpenMP-parallel torch op keeps its
own OpenMP team, and measured here that alone slowed the training thread's steps by ~15%
for as long as the thread lived. The rare non-contiguous CPU tensor is copied by torch in a
short-lived helper thread instead.
"""

from __future__ import annotations

import logging
import ctypes
import threading
import time
from typing import Callable

import torch

from .._util import Worker
from .arena import Arena
from .job import SaveJob
from .ring import BlockRing

log = logging.getLogger("zerostall")


_memmove = ctypes.memmove
_memset = ctypes.memset


def _in_helper_thread(fn: Callable[[], None]) -> None:
    """Run a torch op in a thread that then exits (see the module docstring)."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            err.append(exc)

    t = threading.Thread(target=run, name="zerostall-copy")
    t.start()
    t.join()
    if err:
        raise err[0]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view of ``t`` (a copy only if ``t`` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class Snapshotter(Worker[SaveJob]):
    def __init__(self, arena: Arena, ring: BlockRing):
        self.arena = arena
        self.ring = ring
        self._stream = None
        super().__init__("zerostall-snapshot")

    # -- snapshot thread ----------------------------------------------------------------
    def handle(self, job: SaveJob) -> None:
        t0 = time.perf_counter()
        try:
            self._stage(job)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            log.error("zerostall: snapshot of step %d failed: %s", job.step, exc)
            job.fail(exc)
        finally:
            self.ring.publish(job.g_end)  # a failed job's blocks are drained unwritten
            job.leaves = None
            job.snapshot_s = time.perf_counter() - t0
            job.t_staged = time.perf_counter()
            job.staged.set()

    def _cuda_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self.arena.register_cuda()
            self._stream = torch.cuda.Stream()  # priority 0: the lowest
        return self._stream

    @staticmethod
    def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
        out: list[torch.Tensor] = []
        _in_helper_thread(lambda: out.append(tensor.contiguous()))
        return out[0]

    def _stage(self, job: SaveJob) -> None:
        ring, B = self.ring, self.ring.block_bytes
        arena = job.arena or self.arena  # the pool swaps arenas only between jobs
        arena_u8 = arena.u8
        use_cuda = "cuda" in job.plan.devices
        stream = self._cuda_stream() if use_cuda else None
        if stream is not None and job.cuda_event is not None:
            stream.wait_event(job.cuda_event)

        def spans(a: int, b: int):
            """Yield (arena offset, file offset, length) runs covering file bytes [a, b)."""
            pos = a
            while pos < b:
                g = job.g0 + pos // B
                run_end_g = ring.wait_writable(g)
                end = min(b, (run_end_g - job.g0) * B)
                aoff = ring.slot_offset(g) + pos % B
                arena.wait_ready(aoff + end - pos)  # the first lap streams behind the faulter
                yield aoff, pos, end - pos
                pos = end

        base = arena.address

        def fill_zero(a: int, b: int) -> None:
            for aoff, _, n in spans(a, b):
                _memset(base + aoff, 0, n)

        header = job.header.encode()
        for aoff, foff, n in spans(0, len(header)):
            arena.mv[aoff:aoff + n] = header[foff:foff + n]
        pos = len(header)
        for item, tensor in zip(job.plan.items, job.leaves or ()):
            if job.error is not None:  # persist already failed: stop copying, drain
                return
            fill_zero(pos, item.offset)
            if item.nbytes:
                on_cpu = tensor.device.type == "cpu"
                if on_cpu and not tensor.is_contiguous():
                    tensor = self._contiguous(tensor)
                for aoff, foff, n in spans(item.offset, item.offset + item.nbytes):
                    rel = foff - item.offset
                    if on_cpu:
                        _memmove(base + aoff, tensor.data_ptr() + rel, n)
                    else:
                        dst = arena_u8[aoff:aoff + n]
                        with torch.cuda.stream(stream):  # type: ignore[arg-type]
                            dst.copy_(flat_bytes(tensor)[rel:rel + n], non_blocking=True)
                        stream.synchronize()  # type: ignore[union-attr]
                    ring.publish(job.g0 + (foff + n) // B)
            pos = item.offset + item.nbytes
        fill_zero(pos, job.plan.file_bytes)
