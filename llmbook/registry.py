"""The equation catalogue and the registry that links each id to the one object that implements it.

The catalogue is data (``llmbook/data/equations.tsv``: id, chapter, family, name, LaTeX).
Implementations declare the ids they compute with :func:`implements`::

    @implements("01.03")
    def softmax(z, dim=-1): ...

The contract, enforced when a module is imported:

* an id is ``CC.NN`` and exists in the catalogue (whose ids are unique);
* an id is registered **once**, on one public function or class (one object may implement several ids);
* an id of chapter ``CC`` is registered only in a module that the chapter manifest
  (:mod:`llmbook.chapters`) lists for chapter ``CC``.

What is tested and shown is read from the source tree by :mod:`llmbook.coverage`.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import pkgutil
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TypeVar

from llmbook import chapters

__all__ = [
    "Equation",
    "catalogue",
    "families",
    "implements",
    "implementation",
    "implementations",
    "load_all",
    "resolve",
    "repo_root",
]

ID_PATTERN = re.compile(r"^\d\d\.\d\d$")
PACKAGES = ("lm", "rag", "agents", "kernels")

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


def parse_catalogue(text: str, source: str = "equations.tsv") -> dict[str, Equation]:
    """Parse the catalogue TSV; a duplicate or malformed id is an error that names its lines.

    >>> parse_catalogue("id\\tchapter\\tfamily\\tequation\\tlatex\\n01.01\\t1\\tF\\tA\\ta\\n01.01\\t1\\tF\\tB\\tb\\n")
    Traceback (most recent call last):
    ...
    ValueError: equations.tsv: id '01.01' appears twice (lines 2 and 3)
    """
    rows = csv.DictReader(text.splitlines(), delimiter="\t", quoting=csv.QUOTE_NONE)
    out: dict[str, Equation] = {}
    line_of: dict[str, int] = {}
    for line, r in enumerate(rows, start=2):
        eq_id = r["id"]
        if not ID_PATTERN.match(eq_id or ""):
            raise ValueError(f"{source}: line {line} has a malformed id {eq_id!r} (expected 'CC.NN')")
        if eq_id in out:
            raise ValueError(f"{source}: id {eq_id!r} appears twice (lines {line_of[eq_id]} and {line})")
        if int(r["chapter"]) != int(eq_id[:2]):
            raise ValueError(f"{source}: line {line}: id {eq_id} is filed under chapter {r['chapter']}")
        out[eq_id] = Equation(eq_id, int(r["chapter"]), r["family"], r["equation"], r["latex"])
        line_of[eq_id] = line
    return out


@cache
def catalogue() -> dict[str, Equation]:
    """All equations of the book, keyed by id, in catalogue order."""
    text = resources.files("llmbook.data").joinpath("equations.tsv").read_text(encoding="utf-8")
    return parse_catalogue(text)


def families() -> dict[int, str]:
    """Chapter number -> family name."""
    return {e.chapter: e.family for e in catalogue().values()}


# id -> "module:qualname" of the one implementing object
_REGISTRY: dict[str, str] = {}


def _check_id(eq_id: str) -> None:
    if not isinstance(eq_id, str) or not ID_PATTERN.match(eq_id):
        raise ValueError(f"equation id {eq_id!r} must look like 'CC.NN', e.g. '01.03'")
    if eq_id not in catalogue():
        raise ValueError(f"equation id {eq_id!r} is not in the catalogue (llmbook/data/equations.tsv)")


def _check_owner(eq_id: str, module: str) -> None:
    owner = chapters.chapter(catalogue()[eq_id].chapter)
    if module not in owner.modules:
        listed = ", ".join(owner.modules) or "none yet"
        raise ValueError(f"equation {eq_id} belongs to chapter {owner.number}, whose modules are: {listed}; "
                         f"{module} may not register it (add the module to llmbook/chapters.py first)")


def implements(*ids: str) -> Callable[[F], F]:
    """Register the decorated function or class as *the* implementation of catalogue ``ids``.

    Unknown or malformed ids, an id registered a second time, and an id registered outside its
    chapter's modules all raise ``ValueError`` at import time, so no mistake can hide.

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
    if len(set(ids)) != len(ids):
        raise ValueError(f"implements() got a repeated id: {ids}")

    def decorate(obj: F) -> F:
        where = f"{obj.__module__}:{obj.__qualname__}"
        for eq_id in ids:
            _check_owner(eq_id, obj.__module__)
            previous = _REGISTRY.get(eq_id)
            if previous is not None and previous != where:
                raise ValueError(f"equation {eq_id} is registered twice: by {previous} and by {where}; "
                                 "an id has one implementation (document variants in its docstring instead)")
        for eq_id in ids:
            _REGISTRY[eq_id] = where
        obj.__equations__ = tuple(ids)  # type: ignore[attr-defined]
        return obj

    return decorate


@contextmanager
def isolated_registry():
    """Run a block with an empty registry and restore the real one afterwards (for tests)."""
    saved = dict(_REGISTRY)
    _REGISTRY.clear()
    try:
        yield _REGISTRY
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def load_all() -> None:
    """Import every implementation module so that all registrations have run."""
    for ch in chapters.CHAPTERS.values():
        for module in ch.modules:  # an unwritten chapter may list modules that do not exist yet
            if ch.written or importlib.util.find_spec(module) is not None:
                importlib.import_module(module)
    for part in PACKAGES:  # modules missing from the manifest too: they must not register anything
        pkg = importlib.import_module(f"llmbook.{part}")
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"llmbook.{part}."):
            importlib.import_module(info.name)


def implementations() -> dict[str, list[str]]:
    """id -> ``[module:qualname]`` of its implementing object, after importing all modules."""
    load_all()
    return {k: [v] for k, v in sorted(_REGISTRY.items())}


def implementation(eq_id: str) -> str | None:
    """``module:qualname`` of the object registered for ``eq_id``, or None if not yet implemented."""
    _check_id(eq_id)
    load_all()
    return _REGISTRY.get(eq_id)


def resolve(where: str):
    """Return the object named by ``module:qualname``."""
    module, _, qualname = where.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def repo_root() -> Path | None:
    """The source checkout holding ``tests/`` and ``book/``, or None for an installed package."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests").is_dir() and (root / "book").is_dir() else None

