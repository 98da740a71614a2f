"""The hostile-checkpoint suite: every malformed step either falls back to the previous good
step or raises CorruptCheckpoint; nothing hangs, nothing executes, memory stays bounded.

Each case damages step 2 of a directory whose step 1 is good. For every case:

- ``load()`` returns step 1's state (bit-exact);
- ``load(step=2, fallback=False)`` raises CorruptCheckpoint (or CheckpointNotFound where the
  damaged directory is not a checkpoint at all, e.g. its manifest is a FIFO);
- an in-place load leaves no byte of step 2 in the caller's state (a key only step 2 has
  keeps its old value);
- the peak RSS of the load stays under +256 MiB (the kernel's high-water mark, reset before
  each case), although several cases claim terabytes;
- the CLI (``ls``, ``verify``, ``inspect``) answers with an exit status, never a traceback.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.errors import CheckpointNotFound, CorruptCheckpoint

from tests.helpers import seal_manifest
from tests.manifest_forms import as_form, as_objects

pytestmark = pytest.mark.timeout(120)

RSS_BOUND = 256 << 20
SHARD = "rank-00000.shard"  # the name the writer gives rank 0's file (checked in the fixture)


def _state(step):
    return {
        "w": torch.arange(1000, dtype=torch.float32) * step,
        "b": torch.full((64,), float(step), dtype=torch.bfloat16),
        "n": np.arange(6, dtype=np.int64) * step,
        "m": {"a": step, "hist": [{"loss": 1.0 / step}]},
        **({"new": torch.full((100,), 7.0)} if step == 2 else {}),
    }


@pytest.fixture
def ck(ckdir):
    zerostall.save(ckdir, _state(1), step=1)
    zerostall.save(ckdir, _state(2), step=2)
    assert _env(ckdir)["body"]["files"][0]["name"] == SHARD
    return ckdir


@pytest.fixture
def ck_objects(ck):
    """``ck`` with step 2's manifest in the form earlier releases wrote (version 1, one
    object per tensor): refused naming its version; the same hostile edits must fail on it too."""
    _write_env(ck, dict(_env(ck), _form="objects"))
    assert isinstance(json.load(open(_p(ck, "manifest.json")))["body"]["tensors"], list)
    with pytest.raises(CorruptCheckpoint, match="format_version 1 was written by an earlier zerostall"):
        zerostall.load(ck, step=2, fallback=False)
    return ck


def _p(ck, *parts):
    return os.path.join(ck, "step-2", *parts)


def _env(ck):
    """Step 2's envelope, its body's tensors as one dict per tensor (``_form`` remembers the
    form on disk: :func:`_write_env` writes that form back)."""
    env = json.load(open(_p(ck, "manifest.json")))
    env["_form"] = as_objects(env["body"])
    return env


def _write_env(ck, env, reseal=True):
    as_form(env["body"], env.pop("_form", "columns"))
    with open(_p(ck, "manifest.json"), "wb") as f:
        f.write(seal_manifest(env["body"], None if reseal else env["body_crc32c"]))


def body(mutate):
    def case(ck):
        env = _env(ck)
        mutate(env["body"])
        _write_env(ck, env)
    return case


def raw(old, new):
    """Replace text in the manifest (for what json.dump cannot write: 1e400, NaN, 5000 digits)."""
    def case(ck):
        s = open(_p(ck, "manifest.json")).read()
        assert old in s
        open(_p(ck, "manifest.json"), "w").write(s.replace(old, new, 1))
    return case


def shard(fn):
    def case(ck):
        fn(_p(ck, SHARD), _env(ck)["body"])
    return case


def _tensor(b, key):
    return next(t for t in b["tensors"] if t["key"] == key)


def _poke(offset, byte=b"\x01"):
    def fn(path, b):
        with open(path, "r+b") as f:
            at = offset if offset >= 0 else os.path.getsize(path) + offset
            f.seek(at)
            was = f.read(1)
            f.seek(at)
            # always a change: a random field (the checkpoint id's hex) may already hold ``byte``
            f.write(byte if was != byte else bytes([byte[0] ^ 0x01]))
    return fn


def _pad_offset(b):
    w = _tensor(b, "w")
    return w["offset"] + w["nbytes"] + 10  # inside w's zero padding


def _sparse_8tib(ck):
    """An 8 TiB sparse shard and a manifest that matches it (consistent sizes)."""
    size = 8 << 40
    try:
        with open(_p(ck, SHARD), "r+b") as f:
            f.truncate(size)
    except OSError as exc:
        pytest.skip(f"this filesystem refuses an 8 TiB sparse file: {exc}")
    env = _env(ck)
    env["body"]["files"][0]["file_bytes"] = size
    env["body"]["tensors"].append({"key": "huge", "dtype": "float32", "shape": [(size - (1 << 30)) // 4],
                                   "file": SHARD, "offset": 1 << 30, "nbytes": size - (1 << 30), "crc32c": 0})
    env["body"]["tree"]["d"].append([{"v": "huge"}, {"T": len(env["body"]["tensors"]) - 1}])
    _write_env(ck, env)


def _overlapping_50(ck):
    env = _env(ck)
    w = _tensor(env["body"], "w")
    for i in range(50):  # distinct shapes over one region: overlap, not aliases
        env["body"]["tensors"].append(dict(w, key=f"o{i}", shape=[w["nbytes"] // 4 - i - 1],
                                           nbytes=w["nbytes"] - 4 * (i + 1)))
        env["body"]["tree"]["d"].append([{"v": f"o{i}"}, {"T": len(env["body"]["tensors"]) - 1}])
    _write_env(ck, env)


def _fs(fn):
    def case(ck):
        fn(ck)
    return case


def _fifo(rel):
    def fn(ck):
        path = _p(ck, rel)
        os.unlink(path)
        os.mkfifo(path)
    return fn


def _dir(rel):
    def fn(ck):
        path = _p(ck, rel)
        os.unlink(path)
        os.mkdir(path)
    return fn


def _symlink_out(rel):
    def fn(ck):
        path = _p(ck, rel)
        outside = os.path.join(os.path.dirname(ck), "outside-" + rel)
        shutil.copy(path, outside)
        os.unlink(path)
        os.symlink(outside, path)
    return fn


def _rename_step(name):
    def fn(ck):
        os.rename(_p(ck), os.path.join(ck, name))
    return fn


def _symlink_step(ck):
    outside = os.path.join(os.path.dirname(ck), "outside-step")
    os.rename(_p(ck), outside)
    os.symlink(outside, _p(ck))


def _copy_from_step1(name):
    def fn(ck):
        shutil.copy(os.path.join(ck, "step-1", name), _p(ck, name))
    return fn


def _deep_tree(b):
    node = {"v": 1}
    for _ in range(400):
        node = {"l": [node]}
    b["tree"]["d"].append([{"v": "deep"}, node])


CASES = {
    # manifest: numbers
    "created_1e400": raw('"created_unix":', '"created_unix":1e400,"x_":'),
    "nan_in_tree": raw('"hist"', '"nanv": NaN, "hist"'),
    "infinity_const": raw('"created_unix":', '"created_unix":Infinity,"x_":'),
    "int_5000_digits": raw('"created_unix":', '"created_unix":' + "9" * 5000 + ',"x_":'),
    "step_mismatch": body(lambda b: b.update(step=3)),
    "step_2_pow_63": body(lambda b: b.update(step=2 ** 63)),
    "world_size_0": body(lambda b: b.update(world_size=0)),
    "format_version_str": body(lambda b: b.update(format_version="1")),
    "checksum_md5": body(lambda b: b.update(checksum="md5")),
    "alignment_512": body(lambda b: b.update(alignment=512)),
    "checkpoint_id_empty": body(lambda b: b.update(checkpoint_id="")),
    "created_str": body(lambda b: b.update(created_unix="yesterday")),
    "user_metadata_list": body(lambda b: b.update(user_metadata=[1])),
    "body_crc_mismatch": lambda ck: (lambda env: (env["body"].update(step=2), env.update(body_crc32c="00000000"),
                                                  _write_env(ck, env, reseal=False)))(_env(ck)),
    # manifest: files
    "files_not_list": body(lambda b: b.update(files={"a": 1})),
    "file_name_traversal": body(lambda b: b["files"][0].update(name="../step-1/" + SHARD)),
    "file_name_absolute": body(lambda b: b["files"][0].update(name="/etc/passwd")),
    "file_bytes_unaligned": body(lambda b: b["files"][0].update(file_bytes=b["files"][0]["file_bytes"] + 1)),
    "file_bytes_float": body(lambda b: b["files"][0].update(file_bytes=float(b["files"][0]["file_bytes"]))),
    "file_bytes_1pib": body(lambda b: b["files"][0].update(file_bytes=1 << 50)),
    "file_rank_out_of_world": body(lambda b: b["files"][0].update(rank=5)),
    "file_listed_twice": body(lambda b: b["files"].append(dict(b["files"][0]))),
    # manifest: tensors
    "dtype_unknown": body(lambda b: _tensor(b, "w").update(dtype="torch.storage._load_from_bytes")),
    "tensor_entry_not_object": body(lambda b: b["tensors"].append([1, 2])),
    "shape_negative": body(lambda b: _tensor(b, "w").update(shape=[-1000], nbytes=-4000)),
    "shape_zero_elems_overflow": body(lambda b: _tensor(b, "new").update(shape=[2 ** 40, 2 ** 40, 0], nbytes=0)),
    "shape_string": body(lambda b: _tensor(b, "w").update(shape="1000")),
    "shape_bool_dim": body(lambda b: _tensor(b, "w").update(shape=[True] * 1)),
    "nbytes_mismatch": body(lambda b: _tensor(b, "w").update(nbytes=4096)),
    "offset_unaligned": body(lambda b: _tensor(b, "w").update(offset=4097)),
    "offset_beyond_file": body(lambda b: _tensor(b, "w").update(offset=1 << 40)),
    "offset_in_header": body(lambda b: _tensor(b, "w").update(offset=0)),
    "offset_string": body(lambda b: _tensor(b, "w").update(offset="4096")),
    "crc_out_of_range": body(lambda b: _tensor(b, "w").update(crc32c=1 << 33)),
    "crc_wrong": body(lambda b: _tensor(b, "w").update(crc32c=(_tensor(b, "w")["crc32c"] + 1) % (1 << 32))),
    "key_not_str": body(lambda b: _tensor(b, "w").update(key=5)),
    "two_tensors_overlap": body(lambda b: _tensor(b, "new").update(offset=_tensor(b, "w")["offset"])),
    "overlapping_50": _overlapping_50,
    # manifest: tree
    "tree_index_out_of_range": body(lambda b: b["tree"]["d"].append([{"v": "x"}, {"T": 99}])),
    "tree_index_bool": body(lambda b: b["tree"]["d"].append([{"v": "x"}, {"T": True}])),
    "tree_numpy_over_bfloat16": body(lambda b: b["tree"]["d"].append(
        [{"v": "x"}, {"A": next(i for i, t in enumerate(b["tensors"]) if t["dtype"] == "bfloat16")}])),
    "tree_unknown_tag": body(lambda b: b.update(tree={"pickle": "80049500"})),
    "tree_deep": body(_deep_tree),
    "rank_trees_wrong_length": body(lambda b: b.update(rank_trees=[b["tree"]] * 3)),
    # manifest file itself
    "manifest_garbage": lambda ck: open(_p(ck, "manifest.json"), "wb").write(b"\x00\xff garbage"),
    "manifest_truncated": lambda ck: (lambda d: open(_p(ck, "manifest.json"), "wb").write(d[:len(d) // 2]))(
        open(_p(ck, "manifest.json"), "rb").read()),
    "manifest_empty": lambda ck: open(_p(ck, "manifest.json"), "wb").close(),
    "manifest_json_array": lambda ck: open(_p(ck, "manifest.json"), "w").write("[1, 2, 3]"),
    "manifest_of_step_1": _copy_from_step1("manifest.json"),
    # shard header, payload and padding
    "header_magic": shard(_poke(0, b"X")),
    "header_field": shard(_poke(40, b"9")),
    "payload_bit_flip": shard(lambda p, b: _poke(_tensor(b, "w")["offset"] + 3)(p, b)),
    "padding_between": shard(lambda p, b: _poke(_pad_offset(b))(p, b)),
    "padding_tail": shard(_poke(-1)),
    "shard_truncated": shard(lambda p, b: os.truncate(p, os.path.getsize(p) - 4096)),
    "shard_extended": shard(lambda p, b: os.truncate(p, os.path.getsize(p) + 4096)),
    "shard_of_step_1": _copy_from_step1(SHARD),
    "shard_sparse_8tib": _sparse_8tib,
    # directory entries
    "shard_missing": lambda ck: os.unlink(_p(ck, SHARD)),
    "shard_fifo": _fifo(SHARD),
    "shard_directory": _dir(SHARD),
    "shard_symlink": _symlink_out(SHARD),
    "manifest_fifo": _fifo("manifest.json"),
    "manifest_directory": _dir("manifest.json"),
    "manifest_symlink": _symlink_out("manifest.json"),
    "step_dir_symlink": _symlink_step,
    "step_dir_leading_zero": _rename_step("step-02"),
    "step_dir_over_2_pow_63": _rename_step("step-99999999999999999999"),
    "step_dir_partial": _rename_step("step-2.partial"),
}


def _vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/self/status")


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError as exc:
        pytest.skip(f"cannot reset the RSS high-water mark here: {exc}")


def test_suite_is_large_enough():
    assert len(CASES) >= 40


TENSOR_CASES = ("dtype_unknown", "tensor_entry_not_object", "shape_negative", "shape_zero_elems_overflow",
                "shape_string", "shape_bool_dim", "nbytes_mismatch", "offset_unaligned", "offset_beyond_file",
                "offset_in_header", "offset_string", "crc_out_of_range", "crc_wrong", "key_not_str",
                "two_tensors_overlap", "overlapping_50", "tree_numpy_over_bfloat16", "format_version_str")
"""The cases that edit tensor entries, run again on a manifest in the objects form (version 1)."""


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_case(ck, name):
    _check_case(ck, name)


@pytest.mark.parametrize("name", TENSOR_CASES)
def test_hostile_case_objects_form(ck_objects, name):
    _check_case(ck_objects, name)


def _check_case(ck, name):
    import gc
    CASES[name](ck)
    want = _state(1)
    gc.collect()
    _reset_peak()
    base = _vm("VmRSS")
    out = zerostall.load(ck)  # falls back to step 1
    peak = _vm("VmHWM") - base
    assert peak < RSS_BOUND, f"{name}: load raised the peak RSS by {peak >> 20} MiB"
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    assert np.array_equal(out["n"], want["n"]) and out["m"] == want["m"] and "new" not in out

    sentinel = {"w": torch.full((1000,), -1.0), "new": torch.full((100,), -1.0)}
    rep = zerostall.LoadReport()
    zerostall.load(ck, sentinel, report=rep)
    assert rep.step == 1
    assert torch.equal(sentinel["w"], want["w"])
    assert torch.equal(sentinel["new"], torch.full((100,), -1.0)), "bytes of the failed step leaked in"
    assert rep.missing_keys == ["new"]

    with pytest.raises((CorruptCheckpoint, CheckpointNotFound)) as ei:
        zerostall.load(ck, step=2, fallback=False)
    if os.path.isfile(os.path.join(ck, "step-2", "manifest.json")) and not os.path.islink(_p(ck)):
        assert isinstance(ei.value, CorruptCheckpoint), ei.value  # a listed step: corruption, named
    for argv in (["ls", ck], ["verify", ck], ["inspect", ck, "--step", "2"], ["inspect", ck, "--json"]):
        assert cli(argv) in (0, 1, 2), argv  # an exit status, not a traceback


def test_exact_duplicate_entries_are_aliases_allocated_once(ckdir):
    """50 identical manifest entries over one 16 MiB region load as one tensor (+16 MiB, not +800)."""
    import gc
    zerostall.save(ckdir, {"big": torch.arange(4 << 20, dtype=torch.float32)}, step=1)
    path = os.path.join(ckdir, "step-1", "manifest.json")
    env = json.load(open(path))
    as_objects(env["body"])
    t0 = env["body"]["tensors"][0]
    for i in range(50):
        env["body"]["tensors"].append(dict(t0, key=f"alias{i}"))
        env["body"]["tree"]["d"].append([{"v": f"alias{i}"}, {"T": i + 1}])
    as_form(env["body"], "columns")
    with open(path, "wb") as f:
        f.write(seal_manifest(env["body"]))
    gc.collect()
    _reset_peak()
    base = _vm("VmRSS")
    out = zerostall.load(ckdir)
    peak = _vm("VmHWM") - base
    assert peak < RSS_BOUND, f"peak RSS +{peak >> 20} MiB"
    assert all(out[f"alias{i}"] is out["big"] for i in range(50))
    assert torch.equal(out["big"], torch.arange(4 << 20, dtype=torch.float32))


def test_huge_claims_bounded_in_a_fresh_process(ckdir, tmp_path):
    """The same bound measured with getrusage in a subprocess (no pytest state around it)."""
    import subprocess
    import sys
    zerostall.save(ckdir, _state(1), step=1)
    zerostall.save(ckdir, _state(2), step=2)
    _overlapping_50(ckdir)
    script = tmp_path / "probe.py"
    script.write_text(
        "import resource, sys, zerostall\n"
        "import torch\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "out = zerostall.load(sys.argv[1])\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(out['m']['a'], (peak - base) * 1024)\n")
    res = subprocess.run([sys.executable, str(script), ckdir], capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    step_a, grew = res.stdout.split()
    assert step_a == "1" and int(grew) < RSS_BOUND
