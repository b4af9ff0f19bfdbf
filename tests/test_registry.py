"""The catalogue, the registry and the coverage scan keep their promises."""

import io
import json
import re
from pathlib import Path

import pytest

from llmbook import bookpages, cli, registry

ROOT = Path(__file__).resolve().parent.parent


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


def test_every_registered_id_is_known_and_resolves():
    impls = registry.implementations()
    assert impls, "nothing is registered"
    for eq_id, names in impls.items():
        assert eq_id in registry.catalogue()
        for where in names:
            obj = registry.resolve(where)
            assert eq_id in obj.__equations__


def test_every_registered_equation_is_tested_against_an_oracle():
    cov = registry.coverage(ROOT)
    untested = [i for i in cov.implemented if not cov.is_tested(i)]
    assert not untested, f"registered but with no @pytest.mark.equation(..., oracle=...) test: {untested}"
    for eq_id, refs in cov.tested.items():
        assert eq_id in registry.catalogue(), f"{refs[0].where} marks unknown id {eq_id}"
        for ref in refs:
            assert ref.oracle and not ref.oracle.startswith("llmbook"), f"{ref.where}: oracle {ref.oracle!r}"


def test_book_sections_name_known_ids():
    cov = registry.coverage(ROOT)
    assert not cov.unknown_ids


def test_cli_search_summary_and_missing():
    out = io.StringIO()
    assert cli.print_equations("perplexity", registry.coverage(ROOT), out=out) == 0
    assert "01.15" in out.getvalue() and "llmbook.lm.probability.perplexity" in out.getvalue()
    out = io.StringIO()
    assert cli.print_equations("no such equation anywhere", registry.coverage(ROOT), out=out) == 1
    out = io.StringIO()
    cli.print_summary(registry.coverage(ROOT), out=out)
    assert "all chapters" in out.getvalue() and "363" in out.getvalue()
    out = io.StringIO()
    cli.print_missing(registry.coverage(ROOT), out=out)
    cov = registry.coverage(ROOT)
    listed = {line.split()[0] for line in out.getvalue().splitlines()}
    complete = {i for i in registry.catalogue() if cov.is_tested(i) and cov.is_shown(i)}
    assert listed == set(registry.catalogue()) - complete


def test_generated_index_lists_every_implemented_equation():
    cov = registry.coverage(ROOT)
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
