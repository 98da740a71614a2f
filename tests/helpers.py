"""Deep clone / bit-exact comparison of nested state dicts, shared by tests and test workers."""

import argparse
import collections
import math
import socket

import pytest
import torch
from zerostall_bench.model import states_equal  # the bench checks its restores with the same test


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone(v) for v in x)
    return x


equal = states_equal


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


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def same(a, b, path="<root>", more=None):
    """Type-exact, bit-exact comparison of a saved state ``a`` and what loaded back ``b``
    (nan == nan, -0.0 != 0.0, tuple != list, dict keys type-exact and in order, defaultdict
    factories). ``more(a, b, path, same)`` compares the caller's own types: True when it did."""
    import numpy as np

    def rec(x, y, p):
        same(x, y, p, more)

    assert type(a) is type(b), f"{path}: {type(a).__name__} came back as {type(b).__name__}"
    if more is not None and more(a, b, path, rec):
        return
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert not b.is_conj() and not b.is_neg()
        assert torch.equal(_bits(a.resolve_conj().resolve_neg()), _bits(b)), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert len(a) == len(b), f"{path}: {len(a)} keys came back as {len(b)}"
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            rec(ka, kb, f"{path}[key]")
            rec(va, vb, f"{path}.{ka}")
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            rec(x, y, f"{path}.{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), path
    elif isinstance(a, (np.datetime64, np.timedelta64)):
        assert a.dtype == b.dtype and ((np.isnat(a) and np.isnat(b)) or a == b), path
    elif isinstance(a, argparse.Namespace):
        rec(vars(a), vars(b), path)
    else:
        assert a == b, f"{path}: {a!r} came back as {b!r}"


class ShardItem:
    """What the shard codec needs of one item (``format.shard.Item``), for codec tests."""

    def __init__(self, key, offset, nbytes, crc):
        self.key, self.offset, self.nbytes, self.crc32c = key, offset, nbytes, crc


def write_test_shard(path, payloads, rank, window):
    """Write ``payloads`` (uint8 tensors) as one shard at ``path`` through a ``window``-byte arena
    with the threads engine, laid out by the current layout's ``pack_offsets``. Returns
    ``(header, items, engine, arena)``; the caller closes the engine and the arena."""
    from zerostall.config import IOConfig
    from zerostall.format.layout import ShardHeader, pack_offsets
    from zerostall.format.shard import write_shard
    from zerostall.io import get_engine
    from zerostall.memory.arena import Arena
    offsets, file_bytes = pack_offsets([p.numel() for p in payloads])
    header = ShardHeader("id", 0, rank, file_bytes)
    eng = get_engine("threads", IOConfig())
    buf = Arena(window, mlock=False)
    f = eng.open_write(path, file_bytes)
    crcs = write_shard(f, header, payloads, offsets, buf)
    f.finish()
    f.close()
    items = [ShardItem(f"k{i}", o, p.numel(), c) for i, (o, p, c) in enumerate(zip(offsets, payloads, crcs))]
    return header, items, eng, buf


def two_steps(tmp_path, state):
    """A root under ``tmp_path`` with steps 1 and 2 saved from ``state(1.0)`` and ``state(2.0)``."""
    import zerostall
    root = str(tmp_path / "ck")
    zerostall.save(root, state(1.0), step=1)
    zerostall.save(root, state(2.0), step=2)
    return root


def seal_manifest(body, crc=None):
    """The bytes of a manifest file around ``body`` (a dict), in the one envelope zerostall
    writes and reads; ``crc``: record this crc32c (8 hex digits) instead of the body's."""
    import json

    from zerostall.format.manifest import envelope
    raw = envelope(json.dumps(body, separators=(",", ":")).encode())
    if crc is not None:
        at = raw.index(b'"body_crc32c":"') + len(b'"body_crc32c":"')
        raw = raw[:at] + crc.encode() + raw[at + 8:]
    return raw


def resident_pages(path):
    """(resident, total) pages of ``path`` in the page cache, by ``mincore(2)`` on a mapping
    (mapping a file does not fault its pages in: this observes the cache without changing it)."""
    import ctypes
    import mmap
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    npages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap failed", path)
    try:
        vec = (ctypes.c_ubyte * npages)()
        if libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed", path)
        return sum(v & 1 for v in vec), npages
    finally:
        libc.munmap(addr, size)

