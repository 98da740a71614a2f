"""Deep clone / bit-exact comparison of nested state dicts, shared by tests and test workers."""

import socket

import pytest
import torch

from zerostall.bench.model import states_equal


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone(v) for v in x)
    return x


equal = states_equal  # the library's one bit-exact comparison of nested states


def flip_byte(path, offset, mask=0x40):
    """XOR the byte at ``offset`` of ``path`` with ``mask`` in place (bit rot, for corruption tests)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def skip_unless_engine(name):
    """Skip (not error) where the probe says this host cannot run the engine (io_uring off)."""
    if name == "uring":
        from zerostall.io.probe import io_uring_status
        ok, why = io_uring_status()
        if not ok:
            pytest.skip(f"io_uring is unavailable here: {why}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (MASTER_PORT of a gloo group, a proxy's port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
