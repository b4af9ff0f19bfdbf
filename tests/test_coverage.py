"""The coverage scan: strict "shown", mirrored tests, and one by-chapter summary for the CLI and the pages."""

import io
import json
from pathlib import Path

from llmbook import bookpages, cli, coverage, registry
from llmbook.lm import attention, probability

ROOT = Path(__file__).resolve().parent.parent


def _notebook(tmp_path: Path, cells: list[tuple[str, str]]) -> Path:
    nb = {"cells": [{"cell_type": t, "source": s, "metadata": {}, **({"outputs": []} if t == "code" else {})}
                    for t, s in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "book" / "03-attention.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb), encoding="utf-8")
    (tmp_path / "_toc.yml").write_text("root: x\nchapters:\n  - file: book/03-attention\n", encoding="utf-8")
    return path


def test_calls_resolve_through_the_notebooks_own_imports():
    setup = "from llmbook.lm import attention as attn\nimport llmbook.lm.probability as prob\nimport torch"
    called = coverage.called_objects(
        ["attn.scaled_dot_product_attention(q, k, v)\nprob.softmax(z)\ntorch.softmax(z, -1)\n%timeit x"],
        [setup])
    assert attention.scaled_dot_product_attention in called and probability.softmax in called
    assert len(called) == 2  # torch.softmax is not an llmbook object, and the magic is ignored
    # a bare name counts only when it was imported from llmbook
    assert coverage.called_objects(["softmax(z)"], ["from torch import softmax"]) == []
    assert coverage.called_objects(["softmax(z)"], ["from llmbook.lm.probability import softmax"]) == [
        probability.softmax]


def test_a_section_is_shown_only_if_its_own_cells_call_the_registered_object(tmp_path):
    impls = registry.implementations()
    path = _notebook(tmp_path, [
        ("code", "from llmbook.lm import attention as attn\nfrom torch.nn.functional import softmax"),
        ("markdown", "(sec-03-01)=\n## Scaled dot-product attention"),
        ("code", "softmax(scores, -1)  # some other softmax"),
        ("markdown", "(sec-03-03)=\n(sec-03-04)=\n## Two ids, one section"),
        ("code", "attn.MultiHeadAttention(16, 2)"),
        ("markdown", "(sec-03-05)=\n## Multi-query"),
        ("code", "attn.scaled_dot_product_attention(q, k, v)  # MultiQueryAttention is called in the next one"),
        ("markdown", "(sec-03-06)=\n## Grouped-query"),
        ("code", "attn.MultiQueryAttention(16, 2)\nattn.GroupedQueryAttention(16, 4, 2)"),
    ])
    shown = coverage.scan_book(tmp_path, impls)
    assert shown["03.01"] == coverage.Shown("book/03-attention.ipynb", False)
    assert shown["03.03"].calls is True and shown["03.04"].calls is False  # 03.04 is CrossAttention
    assert shown["03.05"].calls is False and shown["03.06"].calls is True
    assert list(coverage.notebook_sections(path)) == ["03-01", "03-03", "03-04", "03-05", "03-06"]


def test_a_marker_outside_the_mirrored_test_file_does_not_count():
    cov = coverage.Coverage({"03.01": ["llmbook.lm.attention:scaled_dot_product_attention"]},
                            {"03.01": [coverage.TestRef("tests/lm/test_norms.py::test_x", "torch")]}, {})
    assert cov.is_tested("03.01") is False
    assert cov.misplaced_tests() == ["tests/lm/test_norms.py::test_x marks 03.01, whose tests belong in "
                                     "tests/lm/test_attention.py or tests/lm/test_efficient_attention.py or "
                                     "tests/lm/test_local_attention.py or tests/lm/test_flash.py or "
                                     "tests/kernels/test_flash_attention.py or "
                                     "tests/kernels/test_flash_attention_kernels.py"]
    cov.tested["03.01"].append(coverage.TestRef("tests/lm/test_attention.py::test_y", "torch"))
    assert cov.is_tested("03.01") is True


def test_cli_and_status_page_print_the_same_by_chapter_rows():
    cov = coverage.coverage(ROOT)
    rows = {r.number: r for r in cov.by_chapter()}
    assert len(rows) == 43 and sum(r.total for r in rows.values()) == 363
    out = io.StringIO()
    cli.print_summary(cov, out=out)
    page = bookpages.status_page(cov)
    for r in rows.values():
        if r.implemented:
            assert f"| {r.number} | {r.family} | {r.total} | {r.implemented} | {r.tested} | {r.shown} |" in page
            assert f"{r.implemented:>6} {r.tested:>6} {r.shown:>6}" in out.getvalue()
