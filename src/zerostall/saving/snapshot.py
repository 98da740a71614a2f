"""The snapshot thread: copies each save's tensors into the arena ring, in file order.

One daemon thread owned by the process's staging pool (:mod:`.pool`); jobs are staged strictly
in the order the caller queued them: the shard header, every tensor's bytes (zero-padded to
4 KiB), the zero tail, each finished block published to the persist thread. CUDA tensors are
copied non-blocking on a low-priority side stream of their device (:class:`DeviceStreams`),
after the event :func:`record_save_events` recorded at ``save()``. Then it encodes the Python
objects ``save()`` only snapshotted (:class:`~zerostall.format.frozen.DeferredTree`; an error
there is raised by the committer).

Never mutates the caller's tensors; drops them once the job is staged. CPU bytes move with
``memmove``/``memset``, never a torch op: a long-lived thread that ran an OpenMP-parallel torch
op keeps its own OpenMP team, which slows training (docs/speed-tricks.md). A non-contiguous CPU
tensor is copied by torch in a short-lived helper thread, in row chunks of at most
``STRIDED_CHUNK_BYTES``.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import operator
import time
from typing import Any, Callable, Iterator

import torch

from .._fast import DEVICE, NBYTES, OFFSET, copy_crc, copy_runs, crc_runs, zero_runs
from .._util import Worker, run_in_fresh_thread
from ..memory.arena import Arena
from .job import Forward, Job, Slot
from .plan import SavePlan
from ..memory.ring import BlockRing

log = logging.getLogger("zerostall")


_memmove, _memset = ctypes.memmove, ctypes.memset
CRC_AT_COPY = True
"""A full save of host tensors checksums each tensor as the snapshot thread copies it
(:func:`~zerostall._fast.copy_crc`; ``Job.crc_at_copy``): the persist thread then writes without a
crc pass of its own. The seam the tests flip to compare with the persist thread's checksums."""
STRIDED_CHUNK_BYTES = 8 << 20
SMALL_ITEM_BYTES = 1 << 20
"""Tensors up to this size are copied in runs (:meth:`Snapshotter._copy_small`); a larger one
is streamed block by block, so the persist thread can write its first blocks meanwhile."""
_CONTIG = torch.Tensor.is_contiguous


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


def bounce_rows(t: torch.Tensor, limit: int = STRIDED_CHUNK_BYTES) -> Iterator[tuple[int, int]]:
    """(address, length) of each of :func:`row_slices`, copied in turn into one bounce buffer
    of at most ``limit`` bytes (or one innermost row); valid until the next is yielded. Torch
    ops: run it in a short-lived helper thread (see the module docstring)."""
    es = t.element_size()
    buf = torch.empty(min(limit, max(t.numel() * es, es)), dtype=torch.uint8)
    for sl in row_slices(t, limit):
        n = sl.numel() * es
        if n > buf.numel():
            buf = torch.empty(n, dtype=torch.uint8)
        buf[:n].view(sl.dtype).view(sl.shape).copy_(sl)
        yield buf.data_ptr(), n


def _index(device: torch.device, cuda: Any) -> int:
    return device.index if device.index is not None else int(cuda.current_device())


def record_save_events(tensors: Any, cuda: Any = torch.cuda) -> dict[int, Any]:
    """On the caller's thread in ``save()``: one event per CUDA device among ``tensors``,
    recorded on that device's current stream (the snapshot copies wait for it, so they see
    every kernel the caller queued before ``save()``)."""
    events: dict[int, Any] = {}
    for t in tensors:
        if t.device.type != "cuda":
            continue
        i = _index(t.device, cuda)
        if i not in events:
            with cuda.device(i):
                ev = cuda.Event()
                ev.record(cuda.current_stream(i))
            events[i] = ev
    return events


