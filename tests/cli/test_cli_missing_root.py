"""A checkpoint root that does not exist (a directory, a file:// path, an S3 bucket) is bad
usage: exit 2 with one line naming it and what to check, never "no checkpoints" with exit 0
(the old ``ls s3://missing-bucket/p`` and ``ls file:///missing`` said that). An existing root
without checkpoints is fine: exit 0, "no checkpoints"."""

import os
import uuid

import pytest

from zerostall.cli.app import main

pytestmark = pytest.mark.timeout(120)
S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"
BUCKET = "edges-zerostall-cli-test"  # exists (created below); prefixes are per test


def _roots(kind, tmp_path):
    """(a root that does not exist, an existing empty one)."""
    if kind == "s3":
        if not S3:
            pytest.skip("no S3 server: source the S3 environment (ZEROSTALL_TEST_S3=1)")
        boto3 = pytest.importorskip("boto3")  # the s3 cases only (a GPU host may lack it)
        s3 = boto3.client("s3")
        try:
            s3.create_bucket(Bucket=BUCKET)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        return f"s3://edges-missing-{uuid.uuid4().hex[:12]}/p", f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    (tmp_path / "empty").mkdir()
    if kind == "file":
        return f"file://{tmp_path}/missing", f"file://{tmp_path}/empty"
    return str(tmp_path / "missing"), str(tmp_path / "empty")


@pytest.mark.parametrize(("cmd", "kind"), [(c, k) for c in ("ls", "verify", "inspect", "restore")
                                            for k in ("local", "file", "s3")
                                            if not (c == "restore" and k == "local")])  # restore reads a remote tier
def test_missing_root_is_bad_usage(kind, cmd, tmp_path, capsys):
    missing, _ = _roots(kind, tmp_path)
    argv = [cmd, missing] + (["--to", str(tmp_path / "to")] if cmd == "restore" else [])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert not out
    assert err.startswith(f"zerostall {cmd}: ") and len(err.strip().splitlines()) == 1, err
    name = missing.split("/")[2] if kind == "s3" else missing.replace("file://", "")
    assert name in err and "does not exist" in err and "check the" in err, err
    assert not os.path.exists(tmp_path / "to") and not os.path.exists(tmp_path / "missing")


@pytest.mark.parametrize("kind", ["local", "file", "s3"])
@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_empty_root_says_no_checkpoints(kind, cmd, tmp_path, capsys):
    _, empty = _roots(kind, tmp_path)
    assert main([cmd, empty]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("no checkpoints in ") and not err, (out, err)


@pytest.mark.parametrize("cmd", ["ls", "verify"])
def test_a_file_url_naming_a_file_says_so(cmd, tmp_path, capsys):
    """file:///path/to/a/file: exit 2 saying it is not a directory (it said "does not exist")."""
    (tmp_path / "f").write_text("x")
    assert main([cmd, f"file://{tmp_path}/f"]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and "does not exist" not in err, err
