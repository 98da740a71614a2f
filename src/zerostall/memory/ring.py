"""The arena as a ring of fixed-size blocks shared by consecutive saves.

Every save reserves ``ceil(file_bytes / block_bytes)`` consecutive *global* block numbers;
global block ``g`` lives in arena slot ``g % nblocks``. Three monotonic cursors, guarded by
one condition variable, carry the whole protocol:

* ``reserved`` — advanced by the caller's thread in ``save()``;
* ``staged``   — advanced by the snapshot thread: every block below it holds final bytes;
* ``released`` — advanced by the persist threads: every block below it is on disk (or
  abandoned) and its slot may be overwritten.

Shared by every Checkpointer of the process (:mod:`zerostall.saving.pool`): persist threads
release ranges possibly out of order, and ``released`` moves over a contiguous prefix. Block
``g`` is written only while ``g < released + nblocks``. The ring grows only while idle.
"""

from __future__ import annotations

import threading


class BlockRing:
    def __init__(self, nbytes: int, block_bytes: int):
        self.block_bytes = block_bytes
        self.nblocks = nbytes // block_bytes
        if self.nblocks < 2:
            raise ValueError("the arena must hold at least two blocks")
        self.cond = threading.Condition()
        self.reserved = 0
        self.staged = 0
        self.released = 0
        self._done: dict[int, int] = {}  # released ranges beyond the cursor: lo -> hi

    def resize(self, nbytes: int) -> bool:
        """Use ``nbytes`` of the arena from now on if the ring is idle; return whether it did."""
        with self.cond:
            n = nbytes // self.block_bytes
            if n < 2 or n == self.nblocks or self.released != self.reserved:
                return False
            self.nblocks = n
            return True

    @property
    def capacity_bytes(self) -> int:
        return self.nblocks * self.block_bytes

    # -- caller thread ------------------------------------------------------------------
    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    # ``reserved`` has one writer (the caller's thread) that the workers never read: no lock, so a
    # signal handler interrupting save() here cannot leave the condition held.
    def fits_now(self, nblocks: int) -> bool:
        """Whether a snapshot of ``nblocks`` could be staged without waiting for the disk."""
        return self.reserved + min(nblocks, self.nblocks) - self.released <= self.nblocks

    def reserve(self, nblocks: int) -> int:
        g0 = self.reserved
        self.reserved = g0 + nblocks
        return g0

    def idle(self) -> bool:
        return self.released == self.reserved

    # -- snapshot thread ----------------------------------------------------------------
    def wait_writable(self, g: int) -> int:
        """Block until ``g`` may be written; return the end of the writable, unwrapped run."""
        with self.cond:
            while g >= self.released + self.nblocks:
                self.cond.wait()
            return min(self.released + self.nblocks, (g // self.nblocks + 1) * self.nblocks)

    def publish(self, g_end: int) -> None:
        with self.cond:
            if g_end > self.staged:
                self.staged = g_end
                self.cond.notify_all()

    # -- persist thread -----------------------------------------------------------------
    def wait_staged(self, g: int) -> int:
        """Block until block ``g`` is staged; return the staged cursor."""
        with self.cond:
            while self.staged <= g:
                self.cond.wait()
            return self.staged

    def release(self, lo: int, hi: int) -> None:
        """Blocks ``[lo, hi)`` may be overwritten (each job releases its blocks in order)."""
        if hi <= lo:
            return
        with self.cond:
            if lo > self.released:
                self._done[lo] = hi
                return
            self.released = max(self.released, hi)
            while self.released in self._done:
                self.released = max(self.released, self._done.pop(self.released))
            self.cond.notify_all()

    def slot_offset(self, g: int) -> int:
        return (g % self.nblocks) * self.block_bytes
