"""Are a notebook's stored outputs proven current? One execution per build, and no stale page.

``make test`` runs nbval over every chapter notebook: it re-executes the notebook and compares each
cell's fresh output with the stored one. When every cell of a notebook passes, this module's pytest
plugin (``pytest -p llmbook.freshness``) writes a *proof* to ``_build/proofs/<notebook>.json``: the
notebook's *outputs key* at the start of the run, and the seconds its execution took.

The outputs key is a SHA-256 over everything that can change what a notebook prints: the notebook
file itself, every file of the ``llmbook`` package, the pinned versions (``constraints.txt``) and the
Python and torch versions. ``make book`` then renders the stored outputs of each notebook whose proof
matches the current key, and executes the others (a fresh clone, a notebook edited since the test
run, a package change), so stale outputs can never reach the site unnoticed, and in CI, where
``make test`` ran first in the same tree, each notebook executes exactly once.

Under a forced CPU code path (:mod:`llmbook.cpu`, ``make nbval CPU_PATH=generic``) the plugin compares and
reports but leaves the proofs as they are: they record the run on the machine's own paths, whose times
are the ones the budget speaks of.

The plugin also reports each notebook's execution time against the chapter budget (20 s on the 2-core
reference machine). The budget is a report: a reader's slower laptop must not fail the regression test
for being slow. ``LLMBOOK_NOTEBOOK_BUDGET_STRICT=1`` turns an over-budget notebook into a failed run (for
the book's own timing checks), and ``LLMBOOK_NOTEBOOK_BUDGET_S`` sets the budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

__all__ = ["outputs_key", "proof_path", "read_proof", "is_proven", "plan", "budget_s", "budget_is_strict",
           "NbvalProofPlugin"]

PROOFS = Path("_build") / "proofs"
BUDGET_S = 20.0  # execution budget of one chapter notebook on the 2-core reference machine


def budget_s() -> float:
    """The per-chapter budget: ``BUDGET_S``, or ``LLMBOOK_NOTEBOOK_BUDGET_S`` on a slower machine."""
    return float(os.environ.get("LLMBOOK_NOTEBOOK_BUDGET_S", BUDGET_S))


def budget_is_strict() -> bool:
    """Does a notebook over the budget fail the run? Only with ``LLMBOOK_NOTEBOOK_BUDGET_STRICT=1`` (opt-in)."""
    return os.environ.get("LLMBOOK_NOTEBOOK_BUDGET_STRICT", "0").strip().lower() in ("1", "true", "yes")


_SKIP_DIRS = {"__pycache__", ".ipynb_checkpoints"}


def _package_files(root: Path) -> list[Path]:
    pkg = root / "llmbook"
    return sorted(p for p in pkg.rglob("*") if p.is_file() and not _SKIP_DIRS & set(p.parts) and p.suffix != ".pyc")


def _environment() -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover
        torch_version = "none"
    return f"python {platform.python_version()} torch {torch_version}"


def outputs_key(notebook: Path | str, root: Path | str = ".") -> str:
    """SHA-256 of the notebook, the package sources, ``constraints.txt`` and the Python/torch versions.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "nb.ipynb").write_text("{}")
    2
    >>> outputs_key(d / "nb.ipynb", d) == outputs_key(d / "nb.ipynb", d)
    True
    """
    root, notebook = Path(root), Path(notebook)
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + hashlib.sha256(data).digest())

    add("notebook", notebook.read_bytes())
    for p in _package_files(root):
        add(p.relative_to(root).as_posix(), p.read_bytes())
    constraints = root / "constraints.txt"
    add("constraints", constraints.read_bytes() if constraints.exists() else b"")
    add("environment", _environment().encode())
    return h.hexdigest()


def proof_path(notebook: Path | str, root: Path | str = ".") -> Path:
    return Path(root) / PROOFS / (Path(notebook).stem + ".json")


def read_proof(notebook: Path | str, root: Path | str = ".") -> dict | None:
    path = proof_path(notebook, root)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_proven(notebook: Path | str, root: Path | str = ".") -> bool:
    """True if nbval passed on exactly this notebook, package, pins and environment."""
    proof = read_proof(notebook, root)
    return bool(proof) and proof.get("key") == outputs_key(notebook, root)


def plan(notebooks: list[Path], root: Path | str = ".") -> tuple[list[Path], list[Path]]:
    """Split the book's notebooks into (render stored outputs, execute at build time)."""
    proven = [nb for nb in notebooks if is_proven(nb, root)]
    return proven, [nb for nb in notebooks if nb not in proven]


