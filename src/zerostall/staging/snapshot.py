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
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Callable

import torch

from .._util import Worker
from .arena import Arena
from .job import SaveJob
from .ring import BlockRing

log = logging.getLogger("zerostall")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D uint8 view of ``t`` (a copy only if ``t`` is not contiguous)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class Snapshotter(Worker[SaveJob]):
    def __init__(self, arena: Arena, ring: BlockRing, on_staged: Callable[[SaveJob], None]):
        self.arena = arena
        self.ring = ring
        self.on_staged = on_staged
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
            self.on_staged(job)

    def _cuda_stream(self) -> "torch.cuda.Stream":
        if self._stream is None:
            self.arena.register_cuda()
            self._stream = torch.cuda.Stream()  # priority 0: the lowest
        return self._stream

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

        def fill_zero(a: int, b: int) -> None:
            for aoff, _, n in spans(a, b):
                arena_u8[aoff:aoff + n].zero_()

        header = torch.frombuffer(bytearray(job.header.encode()), dtype=torch.uint8)
        pos = 0
        for aoff, foff, n in spans(0, header.numel()):
            arena_u8[aoff:aoff + n].copy_(header[foff:foff + n])
        pos = header.numel()
        for item, tensor in zip(job.plan.items, job.leaves or ()):
            if job.error is not None:  # persist already failed: stop copying, drain
                return
            fill_zero(pos, item.offset)
            if item.nbytes:
                src = None
                for aoff, foff, n in spans(item.offset, item.offset + item.nbytes):
                    dst = arena_u8[aoff:aoff + n]
                    with torch.cuda.stream(stream) if stream is not None else nullcontext():
                        if n == item.nbytes and not tensor.is_contiguous() and tensor.dim() > 0:
                            # whole tensor in one run: strided copy straight into place
                            dst.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=use_cuda)
                        else:
                            if src is None:
                                src = flat_bytes(tensor)
                            rel = foff - item.offset
                            dst.copy_(src[rel:rel + n], non_blocking=use_cuda)
                    if stream is not None:
                        stream.synchronize()
                    ring.publish(job.g0 + (foff + n) // B)
            pos = item.offset + item.nbytes
        fill_zero(pos, job.plan.file_bytes)
