"""The command line as a reader who installed the package (no checkout beside it) meets it."""

import io

from llmbook import cli, coverage, registry


def test_the_summary_outside_a_checkout_says_coverage_needs_one_and_prints_what_the_package_knows(monkeypatch):
    monkeypatch.setattr(registry, "repo_root", lambda: None)  # an installed package: no tests/, no book/
    cov = coverage.coverage()
    assert cov.tested is None and cov.shown is None
    out = io.StringIO()
    assert cli.print_summary(cov, out=out) == 0
    text = out.getvalue()
    assert "?" not in text and "complete chapters: none" not in text
    assert "tested and shown: not known here" in text and "github.com/llmbook/llmbook" in text
    rows = {r.number: r for r in cov.by_chapter()}
    assert f"{'':>3}  {'all chapters':<40} {363:>5} {sum(r.implemented for r in rows.values()):>6}" in text
    assert f"{1:>3}  {rows[1].family[:40]:<40} {rows[1].total:>5} {rows[1].implemented:>6}" in text
