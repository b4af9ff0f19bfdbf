"""The book's prose as a retrieval corpus (llmbook.rag.corpus) and its labelled queries.

Oracles: the notebooks' own JSON read with a plain regex (every MyST target becomes a section),
docutils' ``make_id`` (the web anchors Sphinx writes), a regeneration from ``book/`` (the shipped
snapshot), and an independent token-overlap ranking (the judgements are not random).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from llmbook import chapters
from llmbook.cli import main
from llmbook.rag import corpus as C

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def passages():
    return C.load_corpus()


@pytest.fixture(scope="module")
def rebuilt():
    return C.build_corpus(ROOT)


@pytest.fixture(scope="module")
def queries():
    return C.load_queries()


def test_snapshot_equals_regeneration_from_book(passages, rebuilt):
    stale = sorted({p.id for p in set(rebuilt) ^ set(passages)})[:5]
    assert passages == rebuilt, (
        f"llmbook/data/book_corpus.jsonl is stale ({len(passages)} passages stored, {len(rebuilt)} in book/; "
        f"first differences: {stale}): a chapter's prose changed. Run `python -m llmbook corpus` and commit the file.")


def test_cli_writes_the_snapshot(tmp_path, capsys, rebuilt):
    out = tmp_path / "corpus.jsonl"
    assert main(["corpus", "--root", str(ROOT), "--out", str(out)]) == 0
    assert f"wrote {len(rebuilt)} passages" in capsys.readouterr().out
    assert C.load_corpus(out) == rebuilt


def test_every_target_of_every_written_chapter_is_a_section(rebuilt):
    passages = rebuilt  # the code's behaviour on the notebooks as they are (staleness is the test above)
    for ch in chapters.CHAPTERS.values():
        if not ch.written:
            continue
        cells = json.loads((ROOT / ch.notebook).read_text(encoding="utf-8"))["cells"]
        md = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        targets = set(re.findall(r"^\((sec-[\w-]+)\)=\s*$", md, re.M))
        got = {p.section for p in passages if p.chapter == ch.number} - {None}
        assert got == targets, f"chapter {ch.number}: sections {sorted(got ^ targets)} differ from the notebook"
        assert all(p.url.startswith(f"book/{Path(ch.notebook).stem}.html") for p in passages if p.chapter == ch.number)


def test_passages_are_well_formed_and_in_order(passages):
    assert len(passages) > 300
    assert len({p.id for p in passages}) == len(passages), "passage ids must be unique"
    assert [p.chapter for p in passages] == sorted(p.chapter for p in passages)
    for p in passages:
        stem, anchor = p.id.split("#")[0], p.id.split("#")[1].rpartition("/")[0]
        assert p.url == f"book/{stem}.html#{anchor}", p.id
        if p.section is not None:
            assert anchor == p.section, p.id
        assert p.text.strip() and p.heading.strip(), p.id
        # No MyST left over: targets, roles, equation labels, directive options or fences.
        for leftover in (r"^\([\w-]+\)=", r"\{[\w:]+\}`", r"\$\$\s*\(eq-", r"^:class:", r"^```", r"^#+ "):
            assert not re.search(leftover, p.text, re.M), (p.id, leftover)
    # Each passage but a block's first is at least MIN_CHARS long (shorter pieces join the one before).
    firsts = {p.id.rpartition("/")[0] + "/0" for p in passages}
    assert all(len(p.text) >= C.MIN_CHARS for p in passages if p.id not in firsts)


def test_latex_kept_as_written(passages):
    p = next(p for p in passages if p.section == "sec-09-04")
    assert r"S_p = \min\Big\{S : \sum_{i \in S} p_i \ge p\Big\}" in p.text
    assert "[holtzman2020]" in p.text and "{cite}" not in p.text


def test_heading_anchors_match_docutils(passages):
    make_id = pytest.importorskip("docutils.nodes").make_id
    untargeted = [p for p in passages if p.section is None]
    assert untargeted
    for p in untargeted:
        assert C.anchor_slug(p.heading) == make_id(p.heading), p.heading
        assert p.id.split("#")[1].startswith(make_id(p.heading)), p.id


@pytest.mark.parametrize("md, text", [
    ("{ref}`chapter 8\n<sec-08-training>` and {eq}`eq-softmax`", "chapter 8 and (eq-softmax)"),
    ("{func}`~llmbook.lm.ssm.selective_scan` or {py:mod}`llmbook.lm.memory`", "selective_scan or llmbook.lm.memory"),
    ("see the [notation page](notation.md) and *this*", "see the notation page and this"),
    ("$a * b * c$ and `**kwargs` stay; **bold** goes", "$a * b * c$ and **kwargs stay; bold goes"),
    ("```{admonition} Solution\n:class: dropdown\nIt is $2$.\n```", "Solution:\nIt is $2$."),
    ("```bash\n# a comment\ntorchrun x.py\n```", "# a comment\ntorchrun x.py"),
    ("### Sub heading\n<!-- hidden -->\ntext", "Sub heading\n\ntext"),
])
def test_plain_text(md, text):
    assert C.plain_text(md) == text


def test_a_code_comment_in_a_fence_starts_no_block(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": "# 1. T\n\nIntro.\n\n```bash\n# not a heading\nx\n```"},
                    {"cell_type": "code", "source": "ignored = 1"},
                    {"cell_type": "markdown", "source": ["(sec-01-01)=\n", "## A (01.01)\n", "\n", "Body."]}]}
    path = tmp_path / "01-t.ipynb"
    path.write_text(json.dumps(nb))
    got = C.notebook_passages(path, 1)
    assert [(p.id, p.section, p.heading) for p in got] == [("01-t#t/0", None, "1. T"),
                                                           ("01-t#sec-01-01/0", "sec-01-01", "A (01.01)")]
    assert got[0].text == "Intro.\n\n# not a heading\nx" and got[1].text == "Body."
    assert got[1].url == "book/01-t.html#sec-01-01"


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        C.notebook_passages(tmp_path / "missing.ipynb", 3)
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a notebook"):
        C.notebook_passages(bad, 3)
    with pytest.raises(FileNotFoundError, match="has no book/ folder"):
        C.build_corpus(tmp_path)
    with pytest.raises(TypeError, match="markdown must be a str"):
        C.plain_text(None)
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(ValueError, match="line 1 is not a passage"):
        C.load_corpus(bad)


@pytest.mark.parametrize("row, match", [
    ("q1\tplain\tdev\twhat?", "expected 6 tab-separated columns"),
    ("q1\tplain\tdev\twhat?\tsec-01-01:3\t", "is not 'section:grade'"),
    ("q1\tplain\tdev\twhat?\tsec-01-01:1\t", "at least one section of grade 2"),
    ("q1\tvague\tdev\twhat?\tsec-01-01:2\t", "a kind in plain/paraphrase/exact"),
    ("q1\tplain\ttrain\twhat?\tsec-01-01:2\t", "split must be 'dev' or 'test'"),
    ("q1\tplain\tdev\twhat?\tsec-01-01:2\tsec-01-01", "judged both relevant and not"),
    ("q1\tplain\tdev\twhat?\tsec-01-01:2\t\nq1\tplain\ttest\tagain?\tsec-01-02:2\t", "needs a new id"),
])
def test_query_file_errors(tmp_path, row, match):
    path = tmp_path / "q.tsv"
    path.write_text("# comment\nid\tkind\tsplit\tquery\trelevant\tnonrelevant\n" + row + "\n")
    with pytest.raises(ValueError, match=match):
        C.load_queries(path)
    with pytest.raises(ValueError, match="split must be None"):
        C.load_queries(split="train")


def test_qrels_names_unknown_sections(passages):
    with pytest.raises(ValueError, match=r"no passage in the corpus: \['sec-99-01'\]"):
        C.qrels([C.Query("q", "x", "plain", {"sec-99-01": 2})], passages)


def test_queries_cover_every_chapter(queries, passages):
    assert 90 <= len(queries) <= 120
    kinds = Counter(q.kind for q in queries)
    assert kinds["paraphrase"] >= 10 and kinds["exact"] >= 10, kinds
    judged = C.qrels(queries, passages)  # raises if a judged section has no passage
    chapter_of = {p.id: p.chapter for p in passages}
    answered = Counter()
    for q in queries:
        assert judged[q.id], q.id
        answered.update({chapter_of[pid] for pid, g in judged[q.id].items() if g == 2})
    missing = set(range(1, 44)) - set(answered)
    assert len(missing) <= 3, f"chapters with no answering query: {missing}"
    assert max(answered.values()) <= 8, answered  # evenly: no chapter dominates


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def test_no_query_is_quoted_by_the_corpus(queries, passages):
    """A question the book's prose quotes would retrieve its own quotation: no 6 consecutive words of a query may
    occur in a passage, and a plain or paraphrase query shorter than 6 words may not occur whole. (An exact-term
    query, "C = 6ND", is a term the answering section has to contain.)"""
    def grams(ws, n):
        return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}

    texts = [_words(f"{p.heading} {p.text}") for p in passages]
    by_n: dict[int, dict[tuple, set]] = {}  # n -> {n-gram: passages holding it}, built once per n
    quoted = []
    for q in queries:
        w = _words(q.text)
        n = 6 if len(w) >= 6 else (len(w) if q.kind != "exact" else None)
        if n is None:
            continue
        if n not in by_n:
            by_n[n] = {}
            for p, t in zip(passages, texts, strict=True):
                for g in grams(t, n):
                    by_n[n].setdefault(g, set()).add(p.id)
        quoted += [(q.id, pid) for g in grams(w, n) for pid in sorted(by_n[n].get(g, ()))]
    assert not quoted, f"queries quoted by passages: {quoted}"
    # the check finds a quotation when there is one
    fake = C.Query("x", " ".join(texts[5][3:10]), "plain", {})
    g7 = grams(_words(fake.text), 6)
    assert any(g7 & grams(t, 6) for t in texts)


# ---- sanity: an independent, trivial ranking finds the judged passages --------------------------------

_STOP = set("a an the of to in on and or is are be by for with what why how does do did which that this it its as at "
            "from into than when who whose after before over does not can".split())


def _tokens(s: str) -> list[str]:
    return [t for t in re.findall(r"[a-z0-9]+", s.lower()) if t not in _STOP]


def _overlap_hits(queries, passages, judged, k=10):
    """Queries with a relevant passage in the top k of an idf-weighted token-overlap ranking."""
    docs = [set(_tokens(p.full_text)) for p in passages]
    df = Counter(t for d in docs for t in d)
    idf = {t: math.log(len(docs) / n) for t, n in df.items()}
    hits = 0
    for q in queries:
        terms = set(_tokens(q.text))
        scores = [sum(idf[t] for t in terms & d) for d in docs]
        top = sorted(range(len(docs)), key=lambda i: (-scores[i], i))[:k]
        hits += any(passages[i].id in judged[q.id] for i in top)
    return hits


def test_token_overlap_baseline_finds_judged_passages(queries, passages):
    judged = C.qrels(queries, passages)
    hits = _overlap_hits(queries, passages, judged)
    print(f"token overlap: a judged passage in the top 10 for {hits} of {len(queries)} queries")
    assert hits >= 0.7 * len(queries), hits
    # Control: the same ranking against judgements shuffled between queries finds far fewer.
    rng = random.Random(0)
    shuffled = list(judged.values())
    rng.shuffle(shuffled)
    control = _overlap_hits(queries, passages, dict(zip(judged, shuffled, strict=True)))
    print(f"control with shuffled judgements: {control} of {len(queries)}")
    assert control <= 0.3 * len(queries), control
