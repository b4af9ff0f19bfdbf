"""The catalogue, the registry and the coverage scan keep their promises."""

import functools
import io
import json
import re
from pathlib import Path

import pytest

from llmbook import bookpages, chapters, cli, coverage, registry

ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=1)
def _coverage():
    """The registry's coverage of the repository, computed once per test process (it reads every file)."""
    return coverage.coverage(ROOT)


def test_catalogue_has_all_363_unique_ids():
    cat = registry.catalogue()
    assert len(cat) == 363
    assert all(re.fullmatch(r"\d\d\.\d\d", i) for i in cat)
    assert len({e.chapter for e in cat.values()}) == 43


def test_catalogue_matches_shared_copy_when_present():
    shared = ROOT.parent / "shared" / "equations.tsv"
    if not shared.exists():
        pytest.skip("no ../shared/equations.tsv next to this checkout")
    ours = (ROOT / "llmbook" / "data" / "equations.tsv").read_text(encoding="utf-8")
    assert ours == shared.read_text(encoding="utf-8")


def test_unknown_or_malformed_ids_are_rejected():
    with pytest.raises(ValueError, match="not in the catalogue"):
        registry.implements("99.99")
    with pytest.raises(ValueError, match="must look like 'CC.NN'"):
        registry.implements("1.3")
    with pytest.raises(ValueError, match="at least one"):
        registry.implements()


def test_a_duplicate_catalogue_id_fails_loudly():
    head = "id\tchapter\tfamily\tequation\tlatex\n"
    with pytest.raises(ValueError, match=r"id '03.01' appears twice \(lines 2 and 4\)"):
        registry.parse_catalogue(head + "03.01\t3\tA\tx\tx\n03.02\t3\tA\ty\ty\n03.01\t3\tA\tz\tz\n")
    with pytest.raises(ValueError, match="filed under chapter 4"):
        registry.parse_catalogue(head + "03.01\t4\tA\tx\tx\n")


def _fake(module: str, name: str = "f"):
    def f():
        pass

    f.__module__, f.__qualname__ = module, name
    return f


def test_an_id_is_registered_once_and_only_in_its_chapters_modules(monkeypatch):
    from llmbook import chapters

    with registry.isolated_registry() as reg:
        registry.implements("05.01")(_fake("llmbook.lm.norms", "layer_norm"))
        assert reg == {"05.01": "llmbook.lm.norms:layer_norm"}
        registry.implements("05.01")(_fake("llmbook.lm.norms", "layer_norm"))  # a re-import is harmless
        with pytest.raises(ValueError, match="05.01 is registered twice: by llmbook.lm.norms:layer_norm and by "
                                             "llmbook.lm.norms:other"):
            registry.implements("05.01")(_fake("llmbook.lm.norms", "other"))
        with pytest.raises(ValueError, match="belongs to chapter 3, whose modules are: llmbook.lm.attention"):
            registry.implements("03.01")(_fake("llmbook.lm.norms"))
        with monkeypatch.context() as m:  # every chapter has planned modules now: pretend 40 had none
            m.setitem(chapters.CHAPTERS, 40, chapters.Chapter(40, "agents", None, ()))
            with pytest.raises(ValueError, match="chapter 40, whose modules are: none yet"):
                registry.implements("40.01")(_fake("llmbook.agents.evaluation"))
        with pytest.raises(ValueError, match="repeated id"):
            registry.implements("05.02", "05.02")
    assert "05.01" in registry.implementations()  # the real registry is back


def test_every_registered_id_is_known_and_resolves_to_one_object_of_its_chapter():
    impls = registry.implementations()
    assert impls, "nothing is registered"
    for eq_id, names in impls.items():
        assert eq_id in registry.catalogue()
        assert len(names) == 1
        obj = registry.resolve(names[0])
        assert eq_id in obj.__equations__
        chapter = chapters.chapter(registry.catalogue()[eq_id].chapter)
        assert obj.__module__ in chapter.modules


