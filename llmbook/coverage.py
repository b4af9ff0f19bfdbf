"""Coverage of the catalogue, read from the source tree: implemented, tested and shown.

* **implemented**: one object in the package is registered against the id (:mod:`llmbook.registry`);
* **tested**: a test in the *mirrored test file* of one of the chapter's modules
  (``llmbook/lm/attention.py`` -> ``tests/lm/test_attention.py``) carries
  ``@pytest.mark.equation("03.01", oracle="...")`` naming an independent reference;
* **shown**: the chapter's notebook (from :mod:`llmbook.chapters`, listed in ``_toc.yml``) has a
  section labelled ``(sec-03-01)=`` whose code cells *call the registered object* by a name that
  resolves to it through the notebook's imports (``attn.scaled_dot_product_attention(...)`` after
  ``from llmbook.lm import attention as attn``). A call to some other ``softmax`` does not count.

A section runs from the cell holding its target to the cell before the next ``(sec-...)=`` target.
Tests and book are read from a source checkout; an installed package reports them as unknown (None).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmbook import chapters, registry

__all__ = ["TestRef", "Shown", "ChapterRow", "Coverage", "coverage", "scan_tests", "scan_book", "book_notebooks"]

TARGET = re.compile(r"^\(sec-([\w-]+)\)=\s*$", re.M)
EQ_TARGET = re.compile(r"^(\d\d)-(\d\d)$")


@dataclass(frozen=True)
class TestRef:
    """A test marked ``@pytest.mark.equation(...)``."""

    where: str  # "tests/lm/test_x.py::test_name"
    oracle: str

    @property
    def path(self) -> str:
        return self.where.split("::", 1)[0]


def _marker_calls(node: ast.AST):
    for dec in getattr(node, "decorator_list", []):
        if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute):
            f = dec.func
            if f.attr == "equation" and isinstance(f.value, ast.Attribute) and f.value.attr == "mark":
                yield dec


def scan_tests(root: Path) -> dict[str, list[TestRef]]:
    """Read every test file and collect ``pytest.mark.equation(ids..., oracle=...)`` markers."""
    found: dict[str, list[TestRef]] = {}

    def visit(node, rel: str, prefix: str = ""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                for call in _marker_calls(child):
                    ids = [a.value for a in call.args if isinstance(a, ast.Constant)]
                    oracle = next((k.value.value for k in call.keywords
                                   if k.arg == "oracle" and isinstance(k.value, ast.Constant)), "")
                    for eq_id in ids:
                        found.setdefault(eq_id, []).append(TestRef(f"{rel}::{name}", oracle))
                if isinstance(child, ast.ClassDef):
                    visit(child, rel, prefix=name + "::")

    for path in sorted((root / "tests").rglob("test_*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), path.relative_to(root).as_posix())
    return found


# --------------------------------------------------------------------------- the book


def book_notebooks(root: Path) -> list[Path]:
    """The notebooks that are part of the book: those listed in ``_toc.yml``."""
    toc = root / "_toc.yml"
    listed = re.findall(r"file:\s*([\w./-]+)", toc.read_text(encoding="utf-8")) if toc.exists() else []
    paths = [root / (f if f.endswith(".ipynb") else f + ".ipynb") for f in listed]
    return [p for p in paths if p.exists()]


def _python(source: str) -> ast.Module:
    """Parse a code cell, ignoring IPython magics and shell escapes."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return ast.Module(body=[], type_ignores=[])


def _aliases(trees: list[ast.Module]) -> dict[str, str]:
    """Local name -> dotted name it was imported as, for every ``llmbook`` import of a notebook."""
    out: dict[str, str] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "llmbook":
                        out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "llmbook":
                for a in node.names:
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


_MISSING = object()


