"""Format version 2: references to earlier steps' bytes, validated like own entries."""


import pytest

from zerostall.errors import CheckpointNotFound, CorruptCheckpoint, RemoteError
from zerostall.format import FileEntry, Manifest, TensorEntry
from zerostall.format.refs import RefFile, closure
from zerostall.store.retention import dependents, spare_referenced

from tests.helpers import seal_manifest
from tests.manifest_forms import FORMS, edit

F = "rank-00000.zst"


def _manifest(**kw):
    base = dict(step=7, world_size=1, checkpoint_id="abc", created_unix=1.0,
                files=(FileEntry(F, 0, "h", 8192),),
                tensors=(TensorEntry("w", "float32", (2, 3), F, 4096, 24, 123),
                         TensorEntry("frozen", "float32", (1024,), F, 4096, 4096, 456, step=3)),
                tree={"d": [[{"v": "w"}, {"T": 0}], [{"v": "frozen"}, {"T": 1}]]},
                ref_files=(RefFile(3, F, 0, 12288, "def"),))
    base.update(kw)
    return Manifest(**base)


def _reseal(body):
    return seal_manifest(body)


def test_roundtrip_with_and_without_references_and_v2_refused():
    m = _manifest()
    body = m.body()
    assert body["format_version"] == 3 and body["tensors"]["file"] == [0, 1]  # 1: ref_files[0]
    m2 = Manifest.from_bytes(m.to_bytes())
    assert m2.tensors == m.tensors and m2.ref_files == m.ref_files
    assert m2.referenced_bytes == 4096 and m2.total_bytes == 8192
    plain = _manifest(tensors=m.tensors[:1], tree={"d": [[{"v": "w"}, {"T": 0}]]}, ref_files=())
    assert plain.body()["format_version"] == 3 and "ref_files" not in plain.body()
    old = edit(m.body(), lambda b: None, "objects")  # what 0.5 wrote: version 2, objects
    assert old["format_version"] == 2 and old["tensors"][1]["step"] == 3
    with pytest.raises(CorruptCheckpoint, match="format_version 2 was written by an earlier zerostall;.* save it again"):
        Manifest.from_bytes(_reseal(old))
    assert Manifest.from_bytes(plain.to_bytes()).ref_files == ()


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b.pop("ref_files"), "requires a non-empty 'ref_files'|not listed in 'files' or 'ref_files'"),
    (lambda b: b.update(format_version=1), "format_version 1 was written by an earlier zerostall"),
    (lambda b: b.update(ref_files=[]), "requires a non-empty 'ref_files'"),
    (lambda b: b["ref_files"][0].update(step=7), "not earlier"),
    (lambda b: b["ref_files"][0].update(step=-1), "non-negative"),
    (lambda b: b["ref_files"][0].update(name="../../etc/passwd"), "plain file name"),
    (lambda b: b["ref_files"][0].update(file_bytes=100), "multiple"),
    (lambda b: b["ref_files"][0].update(file_id=""), "file_id"),
    (lambda b: b["ref_files"].append(dict(b["ref_files"][0])), "twice"),
    (lambda b: b["tensors"][1].update(step=4), "not listed in 'ref_files'|not listed in 'files' or 'ref_files'"),
    (lambda b: b["tensors"][1].update(step="3"), "not listed in 'ref_files'|not listed in 'files' or 'ref_files'"),
    (lambda b: b["tensors"][1].update(offset=12288), "outside"),
    (lambda b: b["tensors"][1].update(offset=4097), "unaligned"),
])
@pytest.mark.parametrize("form", FORMS)
def test_hostile_references_rejected(mutate, msg, form):
    body = edit(_manifest().body(), mutate, form)
    with pytest.raises(CorruptCheckpoint, match=msg):
        Manifest.from_bytes(_reseal(body))


def test_closure_and_retention_order():
    refs = {5: {3}, 3: {1}, 4: {1}, 1: set(), 2: set(), 0: set()}

    class M:
        def __init__(self, s):
            self.ref_files = tuple(RefFile(r, F, 0, 8192, "x") for r in refs[s])

    assert closure({5}, lambda s: refs[s]) == {5, 3, 1}
    # keep 5 (newest): 3 and 1 stay (closure), 4, 2, 0 go, newest first
    assert spare_referenced([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], M) == [4, 2, 0]
    assert spare_referenced([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], M, protect={2}) == [4, 0]

    # a kept step whose manifest cannot be read now (damaged since the listing, a remote
    # answering 503, EIO) may reference any doomed step: delete nothing this time
    for err in (CorruptCheckpoint("unreadable"), RemoteError("503 SlowDown"), OSError(5, "EIO")):
        def broken(s, err=err):
            if s == 5:
                raise err
            return M(s)
        assert spare_referenced([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], broken) == []

    def gone(s):  # a step deleted meanwhile references nothing
        if s == 5:
            raise CheckpointNotFound("gone")
        return M(s)
    assert spare_referenced([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4], gone) == [4, 3, 2, 1, 0]
    assert dependents([0, 1, 2, 3, 4, 5], 1, M) == [3, 4]


def test_crc_combine_matches_whole_buffer_crc():
    import os
    import random

    import crc32c

    from zerostall.format.crc_combine import combine
    rnd = random.Random(0)
    for n in [0, 1, 7, 4096, 65537]:
        a, b = os.urandom(rnd.randint(0, 3000)), os.urandom(n)
        assert combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_parallel_source_crc_equals_crc_of_the_bytes():
    import crc32c
    import torch

    from zerostall.saving import incremental as inc
    ts = [torch.randn(n) for n in (0, 1, 1000, (16 << 20) // 4, (16 << 20) // 4 + 3, 5 << 20)]
    ts.append(torch.randn(300, 200).t())  # not contiguous
    for threads in (1, 3):
        c = inc._CpuCrc(threads)
        got = c.many(ts)
        c.close()
        assert got == [crc32c.crc32c(t.contiguous().numpy().tobytes()) for t in ts]


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b["ref_files"][0].update(file_bytes=100),
     r"step 3: file 'rank-00000\.zst': file_bytes 100"),
    (lambda b: b["ref_files"][0].update(rank=-1), r"step 3: file 'rank-00000\.zst': .*rank"),
])
def test_a_bad_reference_is_named_with_its_step(mutate, msg):
    """Every step's shards share their names: an error about a reference names its step too."""
    with pytest.raises(CorruptCheckpoint, match=msg):
        Manifest.from_bytes(_reseal(edit(_manifest().body(), mutate)))