def test_the_manifest_matches_the_tree_and_the_toc():
    toc = re.findall(r"file:\s*(book/\d\d-[\w-]+)", (ROOT / "_toc.yml").read_text(encoding="utf-8"))
    written = [ch.notebook for ch in chapters.CHAPTERS.values() if ch.written]
    assert sorted(f + ".ipynb" for f in toc) == sorted(written)
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "book").glob("[0-9][0-9]-*.ipynb")) == sorted(written)
    for ch in chapters.CHAPTERS.values():
        assert ch.notebook is None or ch.notebook.startswith(f"book/{ch.number:02d}-")
        for module in ch.modules if ch.written else ():  # an unwritten chapter may plan modules
            assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module
    # every implementation module is owned by a chapter (shared infrastructure lives at the top level)
    for part in registry.PACKAGES:
        for path in (ROOT / "llmbook" / part).glob("[!_]*.py"):
            module = f"llmbook.{part}.{path.stem}"
            assert chapters.chapter_of_module(module) is not None or module in chapters.SHARED_MODULES, \
                f"{module} is in no chapter of llmbook/chapters.py"


def test_tests_sit_in_the_mirrored_files_and_sections_in_their_chapter():
    cov = _coverage()
    assert not cov.misplaced_tests()
    assert not cov.misplaced_sections()


def test_every_registered_equation_is_tested_against_an_oracle():
    cov = _coverage()
    untested = [i for i in cov.implemented if not cov.is_tested(i)]
    assert not untested, f"registered but with no @pytest.mark.equation(..., oracle=...) test: {untested}"
    for eq_id, refs in cov.tested.items():
        assert eq_id in registry.catalogue(), f"{refs[0].where} marks unknown id {eq_id}"
        for ref in refs:
            assert ref.oracle and not ref.oracle.startswith("llmbook"), f"{ref.where}: oracle {ref.oracle!r}"


def test_book_sections_name_known_ids():
    cov = _coverage()
    assert not cov.unknown_ids


def test_cli_search_summary_and_missing():
    cov = _coverage()  # one scan of the package, tests and book per worker
    out = io.StringIO()
    assert cli.print_equations("perplexity", cov, out=out) == 0
    assert "01.15" in out.getvalue() and "llmbook.lm.probability.perplexity" in out.getvalue()
    out = io.StringIO()
    assert cli.print_equations("no such equation anywhere", cov, out=out) == 1
    out = io.StringIO()
    cli.print_summary(cov, out=out)
    assert "all chapters" in out.getvalue() and "363" in out.getvalue()
    out = io.StringIO()
    cli.print_missing(cov, out=out)
    listed = {line.split()[0] for line in out.getvalue().splitlines()}
    complete = {i for i in registry.catalogue() if cov.is_tested(i) and cov.is_shown(i)}
    assert listed == set(registry.catalogue()) - complete


def test_generated_index_lists_every_implemented_equation():
    cov = _coverage()
    page = bookpages.equation_index(cov)
    for eq_id in cov.implemented:
        assert f"<td>{eq_id}</td>" in page


def test_every_notebook_has_the_setup_cell_for_the_configured_repository():
    url = bookpages.repository_url(ROOT / "_config.yml")
    expected = bookpages.setup_cell_source(url)
    notebooks = sorted((ROOT / "book").glob("*.ipynb"))
    assert notebooks
    for nb in notebooks:
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        code = [c for c in cells if c["cell_type"] == "code"]
        first = code[0]
        assert "setup" in first["metadata"].get("tags", []), f"{nb.name}: first code cell is not tagged 'setup'"
        assert "".join(first["source"]) == expected, f"{nb.name}: setup cell is stale; run `make notebooks`"
        assert "hide-input" in first["metadata"]["tags"] or "remove-input" in first["metadata"]["tags"]


def test_no_notebook_cell_hides_a_show_source_call():
    """Jupyter displays only a cell's last bare expression: a bare ``show_source(...)`` before it shows nothing."""
    import ast

    hidden = []
    for nb in sorted((ROOT / "book").glob("[0-9]*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            body = ast.parse("".join(cell["source"])).body
            hidden += [f"{nb.name} cell {i}" for node in body[:-1] if isinstance(node, ast.Expr)
                       and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "show_source"]
    assert not hidden, f"wrap these in display(...): {hidden}"
