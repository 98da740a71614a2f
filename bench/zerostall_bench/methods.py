"""The checkpoint methods the bench compares, behind one small interface.

Each ``save`` returns ``(stall_s, staged_s, durable_s)`` measured from the call:
``stall_s`` the caller was blocked, ``staged_s`` the state may be mutated, ``durable_s``
the checkpoint is on disk (fsynced). Every method is used as its documentation shows, in its
best configuration available in the installed torch; restores load into a pre-allocated
state where the method can (DCP, zerostall) and allocate where it cannot (``torch.load``).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any, Callable

import torch

from zerostall.config import IOConfig


class Pending:
    """A save in flight, polled by the training loop: ``poll()`` is True once durable.

    ``stall_s`` is how long the call blocked; ``staged_s``/``durable_s`` are filled (seconds
    from the call) by ``poll()`` as they happen. Polled from the caller's thread only.
    """

    def __init__(self, t0: float, stall_s: float, staged: Any = None, durable: Any = None,
                 after: Callable[[], None] | None = None):
        self.t0, self.stall_s = t0, stall_s
        self._staged, self._durable, self._after = staged, durable, after
        self.staged_s = stall_s if staged is None else 0.0
        self.durable_s = stall_s if durable is None else 0.0
        self._thread: threading.Thread | None = None
        self._err: list[BaseException] = []

    def poll(self) -> bool:
        if self.durable_s:
            return True
        now = time.perf_counter() - self.t0
        if self._staged is not None and not self.staged_s and self._staged():
            self.staged_s = now
        if not self._durable():
            return False
        if self._after is not None:  # e.g. fsync the files: off the training thread, as a user would
            if self._thread is None:
                self._thread = threading.Thread(target=self._run_after)
                self._thread.start()
            if self._thread.is_alive():
                return False
            if self._err:
                raise self._err[0]
        self.staged_s = self.staged_s or now
        self.durable_s = max(time.perf_counter() - self.t0, self.staged_s)
        return True

    def _run_after(self) -> None:
        try:
            self._after()  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - re-raised by poll()
            self._err.append(exc)

    def wait(self) -> tuple[float, float, float]:
        while not self.poll():
            time.sleep(0.001)
        return self.stall_s, self.staged_s, self.durable_s


def fsync_tree(d: str) -> None:
    """fsync every file under ``d`` (peers that do not fsync are made durable this way)."""
    for dp, _, fs in os.walk(d):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Method:
    name = "?"
    note = ""
    unavailable = ""
    """Why this method cannot run here (the row is reported, not hidden)."""
    imports: tuple[str, ...] = ()
    """Modules a training script would have imported already (the cold run imports them first)."""
    cold = False
    """Set by the cold scenario: set up as a user's first save would, with no warm-up."""

    def start(self, step: int, state: Any) -> Pending:
        """Begin a save; the default runs a blocking ``save`` (the whole call is stall)."""
        t0 = time.perf_counter()
        stall, staged, durable = self.save(step, state)
        p = Pending(t0, stall)
        p.staged_s, p.durable_s = staged, durable
        return p

    def setup(self, root: str, state: Any) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        raise NotImplementedError

    def restore(self, step: int, target: Any) -> Any:
        raise NotImplementedError

    def files(self, step: int) -> list[str]:
        d = self.dir(step)
        return [os.path.join(dp, f) for dp, _, fs in os.walk(d) for f in fs]

    def dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def cleanup(self, step: int) -> None:
        shutil.rmtree(self.dir(step), ignore_errors=True)

    def close(self) -> None:
        pass


class AsyncMethod(Method):
    """A method whose ``start`` returns while the save goes on; ``save`` waits for it."""

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        return self.start(step, state).wait()


class TorchFileMethod(AsyncMethod):
    """An async method that writes one ``torch.save`` file per step (restored by ``torch.load``)."""

    filename = "state.pt"

    def _path(self, step: int) -> str:
        return os.path.join(self.dir(step), self.filename)

    def restore(self, step: int, target: Any) -> Any:
        return torch.load(self._path(step), weights_only=True)


