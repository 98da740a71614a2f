"""The format layer: dtypes, shard layout, manifest, tree encoding (and its reference cycles)."""

import gc
import json
import math
import random
import weakref

import numpy as np
import pytest
import torch

from zerostall.errors import CorruptCheckpoint, UnsupportedStateError
from zerostall.format import FileEntry, Manifest, TensorEntry, layout
from zerostall.format.decode import decode_tree
from zerostall.format.layout import ShardHeader
from zerostall.format.tree import encode_tree

from tests.helpers import seal_manifest
from tests.manifest_forms import FORMS, edit


def _manifest(**kw):
    base = dict(step=7, world_size=1, checkpoint_id="abc", created_unix=1.0,
                files=(FileEntry("rank-00000.shard", 0, "h", 8192),),
                tensors=(TensorEntry("w", "float32", (2, 3), "rank-00000.shard", 4096, 24, 123),),
                tree={"d": [[{"v": "w"}, {"T": 0}]]})
    base.update(kw)
    return Manifest(**base)


def test_manifest_roundtrip():
    m = _manifest()
    m2 = Manifest.from_bytes(m.to_bytes())
    assert m2.tensors == m.tensors and m2.files == m.files and m2.step == 7


def test_manifest_written_as_columns_and_an_earlier_version_refused():
    """Version 3 writes the tensor table as columns; a version 1 or 2 body (one object per
    tensor, what earlier releases wrote) is refused naming its version and what to do."""
    m = _manifest(tensors=(TensorEntry("w", "float32", (2, 3), "rank-00000.shard", 4096, 24, 123),
                           TensorEntry("b", "bfloat16", (), "rank-00000.shard", 0x2000 - 2, 2, 7)),
                  files=(FileEntry("rank-00000.shard", 0, "h", 12288),),
                  tree={"d": [[{"v": "w"}, {"T": 0}], [{"v": "b"}, {"T": 1}]]})
    body = m.body()
    assert body["format_version"] == 3 and body["tensors"] == {
        "dtypes": ["float32", "bfloat16"], "key": ["w", "b"], "dtype": [0, 1], "shape": [[2, 3], []],
        "file": [0, 0], "offset": [4096, 0x2000 - 2], "nbytes": [24, 2], "crc32c": [123, 7]}
    assert Manifest.from_bytes(m.to_bytes()).tensors == m.tensors
    old = edit(m.body(), lambda b: None, "objects")
    assert old["format_version"] == 1 and old["tensors"][1] == m.tensors[1].to_json()
    for version in (1, 2):
        old["format_version"] = version
        with pytest.raises(CorruptCheckpoint, match=f"format_version {version} was written by an earlier zerostall;"
                                                    " this zerostall reads only format_version 3: load the checkpoint "
                                                    "with the zerostall that wrote it and save it again"):
            Manifest.from_bytes(_reseal(old))
    with pytest.raises(CorruptCheckpoint, match="format_version 4 was written by a newer zerostall"):
        Manifest.from_bytes(_reseal({**m.body(), "format_version": 4}))


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: t.update(dtype=[2]), r"dtype index 2 is not in \[0, 1\)"),
    (lambda t: t.update(file=[1]), "file 1 is not listed"),
    (lambda t: t.update(crc32c=[]), "columns differ in length"),
    (lambda t: t.pop("offset"), "must hold the lists"),
    (lambda t: t.update(dtypes=["object"]), "unknown dtype"),
    (lambda t: t.update(key=[["w"]]), "no valid key"),
])
def test_hostile_columns_rejected(mutate, msg):
    """What only the column table can get wrong: indices, lengths, missing columns."""
    body = _manifest().body()
    mutate(body["tensors"])
    with pytest.raises(CorruptCheckpoint, match=msg):
        Manifest.from_bytes(_reseal(body))


def test_older_reader_refuses_version_3_by_name():
    """What a reader of versions 1-2 does with this release's manifests: its version check
    (kept verbatim here) names the version and asks for an upgrade."""
    v = _manifest().body()["format_version"]
    assert v not in (1, 2)  # so the check below, from 0.5's from_bytes, refuses it
    msg = (f"unknown format_version {v!r:.40} (this zerostall reads 1 and 2; upgrade zerostall to read "
           "newer checkpoints)")
    assert "upgrade zerostall" in msg and "3" in msg


def test_every_single_byte_flip_in_manifest_is_detected():
    raw = bytearray(_manifest().to_bytes())
    for i in range(0, len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(CorruptCheckpoint):
            Manifest.from_bytes(bytes(bad))


def _reseal(body):
    return seal_manifest(body)


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b.update(format_version=99), "format_version"),
    (lambda b: b["files"][0].update(name="../evil"), "plain file name"),
    (lambda b: b["files"][0].update(name="/etc/passwd"), "plain file name"),
    (lambda b: b["tensors"][0].update(offset=1 << 40), "outside"),
    (lambda b: b["tensors"][0].update(nbytes=-1), "nbytes"),
    (lambda b: b["tensors"][0].update(dtype="object"), "unknown dtype"),
    (lambda b: b["tensors"][0].update(shape=[2**40, 2**40]), r"2\*\*62 elements"),
    (lambda b: b["tensors"][0].update(shape=[-2, -3]), "shape"),
    (lambda b: b.update(tree={"T": 5}), "tensor 5"),
])
@pytest.mark.parametrize("form", FORMS)
def test_hostile_manifest_fields_rejected(mutate, msg, form):
    body = edit(_manifest().body(), mutate, form)
    with pytest.raises(CorruptCheckpoint, match=msg):
        Manifest.from_bytes(_reseal(body))


