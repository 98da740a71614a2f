"""The ```python blocks of the docs pages in DOCS run, in order, one namespace per file, in a temporary directory
(```py blocks are recipes for what CI does not have: several hosts, software it does not install). docs/design.md names
only files that exist; docs/configuration.md lists every setting and environment variable."""

import dataclasses
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
DOCS = ["integrations.md", "resume.md", "usage.md", "incremental.md", "configuration.md", "dcp.md"]


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


def test_design_names_only_files_that_exist():
    """docs/design.md walks a save and a load file by file: a newcomer following it lands in
    the files it names (paths under src/zerostall/, or short forms such as ``memory/ring.py``)."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    src = os.path.join(ROOT, "src", "zerostall")
    named = set(re.findall(r"(?<![\w./])((?:src/zerostall/)?(?:[a-z_]+/)+(?:[a-z_]+\.py)?)(?![\w/])", text))
    named = {n for n in named if n.startswith("src/") or n.split("/")[0] in os.listdir(src)}
    assert len(named) > 40
    missing = [n for n in sorted(named)
               if not os.path.exists(os.path.join(ROOT, n) if n.startswith("src/") else os.path.join(src, n))]
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


def test_configuration_lists_every_setting_and_variable():
    from zerostall.config import CheckpointConfig, IOConfig, PeersConfig, StagingConfig
    text = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    prefixes = {CheckpointConfig: "", IOConfig: "io.", StagingConfig: "staging.", PeersConfig: "peers."}
    nested = {"io", "staging", "peers"}
    missing = [p + f.name for cls, p in prefixes.items() for f in dataclasses.fields(cls)
               if f.name not in nested and f"`{p}{f.name}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"
    names = set()
    for d, _, files in os.walk(os.path.join(ROOT, "src", "zerostall")):
        for n in files:
            if n.endswith(".py"):
                names |= set(re.findall(r"ZEROSTALL_[A-Z_]+[A-Z]", open(os.path.join(d, n)).read()))
    assert names and not [n for n in sorted(names) if f"`{n}`" not in text], names
