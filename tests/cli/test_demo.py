"""The demo's crash-and-resume verification, with a tiny model."""

import os

from zerostall.cli import main as cli


def test_demo_tiny_crash_resume_bit_exact(tmp_path, capsys):
    d = str(tmp_path / "demo [bold]x[/] [uring]")  # printed as written, not read as markup
    rc = cli(["demo", "--tiny", "--steps", "12", "--every", "3", "--dir", d])
    out = capsys.readouterr().out
    assert "VERDICT: PASS" in out, out
    assert rc == 0
    assert "bit-identical" in out and "killed (exit -9)" in out
    assert os.path.isdir(os.path.join(d, "crashed"))
    assert f"into {d}" in out, out
    ckpts = [line for line in out.splitlines() if line.startswith("  ckpt ")]
    assert ckpts and all(line.endswith(" MiB") and "durable" in line for line in ckpts), out  # one line each