def test_tree_roundtrip_plain_and_keys():
    t = torch.arange(4)
    obj = {"a": t, "opt": {"state": {0: {"step": 3}}, "groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]},
           "nan": math.nan, "inf": -math.inf, "none": None, "flag": True, "s": "x", (1, "k"): "tuple-key",
           "arr": np.arange(3, dtype=np.int16)}
    tree, leaves = encode_tree(obj)
    json.dumps(tree, allow_nan=False)  # pure JSON
    out = decode_tree(tree, [l.tensor for l in leaves])
    assert out["opt"] == obj["opt"] and out[(1, "k")] == "tuple-key"
    assert math.isnan(out["nan"]) and out["inf"] == -math.inf and out["none"] is None
    assert isinstance(out["arr"], np.ndarray) and out["arr"].tolist() == [0, 1, 2]


def test_shared_storage_stored_once():
    w = torch.randn(3, 3)
    tree, leaves = encode_tree({"emb": w, "head": w, "view": w[1]})
    assert len(leaves) == 2  # emb/head alias; a different view is its own entry


@pytest.mark.parametrize("bad,key", [
    ({"a": {"b": object()}}, "a.b"),
    ({"m": torch.empty(2, device="meta")}, "m"),
    ({"s": {"f": lambda: 0}}, "s.f"),
    ({"o": np.array([object()])}, "o"),
])
def test_unsupported_leaves_name_the_key(bad, key):
    with pytest.raises(UnsupportedStateError, match=key.replace(".", r"\.")):
        encode_tree(bad)


def test_header_check():
    h = ShardHeader("id", 1, 0, 8192)
    ShardHeader.check(h.encode(), h, "f")
    with pytest.raises(CorruptCheckpoint, match="does not match"):
        ShardHeader.check(ShardHeader("other", 1, 0, 8192).encode(), h, "f")


# Encoding and decoding a state tree leave no reference cycle: the tensors they were given
# are freed by reference counting alone (a restore's scratch, the whole state, used to stay
# mapped until the next cyclic GC, whose munmap then landed inside a later save()).

def test_tensors_passed_through_encode_and_decode_are_freed_without_the_gc():
    gc.collect()
    gc.disable()
    try:
        src = torch.arange(16.0)
        tree, leaves = encode_tree({"m": {"w": src, "n": [1, 2.5, "x"]}, "step": 3})
        scratch = torch.zeros(16)  # what a restore reads into
        out = decode_tree(tree, [scratch])
        assert out["m"]["w"] is scratch and out["step"] == 3 and out["m"]["n"] == [1, 2.5, "x"]
        refs = [weakref.ref(src), weakref.ref(scratch)]
        del src, scratch, leaves, out, tree
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()


def test_a_plain_dict_key_or_value_is_encoded_without_a_helper_frame():
    # per key of every small dict (an optimizer's per-parameter state: per tensor) on the
    # caller's thread inside save(): the plain cases run inline, no Python call but the walk's own
    import sys

    from zerostall.format import tree as tree_mod

    calls: list[str] = []
    walk = tree_mod._Walk(None, None, None, None, None, None)
    sys.setprofile(lambda frame, event, arg: calls.append(frame.f_code.co_name) if event == "call" else None)
    try:
        for k in ("exp_avg", None, True, 1.5, float("nan")):
            tree_mod._encode_key(k, ())
            walk.node(k, (), 0)
    finally:
        sys.setprofile(None)
    assert set(calls) == {"_encode_key", "node"}, calls


# ------------------------------------------------------------------------------------------------
# ``layout.pack_offsets`` (the one offset assignment of every save) inlines ``place`` and
# ``item_align`` for speed (100k tensors in a first save's plan): it must give exactly the
# offsets and file length of placing the items one by one with the layout's rule.
def _one_by_one(sizes, start):
    offsets, pos = [], start
    for n in sizes:
        off, pos = layout.place(pos, n)
        offsets.append(off)
    return offsets, max(layout.align_up(pos), start)


EDGES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 4095, 4096, 4097,
         (256 << 10) - 1, 256 << 10, (256 << 10) + 1]


@pytest.mark.parametrize("seed", range(20))
def test_pack_offsets_equals_placing_one_by_one(seed):
    rng = random.Random(seed)
    sizes = [rng.choice(EDGES + [rng.randint(0, 1 << 21), rng.randint(0, 5000)]) for _ in range(rng.randint(0, 400))]
    for start in (layout.HEADER_BYTES, 8192):
        assert layout.pack_offsets(sizes, start) == _one_by_one(sizes, start)


def test_pack_offsets_every_alignment_class():
    sizes = EDGES * 3
    offsets, end = layout.pack_offsets(sizes)
    assert (offsets, end) == _one_by_one(sizes, layout.HEADER_BYTES)
    assert all(o % layout.item_align(n) == 0 for o, n in zip(offsets, sizes))
    assert end % 4096 == 0 and end >= offsets[-1] + sizes[-1]
