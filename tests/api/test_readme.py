"""The README's Python examples run, in order, as written."""

import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    for b in blocks:
        exec(compile(b, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert sorted(int(n[5:]) for n in os.listdir(tmp_path / "ckpt") if n.startswith("step-")) == [40, 60, 80, 100]
    assert isinstance(ns["state"]["model"]["0.weight"], torch.Tensor)
