"""The equation catalogue and the registry that links each id to code, tests and the book.

The catalogue is data (``llmbook/data/equations.tsv``: id, chapter, family, name, LaTeX).
Implementations declare the ids they compute with :func:`implements`::

    @implements("01.03")
    def softmax(z, dim=-1): ...

Coverage has three levels, read from three places:

* **implemented**: a function in the package is registered against the id;
* **tested**: a test in ``tests/`` carries ``@pytest.mark.equation("01.03", oracle="...")``
  naming the independent reference it compares against (found by reading the test files);
* **shown**: a chapter notebook in ``book/`` has a section target ``(sec-01-03)=`` and a code
  cell that calls one of the id's implementing functions.

The last two need a source checkout (``tests/`` and ``book/`` next to the package); an installed
package reports them as unknown.
"""

from __future__ import annotations

import ast
import csv
import importlib
import json
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TypeVar

__all__ = [
    "Equation",
    "catalogue",
    "implements",
    "implementations",
    "load_all",
    "Coverage",
    "coverage",
]

ID_PATTERN = re.compile(r"^\d\d\.\d\d$")
SECTION_PATTERN = re.compile(r"^\(sec-(\d\d)-(\d\d)\)=\s*$", re.M)
PARTS = ("lm", "rag", "agents", "kernels")

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Equation:
    """One catalogue entry."""

    id: str
    chapter: int
    family: str
    name: str
    latex: str

    @property
    def label(self) -> str:
        """The MyST target of the book section that shows this equation."""
        return "sec-" + self.id.replace(".", "-")


@cache
def catalogue() -> dict[str, Equation]:
    """All equations of the book, keyed by id, in catalogue order."""
    text = resources.files("llmbook.data").joinpath("equations.tsv").read_text(encoding="utf-8")
    rows = csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE)
    out = {}
    for r in rows:
        out[r["id"]] = Equation(r["id"], int(r["chapter"]), r["family"], r["equation"], r["latex"])
    return out


def families() -> dict[int, str]:
    """Chapter number -> family name."""
    return {e.chapter: e.family for e in catalogue().values()}


# id -> list of "module:qualname" of the implementing objects, in registration order
_REGISTRY: dict[str, list[str]] = {}


def _check_id(eq_id: str) -> None:
    if not isinstance(eq_id, str) or not ID_PATTERN.match(eq_id):
        raise ValueError(f"equation id {eq_id!r} must look like 'CC.NN', e.g. '01.03'")
    if eq_id not in catalogue():
        raise ValueError(f"equation id {eq_id!r} is not in the catalogue (llmbook/data/equations.tsv)")


def implements(*ids: str) -> Callable[[F], F]:
    """Register the decorated function or class as the implementation of catalogue ``ids``.

    Unknown or malformed ids raise ``ValueError`` at import time, so a typo cannot hide.

    >>> from llmbook.registry import implements
    >>> implements("99.99")
    Traceback (most recent call last):
    ...
    ValueError: equation id '99.99' is not in the catalogue (llmbook/data/equations.tsv)
    """
    if not ids:
        raise ValueError("implements() needs at least one equation id")
    for eq_id in ids:
        _check_id(eq_id)

    def decorate(obj: F) -> F:
        where = f"{obj.__module__}:{obj.__qualname__}"
        for eq_id in ids:
            names = _REGISTRY.setdefault(eq_id, [])
            if where not in names:
                names.append(where)
        obj.__equations__ = tuple(ids)  # type: ignore[attr-defined]
        return obj

    return decorate


def load_all() -> None:
    """Import every implementation module so that all registrations have run."""
    for part in PARTS:
        pkg = importlib.import_module(f"llmbook.{part}")
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"llmbook.{part}."):
            importlib.import_module(info.name)


def implementations() -> dict[str, list[str]]:
    """id -> implementing objects (``module:qualname``), after importing all modules."""
    load_all()
    return {k: list(v) for k, v in sorted(_REGISTRY.items())}