def _lookup(dotted: str):
    """The object a dotted name refers to (modules imported as needed), or ``_MISSING``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def called_objects(sources: list[str], all_sources: list[str]) -> list[object]:
    """Objects that the code in ``sources`` calls, resolved through the imports in ``all_sources``."""
    return _calls([_python(s) for s in sources], _aliases([_python(s) for s in all_sources]))


def _calls(trees: list[ast.Module], alias: dict[str, str]) -> list[object]:
    out = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name and name[0] in alias:
                    obj = _lookup_cached(".".join([alias[name[0]], *name[1:]]))
                    if obj is not _MISSING:
                        out.append(obj)
    return out


_lookup_cache: dict[str, object] = {}


def _lookup_cached(dotted: str):
    if dotted not in _lookup_cache:
        _lookup_cache[dotted] = _lookup(dotted)
    return _lookup_cache[dotted]


@dataclass(frozen=True)
class Shown:
    notebook: str  # "book/01-probability.ipynb"
    calls: bool  # the section's code calls the registered object


def notebook_sections(path: Path) -> dict[str, list[str]]:
    """Section label (``"03-01"``, ``"claim-c12"``) -> the code of its cells."""
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for c in cells:
        src = "".join(c["source"])
        if c["cell_type"] == "markdown":
            labels = TARGET.findall(src)
            if labels:
                current = []
                for label in labels:
                    sections[label] = current
        elif c["cell_type"] == "code":
            current.append(src)
    return sections


def scan_book(root: Path, impls: dict[str, list[str]]) -> dict[str, Shown]:
    """For every ``sec-CC-NN`` section of a toc-listed notebook: does its code call the registered object?"""
    shown: dict[str, Shown] = {}
    for path in book_notebooks(root):
        sections = notebook_sections(path)
        trees = {src: _python(src) for code in sections.values() for src in code}
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        alias = _aliases([_python("".join(c["source"])) for c in cells if c["cell_type"] == "code"])
        for label, code in sections.items():
            m = EQ_TARGET.match(label)
            if not m:
                continue
            eq_id = f"{m.group(1)}.{m.group(2)}"
            targets = [registry.resolve(w) for w in impls.get(eq_id, [])]
            called = _calls([trees[src] for src in code], alias)
            shown[eq_id] = Shown(path.relative_to(root).as_posix(), any(o is t for o in called for t in targets))
    return shown


# --------------------------------------------------------------------------- the summary


@dataclass(frozen=True)
class ChapterRow:
    number: int
    family: str
    part: str
    notebook: str | None
    total: int
    implemented: int
    tested: int | None
    shown: int | None

    @property
    def complete(self) -> bool:
        return self.total == self.implemented == self.tested == self.shown


@dataclass
class Coverage:
    """What is implemented, tested and shown, per id, and what breaks the chapter contract."""

    implemented: dict[str, list[str]]
    tested: dict[str, list[TestRef]] | None
    shown: dict[str, Shown] | None
    unknown_ids: list[str] = field(default_factory=list)

    def _allowed_tests(self, eq_id: str) -> tuple[str, ...]:
        return chapters.chapter(registry.catalogue()[eq_id].chapter).test_paths()

    def misplaced_tests(self) -> list[str]:
        """Equation markers outside the mirrored test files of the id's chapter modules."""
        out = []
        for eq_id, refs in (self.tested or {}).items():
            if eq_id not in registry.catalogue():
                continue
            allowed = self._allowed_tests(eq_id)
            out += [f"{r.where} marks {eq_id}, whose tests belong in {' or '.join(allowed) or '(no module yet)'}"
                    for r in refs if r.path not in allowed]
        return out

    def misplaced_sections(self) -> list[str]:
        """Equation sections found outside their chapter's notebook."""
        out = []
        for eq_id, s in (self.shown or {}).items():
            if eq_id in registry.catalogue():
                nb = chapters.chapter(registry.catalogue()[eq_id].chapter).notebook
                if s.notebook != nb:
                    home = nb or "an unwritten chapter"
                    out.append(f"{s.notebook} has a section for {eq_id}, which belongs in {home}")
        return out

    def is_tested(self, eq_id: str) -> bool | None:
        if self.tested is None:
            return None
        allowed = self._allowed_tests(eq_id)
        return eq_id in self.implemented and any(t.oracle and t.path in allowed for t in self.tested.get(eq_id, []))

    def is_shown(self, eq_id: str) -> bool | None:
        if self.shown is None:
            return None
        s = self.shown.get(eq_id)
        nb = chapters.chapter(registry.catalogue()[eq_id].chapter).notebook
        return bool(s and s.calls and s.notebook == nb and eq_id in self.implemented)

    def by_chapter(self) -> list[ChapterRow]:
        """One row per chapter: the single coverage summary that the CLI and the book pages print."""
        rows = []
        for number, family in sorted(registry.families().items()):
            ids = [e.id for e in registry.catalogue().values() if e.chapter == number]
            ch = chapters.chapter(number)
            tested = None if self.tested is None else sum(bool(self.is_tested(i)) for i in ids)
            shown = None if self.shown is None else sum(bool(self.is_shown(i)) for i in ids)
            rows.append(ChapterRow(number, family, ch.part, ch.notebook, len(ids),
                                   sum(i in self.implemented for i in ids), tested, shown))
        return rows


def coverage(root: Path | None = None) -> Coverage:
    """Implemented (the registry), tested (``tests/``) and shown (``book/``) for every id, read from ``root``.

    ``root`` defaults to the source checkout holding the package; without one (an installed package)
    ``tested`` and ``shown`` are None.
    """
    impls = registry.implementations()
    root = root if root is not None else registry.repo_root()
    tested = scan_tests(root) if root else None
    shown = scan_book(root, impls) if root else None
    known = registry.catalogue()
    unknown = sorted({i for i in (tested or {}) if i not in known} | {i for i in (shown or {}) if i not in known})
    return Coverage(impls, tested, shown, unknown)
