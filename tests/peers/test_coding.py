"""The RS codec and the fragment layout of coded peer copies (pure, fast)."""

import itertools
import os

import pytest

from zerostall.config import CheckpointConfig, PeersConfig
from zerostall.errors import ConfigError, CorruptCheckpoint
from zerostall.peers.coded import check_cluster
from zerostall.peers.coding import Code, Layout
from zerostall.peers.fragments import FragmentCheck, header_block, parse_header


@pytest.mark.parametrize("k,m", [(4, 2), (3, 1), (2, 3)])
def test_any_k_of_k_plus_m_fragments_rebuild_every_data_fragment(k, m):
    code = Code(k, m)
    data = [os.urandom(8192) for _ in range(k)]
    frags = dict(enumerate(data + code.parity(data)))
    for have in itertools.combinations(range(k + m), k):
        missing = [i for i in range(k) if i not in have]
        got = code.recover({i: frags[i] for i in have}, missing)
        assert got == {i: data[i] for i in missing}, have


def test_parity_is_a_function_of_the_data_and_fewer_than_k_fragments_are_refused():
    code = Code(4, 2)
    data = [bytes([i]) * 4096 for i in range(4)]
    p = code.parity(data)
    assert p == code.parity([memoryview(bytearray(d)) for d in data])  # any buffer, no copy needed
    assert code.parity([data[0], data[1], data[2], b"\x07" * 4096]) != p
    with pytest.raises(CorruptCheckpoint, match="needs 4 fragments"):
        code.recover({0: data[0], 1: data[1], 4: p[0]}, [2])


def test_layout_cuts_the_concatenated_files_into_k_aligned_fragments():
    lay = Layout((("rank-00000.shard", 3 * 4096), ("rank-00001.shard", 2 * 4096)), 2, 1)
    assert lay.total_bytes == 5 * 4096 and lay.fragment_bytes == 3 * 4096
    assert list(lay.pieces(0, 0, 3 * 4096)) == [("rank-00000.shard", 0, 0, 3 * 4096)]
    # fragment 1: all of the second file, then one block of padding
    assert list(lay.pieces(1, 0, 3 * 4096)) == [("rank-00001.shard", 0, 0, 2 * 4096), (None, 0, 2 * 4096, 4096)]
    assert list(lay.pieces(1, 4096, 4096)) == [("rank-00001.shard", 4096, 4096, 4096)]
    raw = lay.describe(7, "abc", "n0")
    back, doc = Layout.parse(raw, "x")
    assert back == lay and doc["step"] == 7 and doc["checkpoint_id"] == "abc"
    with pytest.raises(CorruptCheckpoint, match="bad coding descriptor"):
        Layout.parse(raw.replace(b'"k": 2', b'"k": 3'), "x")  # sizes no longer add up
    with pytest.raises(ValueError):
        list(lay.pieces(2, 0, 4096))  # not a data fragment


def test_a_wrong_byte_changes_the_fragment_crc_and_a_header_round_trips():
    a, b = FragmentCheck(), FragmentCheck()
    data = bytearray(os.urandom(1 << 16))
    a.feed(memoryview(data))
    data[1234] ^= 0x01
    b.feed(memoryview(data[:5000]))
    b.feed(memoryview(data[5000:]))
    assert a.crc != b.crc and a.n == b.n
    h = parse_header(header_block(3, 1 << 16, a.crc, "d" * 16), "f")
    assert (h["index"], h["bytes"], h["crc32c"]) == (3, 1 << 16, a.crc)
    with pytest.raises(CorruptCheckpoint, match="not a fragment"):
        parse_header(b"\0" * 4096, "f")


def test_config_code_is_exclusive_with_replicas_and_a_small_cluster_is_refused_by_name():
    pc = PeersConfig(code="rs", data_fragments=4, parity_fragments=2)
    assert CheckpointConfig(peers=pc).peer_copies
    with pytest.raises(ConfigError, match="replicas=2 and peers.code='rs'"):
        CheckpointConfig(replicas=2, peers=pc)
    with pytest.raises(ConfigError, match="peers.code"):
        PeersConfig(code="xor")
    with pytest.raises(ConfigError, match="peers.parity_fragments"):
        PeersConfig(code="rs", parity_fragments=0)
    with pytest.raises(ConfigError, match=r"needs at least 7 nodes; this job has 5 .* at most 4, or use replicas"):
        check_cluster(4, 2, [f"n{i}" for i in range(5)])
    check_cluster(4, 2, [f"n{i}" for i in range(7)])


def test_under_a_bandwidth_cap_a_holder_waits_at_most_a_quarter_of_its_timeout_between_pieces():
    from zerostall.peers.coded import _stripe_bytes
    from zerostall.peers.coding import STRIPE_BYTES
    from zerostall.peers.stream import Pacer
    assert _stripe_bytes(None, 6) == _stripe_bytes(Pacer(None), 6) == STRIPE_BYTES
    for rate, timeout, frags in ((2 << 20, 5.0, 6), (200_000_000, 30.0, 10), (1 << 20, 2.0, 64)):
        stripe = _stripe_bytes(Pacer(rate, timeout), frags)
        assert stripe % 4096 == 0 and stripe <= STRIPE_BYTES
        # a holder's next piece comes after every other fragment's piece of the stripe was paid for
        assert frags * stripe / rate <= max(timeout / 4, frags * 4096 / rate), (rate, timeout, frags, stripe)
