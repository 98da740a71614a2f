"""The CLI with bad input: one line and an exit status (2 usage, 1 failure), never a traceback;
read-only commands create nothing; keys from a checkpoint are printed literally."""

import argparse
import os

import pytest
import torch

import zerostall
from zerostall.cli.app import build_parser
from zerostall.cli.app import main

pytestmark = pytest.mark.timeout(120)

HOSTILE_KEYS = {"w[bold red]x[/]": torch.ones(2), "esc\x1b]0;pwned\x07": torch.ones(1),
                ":thumbs_up:": torch.zeros(1), "rtl\u202eevil": torch.zeros(1)}


def _tree(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


@pytest.fixture
def ck(tmp_path):
    d = str(tmp_path / "ck")
    torch.manual_seed(0)
    zerostall.save(d, {**HOSTILE_KEYS, "model": torch.nn.Linear(3, 2).state_dict(), "step": 7}, step=7)
    return d


@pytest.mark.parametrize("argv,code,msg", [
    (["ls", "{tmp}/missing"], 2, "does not exist (check the path"),
    (["verify", "{tmp}/missing"], 2, "does not exist (check the path"),
    (["inspect", "{tmp}/missing"], 2, "does not exist (check the path"),
    (["export", "{tmp}/missing", "{tmp}/o.st"], 2, "does not exist (check the path"),
    (["inspect", "{ck}", "--step", "99"], 1, "step 99"),
    (["export", "{ck}", "--step", "99", "{tmp}/o.st"], 1, "step 99"),
    (["export", "{ck}", "{tmp}/no/such/dir/o.st"], 2, "not a writable directory"),
    (["export", "{ck}", "--prefix", "nothing", "{tmp}/o.st"], 2, "starts with 'nothing.'"),
    (["export", "{ck}", "--rank", "3", "{tmp}/o.st"], 2, "--rank 3 does not apply"),
    (["export", "{ck}", "--format", "npz", "{tmp}/o.st"], 2, "unknown export format"),
])
def test_user_errors_exit_with_one_line(ck, tmp_path, capsys, argv, code, msg):
    argv = [x.format(tmp=tmp_path, ck=ck) for x in argv]
    before = _tree(tmp_path)
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"zerostall {argv[0]}: ")
    assert _tree(tmp_path) == before  # nothing created, nothing removed


@pytest.mark.parametrize("argv", [["ls", "{ck}", "--bogus"], ["inspect", "{ck}", "--step", "x"],
                                  ["bench", "--size-gib", "0"], ["bench", "--repeat", "-1"],
                                  ["verify", "{ck}", "--engine", "nope"], ["demo", "--steps", "0"]])
def test_usage_errors_exit_2(ck, argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main([x.format(ck=ck) for x in argv])
    assert ei.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bench_on_cuda_without_cuda_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    with pytest.raises(SystemExit) as ei:
        main(["bench", "--device", "cuda"])
    assert ei.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_read_only_commands_create_nothing(ck, tmp_path, capsys):
    before = _tree(tmp_path)
    for argv in (["ls", ck], ["ls", ck, "--json"], ["verify", ck], ["inspect", ck], ["inspect", ck, "--json"],
                 ["doctor", str(tmp_path / "not-yet" / "ckpt"), "--json"]):
        assert main(argv) == 0, argv
    assert _tree(tmp_path) == before
    assert "does not exist yet" in capsys.readouterr().out


def test_keys_printed_literally(ck, capsys):
    assert main(["inspect", ck]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out  # nothing reaches the terminal
    assert "\\x1b" in out  # shown as an escape
    assert "[bold" in out and "red]x[/]" in out  # markup shown, not interpreted
    assert ":thumbs_up:" in out and "\U0001f44d" not in out
    assert "\\u202e" in out


def test_help_text_on_every_argument():
    missing = []

    def walk(p, name):
        for act in p._actions:
            if isinstance(act, argparse._SubParsersAction):
                for sub_name, sub in act.choices.items():
                    walk(sub, f"{name} {sub_name}")
            elif not isinstance(act, argparse._HelpAction) and not act.help:
                missing.append(f"{name} {'/'.join(act.option_strings) or act.dest}")

    walk(build_parser(), "zerostall")
    assert not missing, missing


def test_export_defaults_to_newest_step_and_strips_a_prefix(ck, tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    out = str(tmp_path / "model.safetensors")
    assert main(["export", ck, "--prefix", "model", out]) == 0
    assert "step 7" in capsys.readouterr().out
    torch.manual_seed(0)
    want = torch.nn.Linear(3, 2).state_dict()
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(safetensors.load_file(out))  # keys without the "model." prefix
    assert torch.equal(model.weight, want["weight"]) and torch.equal(model.bias, want["bias"])
    from safetensors import safe_open
    with safe_open(out, "pt") as f:
        assert f.metadata()["zerostall_step"] == "7"
