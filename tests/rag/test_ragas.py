"""Chapter 29, RAGAS-style metrics (llmbook/rag/ragas.py).

Oracles: sklearn.metrics.precision_score (context precision as the precision of "retrieved" against
"relevant"; faithfulness as the precision of "claimed" against "supported"; attribution precision as the
precision of "cited" against "citation supports"), sklearn.metrics.recall_score (context recall), float64
brute-force counts in plain Python over the labelled set, torch.nn.functional.cosine_similarity.
Relations with chapter 26 (llmbook.rag.metrics) are checked on the book's 56 labelled queries.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import precision_score, recall_score

from llmbook.rag import encoder, pipeline, ragas, sparse
from llmbook.rag import metrics as M
from llmbook.rag.corpus import load_queries


def _verdicts(seed, B=6, K=10):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, K, generator=g) < 0.4).long()


@pytest.mark.equation("29.03", oracle="sklearn.metrics.precision_score over the top k; brute-force rank-weighted sum")
def test_context_precision_sklearn_and_brute_force():
    for seed in range(5):
        v = _verdicts(seed)
        for k in (1, 3, 10):
            ours = ragas.context_precision(v, k=k)
            ref = [precision_score(row[:k].numpy(), [1] * k, zero_division=0) for row in v]
            torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=0)
            w = ragas.context_precision(v, k=k, weighted=True)
            for b, row in enumerate(v.tolist()):
                top = row[:k]
                num = sum(sum(top[:i + 1]) / (i + 1) * top[i] for i in range(k))
                assert w[b].item() == pytest.approx(num / sum(top) if sum(top) else 0.0, abs=1e-12)
    # k beyond the list: the empty slots are misses
    assert ragas.context_precision(torch.tensor([1, 1]), k=4).item() == 0.5


def _book_runs():
    d = pipeline.book_data()
    return d, {"BM25": sparse.bm25_scores(d.query_terms, d.doc_terms), "dense": pipeline.dense_scores(d)}


def test_context_metrics_on_the_book_are_chapter_26s():
    """Relation: with verdicts = labels of the top k, CP@k = P@k and CR (facts = relevant passages) = recall@k."""
    d, runs = _book_runs()
    rel = (d.labels > 0).long()
    for S in runs.values():
        order = S.argsort(dim=1, descending=True, stable=True)
        for k in (1, 5, 10):
            v = rel.gather(1, order[:, :k])
            torch.testing.assert_close(ragas.context_precision(v, k=k), M.precision_at_k(S, d.labels, k),
                                       atol=1e-12, rtol=0)
            covered = torch.zeros_like(rel).scatter(1, order[:, :k], 1) * rel
            torch.testing.assert_close(ragas.context_recall(covered, mask=rel), M.recall_at_k(S, d.labels, k),
                                       atol=1e-12, rtol=0)


@pytest.mark.equation("29.04", oracle="sklearn.metrics.recall_score(fact exists, covered); brute-force counts")
def test_context_recall_brute_force():
    covered, mask = _verdicts(1), _verdicts(2)
    ours = ragas.context_recall(covered, mask)
    ref = [recall_score(m.numpy(), c.numpy(), zero_division=0) for c, m in zip(covered, mask, strict=True)]
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float64), atol=1e-12, rtol=0)
    for b in range(covered.shape[0]):
        n = sum(mask[b].tolist())
        hit = sum(c * m for c, m in zip(covered[b].tolist(), mask[b].tolist(), strict=True))
        assert ours[b].item() == pytest.approx(hit / n if n else 0.0, abs=1e-15)
    assert ragas.context_recall(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)).item() == 0.0


def _labelled():
    d = pipeline.book_data()
    items = ragas.load_answers()
    C = max(len(it.claims) for it in items)
    sup = torch.zeros(len(items), C, dtype=torch.long)
    cited, ok, mask = sup.clone(), sup.clone(), sup.clone()
    for b, it in enumerate(items):
        for c, cl in enumerate(it.claims):
            mask[b, c], sup[b, c], cited[b, c], ok[b, c] = 1, int(cl.supported), int(bool(cl.cite)), int(cl.citation_ok)
    return d, items, sup, cited, ok, mask


@pytest.mark.equation("29.05", oracle="sklearn.metrics.precision_score(supported, all claimed); brute-force counts")
def test_faithfulness_on_the_labelled_set():
    _, items, sup, _, _, mask = _labelled()
    ours = ragas.faithfulness(sup, mask)
    for b, it in enumerate(items):
        n = len(it.claims)
        assert ours[b].item() == pytest.approx(precision_score(sup[b, :n].numpy(), [1] * n), abs=1e-15)
        assert ours[b].item() == pytest.approx(sum(c.supported for c in it.claims) / n, abs=1e-15)
    # ragged slots: padding outside the mask never counts
    g = torch.Generator().manual_seed(3)
    sup_r, mask_r = (torch.rand(6, 5, generator=g) < 0.6).long(), (torch.rand(6, 5, generator=g) < 0.7).long()
    ref = [precision_score(s_[m_ > 0].numpy(), [1] * int(m_.sum()), zero_division=0) if m_.sum() else 0.0
           for s_, m_ in zip(sup_r, mask_r, strict=True)]
    torch.testing.assert_close(ragas.faithfulness(sup_r, mask_r), torch.tensor(ref, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    assert 0 < ours.mean().item() < 1  # the set mixes supported and unsupported claims on purpose


@pytest.mark.equation("29.06", oracle="torch.nn.functional.cosine_similarity in float64")
def test_answer_relevance_against_cosine_similarity():
    g = torch.Generator().manual_seed(0)
    e_q = torch.randn(4, 8, generator=g, dtype=torch.float64)
    e_gen = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    ref = F.cosine_similarity(e_gen, e_q[:, None], dim=-1).mean(-1)
    torch.testing.assert_close(ragas.answer_relevance(e_q * 5, e_gen), ref, atol=1e-12, rtol=0)
    mask = torch.tensor([[1, 1, 0]] * 4)
    torch.testing.assert_close(ragas.answer_relevance(e_q, e_gen, mask),
                               F.cosine_similarity(e_gen[:, :2], e_q[:, None], dim=-1).mean(-1), atol=1e-12, rtol=0)
    # on the labelled set with the cached MiniLM embeddings
    d, items, *_ = _labelled()
    qtext = {q.id: q.text for q in load_queries()}
    E_q = encoder.encode([qtext[it.query] for it in items]).double()
    E_g = torch.stack([encoder.encode(list(it.questions)) for it in items]).double()
    torch.testing.assert_close(ragas.answer_relevance(E_q, E_g),
                               F.cosine_similarity(E_g, E_q[:, None], dim=-1).mean(-1), atol=1e-12, rtol=0)


@pytest.mark.equation("29.07", oracle="sklearn.metrics.precision_score(citation supports, cited)")
def test_attribution_precision_sklearn():
    _, items, _, cited, ok, mask = _labelled()
    ours = ragas.attribution_precision(cited, ok)
    for b in range(len(items)):
        n = int(mask[b].sum())
        ref = precision_score(ok[b, :n].numpy(), cited[b, :n].numpy(), zero_division=0)
        assert ours[b].item() == pytest.approx(ref, abs=1e-15)
    pooled = precision_score(ok[mask > 0].numpy(), cited[mask > 0].numpy())
    assert (cited * ok).sum().item() / cited.sum().item() == pytest.approx(pooled, abs=1e-15)
    assert pooled < 1  # a wrong citation (q26) and cited unsupported claims


def test_labelled_set_is_consistent_and_cached():
    d = pipeline.book_data()
    ids = {p.id for p in d.passages}
    qids = {q.id for q in d.queries}
    items = ragas.load_answers()
    assert 8 <= len(items) <= 12
    for it in items:
        assert it.query in qids and set(it.context) <= ids
        assert 2 <= len(it.claims) <= 4 and len(it.questions) == 3
        for c in it.claims:
            assert set(c.support) <= set(it.context) and (not c.cite or c.cite in ids)
    assert any(not c.supported for it in items for c in it.claims)
    cache = encoder._load_cache()
    missing = [t for t in ragas.judge_texts(items, d.passages) if encoder._key(t) not in cache]
    assert not missing, f"run python -m llmbook corpus: {len(missing)} texts not cached, e.g. {missing[:1]}"


def test_proxy_judge_and_splitter():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    s = torch.tensor([[1.0, 0.1], [0.6, 0.8]])
    v, best = ragas.proxy_judge(a, s, 0.9)
    ref = F.cosine_similarity(a[:, None].double(), s[None].double(), dim=-1).amax(-1)
    torch.testing.assert_close(best, ref, atol=1e-12, rtol=0)
    assert v.tolist() == [1, 0]
    assert ragas.split_sentences("One sentence about RoPE. Another one about ALiBi!") == [
        "One sentence about RoPE.", "Another one about ALiBi!"]


def test_errors():
    with pytest.raises(TypeError, match="long"):
        ragas.faithfulness(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="0 or 1"):
        ragas.context_recall(torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="same shape"):
        ragas.faithfulness(torch.ones(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="at least one"):
        ragas.context_precision(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="must match"):
        ragas.answer_relevance(torch.ones(2, 3), torch.ones(2, 2, 4))


NB = "29-rag-objectives.ipynb"


def test_try_it_numbers():
    from llmbook.rag import rag_objectives as ro
    from tests.try_it import assert_states

    v = torch.tensor([1, 0, 1, 0, 1])
    plain, weighted = ragas.context_precision(v, k=5).item(), ragas.context_precision(v, k=5, weighted=True).item()
    swapped = ragas.context_precision(torch.tensor([0, 1, 1, 0, 1]), k=5, weighted=True).item()
    assert plain == pytest.approx(0.6, abs=1e-12)
    stated = [f"3/5 = {plain:.1f}", f"{weighted:.4f}", f"{swapped:.4f}"]

    lp = torch.log(torch.tensor([[[0.9, 0.01], [0.01, 0.9]]], dtype=torch.float64))
    s = torch.zeros(1, 2, dtype=torch.float64)
    seq, tok = ro.rag_sequence_log_likelihood(s, lp).exp().item(), ro.rag_token_log_likelihood(s, lp).exp().item()
    stated += [f"= {seq:.3f}", f"^2 = {tok:.3f}", f"factor of {round(tok / seq)}", f"{math.sqrt(tok):.3f}"]

    _, items, sup, cited, ok, mask = _labelled()
    f_all = ragas.faithfulness(sup, mask=sup)
    assert (f_all == 1).all()
    attr = ragas.attribution_precision(cited * sup, ok).mean().item()
    stated += [f"(mean {f_all.mean().item():.3f})", f"becomes {attr:.3f} on average"]
    per_item = ragas.attribution_precision(cited * sup, ok).tolist()
    below = [it.query for it, a in zip(items, per_item, strict=True) if a < 1]
    assert below == ["q26"]
    assert_states(NB, stated)
    # the prose counts of the labelled set
    assert int(mask.sum()) == 25
    assert_states(NB, ["all 25 claims"], section="all")