class NbvalProofPlugin:
    """pytest plugin: write a proof for every notebook all of whose nbval cells passed.

    It runs in the controlling process (under pytest-xdist the workers' reports reach it), keys each
    notebook at the start of the session, and sums the cells' execution times (``seconds``, the budget's
    measure) and their set-up and tear-down too (``wall``, which includes starting the kernel).
    """

    def __init__(self, root: Path):
        self.root = root
        self.keys: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # the cells' execution (the budget's measure)
        self.wall: dict[str, float] = {}  # plus the kernel's start and stop
        self.cells: dict[str, int] = {}
        self.failed: set[str] = set()

    def pytest_sessionstart(self, session):
        for nb in sorted((self.root / "book").glob("*.ipynb")):
            self.keys[nb.relative_to(self.root).as_posix()] = outputs_key(nb, self.root)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if not path.endswith(".ipynb"):
            return
        self.wall[path] = self.wall.get(path, 0.0) + report.duration
        if report.when == "call":
            self.cells[path] = self.cells.get(path, 0) + 1
            self.seconds[path] = self.seconds.get(path, 0.0) + report.duration
        if report.failed:
            self.failed.add(path)

    def over_budget(self) -> list[str]:
        """Notebooks whose cells took longer than the budget (reported; a failure only if the budget is strict)."""
        return [p for p, s in sorted(self.seconds.items()) if s > budget_s()]

    def pytest_sessionfinish(self, session):
        from llmbook.cpu import forced

        if self.over_budget() and budget_is_strict() and session is not None and session.exitstatus == 0:
            session.exitstatus = 1
        if forced():  # another CPU code path: a check of portability, not the proofs' run
            return
        (self.root / PROOFS).mkdir(parents=True, exist_ok=True)
        for path, key in self.keys.items():
            target = proof_path(path, self.root)
            if path in self.failed or path not in self.cells:
                target.unlink(missing_ok=True)
                continue
            target.write_text(json.dumps({
                "notebook": path, "key": key, "cells": self.cells[path],
                "seconds": round(self.seconds[path], 2), "wall": round(self.wall[path], 2),
                "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
            }, indent=1), encoding="utf-8")

    def pytest_terminal_summary(self, terminalreporter):
        if not self.cells:
            return
        tr = terminalreporter
        tr.section("notebook execution (nbval)")
        for path, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            verdict = "FAILED" if path in self.failed else ("OVER BUDGET" if s > budget_s() else "ok")
            tr.write_line(f"{s:6.1f} s  (wall {self.wall[path]:5.1f} s)  {self.cells.get(path, 0):3d} cells  {path}  "
                          f"{verdict}")
        rule = ("a notebook over it fails the run" if budget_is_strict()
                else "reported only; LLMBOOK_NOTEBOOK_BUDGET_STRICT=1 makes it fail the run")
        tr.write_line(f"budget: {budget_s():g} s of execution per chapter ({rule}); proofs in {PROOFS}/")
        try:
            from llmbook.cpu import describe
        except ImportError:  # pragma: no cover
            return
        tr.write_line(f"CPU code paths: {describe()}")


def pytest_configure(config):
    """Entry point for ``pytest -p llmbook.freshness``: register the plugin in the controlling process."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller writes the proofs
        return
    config.pluginmanager.register(NbvalProofPlugin(Path(config.rootpath)), "llmbook-nbval-proofs")
