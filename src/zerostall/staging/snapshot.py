"""The snapshot thread: copies each save's tensors into the arena ring, in file order.

Runs in one daemon thread owned by the ``Checkpointer``; jobs arrive through ``submit()``
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
short-lived helper thread instead, in row chunks of at most ``STRIDED_CHUNK_BYTES`` that
stream through the ring like any tensor (never one whole copy outside the staging budget).
"""

from __future__ import annotations

import logging
import ctypes
import threading
import time
from typing import Any, Callable, Iterator

import torch

from .._util import Worker
from .arena import Arena
from .job import SaveJob
from .ring import BlockRing

log = logging.getLogger("zerostall")


_memmove = ctypes.memmove
_memset = ctypes.memset
STRIDED_CHUNK_BYTES = 8 << 20


def row_slices(t: torch.Tensor, limit: int = STRIDED_CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """Consecutive slices (views) of ``t`` covering it in row-major order, each at most
    ``limit`` bytes (or one element row of the innermost dimension)."""
    es = t.element_size()
    if t.dim() == 0 or t.numel() * es <= limit:
        yield t
        return
    rows = t.shape[0]
    row_bytes = max(1, t[0].numel() * es)
    if row_bytes <= limit or t.dim() == 1:
        per = max(1, limit // row_bytes)
        for i in range(0, rows, per):
            yield t[i:i + per]
    else:
        for i in range(rows):
            yield from row_slices(t[i], limit)


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
            if job.incr is not None:  # may shrink job.plan to what must be written
                job.incr.tracker.decide(job, self._cuda_stream)
            job.layout_ready.set()
            self._stage(job)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            log.error("zerostall: snapshot of step %d failed: %s", job.step, exc)
            job.fail(exc)
        finally:
            self.ring.publish(job.g_end)  # a failed job's blocks are drained unwritten
            job.leaves = None
            job.layout_ready.set()
            job.snapshot_s = time.perf_counter() - t0
            job.t_staged = time.perf_counter()
            job.staged.set()

    def _cuda_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self.arena.register_cuda()
            self._stream = torch.cuda.Stream()  # priority 0: the lowest
        return self._stream

    def _stage_strided(self, job: SaveJob, tensor: torch.Tensor, offset: int, spans: Callable[..., Any]) -> None:
        """Copy a non-contiguous CPU tensor slice by slice through one small bounce buffer
        (runs in a helper thread; one allocation, never a whole contiguous copy)."""
        base, B = self.arena.address, self.ring.block_bytes
        es = tensor.element_size()
        buf = torch.empty(min(STRIDED_CHUNK_BYTES, max(tensor.numel() * es, es)), dtype=torch.uint8)
        foff = offset
        for sl in row_slices(tensor):
            n_sl = sl.numel() * es
            if n_sl > buf.numel():
                buf = torch.empty(n_sl, dtype=torch.uint8)
            buf[:n_sl].view(sl.dtype).view(sl.shape).copy_(sl)
            for aoff, f, n in spans(foff, foff + n_sl):
                _memmove(base + aoff, buf.data_ptr() + (f - foff), n)
                self.ring.publish(job.g0 + (f + n) // B)
            foff += n_sl

    def _stage(self, job: SaveJob) -> None:
        ring, B = self.ring, self.ring.block_bytes
        arena_u8 = self.arena.u8
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
                yield ring.slot_offset(g) + pos % B, pos, end - pos
                pos = end

        base = self.arena.address

        def fill_zero(a: int, b: int) -> None:
            for aoff, _, n in spans(a, b):
                _memset(base + aoff, 0, n)

        header = job.header.encode()
        for aoff, foff, n in spans(0, len(header)):
            self.arena.mv[aoff:aoff + n] = header[foff:foff + n]
        pos = len(header)
        for item, tensor in zip(job.plan.items, job.leaves or ()):
            if job.error is not None:  # persist already failed: stop copying, drain
                return
            fill_zero(pos, item.offset)
            if item.nbytes:
                on_cpu = tensor.device.type == "cpu"
                if on_cpu and not tensor.is_contiguous():
                    _in_helper_thread(lambda t=tensor, o=item.offset: self._stage_strided(job, t, o, spans))
                    pos = item.offset + item.nbytes
                    continue
                flat = None
                for aoff, foff, n in spans(item.offset, item.offset + item.nbytes):
                    rel = foff - item.offset
                    if on_cpu:
                        _memmove(base + aoff, tensor.data_ptr() + rel, n)
                    else:
                        dst = arena_u8[aoff:aoff + n]
                        with torch.cuda.stream(stream):  # type: ignore[arg-type]
                            if flat is None:
                                flat = flat_bytes(tensor)
                            dst.copy_(flat[rel:rel + n], non_blocking=True)
                        stream.synchronize()  # type: ignore[union-attr]
                    ring.publish(job.g0 + (foff + n) // B)
            pos = item.offset + item.nbytes
        fill_zero(pos, job.plan.file_bytes)
