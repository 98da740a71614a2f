"""Replacing a step on a remote tier (the local step is another checkpoint than the remote's:
an overwrite, a run restarted from an earlier step) never leaves the step absent or torn.

The seam: the remote tier's mutating requests (put, copy, delete). A crash is injected before
the n-th of them, for every n until a replacement completes; at each crash the remote must
still list the step and it must load and verify as the old or the new checkpoint; a fresh
replicator (the next run) then finishes: the new checkpoint, and no object its manifest does
not name. The old code deleted the remote step first (a crash there lost it).
Real files (file://) and the real radosgw (s3://)."""

import os
import uuid

import pytest
import torch

import zerostall
from zerostall import LoadReport
from zerostall.cli import main as cli
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.store.local import LocalTier
from zerostall.store.tier import open_tier
from zerostall.saving.upload import Replicator
from zerostall.store.retention import RetentionPolicy

pytestmark = pytest.mark.timeout(600)
S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"
MUTATING = ("_put_file", "_put_bytes", "_delete", "_delete_prefix", "_copy_within")


class Crash(Exception):
    """The process dies here: nothing after this request happens."""


def _arm(remote, n):
    """Crash before the n-th mutating request of ``remote``; returns the request counter."""
    count = [0]
    for name in (m for m in MUTATING if hasattr(remote, m)):
        orig = getattr(remote, name)

        def wrapped(*a, _orig=orig, **k):
            count[0] += 1
            if count[0] == n:
                raise Crash(n)
            return _orig(*a, **k)

        setattr(remote, name, wrapped)
    return count


def _pass(local, url, arm=None):
    remote = open_tier(url)
    count = _arm(remote, arm) if arm else None
    rep = Replicator(LocalTier(local), lambda: remote, RetentionPolicy(), start=False, rank_wait_s=5)
    rep._pass()
    return count


@pytest.fixture(params=["file", "s3"])
def base_url(request, tmp_path):
    if request.param == "file":
        yield f"file://{tmp_path / 'remote'}"
        return
    if not S3:
        pytest.skip("no S3 server: source the S3 environment (ZEROSTALL_TEST_S3=1)")
    url = f"s3://edges-zerostall-replace/{uuid.uuid4().hex[:12]}"
    yield url
    open_tier(url)._delete_prefix("")


def _value(tmp_path, url, tag):
    rep = LoadReport()
    got = zerostall.load(str(tmp_path / f"fresh-{tag}"), remote=url, step=2, report=rep)
    assert rep.failed == [] and rep.source == "remote", rep.failed
    return got["a"][0].item()


def test_replacing_a_remote_step_survives_a_crash_at_every_request(tmp_path, base_url, capsys):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    for s in (1, 2):
        zerostall.save(old, {"a": torch.full((3000,), float(s))}, step=s)
    zerostall.save(new, {"a": torch.full((3000,), 20.0)}, step=2)  # another checkpoint as step 2
    shard = [n for n in os.listdir(os.path.join(new, "step-2")) if n != MANIFEST_NAME]

    n, crashed = 1, 0
    while True:
        url = f"{base_url}/{n}"
        _pass(old, url)  # the remote holds the old run's steps 1 and 2
        assert _value(tmp_path, url, f"{n}-before") == 2.0
        count = None
        try:
            count = _pass(new, url, arm=n)
        except Crash:
            crashed += 1
            remote = open_tier(url)
            assert remote.steps() == [1, 2], f"crash before request {n}: step 2 is not committed"
            assert _value(tmp_path, url, f"{n}-crashed") in (2.0, 20.0)
            capsys.readouterr()
            assert cli(["verify", url]) == 0, capsys.readouterr().err
            _pass(new, url)  # the next run finishes the replacement
        else:
            assert count[0] < n  # a whole replacement ran without reaching request n
        remote = open_tier(url)
        assert remote.steps() == [1, 2]
        assert _value(tmp_path, url, f"{n}-after") == 20.0
        names = remote._objects("step-2/") if base_url.startswith("s3") else os.listdir(remote._path("step-2"))
        names = sorted(o["Key"].rsplit("/", 1)[1] if isinstance(o, dict) else o for o in names)
        assert names == sorted(shard + [MANIFEST_NAME]), f"leftovers after crash {n}"
        if count is not None and count[0] < n:
            break
        n += 1
    print(f"{crashed} crash points")
    assert crashed >= 5  # set aside (copy, manifest, delete), upload, commit, sweep


