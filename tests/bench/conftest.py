import json

import pytest

from zerostall.cli import main as cli


@pytest.fixture
def bench_json(tmp_path):
    """``bench_json(name, *args)`` runs ``zerostall bench *args`` in-process on ``tmp_path/work``
    with its JSON written to ``tmp_path/name``, asserts it exits 0 and returns the document."""
    def run(name, *args):
        out = tmp_path / name
        assert cli(["bench", *args, "--dir", str(tmp_path / "work"), "--json", str(out)]) == 0
        return json.loads(out.read_text())
    return run
