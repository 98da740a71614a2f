"""The persist thread's per-tensor work at commit: the manifest's tensor entries encoded once
per layout (format/table.py ``tensors_json``) and retention reading the references of the
manifest the local tier just committed without parsing it again (``LocalTier.manifest_refs``)."""

import json
import os

import pytest
import torch

import zerostall
from zerostall.errors import CorruptCheckpoint
from zerostall.format.manifest import FileEntry, Manifest, TensorEntry, tensors_json
from zerostall.store.local import LocalTier
from zerostall.store.retention import ManifestRefs

EMPTY = {"dtypes": [], "key": [], "dtype": [], "shape": [], "file": [], "offset": [], "nbytes": [], "crc32c": []}
KEYS = ["a", 'b"c', ',"crc32c":0}', "\u00e9x", "k\\", "tab\there", "\u2028"]


def _entries(bump=0, file="rank-00000.shard"):
    return tuple(TensorEntry(k, "float32", (2, 3) if i % 2 else (), file, 8192 + 4096 * i, 24, (123456 + i * bump) & 0xFFFFFFFF)
                 for i, k in enumerate(KEYS))


def _manifest(tensors, tj=""):
    return Manifest(1, 1, "id", 0.0, (FileEntry(tensors[0].file, 0, "h", 1 << 20),), tensors, {"d": []}, tensors_json=tj)


def test_tensors_json_is_byte_for_byte_the_encoders_and_memo_reused():
    memo = {}
    for bump in (0, 7, 0xFFFFFFF):
        ts = _entries(bump)
        assert _manifest(ts, tensors_json(ts, memo)).to_bytes() == _manifest(ts).to_bytes()
    assert len(memo) == 1  # one layout: encoded once, crc32c joined in since
    other = _entries(1, file="rank-00001.shard")
    assert _manifest(other, tensors_json(other, memo)).to_bytes() == _manifest(other).to_bytes()
    assert json.loads(tensors_json((), memo)) == EMPTY


def test_tensors_json_refuses_references():
    ref = TensorEntry("k", "float32", (1,), "rank-00000.shard", 8192, 4, 1, step=3)
    with pytest.raises(ValueError):
        tensors_json((ref,))


def test_saved_manifests_parse_and_load_across_saves_of_one_layout(tmp_path):
    st = {f"k{i}": torch.full((i % 4 + 1,), float(i)) for i in range(300)}
    st['odd "key"\\'] = torch.ones(2)
    with zerostall.Checkpointer(tmp_path / "ck") as ck:
        for step in range(3):
            for t in st.values():
                t.add_(1)
            ck.save(step, st).result()
            got = zerostall.load(tmp_path / "ck", step=step)
            assert all(torch.equal(got[k], v) for k, v in st.items())


def test_manifest_refs_from_the_commit_then_from_disk_when_the_file_changes(tmp_path):
    st = {"a": torch.ones(3)}
    with zerostall.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, st).result()
        tier = LocalTier(str(tmp_path / "ck"))
        assert isinstance(tier.manifest_refs(1), Manifest)  # a new tier: parsed (and remembered)
        assert isinstance(tier.manifest_refs(1), ManifestRefs)
        cached = ck.tier  # the tier that committed the step
        got = cached.manifest_refs(1)
        assert isinstance(got, ManifestRefs) and got.step == 1 and got.ref_files == ()  # from the commit
        path = os.path.join(tmp_path / "ck", "step-1", "manifest.json")
        raw = open(path, "rb").read()
        with open(path, "wb") as f:  # rewritten (same size, one byte flipped): identity changed
            f.write(raw[:-5] + bytes([raw[-5] ^ 0x01]) + raw[-4:])
        with pytest.raises(CorruptCheckpoint):
            cached.manifest_refs(1)
        with open(path, "wb") as f:
            f.write(raw)
        assert isinstance(cached.manifest_refs(1), Manifest)  # valid again, parsed again


def test_entries_from_plan_items_encode_like_tensor_entries():
    from zerostall.format.manifest import Entries
    from zerostall.saving.plan import PlanItem
    items = tuple(PlanItem(i, k, "bfloat16" if i % 3 else "float32", (2, 3) if i % 2 else (), 12, 8192 + 4096 * i)
                  for i, k in enumerate(KEYS))
    memo = {}
    for bump in (1, 99):
        crcs = tuple((7 + i * bump) & 0xFFFFFFFF for i in range(len(items)))
        lazy = Entries(items, "rank-00003.shard", crcs)
        plain = tuple(TensorEntry(it.key, it.dtype, it.shape, "rank-00003.shard", it.offset, it.nbytes, c)
                      for it, c in zip(items, crcs))
        assert lazy == plain and list(lazy) == list(plain) and lazy[2] == plain[2] and lazy[1:3] == plain[1:3]
        assert tensors_json(lazy, memo) == tensors_json(plain) == tensors_json(lazy)
        assert _manifest(lazy, tensors_json(lazy, memo)).to_bytes() == _manifest(plain).to_bytes()
    assert json.loads(tensors_json(Entries((), "rank-00000.shard", ()), {})) == EMPTY
    with pytest.raises(ValueError):
        Entries(items, "rank-00000.shard", (1,))


_READ_UNDER_LIMIT = r"""
import resource, sys
import torch  # imported before the limit: only the read runs under it
from zerostall.format.manifest import MAX_MANIFEST_BYTES
from zerostall.store import open_tier
from zerostall.store.local import LocalTier
tier = LocalTier(sys.argv[1]) if sys.argv[2] == "local" else open_tier("file://" + sys.argv[1])
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
assert MAX_MANIFEST_BYTES > 64 << 20  # the limit is far above what the read may reserve
man = tier.read_manifest(1)
print("read", man.step, len(man.tensors))
"""


def _read_under_limit(tmp_path, tier):
    import subprocess
    import sys
    with zerostall.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"a": torch.ones(3)}).result()
    return subprocess.run([sys.executable, "-c", _READ_UNDER_LIMIT, str(tmp_path / "ck"), tier], capture_output=True,
                          text=True, timeout=300)


def test_a_manifest_is_read_without_reserving_memory_for_its_size_limit(tmp_path):
    # a small manifest costs a small read: under an address-space limit (ulimit -v, strict
    # overcommit) reading it must not reserve MAX_MANIFEST_BYTES
    out = _read_under_limit(tmp_path, "local")
    assert out.returncode == 0 and "read 1 1" in out.stdout, out.stderr[-2000:]


def test_a_shared_filesystem_tier_reads_a_manifest_without_reserving_its_size_limit(tmp_path):
    # the shared-FS tier's reads (manifests, decision records) are as small as the file
    out = _read_under_limit(tmp_path, "file")
    assert out.returncode == 0 and "read 1 1" in out.stdout, out.stderr[-2000:]