def _two_rank_step(root, value):
    """A step 2 saved by two ranks: rank 0's shard holds the state, rank 1's only a header
    (the files have the same sizes in every checkpoint, so size cannot tell them apart)."""
    import dataclasses

    from zerostall.format.layout import ShardHeader, shard_name
    from zerostall.format.manifest import FileEntry
    zerostall.save(root, {"a": torch.full((3000,), value)}, step=2)
    tier = LocalTier(root)
    man = tier.read_manifest(2)
    f0, = man.files
    name1 = shard_name(1)
    with open(os.path.join(tier.step_dir(2), name1), "wb") as f:
        f.write(ShardHeader(f0.file_id or man.checkpoint_id, 2, 1, f0.file_bytes).encode())
        f.write(bytes(f0.file_bytes - 4096))
    two = dataclasses.replace(man, world_size=2, tree_json="",
                              files=(f0, FileEntry(name1, 1, f0.host, f0.file_bytes, f0.file_id)))
    with open(os.path.join(tier.step_dir(2), MANIFEST_NAME), "wb") as f:
        f.write(two.to_bytes())


def _rank_pass(local, url, rank):
    rep = Replicator(LocalTier(local), lambda: open_tier(url), RetentionPolicy(), rank=rank, world_size=2,
                     start=False, rank_wait_s=0.2)
    rep._pass()


def test_two_ranks_replacing_a_step_never_commit_a_stale_shard(tmp_path, base_url, capsys):
    """Each rank uploads its own shard; rank 0 commits. Rank 1's shard of the replaced
    checkpoint has the size of the new one: rank 0 must not commit before rank 1 replaced it
    (it checks the headers), and rank 1 must not write it before rank 0 set the old step
    aside. After every pass, in either order, the step verifies."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    _two_rank_step(old, 2.0)
    _two_rank_step(new, 20.0)
    url = f"{base_url}/two"
    for rank in (1, 0):
        _rank_pass(old, url, rank)
    assert open_tier(url).steps() == [2] and _value(tmp_path, url, "old") == 2.0
    for i, rank in enumerate((1, 0, 1, 0)):
        _rank_pass(new, url, rank)
        remote = open_tier(url)
        assert remote.steps() == [2], f"pass {i} (rank {rank})"
        capsys.readouterr()
        assert cli(["verify", url]) == 0, f"pass {i} (rank {rank}): {capsys.readouterr().err}"
    assert _value(tmp_path, url, "new") == 20.0
    assert sorted(open_tier(url).names_in(2)) == sorted([MANIFEST_NAME, "rank-00000.shard", "rank-00001.shard"])


def test_verify_of_a_remote_step_replaced_while_it_reads(tmp_path, monkeypatch, capsys):
    """``zerostall verify URL`` read the old manifest, then the step is replaced before it
    opens a shard: it reads the step again (restore_retry), it does not report it corrupt."""
    from zerostall.store.sharedfs import FileTier
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    zerostall.save(old, {"a": torch.full((3000,), 2.0)}, step=2)
    zerostall.save(new, {"a": torch.full((3000,), 20.0)}, step=2)
    url = f"file://{tmp_path / 'remote'}"
    _pass(old, url)
    fired = []
    orig = FileTier._open_read

    def replace_first(self, rel, size, engine):
        if not fired:
            fired.append(rel)
            _pass(new, url)  # the owner's replicator replaces step 2 right now
        return orig(self, rel, size, engine)

    monkeypatch.setattr(FileTier, "_open_read", replace_first)
    capsys.readouterr()
    assert cli(["verify", url]) == 0, capsys.readouterr().err
    assert fired and "step 2: OK" in capsys.readouterr().out
    monkeypatch.setattr(FileTier, "_open_read", orig)
    assert _value(tmp_path, url, "after") == 20.0


def _incremental_run(root, value):
    """Step 1 full, step 2 incremental: its unchanged tensor borrows step 1's shard."""
    with zerostall.Checkpointer(root, incremental=True) as ck:
        state = {"frozen": torch.full((4000,), value), "a": torch.full((100,), value)}
        ck.save(1, state).wait()
        state["a"] += 1
        ck.save(2, state).wait()


