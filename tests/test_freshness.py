"""Stored outputs are rendered only when nbval has proven them current for this exact tree."""

from pathlib import Path
from types import SimpleNamespace

from llmbook import freshness


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


def test_a_notebook_over_the_budget_fails_the_run(tmp_path, monkeypatch):
    root = _tree(tmp_path)
    plugin = freshness.NbvalProofPlugin(root)
    plugin.pytest_sessionstart(None)
    plugin.pytest_runtest_logreport(_report("book/01-a.ipynb::Cell 0", duration=12.0))
    plugin.pytest_runtest_logreport(_report("book/02-b.ipynb::Cell 0", duration=3.0))
    session = SimpleNamespace(exitstatus=0)
    monkeypatch.setenv("LLMBOOK_NOTEBOOK_BUDGET_S", "10")
    assert plugin.over_budget() == ["book/01-a.ipynb"]
    plugin.pytest_sessionfinish(session)
    assert session.exitstatus == 1
    assert freshness.is_proven(root / "book" / "01-a.ipynb", root)  # its outputs are still proven current
    monkeypatch.delenv("LLMBOOK_NOTEBOOK_BUDGET_S")
    assert plugin.over_budget() == [] and freshness.budget_s() == freshness.BUDGET_S