class TorchSave(Method):
    name = "torch.save"
    note = "torch.save to a buffered file, then fsync"

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        os.makedirs(self.dir(step), exist_ok=True)
        t0 = time.perf_counter()
        with open(os.path.join(self.dir(step), "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        t = time.perf_counter() - t0
        return t, t, t

    def restore(self, step: int, target: Any) -> Any:
        return torch.load(os.path.join(self.dir(step), "state.pt"), weights_only=True)


class DCP(Method):
    name = "dcp"
    imports = ("torch.distributed.checkpoint",)
    note = "torch.distributed.checkpoint.save, FileSystemWriter (fsyncs files)"

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(self.dir(step)), no_dist=True)
        t = time.perf_counter() - t0
        return t, t, t

    def restore(self, step: int, target: Any) -> Any:
        import torch.distributed.checkpoint as dcp
        dcp.load(target, storage_reader=dcp.FileSystemReader(self.dir(step)), no_dist=True)
        return target


class DCPAsync(AsyncMethod):
    name = "dcp-async"
    imports = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.staging")
    note = ("dcp.async_save with one reused DefaultStager(use_async_staging=True; pinned and "
            "non-blocking copies on CUDA), thread checkpointer")

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))

    def _closed(self) -> bool:
        """Some torch releases (2.11, seen on an H200 host) close the stager ``async_save`` was
        given once the save is done; reusing it then fails inside its deepcopy (KeyError)."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def start(self, step: int, state: Any) -> Pending:
        import torch.distributed.checkpoint as dcp
        if self._closed():
            self.setup(self.root, state)  # a new stager (its pinned cache is gone with the old one)
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(self.dir(step)),
                              async_stager=self.stager, no_dist=True)
        stall = time.perf_counter() - t0
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)

        def durable() -> bool:
            if upload.done():
                upload.result()  # raise its error, if any
                return True
            return False
        return Pending(t0, stall, staged=staging.done if staging is not None else None, durable=durable)

    def restore(self, step: int, target: Any) -> Any:
        return DCP.restore(self, step, target)  # type: ignore[arg-type]

    def close(self) -> None:
        self.stager.close()


class Zerostall(AsyncMethod):
    def __init__(self, engine: str):
        self.engine = engine
        self.name = f"zerostall-{engine}"
        self.note = f"Checkpointer(engine={engine!r}), prepare(state) once, reused"

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from zerostall.checkpointer import Checkpointer
        self.ck = Checkpointer(root, io=IOConfig(engine=self.engine), keep_last=1)
        if not self.cold:
            self.ck.prepare(state, wait=True)  # the steady state; `cold` measures the first save

    def start(self, step: int, state: Any) -> Pending:
        t0 = time.perf_counter()
        h = self.ck.save(step, state)
        stall = time.perf_counter() - t0

        def durable() -> bool:
            if h.done():
                h.result()  # raise its error, if any
                return True
            return False
        return Pending(t0, stall, staged=h.staged, durable=durable)

    def restore(self, step: int, target: Any) -> Any:
        return self.ck.load(target, step=step)

    def close(self) -> None:
        self.ck.close()


class ZerostallOneShot(Method):
    name = "zerostall.save"
    note = "one-shot zerostall.save(path, state, step) per checkpoint (waits until durable)"

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        from zerostall import save
        t0 = time.perf_counter()
        save(self.root, state, step, keep_last=1)
        t = time.perf_counter() - t0
        return t, t, t

    def restore(self, step: int, target: Any) -> Any:
        from zerostall import load
        return load(self.root, target, step=step)

    def files(self, step: int) -> list[str]:
        return Method.files(self, step)


def available_methods() -> dict[str, Method]:
    from zerostall.io.probe import io_uring_status
    from .peers import peer_methods
    out: dict[str, Method] = {"torch.save": TorchSave(), "dcp": DCP(), "dcp-async": DCPAsync()}
    engines = ["threads", "buffered"]
    if io_uring_status()[0]:
        engines.insert(0, "uring")
    for e in engines:
        out[f"zerostall-{e}"] = Zerostall(e)
    out["zerostall.save"] = ZerostallOneShot()
    out.update(peer_methods())
    return out
