"""The arena as a ring of fixed-size blocks shared by consecutive saves.

Every save reserves ``ceil(file_bytes / block_bytes)`` consecutive *global* block numbers;
global block ``g`` lives in arena slot ``g % nblocks``. Three monotonic cursors, guarded by
one condition variable, carry the whole protocol:

* ``reserved`` — advanced by the caller's thread in ``save()``;
* ``staged``   — advanced by the snapshot thread: every block below it holds final bytes;
* ``released`` — advanced by the persist thread: every block below it is on disk (or
  abandoned) and its slot may be overwritten.

The snapshot thread may write block ``g`` only while ``g < released + nblocks``. When the
arena holds two snapshots this is double buffering; when a state is larger than the arena
it streams through as a ring, and memory never exceeds the arena.
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

    # -- caller thread ------------------------------------------------------------------
    def blocks_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.block_bytes))

    # ``reserved`` has one writer (the caller's thread, saves serialised by the Checkpointer)
    # and the workers never read it, so these take no lock: a signal handler that interrupts
    # save() here must not leave the condition held while the workers need it.
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

    def release(self, g_end: int) -> None:
        with self.cond:
            if g_end > self.released:
                self.released = g_end
                self.cond.notify_all()

    def slot_offset(self, g: int) -> int:
        return (g % self.nblocks) * self.block_bytes
