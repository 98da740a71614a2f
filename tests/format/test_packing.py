"""format/layout.py layout 2: small items packed into shared page-aligned extents, read back
checked, whole and in part (real files, threads engine)."""

import crc32c
import pytest
import torch

from zerostall.errors import CorruptCheckpoint
from zerostall.format.layout import HEADER_BYTES, PAGE_ITEM_BYTES, ShardHeader, item_align
from zerostall.format.shard import CrcCursor, check_items, read_runs, read_shard
from tests.helpers import ShardItem, flip_byte, write_test_shard

SIZES = [0, 1, 4, 2, 12, 64, 2684, 2684, 100, PAGE_ITEM_BYTES + 8, 3, 2684, 8, 0, 5000]


Item = ShardItem


@pytest.fixture(params=[4096, 1 << 20], ids=["win4k", "win1m"])
def packed(request, tmp_path):
    g = torch.Generator().manual_seed(1)
    payloads = [torch.randint(1, 256, (n,), dtype=torch.uint8, generator=g) for n in SIZES]  # no zero byte
    path = str(tmp_path / "p.shard")
    header, items, eng, buf = write_test_shard(path, payloads, 0, request.param)
    yield path, header, items, payloads, eng, buf
    eng.close()
    buf.close()


def _read(eng, path, header, items, buf, wanted=None):
    dsts = [torch.zeros(i.nbytes, dtype=torch.uint8) for i in items]
    with eng.open_read(path) as f:
        read_shard(f, path, header.file_bytes, header, items, dsts, buf, wanted=wanted)
    return dsts