class DeviceStreams:
    """The snapshot thread's CUDA side streams: one per device, created on first use. ``cuda``
    is ``torch.cuda``, the seam the unit tests fake. Snapshot thread only."""

    def __init__(self, cuda: Any = torch.cuda):
        self.cuda = cuda
        self._streams: dict[int, Any] = {}
        self._done: dict[int, Any] = {}

    def stream(self, index: int) -> Any:
        s = self._streams.get(index)
        if s is None:
            with self.cuda.device(index):
                s = self.cuda.Stream(device=index, priority=0)  # 0: the lowest priority
            self._streams[index] = s
        return s

    def run(self, device: torch.device, fn: Callable[[], None], after: dict[int, Any] | None = None) -> None:
        """Run ``fn`` (which queues a copy) with ``device`` current and its side stream
        current, after the caller's ``save()`` event of that device; return once the copy
        has finished (an event recorded on the side stream, then waited for)."""
        i = _index(device, self.cuda)
        s = self.stream(i)
        with self.cuda.device(i), self.cuda.stream(s):
            if after and i in after:
                s.wait_event(after[i])
            fn()
            ev = self._done.get(i)
            if ev is None:
                # blocking: the snapshot thread sleeps while the copy runs instead of spinning
                # a core (cudaEventBlockingSync) that the data loader may need
                ev = self._done[i] = self.cuda.Event(blocking=True)
            ev.record(s)
        ev.synchronize()


