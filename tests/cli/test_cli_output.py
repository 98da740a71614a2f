"""What the CLI prints: text it did not write (paths, keys, hints) appears verbatim, never read as
rich markup; outside a terminal a record is one full line; on a terminal COLUMNS is respected."""

import json
import os
import pty
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import zerostall
from zerostall.cli import main as cli

# each is rich markup, or looks like it, or breaks a naive parser
NASTY = ("[bold]", "[/]", "[uring]", "[", "]", "[red]x[/red]")
LONG_KEY = "decoder.[bold]layer[/].[0]." + "w" * 260  # longer than any terminal


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = tmp_path_factory.mktemp("out") / "ck [bold]x[/] [uring] [ ]"
    zerostall.save(str(d), {"layer[0].[bold]w[/]": torch.zeros(4), "[/]": torch.ones(2), "a]": torch.ones(1),
                            LONG_KEY: torch.ones(3)}, step=1)
    return str(d)


def _lines_with(out, *parts):
    return [line for line in out.splitlines() if all(p in line for p in parts)]


def test_ls_inspect_verify_restore_print_brackets_verbatim(root, tmp_path, capsys):
    assert cli(["ls", root]) == 0
    out = capsys.readouterr().out
    assert root in out, out
    assert cli(["inspect", root]) == 0
    out = capsys.readouterr().out
    for key in ("layer[0].[bold]w[/]", "[/]", "a]"):
        assert _lines_with(out, key), (key, out)
    assert _lines_with(out, LONG_KEY, "float32"), "a row is wrapped outside a terminal:\n" + out
    assert cli(["verify", root]) == 0
    assert "step 1: OK" in capsys.readouterr().out
    assert cli(["verify", root, "--step", "7"]) == 1
    assert root in capsys.readouterr().err
    dest = str(tmp_path / "to [bold]y[/] [")
    assert cli(["restore", root, "--to", dest]) == 0
    out = capsys.readouterr().out
    assert f"from {root} into {dest}" in out, out


def test_piped_rows_stay_whole_whatever_columns_or_force_color_say(root, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert cli(["inspect", root]) == 0
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", capsys.readouterr().out)
    assert _lines_with(out, LONG_KEY, "float32"), out


def test_doctor_prints_paths_and_hints_verbatim(root, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "liburing", None)  # import fails: the hint names the extra
    assert cli(["doctor", root]) == 0
    out = capsys.readouterr().out
    assert _lines_with(out, root), out
    hint = "the liburing package is not installed (pip install 'zerostall[uring]')"
    assert _lines_with(out, "io_uring", hint, "warn"), "hint altered or wrapped:\n" + out


def test_plan_bad_value_and_json_forms(root, capsys):
    assert cli(["plan", "--params", "[bold]7[/]"]) == 2
    assert "'[bold]7[/]'" in capsys.readouterr().err
    for cmd in (["ls", root], ["inspect", root], ["verify", root], ["doctor", root]):
        assert cli([*cmd, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc, cmd
    assert cli(["inspect", root, "--json"]) == 0
    keys = {t["key"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert {"layer[0].[bold]w[/]", "[/]", "a]", LONG_KEY} <= keys


def test_terminal_width_follows_columns(root):
    """On a terminal (a pty) the table fits COLUMNS; the same command piped keeps full rows."""
    env = {**os.environ, "COLUMNS": "72", "TERM": "xterm"}
    code = "import sys; from zerostall.cli import main; sys.exit(main(sys.argv[1:]))"
    primary, secondary = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-c", code, "inspect", root], stdout=secondary, stderr=subprocess.PIPE,
                           env=env, timeout=120)
        os.close(secondary)
        secondary = -1
        chunks = []
        while True:
            try:
                b = os.read(primary, 65536)
            except OSError:  # EIO: the other end closed
                break
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    assert p.returncode == 0, p.stderr
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())  # styles, not text
    lines = [line for line in text.replace("\r", "").split("\n") if line.strip()]
    assert any("crc32c" in line for line in lines), text
    assert max(len(line) for line in lines) <= 72, text


def test_delete_refuses_a_negative_step_and_prints_a_bracketed_root_literally(tmp_path, capsys):
    from zerostall.cli import main as cli_main
    root = tmp_path / "run[bold]x[/]"
    root.mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        cli_main(["delete", str(root), "--step", "-1"])
    assert exc.value.code == 2
    assert "-1 is not a step number" in capsys.readouterr().err
    assert cli_main(["delete", str(root), "--step", "3"]) == 0
    assert f"step 3: nothing of it in {root}" in capsys.readouterr().out


# ---- demo: The demo's crash-and-resume verification, with a tiny model.


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


# ---- cli_startup: The commands that never touch a tensor start without importing torch or DCP (checked by the
# modules a fresh process holds afterwards, not by timing; timings are in docs/cli-startup.md).


SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    import zerostall
    seen = {"import zerostall": sorted(m for m in ("torch", "numpy") if m in sys.modules),
            "dir": sorted(set(zerostall.__all__) - set(dir(zerostall)))}
    from zerostall.cli import app
    root, empty = sys.argv[1], sys.argv[2]
    runs = [["--help"], ["plan", "--params", "7e9"], ["plan", "--params", "7e9", "--json"], ["ls", root],
            ["ls", root, "--json"], ["ls", empty], ["inspect", root], ["inspect", root, "--json"], ["doctor", root],
            ["doctor", root, "--json"]]
    codes = []
    for argv in runs:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                codes.append(app.main(argv))
            except SystemExit as exc:  # --help
                codes.append(exc.code)
    seen["codes"] = codes
    seen["heavy"] = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "boto3", "botocore")))
    print(json.dumps(seen))
""")


def test_commands_without_tensors_import_no_torch(tmp_path):
    root = str(tmp_path / "ck")
    zerostall.save(root, {"w": torch.zeros(8), "opt": {"step": 3, "lr": [0.1]}}, step=1)
    os.makedirs(tmp_path / "empty")
    p = subprocess.run([sys.executable, "-c", SCRIPT, root, str(tmp_path / "empty")], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen["import zerostall"] == [], seen  # `import zerostall` alone: neither torch nor numpy
    assert seen["dir"] == [], seen  # every public name is listed by dir(), bound or not
    assert seen["codes"] == [0] * len(seen["codes"]), (seen, p.stderr)
    assert seen["heavy"] == [], seen
