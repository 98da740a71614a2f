"""The package's import graph: imports go only downward, no circles, no hidden lazy imports.

Reads every module under ``src/zerostall`` with :mod:`ast` (nothing is imported). An import of
``zerostall.a.b.c`` also runs the package ``zerostall.a.b``'s ``__init__``, so that counts as an
import of the package too. Imports under ``if TYPE_CHECKING:`` never run: they count for the
direction of arrows (a type named from above is still an arrow up), not for circles.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

PKG = Path(importlib.util.find_spec("zerostall").origin).parent  # not imported: only read

LAYERS: list[set[str]] = [
    {"_fast", "_fast_torch", "_term", "_util", "errors"},
    {"config"},
    {"format"},
    {"io", "memory", "telemetry"},
    {"store"},
    {"distributed"},
    {"peers"},
    {"saving", "restore"},
    {"checkpointer", "rng", "stateful"},
    {"", "oneshot", "extend"},  # zerostall/__init__.py: the public face (its names bound on first use from
    # the modules its _SOURCES names, through importlib: not an import statement this reader sees);
    # extend.py: what adapters may use beside it
    {"tuning", "integrations", "dcp", "demo", "cli"},
]
"""Bottom to top: a module may import from its own layer (without a circle) or any lower one.
The name is the first part below ``zerostall`` ("" is the package's own ``__init__``)."""

LAZY: dict[tuple[str, str], str] = {
    ("zerostall.cli.dcp", "zerostall.integrations.dcp_reader"):
        "imports torch.distributed.checkpoint (~0.7 s): only the dcp subcommands need it",
    ("zerostall.saving.stages", "zerostall.peers.service"):
        "peer replicas (sockets, threads, their module tree) load only with replicas > 1",
    ("zerostall.cli.app", "zerostall.cli.verify"):
        "the restore walk (torch): only the commands that read tensors' bytes need it; --help, plan, ls, "
        "inspect and doctor start without torch (tests/cli/test_cli_output.py)",
    ("zerostall.cli.app", "zerostall.restore"): "torch: only export needs it (as cli.verify)",
    ("zerostall.cli.app", "zerostall.restore.download"): "torch: only restore needs it (as cli.verify)",
    ("zerostall.cli.app", "zerostall.integrations.export"): "torch: only export needs it (as cli.verify)",
    ("zerostall.tuning.doctor", "zerostall.tuning.line_rate"):
        "the staging arena (torch): only doctor --probe measures the line rate",
}
"""The function-level imports of zerostall code that remain, each with why it is deferred. No
entry may climb a layer or break a circle (both are checked with these imports included)."""


def _name(path: Path) -> str:
    parts = ("zerostall",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """The library's modules; ``bench/`` is measurement code, not the library (issue 31 moves it out)."""
    return {_name(p): p for p in sorted(PKG.rglob("*.py")) if "__pycache__" not in p.parts and "bench" not in p.parts}


def _targets(mod: str, node: ast.Import | ast.ImportFrom, is_pkg: bool,
             mods: dict[str, Path]) -> list[tuple[str, bool]]:
    """The zerostall modules ``node`` runs: each named module (True) and every package above it (False)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = mod.split(".")[: len(mod.split(".")) + is_pkg - node.level]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    out: dict[str, bool] = {}
    for name in names:
        if name != "zerostall" and not name.startswith("zerostall.") or name.startswith("zerostall.bench"):
            continue
        while name not in mods:
            name = name.rsplit(".", 1)[0]
        parts = name.split(".")
        for i in range(2, len(parts)):
            out.setdefault(".".join(parts[:i]), False)
        out[name] = True
    return [(t, named) for t, named in out.items() if t != mod and not mod.startswith(t + ".")]


@lru_cache(maxsize=None)
def _edges(named_only: bool = False) -> list[tuple[str, str, str, int]]:
    """(importer, imported, kind, line); kind: "module", "function" or "typing". ``named_only``:
    without the packages an import runs only as parents of the module it names."""
    mods = _modules()
    edges = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"

        def walk(node: ast.AST, kind: str) -> None:
            for child in ast.iter_child_nodes(node):
                k = kind
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    k = "function"
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and k == "module":
                    k = "typing"
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges.extend((mod, t, k, child.lineno) for t, named in _targets(mod, child, is_pkg, mods)
                                 if named or not named_only)
                walk(child, k)
        walk(ast.parse(path.read_text(), str(path)), "module")
    return edges


def _layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: its folder {top!r} is in no layer of LAYERS (add it)")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_only_go_down():
    up = [f"{a}:{line} imports {b} ({kind})" for a, b, kind, line in _edges() if _layer(b) > _layer(a)]
    assert not up, "imports that climb a layer (LAYERS, top of this file):\n" + "\n".join(up)


def test_no_import_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    folders: dict[str, set[str]] = defaultdict(set)
    for a, b, kind, _ in _edges():
        if kind != "typing":
            graph[a].add(b)
            fa, fb = (m.split(".")[1] if "." in m else "" for m in (a, b))
            if fa != fb and _layer(a) == _layer(b):
                folders[fa].add(fb)
    assert not _cycles(graph), f"import circles among modules: {_cycles(graph)}"
    assert not _cycles(folders), f"import circles among folders of one layer: {_cycles(folders)}"


def test_function_level_imports_are_listed():
    found = {(a, b) for a, b, kind, _ in _edges(named_only=True) if kind == "function"}
    unlisted = sorted(f"{a} imports {b} inside a function" for a, b in found - set(LAZY))
    assert not unlisted, ("import at module level, or list it in LAZY with its reason:\n" + "\n".join(unlisted))
    assert not set(LAZY) - found, f"LAZY lists imports that are gone: {sorted(set(LAZY) - found)}"


def test_the_checker_sees_what_it_checks():
    """The graph holds the arrows the tests above rely on (a parser that found nothing would pass them)."""
    edges = {(a, b, kind) for a, b, kind, _ in _edges()}
    assert ("zerostall.checkpointer", "zerostall.saving.stages", "module") in edges
    assert ("zerostall.saving.stages", "zerostall.peers", "function") in edges
    assert ("zerostall.saving.stages", "zerostall.saving", "module") not in edges  # its own package: no edge
    assert ("zerostall.restore.pipeline", "zerostall.distributed", "module") in edges  # the package of a module
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


PUBLIC = {"zerostall", "zerostall.errors", "zerostall.extend"}
"""What a framework adapter may import of zerostall: the public API, its errors and the
extension surface (the DCP plugin, ``integrations/dcp_*``, is a storage plugin on the shard
format and uses ``format/``, ``io/`` and ``memory/`` directly)."""


def test_framework_adapters_use_the_public_surface():
    adapters = {m for m in _modules() if m.startswith("zerostall.integrations.")
                and not m.startswith("zerostall.integrations.dcp_")}
    assert "zerostall.integrations.lightning" in adapters
    inside = [f"{a}:{line} imports {b}" for a, b, _, line in _edges(named_only=True)
              if a in adapters and b not in PUBLIC and not b.startswith("zerostall.integrations")]
    assert not inside, "use zerostall, zerostall.errors or zerostall.extend:\n" + "\n".join(inside)


def test_no_module_over_400_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    big = {m: n for m, n in sizes.items() if n > 400}
    assert not big, f"split these modules (over 400 lines): {big}"