class Snapshotter(Worker["Job | Slot | Forward"]):
    def __init__(self, arena: Arena, ring: BlockRing):
        self.arena = arena
        self.ring = ring
        self._streams: DeviceStreams | None = None
        super().__init__("zerostall-snapshot")

    # -- snapshot thread ----------------------------------------------------------------
    def handle(self, job: Job | Slot | Forward) -> None:
        """Stage one job: hand it on to its persist worker, fix its layout (incremental saves
        decide what to reference), copy, append what changed (incremental), then put
        ``staged``. Every handoff is put, on failure too."""
        if isinstance(job, Slot):  # reserved, never queued: publish unwritten, the pool drains
            self.ring.publish(job.g_end)
            return
        if isinstance(job, Forward):  # a persist worker's stop, behind the jobs queued before it
            Worker._put_last(job.worker, job.item)
            return
        if job.persist is not None:
            job.persist.submit(job)  # the next stage: it writes blocks as they are published
        t0 = time.perf_counter()
        plan, status = job.request.plan, job.status
        crcs = [0] * len(plan.items) if job.crc_at_copy and job.incr is None else None
        try:
            leaves = job.source.leaves or []
            if job.incr is not None:  # what must be written: a smaller plan
                plan, leaves = job.incr.tracker.decide(job.request, plan, leaves, lambda dev, fn: self._cuda(
                    dev).run(dev, fn, job.source.cuda_event), job.incr)
            job.layout.put(plan)
            self._stage(job, plan, plan.items, leaves, header=True, crcs=crcs)
            if job.incr is not None:  # tensors referenced on speculation that changed: appended
                ext = job.incr.tracker.settle(job.request, job.slot, plan, self.ring.block_bytes, job.incr)
                if ext is not None:
                    old, (plan, tensors) = plan, ext
                    job.extension.put(plan)  # the persist thread writes the appended blocks as they come
                    self._stage(job, plan, plan.items[len(old.items):], tensors, header=False)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            log.error("zerostall: snapshot of step %d failed: %s", job.step, exc)
            status.fail(exc)
        finally:
            self.ring.publish(job.slot.g_end)  # a failed job's blocks are drained unwritten
            job.source.leaves = None  # the caller's tensors: not held past staging
            job.layout.put(plan)
            job.extension.put(None)
            snapshot_s = time.perf_counter() - t0
            job.snapshot.put(None if crcs is None else tuple(crcs))
            status.mark_staged(snapshot_s, plan.file_bytes)
        if plan.lazy is not None and status.error is None:  # the Python objects, while the blocks are written
            try:
                plan.lazy.result()
            except Exception:  # noqa: BLE001 - kept by the plan: the committer's final() raises it
                pass

    def _cuda(self, device: torch.device) -> DeviceStreams:
        """The side streams; the first call registers the arena with ``device`` current (the
        device of the first CUDA save: no context is created on a device the rank does not use)."""
        if self._streams is None:
            self.arena.register_cuda(_index(device, torch.cuda))
            self._streams = DeviceStreams()
        return self._streams

    def _stage_strided(self, job: Job, tensor: torch.Tensor, offset: int, spans: Callable[..., Any],
                       crc: list[int] | None = None) -> None:
        """Copy a non-contiguous CPU tensor through :func:`bounce_rows` (in a helper thread);
        with ``crc`` (one int), extend it over the bytes as they are staged."""
        base, B = job.slot.arena.address, self.ring.block_bytes
        foff = offset
        for ptr, n_sl in bounce_rows(tensor):
            for aoff, f, n in spans(foff, foff + n_sl):
                if crc is None:
                    _memmove(base + aoff, ptr + (f - foff), n)
                else:
                    crc[0] = copy_crc(base + aoff, ptr + (f - foff), n, job.slot.arena.mv, aoff, crc[0])
                self.ring.publish(job.slot.g0 + (f + n) // B)
            foff += n_sl

    def _copy_small(self, job: Job, offs: list[int], lens: list[int], ptrs: list[int], i: int,
                    crcs: list[int] | None = None) -> tuple[int, int]:
        """Copy the run of small contiguous CPU tensors from item ``i`` on that starts in
        item ``i``'s block and ends inside the writable part of the ring, zeroing the gaps
        between them (:func:`~zerostall._fast.copy_runs`); publish the blocks it completes.
        Returns (next item, file position after the run); ``(i, offs[i])`` when item ``i``
        reaches past the writable run (the per-item path streams it)."""
        ring, B, g0 = self.ring, self.ring.block_bytes, job.slot.g0
        start = offs[i]
        blk = start // B
        run_end = (ring.wait_writable(g0 + blk) - g0) * B  # file offset where the writable run ends
        j = bisect.bisect_left(offs, (blk + 1) * B, i)  # the items starting in this block
        while j > i and (offs[j - 1] + lens[j - 1] > run_end or lens[j - 1] > SMALL_ITEM_BYTES):
            j -= 1
        k = i
        while k < j and lens[k] <= SMALL_ITEM_BYTES:
            k += 1
        j = k
        if j == i:
            return i, start
        end = offs[j - 1] + lens[j - 1]
        slot0 = ring.slot_offset(g0 + blk)
        job.slot.arena.wait_ready(slot0 + end - blk * B)
        at = job.slot.arena.address + slot0 - blk * B  # arena address of file offset 0, in this run
        ends = list(map(operator.add, offs[i:j], lens[i:j]))
        gaps = [(e, s - e) for e, s in zip(ends, offs[i + 1:j]) if s > e]
        if gaps:
            zero_runs([at + e for e, _ in gaps], [n for _, n in gaps])
        copy_runs(map(at.__add__, offs[i:j]), ptrs[i:j], lens[i:j])
        if crcs is not None:  # the run just copied (at most a block), checksummed while in the cache
            a0 = slot0 - blk * B  # arena offset of file offset 0 in this run
            crcs[i:j] = crc_runs(job.slot.arena.mv, [a0 + o for o in offs[i:j]], [a0 + e for e in ends])
        ring.publish(g0 + end // B)
        return j, end

    def _stage(self, job: Job, plan: SavePlan, items: Any, tensors: Any, *, header: bool,
               crcs: list[int] | None = None) -> None:
        """Copy ``items``' tensors into the job's blocks (with the header of ``plan``, unless
        ``header=False``: an incremental save's appended tensors, laid out after the blocks
        staged before, the gap before them never written) and publish them; with ``crcs`` (one
        per item, host tensors only) checksum each as it is copied (:data:`CRC_AT_COPY`)."""
        ring, B = self.ring, self.ring.block_bytes
        g0, cuda_event = job.slot.g0, job.source.cuda_event
        arena = job.slot.arena  # the pool swaps arenas only between jobs
        arena_u8 = arena.u8
        devices = list(dict.fromkeys(map(DEVICE, tensors)))  # distinct, in order (one C-level map)
        first_cuda = next((d for d in devices if d.type == "cuda"), None)
        streams = self._cuda(first_cuda) if first_cuda is not None else None

        def spans(a: int, b: int):
            """Yield (arena offset, file offset, length) runs covering file bytes [a, b)."""
            pos = a
            while pos < b:
                g = g0 + pos // B
                run_end_g = ring.wait_writable(g)
                end = min(b, (run_end_g - g0) * B)
                aoff = ring.slot_offset(g) + pos % B
                arena.wait_ready(aoff + end - pos)  # the first lap streams behind the faulter
                yield aoff, pos, end - pos
                pos = end

        base = arena.address

        def fill_zero(a: int, b: int) -> None:
            for aoff, _, n in spans(a, b):
                _memset(base + aoff, 0, n)

        if header:
            raw = job.header(plan).encode()
            for aoff, foff, n in spans(0, len(raw)):
                arena.mv[aoff:aoff + n] = raw[foff:foff + n]
            pos = len(raw)
        else:
            pos = items[0].offset if items else plan.file_bytes
        items, tensors = list(items), list(tensors)
        # contiguous CPU tensors only: copied by address, in runs
        bulk = {"cpu"}.issuperset(d.type for d in devices) and all(map(_CONTIG, tensors))
        offs, lens = list(map(OFFSET, items)), list(map(NBYTES, items))
        bulk = bulk and all(map(operator.le, offs, offs[1:]))  # runs are found by bisection
        ptrs = list(map(torch.Tensor.data_ptr, tensors)) if bulk else []
        i, n_items = 0, len(items)
        while i < n_items:
            if job.status.error is not None:  # persist already failed: stop copying, drain
                return
            if bulk and lens[i] <= SMALL_ITEM_BYTES:
                fill_zero(pos, offs[i])
                j, pos = self._copy_small(job, offs, lens, ptrs, i, crcs)
                if j > i:
                    i = j
                    continue
            item, tensor = items[i], tensors[i]
            fill_zero(pos, item.offset)
            if item.nbytes:
                on_cpu = tensor.device.type == "cpu"
                if on_cpu and not tensor.is_contiguous():
                    box = None if crcs is None else [0]
                    run_in_fresh_thread(lambda t=tensor, o=item.offset: self._stage_strided(job, t, o, spans, box),
                                        "zerostall-copy")
                    if box is not None:
                        crcs[i] = box[0]
                    pos = item.offset + item.nbytes
                    i += 1
                    continue
                flat: list[torch.Tensor] = []  # CUDA: made once per tensor, on its own device
                for aoff, foff, n in spans(item.offset, item.offset + item.nbytes):
                    rel = foff - item.offset
                    if on_cpu and crcs is not None:
                        crcs[i] = copy_crc(base + aoff, tensor.data_ptr() + rel, n, arena.mv, aoff, crcs[i])
                    elif on_cpu:
                        _memmove(base + aoff, tensor.data_ptr() + rel, n)
                    else:
                        def copy(aoff=aoff, rel=rel, n=n, tensor=tensor) -> None:
                            if not flat:
                                flat.append(tensor.contiguous().reshape(-1).view(torch.uint8))
                            for o, k in arena.pinned_pieces(aoff, n):  # each inside one registration
                                src = rel + o - aoff
                                arena_u8[o:o + k].copy_(flat[0][src:src + k], non_blocking=True)
                        streams.run(tensor.device, copy, cuda_event)  # type: ignore[union-attr]
                    ring.publish(g0 + (foff + n) // B)
            pos = item.offset + item.nbytes
            i += 1
        fill_zero(pos, plan.file_bytes)
        ring.publish(g0 + ring.blocks_for(plan.file_bytes))  # the tail block too
