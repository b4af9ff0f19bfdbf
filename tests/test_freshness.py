"""Stored outputs are rendered only when nbval has proven them current for this exact tree."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from llmbook import freshness
from llmbook.cpu import CODE_PATH_VARIABLES


@pytest.fixture(autouse=True)
def _own_code_paths(monkeypatch):
    """These tests write proofs, which happens only on the machine's own paths (`make test CPU_PATH=...` sets them)."""
    for name in CODE_PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "llmbook" / "lm").mkdir(parents=True)
    (tmp_path / "llmbook" / "lm" / "attention.py").write_text("x = 1\n")
    (tmp_path / "book").mkdir()
    for name in ("01-a", "02-b"):
        (tmp_path / "book" / f"{name}.ipynb").write_text('{"cells": []}')
    (tmp_path / "constraints.txt").write_text("torch==2.13.0\n")
    return tmp_path


def test_the_key_changes_with_the_notebook_the_package_and_the_pins(tmp_path):
    root = _tree(tmp_path)
    nb = root / "book" / "01-a.ipynb"
    key = freshness.outputs_key(nb, root)
    assert key == freshness.outputs_key(nb, root)
    for path, text in [(nb, '{"cells": [1]}'), (root / "llmbook" / "lm" / "attention.py", "x = 2\n"),
                       (root / "constraints.txt", "torch==2.14.1\n"), (root / "llmbook" / "new.py", "")]:
        old = path.read_text() if path.exists() else None
        path.write_text(text)
        assert freshness.outputs_key(nb, root) != key, path
        path.write_text(old) if old is not None else path.unlink()
    assert freshness.outputs_key(nb, root) == key
    (root / "llmbook" / "lm" / "__pycache__").mkdir()
    (root / "llmbook" / "lm" / "__pycache__" / "attention.cpython-311.pyc").write_bytes(b"\0")
    assert freshness.outputs_key(nb, root) == key  # byte code is not a source


def _report(nodeid, when="call", failed=False, duration=0.5):
    return SimpleNamespace(nodeid=nodeid, when=when, failed=failed, duration=duration)


def test_the_plugin_proves_passing_notebooks_only_and_an_edit_revokes_the_proof(tmp_path):
    root = _tree(tmp_path)
    plugin = freshness.NbvalProofPlugin(root)
    plugin.pytest_sessionstart(None)
    for i in range(3):
        plugin.pytest_runtest_logreport(_report(f"book/01-a.ipynb::Cell {i}"))
    plugin.pytest_runtest_logreport(_report("book/02-b.ipynb::Cell 0"))
    plugin.pytest_runtest_logreport(_report("book/02-b.ipynb::Cell 1", failed=True))
    plugin.pytest_runtest_logreport(_report("tests/test_x.py::test_y"))  # not a notebook
    plugin.pytest_sessionfinish(None)
    proof = freshness.read_proof("book/01-a.ipynb", root)
    assert proof["cells"] == 3 and proof["seconds"] == 1.5
    plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0", when="setup", duration=2.0))
    plugin.pytest_sessionfinish(None)
    proof = freshness.read_proof("book/01-a.ipynb", root)
    assert proof["seconds"] == 1.5 and proof["wall"] == 3.5  # the kernel's start is not the chapter's budget
    assert freshness.read_proof("book/02-b.ipynb", root) is None
    notebooks = [root / "book" / "01-a.ipynb", root / "book" / "02-b.ipynb"]
    assert freshness.plan(notebooks, root) == (notebooks[:1], notebooks[1:])
    # a notebook edited after the test run is executed by the build again
    notebooks[0].write_text('{"cells": ["edited"]}')
    assert freshness.plan(notebooks, root) == ([], notebooks)


def test_a_failed_rerun_removes_an_old_proof(tmp_path):
    root = _tree(tmp_path)
    for failed in (False, True):
        plugin = freshness.NbvalProofPlugin(root)
        plugin.pytest_sessionstart(None)
        plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0", failed=failed))
        plugin.pytest_sessionfinish(None)
        assert freshness.is_proven(root / "book" / "01-a.ipynb", root) is (not failed)


@pytest.mark.parametrize("strict, exitstatus", [(None, 0), ("0", 0), ("1", 1)])
def test_a_notebook_over_the_budget_is_reported_and_fails_the_run_only_when_strict(tmp_path, monkeypatch, strict,
                                                                                  exitstatus):
    root = _tree(tmp_path)
    plugin = freshness.NbvalProofPlugin(root)
    plugin.pytest_sessionstart(None)
    plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0", duration=12.0))
    plugin.pytest_runtest_logreport(_report("book/02-b.ipynb::Cell 0", duration=3.0))
    session = SimpleNamespace(exitstatus=0)
    monkeypatch.setenv("LLMBOOK_NOTEBOOK_BUDGET_S", "10")
    if strict is None:
        monkeypatch.delenv("LLMBOOK_NOTEBOOK_BUDGET_STRICT", raising=False)
    else:
        monkeypatch.setenv("LLMBOOK_NOTEBOOK_BUDGET_STRICT", strict)
    assert plugin.over_budget() == ["book/01-a.ipynb"]
    plugin.pytest_sessionfinish(session)
    assert session.exitstatus == exitstatus  # a reader's slow machine is not a failure unless asked for
    assert freshness.is_proven(root / "book" / "01-a.ipynb", root)  # its outputs are still proven current
    monkeypatch.delenv("LLMBOOK_NOTEBOOK_BUDGET_S")
    assert plugin.over_budget() == [] and freshness.budget_s() == freshness.BUDGET_S


def test_a_run_under_a_forced_cpu_path_checks_but_leaves_the_proofs_alone(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    nb = root / "book" / "01-a.ipynb"
    plugin = freshness.NbvalProofPlugin(root)
    plugin.pytest_sessionstart(None)
    plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0"))
    plugin.pytest_sessionfinish(None)
    before = freshness.read_proof(nb, root)
    assert before is not None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    for failed in (False, True):  # neither a pass nor a failure under another path rewrites the proof
        plugin = freshness.NbvalProofPlugin(root)
        plugin.pytest_sessionstart(None)
        plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0", duration=9.0, failed=failed))
        plugin.pytest_sessionfinish(None)
        assert freshness.read_proof(nb, root) == before