def test_a_step_borrowing_a_step_the_remote_holds_as_another_checkpoint_is_not_committed(tmp_path, base_url, capsys):
    """The remote holds an earlier run's steps 1 and 2 (2 borrows from 1); the local root holds
    another run's 1 and 2 (2 borrows from its own 1). Remote step 1 cannot be replaced while
    the remote's step 2 borrows from it; step 2 must then not be replaced either: its new
    manifest would reference step-1/rank-00000.shard, which is the other run's (the old code
    committed it: remote step 2 torn for good, and, borrowing from step 1, it kept step 1
    from ever being replaced). After every pass, every remote step verifies."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    _incremental_run(old, 1.0)
    _incremental_run(new, 5.0)
    url = f"{base_url}/borrow"
    _pass(old, url)
    assert _value(tmp_path, url, "old") == 2.0  # "a" + 1
    for i in range(2):
        _pass(new, url)
        assert open_tier(url).steps() == [1, 2]
        capsys.readouterr()
        assert cli(["verify", url]) == 0, f"pass {i}: {capsys.readouterr().out}"
        assert _value(tmp_path, url, f"pass-{i}") == 2.0  # the old run's step 2, whole


@pytest.mark.parametrize("when", ["download", "stat"])
def test_load_of_a_remote_step_replaced_while_it_downloads(tmp_path, base_url, monkeypatch, when):
    """``load(remote=)`` read the old manifest of step 2, then the owner's replicator replaces
    the step before the first object is fetched: the download brings the new checkpoint's
    object (or finds the old one gone), and the load reads the step again instead of falling
    back to step 1 (the old code loaded step 1 and reported step 2 as damaged)."""
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    for s in (1, 2):
        zerostall.save(old, {"a": torch.full((3000,), float(s))}, step=s)
    zerostall.save(new, {"a": torch.full((3000,), 20.0)}, step=2)
    url = f"{base_url}/loading"
    _pass(old, url)
    cls = type(open_tier(url))
    fired = []
    orig = getattr(cls, when)

    def replace_first(self, rel, *a, **k):
        if not fired and rel.startswith("step-2/") and not rel.endswith(MANIFEST_NAME):
            fired.append(rel)
            _pass(new, url)  # the owner's replicator replaces step 2 right now
        return orig(self, rel, *a, **k)

    monkeypatch.setattr(cls, when, replace_first)
    rep = LoadReport()
    got = zerostall.load(str(tmp_path / "fresh"), remote=url, report=rep)
    assert fired
    assert (rep.step, rep.source, rep.failed) == (2, "remote", [])
    assert got["a"][0].item() == 20.0
    assert LocalTier(str(tmp_path / "fresh")).steps() == [2]


def test_a_symlinked_step_directory_on_a_shared_fs_tier_is_replaced_not_written_through(tmp_path):
    """The file:// tier's step-2 is a symlink to a directory outside it (not a checkpoint:
    reading refuses it). Replicating the local step 2 removes the link and uploads into a
    directory of its own; the old code uploaded through the link, and its sweep then deleted
    every file there that the new manifest did not name."""
    new = str(tmp_path / "new")
    zerostall.save(new, {"a": torch.full((3000,), 20.0)}, step=2)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("not zerostall's")
    (tmp_path / "remote").mkdir()
    os.symlink(victim, tmp_path / "remote" / "step-2")
    url = f"file://{tmp_path / 'remote'}"
    _pass(new, url)
    assert sorted(os.listdir(victim)) == ["precious.txt"]
    assert not os.path.islink(tmp_path / "remote" / "step-2")
    assert open_tier(url).steps() == [2] and _value(tmp_path, url, "after") == 20.0


@pytest.mark.parametrize("remote_had_it", [False, True])
def test_a_step_overwritten_locally_while_it_uploads_is_never_committed_torn(tmp_path, base_url, monkeypatch,
                                                                          remote_had_it):
    """The run saves step 2 again (overwrite=True: a preemption save at the step just saved)
    after the replicator read the first copy's manifest and before it read the shard: the
    shard it uploads is the second copy's. It must not commit the first copy's manifest over
    it (the old code did: a torn remote step, its handle marked replicated); the next pass
    uploads the second copy."""
    import zerostall.saving.upload as replicate
    local = str(tmp_path / "local")
    url = f"{base_url}/swap"
    if remote_had_it:  # an earlier copy of step 2 is on the remote (replaced meanwhile)
        zerostall.save(local, {"a": torch.full((3000,), 0.5)}, step=2)
        _pass(local, url)
    zerostall.save(local, {"a": torch.full((3000,), 1.0)}, step=2, overwrite=True)
    orig, fired = replicate.live_names, []

    def overwrite_first(remote, step, checkpoint_id):
        if not fired:
            fired.append(step)
            zerostall.save(local, {"a": torch.full((3000,), 2.0)}, step=2, overwrite=True)
        return orig(remote, step, checkpoint_id)

    monkeypatch.setattr(replicate, "live_names", overwrite_first)
    _pass(local, url)
    assert fired
    if 2 in open_tier(url).steps():  # whatever is committed there loads whole
        assert _value(tmp_path, url, "mid") in (0.5, 1.0, 2.0)
    monkeypatch.setattr(replicate, "live_names", orig)
    _pass(local, url)
    assert open_tier(url).steps() == [2] and _value(tmp_path, url, "after") == 2.0
