"""The ```python blocks of docs/integrations.md and docs/resume.md run, in order, one namespace per file, in a temporary
directory (```py blocks are recipes for software CI does not install)."""

import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DOCS = ["integrations.md", "resume.md"]


@pytest.mark.parametrize("name", DOCS)
def test_doc_python_blocks_run(name, tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "docs", name)).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    if not blocks:
        pytest.skip(f"docs/{name} has no python blocks")
    for needs in ("lightning", "transformers", "accelerate"):
        if f"import {needs}" in text or f"from {needs}" in text:
            pytest.importorskip(needs)
    monkeypatch.chdir(tmp_path)
    for var in ("MASTER_ADDR", "MASTER_PORT"):  # whatever the blocks set stays in this test
        monkeypatch.setenv(var, os.environ.get(var, ""))
        if not os.environ[var]:
            monkeypatch.delenv(var)
    torch.set_num_threads(1)
    ns: dict = {"__name__": f"docs_{name[:-3]}"}
    for i, b in enumerate(blocks):
        exec(compile(b, f"docs/{name} (python block {i + 1})", "exec"), ns)  # noqa: S102 - our docs


def test_readme_links_the_docs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for name in DOCS:
        assert f"docs/{name}" in readme, f"README does not link docs/{name}"
