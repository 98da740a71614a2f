"""Every code block of the README runs, in order, as written.

```python blocks are executed in one namespace in a temporary directory. In ```bash blocks each
command line is checked by what it is: ``pip install`` names this project and extras its
pyproject declares; ``make T`` names a target of the Makefile (make demo and make test are the
demo and the suite themselves: tests/cli/test_cli_output.py and CI run them); ``zerostall ...`` runs
in-process against the checkpoint the Python blocks wrote, except the commands that need what
CI lacks or minutes of their own (a remote server, kernel tracing, the demo, the bench), which
must parse. A line of any other kind fails the test: the README gains no command no test runs.
"""

import os
import re
import shlex
import sys

import pytest
import torch

from zerostall.cli import main as cli
from zerostall.cli.app import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARSE_ONLY = {"restore", "trace", "demo", "bench"}

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _blocks(text):
    """(language, body) of every fenced block, in order; a block without a language is an error."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)


def _commands(body):
    for line in body.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            yield line


def test_every_block_has_a_language_a_test_knows():
    kinds = [lang for lang, _ in _blocks(_readme())]
    assert kinds and set(kinds) <= {"python", "bash"}, kinds


def test_readme_python_blocks_then_cli_commands_run(tmp_path, monkeypatch, capsys):
    blocks = _blocks(_readme())
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for lang, body in blocks:
        if lang == "python":
            exec(compile(body, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert sorted(int(n[5:]) for n in os.listdir(tmp_path / "ckpt") if n.startswith("step-")) == [60, 80, 100]
    assert isinstance(ns["state"]["model"]["0.weight"], torch.Tensor)
    assert torch.equal(ns["model"][0].weight, ns["state"]["model"]["0.weight"])

    ran = []
    for lang, body in blocks:
        for line in _commands(body) if lang == "bash" else ():
            argv = shlex.split(line)
            if argv[0] != "zerostall":
                continue
            if argv[1] in PARSE_ONLY:
                build_parser().parse_args(argv[1:])
                continue
            capsys.readouterr()
            rc = cli(argv[1:])
            out = capsys.readouterr()
            assert rc == 0, f"README: {line!r} exited {rc}: {out.err}"
            ran.append(argv[1])
    assert {"ls", "verify", "inspect", "export", "doctor", "plan", "monitor"} <= set(ran), ran
    assert os.path.getsize(tmp_path / "model.safetensors") > 0


def test_readme_install_and_make_lines_name_what_exists():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(ROOT, "Makefile")) as f:
        targets = set(re.findall(r"^([\w-]+):", f.read(), re.M))
    seen = set()
    for lang, body in _blocks(_readme()):
        for line in _commands(body) if lang == "bash" else ():
            argv = shlex.split(line)
            if argv[:2] == ["pip", "install"]:
                m = re.fullmatch(r"([\w-]+)(?:\[([\w,]+)\])?", argv[2])
                assert m and m.group(1) == project["name"], line
                for extra in (m.group(2) or "").split(","):
                    assert not extra or extra in project["optional-dependencies"], line
                seen.add("pip")
            elif argv[0] == "make":
                assert argv[1] in targets, line
                seen.add(f"make {argv[1]}")
            else:
                assert argv[0] == "zerostall", f"README: a command no test runs: {line!r}"
    assert {"pip", "make demo", "make test"} <= seen
    # extras named in the text, outside the blocks, exist too
    for extra in re.findall(r"'zerostall\[(\w+)\]'", _readme()):
        assert extra in project["optional-dependencies"], extra


def test_readme_is_a_front_door():
    text = _readme()
    assert len(text.splitlines()) < 250
    for page in re.findall(r"\]\((docs/[\w-]+\.md)", text):
        assert os.path.isfile(os.path.join(ROOT, page)), f"README links {page}, which does not exist"
