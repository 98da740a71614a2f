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
import time
from typing import Any

import torch

from ..config import IOConfig


class Method:
    name = "?"
    note = ""

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


class DCPAsync(Method):
    name = "dcp-async"
    note = ("dcp.async_save with one reused DefaultStager(use_async_staging=True; pinned and "
            "non-blocking copies on CUDA), thread checkpointer")

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=cuda))

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        import torch.distributed.checkpoint as dcp
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(self.dir(step)),
                              async_stager=self.stager, no_dist=True)
        stall = time.perf_counter() - t0
        staging = getattr(resp, "staging_completion", None)
        upload = getattr(resp, "upload_completion", resp)
        if staging is not None:
            staging.result()
        staged = time.perf_counter() - t0
        upload.result()
        return stall, staged, time.perf_counter() - t0

    def restore(self, step: int, target: Any) -> Any:
        return DCP.restore(self, step, target)  # type: ignore[arg-type]

    def close(self) -> None:
        self.stager.close()


class Zerostall(Method):
    def __init__(self, engine: str):
        self.engine = engine
        self.name = f"zerostall-{engine}"
        self.note = f"Checkpointer(engine={engine!r}), arena prepared once, reused"

    def setup(self, root: str, state: Any) -> None:
        super().setup(root, state)
        from ..checkpointer import Checkpointer
        self.ck = Checkpointer(root, io=IOConfig(engine=self.engine), keep_last=1)
        self.ck.prepare(state)

    def save(self, step: int, state: Any) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        h = self.ck.save(step, state)
        stall = time.perf_counter() - t0
        h.wait_staged()
        staged = time.perf_counter() - t0
        h.result()
        return stall, staged, time.perf_counter() - t0

    def restore(self, step: int, target: Any) -> Any:
        return self.ck.load(target, step=step)

    def close(self) -> None:
        self.ck.close()


def available_methods() -> dict[str, Method]:
    from ..io.probe import io_uring_status
    out: dict[str, Method] = {"torch.save": TorchSave(), "dcp": DCP(), "dcp-async": DCPAsync()}
    engines = ["threads", "buffered"]
    if io_uring_status()[0]:
        engines.insert(0, "uring")
    for e in engines:
        out[f"zerostall-{e}"] = Zerostall(e)
    return out