def resolve(where: str):
    """Return the object named by ``module:qualname``."""
    module, _, qualname = where.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- coverage


def repo_root() -> Path | None:
    """The source checkout holding ``tests/`` and ``book/``, or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests").is_dir() and (root / "book").is_dir() else None


@dataclass(frozen=True)
class TestRef:
    """A test marked ``@pytest.mark.equation(...)``."""

    where: str  # "tests/lm/test_x.py::test_name"
    oracle: str


def _marker_calls(node: ast.AST):
    decorators = getattr(node, "decorator_list", [])
    for dec in decorators:
        if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute):
            f = dec.func
            if f.attr == "equation" and isinstance(f.value, ast.Attribute) and f.value.attr == "mark":
                yield dec


def scan_tests(root: Path) -> dict[str, list[TestRef]]:
    """Read every test file and collect ``pytest.mark.equation(ids..., oracle=...)`` markers."""
    found: dict[str, list[TestRef]] = {}
    for path in sorted((root / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(root).as_posix()

        def visit(node, prefix="", rel=rel):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = prefix + child.name
                    for call in _marker_calls(child):
                        ids = [a.value for a in call.args if isinstance(a, ast.Constant)]
                        oracle = next(
                            (k.value.value for k in call.keywords
                             if k.arg == "oracle" and isinstance(k.value, ast.Constant)),
                            "",
                        )
                        for eq_id in ids:
                            found.setdefault(eq_id, []).append(TestRef(f"{rel}::{name}", oracle))
                    if isinstance(child, ast.ClassDef):
                        visit(child, prefix=name + "::", rel=rel)

        visit(tree)
    return found


@dataclass(frozen=True)
class Shown:
    notebook: str  # "book/01-probability.ipynb"
    calls: bool  # a code cell of that notebook calls an implementing function


def book_notebooks(root: Path) -> list[Path]:
    """The notebooks that are part of the book: those listed in ``_toc.yml`` (all of ``book/`` without one)."""
    toc = root / "_toc.yml"
    if not toc.exists():
        return sorted(p for p in (root / "book").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    listed = re.findall(r"file:\s*([\w./-]+)", toc.read_text(encoding="utf-8"))
    paths = [root / (f if f.endswith(".ipynb") else f + ".ipynb") for f in listed]
    return [p for p in paths if p.exists()]


def scan_book(root: Path, impls: dict[str, list[str]]) -> dict[str, Shown]:
    """Find the chapter section of each id and whether its notebook calls the implementation."""
    shown: dict[str, Shown] = {}
    for path in book_notebooks(root):
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        md = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for a, b in SECTION_PATTERN.findall(md):
            eq_id = f"{a}.{b}"
            names = [w.rsplit(".", 1)[-1].rsplit(":", 1)[-1] for w in impls.get(eq_id, [])]
            calls = any(re.search(rf"\b{re.escape(n)}\b", code) for n in names)
            shown[eq_id] = Shown(path.relative_to(root).as_posix(), calls)
    return shown


@dataclass
class Coverage:
    """What is implemented, tested and shown, per id."""

    implemented: dict[str, list[str]]
    tested: dict[str, list[TestRef]] | None
    shown: dict[str, Shown] | None
    unknown_ids: list[str] = field(default_factory=list)

    def is_tested(self, eq_id: str) -> bool | None:
        if self.tested is None:
            return None
        return eq_id in self.implemented and any(t.oracle for t in self.tested.get(eq_id, []))

    def is_shown(self, eq_id: str) -> bool | None:
        if self.shown is None:
            return None
        s = self.shown.get(eq_id)
        return bool(s and s.calls and eq_id in self.implemented)


def coverage(root: Path | None = None) -> Coverage:
    impls = implementations()
    root = root if root is not None else repo_root()
    tested = scan_tests(root) if root else None
    shown = scan_book(root, impls) if root else None
    known = catalogue()
    unknown = sorted({i for i in (tested or {}) if i not in known} | {i for i in (shown or {}) if i not in known})
    return Coverage(impls, tested, shown, unknown)
