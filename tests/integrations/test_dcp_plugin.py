"""zerostall.dcp: DCP's planners over zerostall's codec and engines; FileSystemWriter's semantics.

Resharding 4 -> 2 -> 1 on real gloo ranks; overwrite without touching other files; crashes
at every commit boundary; URLs refused; FileSystemWriter checkpoints read safely.
"""

import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerostall.dcp import CheckpointAlreadyExists, Reader, UnsupportedCheckpoint, Writer
from zerostall.integrations.dcp_writer import SHARD_RE
from zerostall.errors import ConfigError, CorruptCheckpoint

from tests.distributed.test_distributed import _launch

warnings.filterwarnings("ignore", message=".*assuming the intent is to")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint")


def _full():
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)


def _text(exc: BaseException) -> str:
    """DCP wraps per-rank failures in CheckpointException (a BaseException); flatten it."""
    failures = getattr(exc, "failures", {})
    return str(exc) + " ".join(f"{v!r} {getattr(v, 'exc', '')} {getattr(v, 'formatted_tb', '')}"
                               for v in failures.values())


def _state(v: float):
    return {"a": torch.full((300, 7), v), "b": {"n": int(v), "s": f"v{v}"}, "e": torch.empty(0),
            "bf": torch.arange(10).to(torch.bfloat16) * v}


def _blank():
    return {"a": torch.zeros(300, 7), "b": {"n": -1, "s": ""}, "e": torch.empty(0),
            "bf": torch.zeros(10, dtype=torch.bfloat16)}


def _same(x, y):
    return torch.equal(x["a"], y["a"]) and x["b"] == y["b"] and torch.equal(x["bf"], y["bf"])


def _load(path, reader=Reader):
    out = _blank()
    dcp.load(out, storage_reader=reader(path), no_dist=True)
    return out


def _save(path, v, **kw):
    dcp.save(_state(v), storage_writer=Writer(path, **kw), no_dist=True)


def _shards(path):
    return sorted(n for n in os.listdir(path) if SHARD_RE.match(n))


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    path = str(tmp / "ckpt")
    for rc, doc, err in _launch("dcp_save", 4, path, tmp):
        assert rc == 0, err
    return path


def test_saved_layout(saved_at_4):
    names = sorted(os.listdir(saved_at_4))
    assert names[0] == ".metadata" and len(names) == 5
    assert sorted(int(SHARD_RE.match(n).group(1)) for n in names[1:]) == [0, 1, 2, 3]
    assert all(os.path.getsize(os.path.join(saved_at_4, n)) % 4096 == 0 for n in names[1:])
    md = Reader(saved_at_4).read_metadata()
    assert md.storage_meta.checkpoint_id == saved_at_4 and md.storage_meta.save_id and md.storage_meta.load_id


def test_load_at_world_2(saved_at_4, tmp_path):
    for rc, doc, err in _launch("dcp_load", 2, saved_at_4, tmp_path):
        assert rc == 0, err
        assert doc["equal"] is True


def test_load_at_world_1(saved_at_4):
    sd = {"w": torch.zeros(64, 8), "r": torch.zeros(5), "extra": {"lr": 0.0}}
    dcp.load(sd, storage_reader=Reader(saved_at_4))
    assert torch.equal(sd["w"], _full()) and torch.equal(sd["r"], torch.ones(5)) and sd["extra"]["lr"] == 0.5


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))


@pytest.mark.parametrize("where,expect", [(4096 + 3, "crc32c"), (-1, "padding"),  # -1: the file's last byte
                                          (40, "header")])
def test_flipped_byte_fails_with_corruption_error(saved_at_4, tmp_path, where, expect):
    bad = str(tmp_path / "bad")
    shutil.copytree(saved_at_4, bad)
    shard = [n for n in os.listdir(bad) if SHARD_RE.match(n) and SHARD_RE.match(n).group(1) == "00001"][0]
    path = os.path.join(bad, shard)
    if where < 0:  # small items are packed (layout 2): the padding is after the last one, up to the page end
        where = os.path.getsize(path) + where
        with open(path, "rb") as f:
            assert f.read()[where] == 0
    _flip(path, where)
    sd = {"w": torch.zeros(64, 8), "r": torch.zeros(5), "extra": {"lr": 0.0}}
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException derives from BaseException
        dcp.load(sd, storage_reader=Reader(bad))
    text = _text(ei.value)
    assert "CorruptCheckpoint" in text and shard in text and expect in text


