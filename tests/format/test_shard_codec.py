"""format/shard.py: the one shard codec, with windows smaller than items (real files, threads engine).

The items of :data:`SIZES` packed (layout 2): k0 (0 B) and k1 (1 B) at 4096, k2 at 4160..8256,
k3 at 8256..18256, k5 (3 B) at 18256, k6 at 18304..38304, k7 at 38304..42399, the file 45056
bytes; test_packing.py has more of the packing itself."""

import os

import crc32c
import pytest
import torch

from zerostall.errors import CorruptCheckpoint
from zerostall.format.layout import HEADER_BYTES, item_align
from zerostall.format.shard import CrcCursor, check_items, pack_offsets, read_shard
from tests.helpers import ShardItem, flip_byte, write_test_shard

SIZES = [0, 1, 4096, 10_000, 0, 3, 20_000, 4095]


Item = ShardItem


def _payloads():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]


@pytest.fixture(params=[4096, 8192, 1 << 20], ids=["win4k", "win8k", "win1m"])
def shard(request, tmp_path):
    payloads = _payloads()
    path = str(tmp_path / "s.shard")
    header, items, eng, buf = write_test_shard(path, payloads, 3, request.param)
    yield path, header, items, payloads, eng, buf
    eng.close()
    buf.close()


def _read(eng, path, header, items, buf, wanted=None, dsts=None, listed=False):
    got = []
    dsts = dsts if dsts is not None else [torch.empty(i.nbytes, dtype=torch.uint8) for i in items]
    with eng.open_read(path) as f:
        read_shard(f, path, header.file_bytes, header, items, dsts, buf, wanted=wanted, on_item=got.append,
                   listed=listed)
    return dsts, got


def test_layout_and_crcs(shard):
    path, header, items, payloads, eng, buf = shard
    assert os.path.getsize(path) == header.file_bytes and header.file_bytes % 4096 == 0
    assert [i.offset for i in items] == [4096, 4096, 4160, 8256, 18256, 18256, 18304, 38304]
    assert header.file_bytes == 45056 and all(i.offset % item_align(i.nbytes) == 0 for i in items)
    assert [i.crc32c for i in items] == [crc32c.crc32c(p.numpy().tobytes()) for p in payloads]
    check_items(path, items, header.file_bytes)
    cur = CrcCursor(items)
    raw = open(path, "rb").read()
    for a in range(0, len(raw), 5000):  # extents in file order, any cut
        cur.feed([(a, memoryview(raw)[a:a + 5000])])
    assert cur.crcs == [i.crc32c for i in items]


def test_read_whole_and_wanted(shard):
    path, header, items, payloads, eng, buf = shard
    dsts, got = _read(eng, path, header, items, buf)
    assert all(torch.equal(d, p) for d, p in zip(dsts, payloads)) and sorted(got) == list(range(len(items)))
    dsts, got = _read(eng, path, header, items, buf, wanted={2, 4, 6})
    assert sorted(got) == [2, 4, 6] and torch.equal(dsts[6], payloads[6]) and torch.equal(dsts[2], payloads[2])


@pytest.mark.parametrize("offset,needle", [(HEADER_BYTES + 4096 * 2 + 100, "crc32c"),  # inside k3
                                           (HEADER_BYTES + 10, "padding"),   # after k1's one byte
                                           (7, "magic"), (40, "header")])
def test_flips_are_caught(shard, offset, needle):
    path, header, items, payloads, eng, buf = shard
    flip_byte(path, offset, 0x10)
    with pytest.raises(CorruptCheckpoint, match=needle):
        _read(eng, path, header, items, buf)


def test_tail_padding_flip_caught(shard):
    path, header, items, payloads, eng, buf = shard
    last = items[-1]
    with open(path, "r+b") as f:
        f.seek(last.offset + last.nbytes)  # the one byte of padding after the last item
        f.write(b"\x01")
    with pytest.raises(CorruptCheckpoint, match="padding"):
        _read(eng, path, header, items, buf)
    with pytest.raises(CorruptCheckpoint, match="padding"):  # a partial read, every item of the file listed
        _read(eng, path, header, items, buf, wanted={len(items) - 1}, listed=True)


def test_overlap_and_out_of_file_refused(shard):
    path, header, items, payloads, eng, buf = shard
    bad = list(items)
    bad[3] = Item("k3", items[2].offset, items[3].nbytes, 0)
    with pytest.raises(CorruptCheckpoint, match="k3"):
        check_items(path, bad, header.file_bytes)
    with pytest.raises(CorruptCheckpoint, match="outside"):
        check_items(path, items, header.file_bytes - 4096)


def test_only_empty_items():
    offsets, file_bytes = pack_offsets([0, 0])
    assert offsets == [HEADER_BYTES, HEADER_BYTES] and file_bytes == HEADER_BYTES


def test_lazy_destinations_live_only_while_in_flight(shard):
    path, header, items, payloads, eng, buf = shard
    live, peak, out = set(), [0], {}

    def dst(i):
        live.add(i)
        peak[0] = max(peak[0], len(live))
        out[i] = torch.empty(items[i].nbytes, dtype=torch.uint8)
        return out[i]

    def done(i):
        live.discard(i)

    with eng.open_read(path) as f:
        read_shard(f, path, header.file_bytes, header, items, dst, buf, wanted={3, 6, 7}, on_item=done)
    assert sorted(out) == [3, 6, 7] and not live
    assert peak[0] == 1  # wanted items are read one after another; never all allocated at once
    assert all(torch.equal(out[i], payloads[i]) for i in (3, 6, 7))
