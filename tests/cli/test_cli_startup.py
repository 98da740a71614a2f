"""The commands that never touch a tensor start without importing torch or DCP (checked by the
modules a fresh process holds afterwards, not by timing; timings are in docs/cli-startup.md)."""

import json
import os
import subprocess
import sys
import textwrap

import torch

import zerostall

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