def test_metadata_is_not_a_code_path(saved_at_4, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    bad = str(tmp_path / "evil")
    shutil.copytree(saved_at_4, bad)
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(CorruptCheckpoint, match="posix.system|refusing"):
        Reader(bad).read_metadata()
    assert not os.path.exists(tmp_path / "pwned")


def test_metadata_naming_a_torch_submodule_imports_nothing(tmp_path):
    """find_class("torch", "_inductor") is refused without importing torch._inductor (fresh
    interpreter: the test process may have imported it already)."""
    with open(tmp_path / ".metadata", "wb") as f:
        f.write(b"ctorch\n_inductor\n.")
    code = textwrap.dedent(f"""
        import sys
        from zerostall.dcp import Reader
        from zerostall.errors import CorruptCheckpoint
        try:
            Reader({str(tmp_path)!r}).read_metadata()
        except CorruptCheckpoint as exc:
            assert "refusing" in str(exc), exc
        else:
            raise SystemExit("read")
        print(sorted(m for m in sys.modules if m.startswith("torch._inductor")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_async_save_single_process(tmp_path):
    path = str(tmp_path / "async")
    sd = {"a": torch.randn(1000, 7), "b": {"c": torch.arange(10)}}
    fut = dcp.async_save(sd, storage_writer=Writer(path), no_dist=True)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    out = {"a": torch.zeros(1000, 7), "b": {"c": torch.zeros(10, dtype=torch.int64)}}
    dcp.load(out, storage_reader=Reader(path))
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"]["c"], sd["b"]["c"])


# -- FileSystemWriter's semantics ---------------------------------------------------------------
def test_overwrite_defaults_to_true_and_keeps_other_files(tmp_path):
    path = str(tmp_path / "ck")
    os.makedirs(os.path.join(path, "logs"))
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine")
    with open(os.path.join(path, "logs", "run.log"), "w") as f:
        f.write("log")
    _save(path, 1.0)
    first = _shards(path)
    _save(path, 2.0)
    assert _same(_load(path), _state(2.0))
    assert open(os.path.join(path, "notes.txt")).read() == "mine"
    assert open(os.path.join(path, "logs", "run.log")).read() == "log"
    # the first save's shard is gone (it was this checkpoint's), nothing else was touched
    assert len(_shards(path)) == 1 and _shards(path) != first
    assert sorted(os.listdir(path)) == sorted([".metadata", "logs", "notes.txt"] + _shards(path))


def test_overwrite_false_refuses_only_existing_metadata(tmp_path):
    path = str(tmp_path / "ck")
    os.makedirs(path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine")
    _save(path, 1.0, overwrite=False)  # a directory with other files is fine
    with pytest.raises(BaseException) as ei:
        _save(path, 2.0, overwrite=False)
    assert "Checkpoint already exists and self.overwrite=False." in _text(ei.value)
    assert _same(_load(path), _state(1.0)) and len(_shards(path)) == 1
    w = Writer(path, overwrite=False)
    w.set_up_storage_writer(True)
    with pytest.raises(RuntimeError, match="^Checkpoint already exists") as ei2:
        w.prepare_local_plan(dcp.planner.SavePlan([]))
    assert isinstance(ei2.value, CheckpointAlreadyExists) and isinstance(ei2.value, FileExistsError)


@pytest.mark.parametrize("url", ["memory://x", "s3://bucket/ckpt", "file:///tmp/x"])
def test_urls_are_refused_never_a_local_scheme_dir(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="is a URL"):
        Writer(url)
    with pytest.raises(ConfigError, match="is a URL"):
        Reader(url)
    assert Writer.validate_checkpoint_id(url) is False and Reader.validate_checkpoint_id(url) is False
    with pytest.raises(BaseException) as ei:
        dcp.save({"x": torch.ones(2)}, checkpoint_id=url, storage_writer=Writer(str(tmp_path / "ok")), no_dist=True)
    assert "is a URL" in _text(ei.value)
    assert os.listdir(tmp_path) == []  # no "memory:" / "s3:" directory, nothing written


def test_checkpoint_id_and_storage_meta(tmp_path):
    w = Writer(tmp_path / "a")
    dcp.save(_state(3.0), checkpoint_id=tmp_path / "b", storage_writer=w, no_dist=True)
    assert not (tmp_path / "a").exists() and (tmp_path / "b" / ".metadata").exists()
    r = Reader(tmp_path / "a")
    out = _blank()
    dcp.load(out, checkpoint_id=tmp_path / "b", storage_reader=r, no_dist=True)
    assert _same(out, _state(3.0))
    md = Reader(tmp_path / "b").read_metadata()
    assert md.storage_meta.checkpoint_id == tmp_path / "b" and md.storage_meta.save_id == w.save_id
    assert md.version == "1.0.0"


# -- crashes: a crashed save never blocks the next, never damages the previous -------------------
_CRASH = textwrap.dedent("""
    import os, sys, warnings, torch
    warnings.filterwarnings("ignore")
    import torch.distributed.checkpoint as dcp
    import zerostall.integrations.dcp_writer as ds
    point, path = sys.argv[1], sys.argv[2]
    die = lambda *a, **k: os._exit(9)
    if point == "mid_write":
        real = ds.write_shard
        def write_shard(f, header, payloads, offsets, buf):
            f.write([(0, buf.mv[:4096])])   # some bytes reach the file, then the process dies
            os._exit(9)
        ds.write_shard = write_shard
    elif point == "before_rename":
        ds.os.replace = die
    elif point == "after_rename":
        ds.Writer._remove_leftovers = die
    sd = {"a": torch.full((300, 7), 2.0), "b": {"n": 2, "s": "v2.0"}, "e": torch.empty(0),
          "bf": torch.arange(10).to(torch.bfloat16) * 2.0}
    dcp.save(sd, storage_writer=ds.Writer(path), no_dist=True)
    os._exit(0)
""")


@pytest.mark.parametrize("point", ["mid_write", "before_rename", "after_rename"])
def test_crashed_save_keeps_previous_and_does_not_block_next(tmp_path, point):
    path = str(tmp_path / "ck")
    _save(path, 1.0)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine")
    p = subprocess.run([sys.executable, "-c", _CRASH, point, path], capture_output=True, text=True, timeout=120)
    assert p.returncode == 9, p.stderr[-2000:]
    after_crash = _load(path)
    assert _same(after_crash, _state(2.0 if point == "after_rename" else 1.0))
    assert len(os.listdir(path)) > 3  # the crash left something behind (a shard and/or temp metadata)
    _save(path, 3.0)  # neither O_EXCL nor leftovers get in the way
    assert _same(_load(path), _state(3.0))
    assert sorted(os.listdir(path)) == sorted([".metadata", "notes.txt"] + _shards(path)) and len(_shards(path)) == 1


def test_failed_write_removes_its_shard_and_keeps_previous(tmp_path, monkeypatch):
    import zerostall.integrations.dcp_writer as ds
    path = str(tmp_path / "ck")
    _save(path, 1.0)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ds, "write_shard", boom)
    with pytest.raises(BaseException) as ei:
        _save(path, 2.0)
    assert "No space left" in _text(ei.value)
    assert len(_shards(path)) == 1 and _same(_load(path), _state(1.0))


# -- FileSystemWriter checkpoints: read-only compatibility ------------------------------------------
def test_reads_filesystemwriter_checkpoints(tmp_path):
    path = str(tmp_path / "fsw")
    dcp.save(_state(4.0), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    assert _same(_load(path), _state(4.0))
    path2 = str(tmp_path / "fsw_per_tensor")
    dcp.save(_state(5.0), storage_writer=dcp.FileSystemWriter(path2, single_file_per_rank=False), no_dist=True)
    assert _same(_load(path2), _state(5.0))


def test_filesystemwriter_pickled_object_is_not_run(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path}/pwned",))

    path = str(tmp_path / "fsw")
    dcp.save({"obj": Evil(), "t": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    with pytest.raises(BaseException) as ei:
        dcp.load({"obj": None, "t": torch.zeros(2)}, storage_reader=Reader(path), no_dist=True)
    assert "cannot be loaded without running code" in _text(ei.value)
    assert not os.path.exists(tmp_path / "pwned")


def test_filesystemwriter_with_extensions_says_which_reader(tmp_path):
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example
    path = str(tmp_path / "rot13")
    dcp.save({"t": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(path, _extensions=[Rot13Example()]),
             no_dist=True)
    with pytest.raises(UnsupportedCheckpoint, match="FileSystemReader"):
        Reader(path).read_metadata()


def test_filesystemreader_on_ours_says_which_reader(tmp_path):
    path = str(tmp_path / "zs")
    _save(path, 1.0)
    with pytest.raises(BaseException) as ei:
        dcp.load(_blank(), storage_reader=dcp.FileSystemReader(path), no_dist=True)
    assert "load it with zerostall.dcp.Reader" in _text(ei.value)


# -- the CLI understands DCP directories ----------------------------------------------------------
def test_cli_ls_verify_inspect(tmp_path, capsys):
    from zerostall.cli.app import main
    zs, fsw = str(tmp_path / "zs"), str(tmp_path / "fsw")
    _save(zs, 1.0)
    dcp.save(_state(1.0), storage_writer=dcp.FileSystemWriter(fsw), no_dist=True)
    assert main(["ls", zs]) == 0
    out = capsys.readouterr().out
    assert "zerostall.dcp" in out and "committed" in out
    assert main(["ls", fsw, "--json"]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)
    assert rows[0]["format"] == "FileSystemWriter" and rows[0]["state"] == "committed"
    assert main(["verify", zs]) == 0 and "OK (zerostall.dcp" in capsys.readouterr().out
    assert main(["verify", fsw]) == 0 and "OK (FileSystemWriter" in capsys.readouterr().out
    assert main(["inspect", zs, "--json"]) == 0
    entries = {e["key"]: e for e in __import__("json").loads(capsys.readouterr().out)[0]["entries"]}
    assert entries["a"]["shape"] == [300, 7] and entries["a"]["dtype"] == "float32"
    assert entries["b.s"]["type"] == "object"
    shard = _shards(zs)[0]
    _flip(os.path.join(zs, shard), 4096 + 4000)  # inside "a"'s payload (8400 bytes, at most "bf"'s 20 before it)
    assert main(["verify", zs]) == 1
    err = capsys.readouterr().err
    assert shard in err and "crc32c" in err


def test_clear_messages_for_other_directories(tmp_path):
    import zerostall
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from zerostall.errors import CheckpointNotFound
    root = str(tmp_path / "zs_root")
    zerostall.save(root, {"x": torch.ones(2)}, step=1)
    with pytest.raises(CheckpointNotFound, match="zerostall Checkpointer directory"):
        Reader(root).read_metadata()
    with pytest.raises(CheckpointNotFound, match="zerostall Checkpointer directory"):
        Reader(os.path.join(root, "step-1")).read_metadata()
    st = str(tmp_path / "fsw_safetensors")
    dcp.save({"t": torch.ones(3)}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(st, serialization_format=SerializationFormat.SAFETENSORS))
    with pytest.raises(BaseException) as ei:
        dcp.load({"t": torch.zeros(3)}, storage_reader=Reader(st), no_dist=True)
    assert "UnsupportedCheckpoint" in _text(ei.value) and "SAFETENSORS" in _text(ei.value)


def test_overwrite_false_without_hard_links(tmp_path, monkeypatch):
    import errno
    import zerostall.integrations.dcp_writer as ds

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(ds.os, "link", no_link)
    path = str(tmp_path / "ck")
    _save(path, 1.0, overwrite=False)
    assert _same(_load(path), _state(1.0))
    w = Writer(path, overwrite=False)  # a checkpoint appears between the plan and the commit
    w.set_up_storage_writer(True)
    md = Reader(path).read_metadata()
    with pytest.raises(CheckpointAlreadyExists):
        w.finish(md, [])
    assert _same(_load(path), _state(1.0)) and not [n for n in os.listdir(path) if n.endswith(".tmp")]


def test_checkpoints_of_earlier_releases(tmp_path):
    """Before 0.2 shards were ``rank-RRRRR.zst`` written into ``<path>.partial/`` and renamed: such
    a checkpoint is refused with what to do; a new save over it works."""
    import dataclasses
    path = str(tmp_path / "old")
    _save(path, 1.0)
    shard = _shards(path)[0]
    os.rename(os.path.join(path, shard), os.path.join(path, "rank-00000.zst"))
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own file
    md.storage_data = {k: dataclasses.replace(v, file="rank-00000.zst") for k, v in md.storage_data.items()}
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException derives from BaseException
        _load(path)
    assert ("not a shard file name (rank-NNNNN.shard; an earlier zerostall's .zst: load it with that zerostall and "
            "save it again)") in _text(ei.value)
    # a crashed save of that release left <path>.partial with an O_EXCL shard: it no longer matters
    os.makedirs(path + ".partial")
    open(os.path.join(path + ".partial", "rank-00000.zst"), "wb").close()
    _save(path, 2.0)
    assert _same(_load(path), _state(2.0))


def test_cli_on_a_root_of_dcp_steps(tmp_path, capsys):
    """torchtitan's layout: <root>/step-N/ each a DCP checkpoint."""
    import json
    from zerostall.cli.app import main
    root = str(tmp_path / "root")
    for s in (10, 20):
        _save(os.path.join(root, f"step-{s}"), float(s))
    assert main(["ls", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["checkpoint"], r["state"]) for r in rows] == [("step 10", "committed"), ("step 20", "committed")]
    assert main(["verify", root]) == 0 and capsys.readouterr().out.count("OK (zerostall.dcp") == 2
    assert main(["inspect", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["metadata"].endswith(os.path.join("step-20", ".metadata"))
    _flip(os.path.join(root, "step-10", _shards(os.path.join(root, "step-10"))[0]), 4096 + 100)
    assert main(["verify", root]) == 1 and "step 10" in capsys.readouterr().err
    assert main(["verify", root, "--step", "20"]) == 0
