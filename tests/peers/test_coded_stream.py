"""A rebuild from coded fragments checks every byte as it streams in and overlaps its phases
(real sockets and disk, one process: n0's step as RS(2,1) fragments on three holder servers):
a wrong byte that the fragment's own crc32c agrees with is caught in the stream, not by reading
the rebuilt files back, and the next fragment is used; the missing data fragment is decoded
while the streams still run; the piece-wise check itself, out of order and across sources."""

import os
import threading

import crc32c
import pytest
import torch

import zerostall
from tests.peers.test_fragments import NAME, Job
from zerostall.errors import CorruptCheckpoint
from zerostall.peers import coded_decode, fragments, stream
from zerostall.peers.coding import descriptor_id
from zerostall.peers.fragments import HEADER, header_block, parse_header
from zerostall.peers.verify import PieceCheck
from zerostall.peers.coded_decode import Timeline
from zerostall.store.local import LocalTier


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def _save_big(job, step, tensors=12, mib=2):
    """A step of ``tensors`` tensors of ``mib`` MiB each (fragments of several pieces)."""
    g = torch.Generator().manual_seed(step)
    state = {f"t{i:02d}": torch.randn((mib << 20) // 4, generator=g) for i in range(tensors)}
    zerostall.save(job.src, state, step)
    return state


def _lie(path, at):
    """Flip the byte at payload offset ``at`` of a held fragment and make its header's crc32c
    agree (a holder whose bytes are wrong and self-consistent: only the tensors' crcs tell)."""
    with open(path, "r+b") as f:
        raw = bytearray(f.read())
        raw[HEADER + at] ^= 0xFF
        h = parse_header(bytes(raw[:HEADER]), path)
        raw[:HEADER] = header_block(h["index"], h["bytes"], crc32c.crc32c(bytes(raw[HEADER:])), h["descriptor"])
        f.seek(0)
        f.write(raw)


def _restore(job, root, tl):
    from zerostall.io.base import choose_engine
    from zerostall.peers.coded_restore import holdings, rebuild
    tier = LocalTier(root, create=True)
    coded = holdings(job.view(), job.client)
    rebuild(job.view(), job.client, tier, lambda: choose_engine(root), max(coded), coded, timeline=tl)
    return tier


def test_a_wrong_byte_the_fragment_crc_agrees_with_stops_its_stream_and_the_next_fragment_is_used(job, tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setattr(fragments, "FETCH_BUF_BYTES", 1 << 20)  # a fragment of many pieces
    _save_big(job, 1)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    shard = open(os.path.join(job.src, "step-1", NAME), "rb").read()
    _lie(job.fragment("n1", 1, 0), 8192 + 100)  # inside the first tensor of data fragment 0
    tl = Timeline()
    tier = _restore(job, str(tmp_path / "new"), tl)
    assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard  # fragment 0 decoded from 1 and 2
    fb = rep._layout(LocalTier(job.src).read_manifest(1)).fragment_bytes
    rows = {(r["fragment"], r["node"]): r for r in tl.streams()}
    bad = rows[(0, "n1")]
    assert bad["end"] == "failed" and bad["last_byte_s"] is None
    assert 0 < bad["bytes"] < fb  # stopped at its first piece, long before its last byte
    assert rows[(1, "n2")]["end"] == rows[(2, "n3")]["end"] == "done"
    assert ("decoded", 0) in tl.order("decoded")


def test_the_missing_data_fragment_is_decoded_while_the_streams_still_run(job, tmp_path, monkeypatch):
    monkeypatch.setattr(fragments, "FETCH_BUF_BYTES", 1 << 20)  # pieces and stripes of 1 MiB: many stripes
    monkeypatch.setattr(coded_decode, "DECODE_BYTES", 1 << 20)
    _save_big(job, 1, tensors=8, mib=2)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    shard = open(os.path.join(job.src, "step-1", NAME), "rb").read()
    away = job.fragment("n1", 1, 0)
    os.rename(away, away + ".away")  # data fragment 0's holder lost it: decoded from 1 and 2
    tl = Timeline()
    decoded = threading.Event()

    def watch():
        while not decoded.is_set() and not any(e.what == "decoded" for e in list(tl.events)):
            decoded.wait(0.01)
        decoded.set()
    threading.Thread(target=watch, daemon=True).start()

    def hold(point):  # n3 serves half of parity fragment 2, then waits for a decoded stripe
        if point == "frag-serve:mid-stream":
            decoded.wait(20)
    stream.fault_hook = hold
    try:
        tier = _restore(job, str(tmp_path / "new"), tl)
    finally:
        stream.fault_hook = None
        decoded.set()
    assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard
    ev = tl.order("decoded", "last-byte", "done", "synced", "committed")
    first_decoded = ev.index(("decoded", 0))
    assert first_decoded < ev.index(("last-byte", 2))  # the decode ran beside the parity's stream
    assert ev[-2:] == [("synced", -1), ("committed", -1)]
    checked = [i for i, (w, f) in enumerate(tl.order("checked", "last-byte")) if f == 1]
    assert tl.order("checked", "last-byte")[checked[0]] == ("checked", 1)  # data checked as it came


def _man(tmp_path, sizes):
    state = {f"t{i}": torch.arange(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    zerostall.save(str(tmp_path / "s"), state, 1)
    tier = LocalTier(str(tmp_path / "s"))
    return tier.read_manifest(1), open(os.path.join(tier.step_dir(1), NAME), "rb").read()


def test_pieces_checked_out_of_order_across_sources_forgotten_and_fed_again(tmp_path):
    man, raw = _man(tmp_path, [10_000, 70_000, 5_000, 123_457])
    cut = 3 * 4096 + 4096 * 5  # inside the second tensor: it straddles the two sources
    mv = memoryview(raw)
    # source 1's pieces first, source 0's after, each in order within itself
    c = PieceCheck(man, NAME, "t")
    c.feed(1, cut, mv[cut:cut + 8192])
    c.feed(1, cut + 8192, mv[cut + 8192:])
    with pytest.raises(CorruptCheckpoint, match="bytes checked"):
        c.finish()  # source 0 missing
    c.feed(0, 0, mv[:cut])
    c.finish()
    # a wrong byte of a tensor two sources share is judged at the end (either part may be wrong);
    # one in a tensor a source sends whole stops that source at once
    bad = bytearray(raw)
    bad[cut - 10] ^= 1
    bad[4096 + 5] ^= 1
    c = PieceCheck(man, NAME, "t")
    c.feed(1, cut, mv[cut:])
    with pytest.raises(CorruptCheckpoint, match="'t0' failed its crc32c"):
        c.feed(0, 0, memoryview(bytes(bad))[:cut])
    c.forget(0)
    bad[4096 + 5] ^= 1
    c.feed(0, 0, memoryview(bytes(bad))[:cut])
    with pytest.raises(CorruptCheckpoint, match="'t1' failed its crc32c.*two fragments"):
        c.finish()
    c.forget(0)  # the source failed: fed again from another holder, right this time
    c.feed(0, 0, mv[:cut])
    c.finish()
    # a byte fed twice is never counted as complete; non-zero padding and a wrong header are named
    c = PieceCheck(man, NAME, "t")
    c.feed(0, 0, mv)
    c.feed(1, cut, mv[cut:])
    with pytest.raises(CorruptCheckpoint):
        c.finish()
    pad = bytearray(raw)
    pad[4096 + 10_000 + 3] = 7
    with pytest.raises(CorruptCheckpoint, match="padding"):
        PieceCheck(man, NAME, "t").feed(0, 0, memoryview(bytes(pad)))
    hdr = bytearray(raw)
    hdr[20] ^= 1
    with pytest.raises(CorruptCheckpoint, match="header"):
        PieceCheck(man, NAME, "t").feed(0, 0, memoryview(bytes(hdr))[:4096])