def test_offsets_are_packed_and_naturally_aligned(packed):
    path, header, items, payloads, eng, buf = packed
    with open(path, "rb") as f:
        assert ShardHeader.version_of(f.read(64)) == 2 and header.file_bytes % 4096 == 0
    data = sum(SIZES)
    assert header.file_bytes - HEADER_BYTES < data + 4096 * 3  # layout 1 took a page per item: 15 pages more
    for it in items:
        assert it.offset % item_align(it.nbytes) == 0
        for size in (1, 2, 4, 8, 16):  # any dtype whose size divides the item's: viewable in place
            if size <= it.nbytes and it.nbytes % size == 0:
                assert it.offset % size == 0
    big = items[9]
    assert big.offset % 4096 == 0 and items[10].offset >= big.offset + 4096 * ((big.nbytes + 4095) // 4096)
    assert [items[i].offset for i in (1, 2, 3, 4, 5)] == [4096, 4100, 4104, 4112, 4128]
    assert items[14].offset % 64 == 0 and items[6].offset % 16 == 0  # 5000 B: a cache line; 2684 B: 16
    check_items(path, items, header.file_bytes)
    assert [i.crc32c for i in items] == [crc32c.crc32c(p.numpy().tobytes()) for p in payloads]
    raw = open(path, "rb").read()
    cur = CrcCursor(items)
    for a in range(0, len(raw), 777):
        cur.feed([(a, memoryview(raw)[a:a + 777])])
    assert cur.crcs == [i.crc32c for i in items]


def test_whole_read_checks_every_gap_byte(packed):
    path, header, items, payloads, eng, buf = packed
    assert all(torch.equal(d, p) for d, p in zip(_read(eng, path, header, items, buf), payloads))
    raw = open(path, "rb").read()
    covered = bytearray(len(raw))
    covered[:HEADER_BYTES] = b"\x01" * HEADER_BYTES
    for it in items:
        covered[it.offset:it.offset + it.nbytes] = b"\x01" * it.nbytes
    gaps = [i for i, c in enumerate(covered) if not c]
    assert gaps and all(raw[i] == 0 for i in gaps)
    for pos in gaps[::max(1, len(gaps) // 12)] + [gaps[-1]]:
        flip_byte(path, pos, 0x10)
        with pytest.raises(CorruptCheckpoint, match="padding"):
            _read(eng, path, header, items, buf)
        flip_byte(path, pos, 0x10)  # back


@pytest.mark.parametrize("wanted", [{6}, {2, 7}, {9}, {0, 13}, {4, 11, 14}])
def test_partial_read_reads_only_the_pages_covering_the_wanted_items(packed, wanted):
    path, header, items, payloads, eng, buf = packed
    runs = read_runs(items, wanted, header.file_bytes)
    assert runs[0][0] == 0 and runs[0][1] >= HEADER_BYTES and all(a % 4096 == 0 and b % 4096 == 0 for a, b in runs)
    for i in wanted:
        it = items[i]
        assert any(a <= it.offset and it.offset + it.nbytes <= b for a, b in runs)
    page_of = lambda o: o // 4096
    need = {page_of(0)} | {p for i in wanted for p in range(page_of(items[i].offset),
                                                              page_of(items[i].offset + max(items[i].nbytes, 1) - 1) + 1)}
    assert sum(b - a for a, b in runs) <= 4096 * len(need)
    dsts = _read(eng, path, header, items, buf, wanted=wanted)
    for i in range(len(items)):
        want = payloads[i] if i in wanted else torch.zeros(items[i].nbytes, dtype=torch.uint8)
        assert torch.equal(dsts[i], want)
    target = max(wanted, key=lambda i: items[i].nbytes)
    if items[target].nbytes:  # a flipped byte of a wanted item fails its crc32c
        flip_byte(path, items[target].offset + items[target].nbytes // 2, 0x10)
        with pytest.raises(CorruptCheckpoint, match="crc32c"):
            _read(eng, path, header, items, buf, wanted=wanted)


def test_partial_read_of_a_page_item_checks_its_tail_padding(packed):
    path, header, items, payloads, eng, buf = packed
    big = items[9]
    flip_byte(path, big.offset + big.nbytes + 100, 0x10)  # its own page's padding
    with pytest.raises(CorruptCheckpoint, match="padding"):
        _read(eng, path, header, items, buf, wanted={9})


def test_partial_read_needs_no_neighbour_listed(packed):
    """An earlier step's file read for the few entries a manifest borrows: the neighbours that
    share their pages are not listed at all, and are not taken for padding."""
    path, header, items, payloads, eng, buf = packed
    few = [items[6], items[11]]
    dsts = [torch.zeros(i.nbytes, dtype=torch.uint8) for i in few]
    with eng.open_read(path) as f:
        read_shard(f, path, header.file_bytes, header, few, dsts, buf, wanted={0, 1})
    assert torch.equal(dsts[0], payloads[6]) and torch.equal(dsts[1], payloads[11])


def test_misaligned_or_page_sharing_items_refused(packed):
    path, header, items, payloads, eng, buf = packed
    bad = list(items)
    bad[6] = Item("k6", items[6].offset + 4, items[6].nbytes, items[6].crc32c)  # 2684 B: needs 64
    with pytest.raises(CorruptCheckpoint, match="k6"):
        check_items(path, bad, header.file_bytes)
    bad = list(items)
    big = items[9]
    bad[10] = Item("k10", big.offset + big.nbytes + 64 - (big.offset + big.nbytes) % 64, 3, 0)  # in the page item's page
    with pytest.raises(CorruptCheckpoint, match="k10"):
        check_items(path, bad, header.file_bytes)


def test_unknown_layout_version_refused(packed):
    path, header, items, payloads, eng, buf = packed
    with open(path, "r+b") as f:
        f.seek(8)
        f.write((3).to_bytes(4, "little"))
    with pytest.raises(CorruptCheckpoint, match="layout version 3"):
        _read(eng, path, header, items, buf)


def test_partial_read_with_every_item_listed_checks_the_padding_it_reads(packed):
    """The DCP reader lists every record of a file: a partial read then checks every padding
    byte of the pages it reads, and skips the unwanted neighbours' bytes unchecked."""
    path, header, items, payloads, eng, buf = packed
    a, b = items[7], items[8]  # 2684 B, then 100 B at the next multiple of 64: a gap between them
    gap = a.offset + a.nbytes
    assert b.offset > gap and items[6].offset // 4096 == a.offset // 4096  # a neighbour on its first page
    flip_byte(path, items[6].offset + 1, 0x10)  # a neighbour on the same pages: not read as a wanted item
    dsts = [torch.zeros(i.nbytes, dtype=torch.uint8) for i in items]
    with eng.open_read(path) as f:
        read_shard(f, path, header.file_bytes, header, items, dsts, buf, wanted={7}, listed=True)
    assert torch.equal(dsts[7], payloads[7])
    flip_byte(path, gap, 0x10)
    with eng.open_read(path) as f:
        with pytest.raises(CorruptCheckpoint, match="padding"):
            read_shard(f, path, header.file_bytes, header, items, dsts, buf, wanted={7}, listed=True)
    with eng.open_read(path) as f:  # not listed: the bytes between could be an unlisted item's
        read_shard(f, path, header.file_bytes, header, items, dsts, buf, wanted={7})
