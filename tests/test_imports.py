"""The package's imports flow one way: catalogue <- implementations <- pipelines and recipes <- CLI and book.

Every ``import`` statement counts, including those inside functions (a deferred import hides a cycle from
the interpreter, not from a reader). The graph is read from the source with ``ast``; the cycles are found by
networkx, an independent implementation of the search.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "llmbook"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (a package directory)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path) -> nx.DiGraph:
    """An edge ``a -> b`` for every import of module ``b`` (inside the package) anywhere in module ``a``."""
    mods = module_names(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # ``from pkg import mod`` imports the module ``pkg.mod``; ``from mod import name`` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph.add_edges_from((name, t) for t in targets if t in mods and t != name)
    return graph


def test_no_import_cycle_inside_llmbook():
    cycles = sorted(" -> ".join(c + [c[0]]) for c in nx.simple_cycles(import_graph(PACKAGE)))
    assert not cycles, "import cycles in llmbook:\n" + "\n".join(cycles)


def test_implementations_do_not_import_the_cli_or_the_book_pages():
    graph = import_graph(PACKAGE)
    upper = {"llmbook.cli", "llmbook.__main__", "llmbook.bookpages"}
    lower = [m for m in graph if m.split(".")[1:2] and m.split(".")[1] in ("lm", "rag", "agents", "kernels")]
    bad = [(m, t) for m in lower for t in graph.successors(m) if t in upper]
    assert not bad


def test_the_cycle_check_finds_a_deferred_import_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g  # deferred, still a cycle\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.a"), ("pkg.c", "pkg.a")}
    assert [sorted(c) for c in nx.simple_cycles(graph)] == [["pkg.a", "pkg.sub.b"]]
