"""The checkpointing libraries users would pick instead, as bench methods when installed.

* torchsnapshot (``Snapshot.take`` and ``Snapshot.async_take``),
* Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())`` (clones in the caller, ``torch.save``
  in a thread),
* NVIDIA Resiliency Extension's ``TorchAsyncCheckpoint`` (its path is CUDA-only: it calls
  ``torch.cuda.synchronize()``; on a CPU-only host the row says so instead of disappearing).

None of them fsyncs its files; to compare durable times honestly the bench fsyncs every file
they wrote once they report completion (off the training thread for the async ones, inside
the blocked time for the synchronous ``take``, as for ``torch.save`` + fsync).
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any

import torch

from .methods import AsyncMethod, Method, Pending, TorchFileMethod, fsync_tree


class TorchSnapshot(AsyncMethod):
    imports = ("torchsnapshot",)

    def __init__(self, asynchronous: bool):
        self.asynchronous = asynchronous
        self.name = "torchsnapshot-async" if asynchronous else "torchsnapshot"
        self.note = ("torchsnapshot.Snapshot.async_take, then fsync" if asynchronous
                     else "torchsnapshot.Snapshot.take, then fsync")

    def _app(self, state: Any) -> dict[str, Any]:
        import torchsnapshot
        return {"state": torchsnapshot.StateDict(**state)}

    def start(self, step: int, state: Any) -> Pending:
        import torchsnapshot
        d = self.dir(step)
        t0 = time.perf_counter()
        if not self.asynchronous:
            torchsnapshot.Snapshot.take(path=d, app_state=self._app(state))
            fsync_tree(d)
            t = time.perf_counter() - t0
            p = Pending(t0, t)
            return p
        pending = torchsnapshot.Snapshot.async_take(path=d, app_state=self._app(state))
        stall = time.perf_counter() - t0

        def durable() -> bool:
            if pending.done():
                pending.wait()  # raises its error, if any
                return True
            return False
        return Pending(t0, stall, durable=durable, after=lambda: fsync_tree(d))

    def restore(self, step: int, target: Any) -> Any:
        import torchsnapshot
        app = self._app(target)
        torchsnapshot.Snapshot(self.dir(step)).restore(app)
        return dict(app["state"])


class LightningAsync(TorchFileMethod):
    name = "lightning-async"
    imports = ("lightning.pytorch",)
    note = "lightning AsyncCheckpointIO(TorchCheckpointIO()).save_checkpoint, then fsync"
    filename = "state.ckpt"

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def start(self, step: int, state: Any) -> Pending:
        path = self._path(step)
        t0 = time.perf_counter()
        self.io.save_checkpoint(state, path)
        stall = time.perf_counter() - t0
        # one worker thread, FIFO: a no-op queued behind the save completes right after it
        marker = self.io._executor.submit(lambda: None)  # noqa: SLF001 - the only completion signal

        def durable() -> bool:
            if marker.done():
                if self.io._error is not None:  # noqa: SLF001
                    raise self.io._error
                return True
            return False
        return Pending(t0, stall, durable=durable, after=lambda: fsync_tree(self.dir(step)))

    def close(self) -> None:
        self.io.teardown()


class NVRxAsync(TorchFileMethod):
    name = "nvrx-async"
    note = ("nvidia_resiliency_ext TorchAsyncCheckpoint.async_save (CUDA only; its persistent worker "
            "started in setup), then fsync")

    def __init__(self) -> None:
        installed = importlib.util.find_spec("nvidia_resiliency_ext") is not None
        if not torch.cuda.is_available():  # the reason that holds whatever is installed
            self.unavailable = ("absent on a CPU-only host: NVRx's TorchAsyncCheckpoint.async_save calls "
                                "torch.cuda.synchronize() and fails without a CUDA device"
                                + ("" if installed else " (nvidia-resiliency-ext is not installed either)"))
        elif not installed:
            self.unavailable = "not installed (pip install nvidia-resiliency-ext; this host has the CUDA device it needs)"

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
        from nvidia_resiliency_ext.checkpointing.async_ckpt.torch_ckpt import TorchAsyncCheckpoint
        # Its first async_save asks torch.distributed.get_rank(), which raises without a process
        # group (the bench has none): start its worker for rank 0 first, as its warm-up API allows.
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            AsyncCallsQueue.warmup_persistent_caller(rank=0)
        self.ckpt = TorchAsyncCheckpoint()

    def _worker_died(self) -> str | None:
        """Why the checkpoint worker process is gone, if it is (else its queue waits forever)."""
        caller = getattr(self.ckpt._async_calls_queue, "persistent_caller", None)  # noqa: SLF001
        proc = getattr(caller, "process", None)
        if proc is not None and not proc.is_alive():
            return f"nvidia_resiliency_ext's checkpoint worker process exited (exit code {proc.exitcode})"
        return None

    def start(self, step: int, state: Any) -> Pending:
        os.makedirs(self.dir(step), exist_ok=True)
        t0 = time.perf_counter()
        self.ckpt.async_save(state, self._path(step))
        stall = time.perf_counter() - t0
        q = self.ckpt._async_calls_queue  # noqa: SLF001

        def durable() -> bool:
            q.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if q.get_num_unfinalized_calls() == 0:
                return True
            died = self._worker_died()
            if died:
                raise RuntimeError(died)
            return False
        return Pending(t0, stall, durable=durable, after=lambda: fsync_tree(self.dir(step)))

    def close(self) -> None:
        """Finish or abort its calls without torch.distributed (its blocking finalize asks
        get_rank()) and without waiting on a dead worker."""
        ckpt = getattr(self, "ckpt", None)
        if ckpt is None:
            return
        q = ckpt._async_calls_queue  # noqa: SLF001
        deadline = time.monotonic() + 120
        while q.get_num_unfinalized_calls() and not self._worker_died() and time.monotonic() < deadline:
            q.maybe_finalize_async_calls(blocking=False, no_dist=True)
            time.sleep(0.05)
        abort = bool(q.get_num_unfinalized_calls()) or self._worker_died() is not None
        q.async_calls.clear()  # what is left is abandoned: close() must not all_reduce over it
        q.close(abort=abort)
        self.ckpt = None


def peer_methods() -> dict[str, Method]:
    out: dict[str, Method] = {}
    if importlib.util.find_spec("torchsnapshot") is not None:
        out["torchsnapshot"] = TorchSnapshot(False)
        out["torchsnapshot-async"] = TorchSnapshot(True)
    if importlib.util.find_spec("lightning") is not None:
        out["lightning-async"] = LightningAsync()
    out["nvrx-async"] = NVRxAsync()
    return out
