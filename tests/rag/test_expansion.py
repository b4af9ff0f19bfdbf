"""Tests of llmbook.rag.expansion (chapter 30): Rocchio, the relevance model, RM3 and HyDE."""

import math

import numpy as np
import pytest
import torch

from llmbook.rag.expansion import (
    dense_prf,
    hyde,
    keep_top_terms,
    load_hypothetical_documents,
    relevance_model,
    rm3_interpolate,
    rm3_query,
    rocchio,
    term_counts,
    weighted_bm25,
)


def _rng(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------------------------- 30.01


def _rocchio_np(q, Dr, Dnr, alpha, beta, gamma):
    """Float64 closed form, coordinate by coordinate (written independently of the implementation)."""
    out = np.empty_like(q)
    for j in range(q.shape[0]):
        pos = sum(d[j] for d in Dr) / len(Dr) if len(Dr) else 0.0
        neg = sum(d[j] for d in Dnr) / len(Dnr) if len(Dnr) else 0.0
        out[j] = alpha * q[j] + beta * pos - gamma * neg
    return out


@pytest.mark.equation("30.01", oracle="numpy float64 closed form, coordinate loop; alpha=1, beta=gamma=0 is identity")
@pytest.mark.parametrize("R,S", [(1, 1), (4, 3), (5, 0), (0, 2)])
def test_rocchio_matches_closed_form(R, S):
    g = _rng(R * 10 + S)
    B, D = 3, 7
    q, Dr, Dnr = g.normal(size=(B, D)), g.normal(size=(B, R, D)), g.normal(size=(B, S, D))
    alpha, beta, gamma = 0.9, 0.6, 0.3
    got = rocchio(torch.tensor(q), torch.tensor(Dr), torch.tensor(Dnr), alpha=alpha, beta=beta, gamma=gamma)
    ref = np.stack([_rocchio_np(q[b], Dr[b], Dnr[b], alpha, beta, gamma) for b in range(B)])
    np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-12)
    # 1-D query with unbatched documents, no non-relevant set
    got1 = rocchio(torch.tensor(q[0]), torch.tensor(Dr[0]), alpha=alpha, beta=beta)
    np.testing.assert_allclose(got1.numpy(), _rocchio_np(q[0], Dr[0], [], alpha, beta, 0.0), rtol=0, atol=1e-12)


@pytest.mark.equation("30.01", oracle="special cases: alpha=1, beta=gamma=0 returns q bit for bit; clip is max(., 0)")
def test_rocchio_special_cases():
    g = torch.Generator().manual_seed(1)
    q, Dr, Dnr = torch.randn(4, 5, generator=g), torch.randn(4, 3, 5, generator=g), torch.randn(4, 2, 5, generator=g)
    assert torch.equal(rocchio(q, Dr, Dnr, alpha=1.0, beta=0.0, gamma=0.0), q)
    # beta alone moves q onto the relevant centroid direction: alpha = 0, beta = 1 is the centroid
    torch.testing.assert_close(rocchio(q, Dr, alpha=0.0, beta=1.0), Dr.mean(1), rtol=0, atol=1e-6)
    clipped = rocchio(q, Dr, Dnr, gamma=2.0, clip_negative=True)
    torch.testing.assert_close(clipped, rocchio(q, Dr, Dnr, gamma=2.0).clamp_min(0), rtol=0, atol=0)
    assert (clipped >= 0).all() and (clipped == 0).any()


def test_rocchio_errors():
    q = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same leading"):
        rocchio(q, torch.zeros(3, 1, 3))
    with pytest.raises(ValueError, match="disagree on D"):
        rocchio(q, torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match="beta must lie"):
        rocchio(q, torch.zeros(2, 1, 3), beta=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        rocchio(q, torch.full((2, 1, 3), float("nan")))


# ----------------------------------------------------------------------------------------------- 30.02, 30.03


def _relevance_model_loops(counts, weights):
    """P(w|R) by brute force: a Python float loop over the vocabulary and the documents."""
    k, V = counts.shape
    z = sum(weights)
    out = []
    for w in range(V):
        total = 0.0
        for d in range(k):
            total += counts[d][w] / sum(counts[d]) * weights[d] / z
        out.append(total)
    return out


@pytest.mark.equation("30.02", oracle="float64 brute-force loop over the vocabulary and documents; P(w|R) sums to 1")
def test_relevance_model_loops_and_simplex():
    g = _rng(2)
    counts = g.integers(0, 4, size=(6, 11)).astype(float)
    counts[:, 0] += 1  # every document has a term
    weights = g.uniform(0.1, 3.0, size=6)
    got = relevance_model(torch.tensor(counts), torch.tensor(weights))
    np.testing.assert_allclose(got.numpy(), _relevance_model_loops(counts, weights), rtol=0, atol=1e-14)
    assert abs(got.sum().item() - 1.0) < 1e-12 and (got >= 0).all()
    # batched: each query's feedback set separately
    C = torch.tensor(g.integers(1, 5, size=(3, 4, 9)).astype(float))
    W = torch.tensor(g.uniform(0.1, 1.0, size=(3, 4)))
    got_b = relevance_model(C, W)
    for b in range(3):
        np.testing.assert_allclose(got_b[b].numpy(), _relevance_model_loops(C[b].numpy(), W[b].numpy()), atol=1e-14)
    torch.testing.assert_close(got_b.sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-12)
    # one feedback document: the relevance model is that document's language model
    torch.testing.assert_close(relevance_model(C[0, :1], W[0, :1]), C[0, 0] / C[0, 0].sum(), rtol=0, atol=1e-15)


def test_relevance_model_errors():
    with pytest.raises(ValueError, match="non-zero row"):
        relevance_model(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="positive sum"):
        relevance_model(torch.tensor([[1.0, 0.0]]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="non-negative"):
        relevance_model(torch.tensor([[1.0, -1.0]]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="same k"):
        relevance_model(torch.ones(2, 3), torch.ones(3))


@pytest.mark.equation("30.03", oracle="float64 loop over the vocabulary; the interpolation stays on the simplex")
def test_rm3_interpolate_loops_and_simplex():
    g = _rng(3)
    Pq, PR = g.dirichlet(np.ones(13), size=4), g.dirichlet(np.ones(13) * 0.3, size=4)
    for lam in (0.0, 0.3, 0.5, 1.0):
        got = rm3_interpolate(torch.tensor(Pq), torch.tensor(PR), lam=lam).numpy()
        ref = [[lam * Pq[b, w] + (1 - lam) * PR[b, w] for w in range(13)] for b in range(4)]
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-15)
        np.testing.assert_allclose(got.sum(-1), 1.0, rtol=0, atol=1e-12)
        assert (got >= 0).all()
    assert np.array_equal(rm3_interpolate(torch.tensor(Pq), torch.tensor(PR), lam=1.0).numpy(), Pq)
    with pytest.raises(ValueError, match="sum to 1"):
        rm3_interpolate(torch.tensor([0.5, 0.6]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="lam must lie"):
        rm3_interpolate(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]), lam=1.5)


def test_keep_top_terms_and_term_counts():
    P = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    kept = keep_top_terms(P, 2)
    torch.testing.assert_close(kept, torch.tensor([[0, 4 / 7, 0, 3 / 7], [0.5, 0.5, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(keep_top_terms(P, 10), P)
    assert term_counts([["a", "a", "z"], []], ["a", "b"]).tolist() == [[2.0, 0.0], [0.0, 0.0]]


def test_rm3_query_brute_force():
    """The RM3 recipe on term lists against a dictionary-based brute force (Anserini's order of steps)."""
    query = ["rope", "position"]
    fb = [["rope", "rotation", "rotation", "angle"], ["position", "rope", "relative"], ["angle", "rotation"]]
    w = [2.0, 1.0, 0.5]
    fb_terms, lam = 3, 0.6
    vocab = sorted({t for d in fb for t in d} | set(query))
    PR = {t: sum(d.count(t) / len(d) * wi / sum(w) for d, wi in zip(fb, w, strict=True)) for t in vocab}
    top = sorted(vocab, key=lambda t: (-PR[t], t))[:fb_terms]  # ties: alphabetical = lower index
    z = sum(PR[t] for t in top)
    ref = {t: lam * query.count(t) / len(query) + (1 - lam) * (PR[t] / z if t in top else 0.0) for t in vocab}
    got = rm3_query(query, fb, torch.tensor(w, dtype=torch.float64), fb_terms=fb_terms, lam=lam)
    assert set(got) == {t for t, v in ref.items() if v > 0}
    for t, v in got.items():
        assert abs(v - ref[t]) < 1e-12
    assert abs(sum(got.values()) - 1) < 1e-12
    # min_len: short feedback terms leave the relevance model, the query's own terms stay
    short = rm3_query(["a", "rope"], [["a", "b", "rope", "rotation"], ["b", "angle"]], torch.tensor([1.0, 1.0]),
                      fb_terms=5, lam=0.5, min_len=2)
    assert set(short) == {"a", "rope", "rotation", "angle"} and abs(short["a"] - 0.25) < 1e-12
    assert abs(short["angle"] - 0.5 * 0.5) < 1e-12  # P(angle | R) = 0.5 * 1 (doc 2 keeps only "angle")
    # exclude: named feedback terms leave too (Anserini's df filter), the query's own terms stay
    ex = rm3_query(["rope"], [["rope", "the", "rotation"], ["the", "angle"]], torch.tensor([1.0, 1.0]),
                   fb_terms=5, lam=0.5, exclude={"the", "rope"})
    assert ex == {"rope": 0.5, "rotation": 0.25, "angle": 0.25}


def test_weighted_bm25_brute_force():
    """Weighted BM25 against Okapi BM25 written out term by term (Lucene idf, k1 = 1.2, b = 0.75)."""
    docs = [["cat", "sat", "mat"], ["dog", "sat"], ["cat", "cat", "dog", "log"], ["bird"]]
    queries = [{"cat": 0.7, "dog": 0.3}, {"sat": 1.0}, {"fish": 1.0}]
    N, avgdl, k1, b = len(docs), sum(map(len, docs)) / len(docs), 1.2, 0.75

    def bm25(t, d):
        df = sum(t in x for x in docs)
        tf = d.count(t)
        if tf == 0:
            return 0.0
        idf = math.log(1 + (N - df + 0.5) / (df + 0.5))
        return idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len(d) / avgdl))

    ref = [[sum(w * bm25(t, d) for t, w in q.items()) for d in docs] for q in queries]
    np.testing.assert_allclose(weighted_bm25(queries, docs).numpy(), ref, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------- 30.04


@pytest.mark.equation("30.04", oracle="sklearn.metrics.pairwise.cosine_similarity of the mean vector; numpy argmax")
def test_hyde_against_sklearn():
    from sklearn.metrics.pairwise import cosine_similarity as sk_cos

    g = _rng(4)
    B, M, N, D = 5, 3, 40, 16
    h, docs, q = g.normal(size=(B, M, D)), g.normal(size=(N, D)), g.normal(size=(B, D))
    for with_q in (False, True):
        r = hyde(torch.tensor(h), torch.tensor(docs), q=torch.tensor(q) if with_q else None)
        v = (h.sum(1) + (q if with_q else 0)) / (M + with_q)
        np.testing.assert_allclose(r.v.numpy(), v, rtol=0, atol=1e-14)
        ref = sk_cos(v, docs)
        np.testing.assert_allclose(r.scores.numpy(), ref, rtol=0, atol=1e-12)
        assert r.best.tolist() == ref.argmax(1).tolist()
    # M = 1 as (B, D)
    r1 = hyde(torch.tensor(h[:, 0]), torch.tensor(docs))
    assert r1.best.tolist() == sk_cos(h[:, 0], docs).argmax(1).tolist()
    with pytest.raises(ValueError, match="at least one document"):
        hyde(torch.tensor(h), torch.zeros(0, D, dtype=torch.float64))


@pytest.mark.equation("30.04", oracle="brute-force argmax of dot products of unit vectors on the book's MiniLM cache")
def test_hyde_on_the_book_cache(monkeypatch):
    from llmbook.rag import encoder, pipeline

    d = pipeline.book_data()
    docs = load_hypothetical_documents()
    # one hypothetical document for each question about Part I (q01-q56); the later questions have none
    part_one = [q.id for q in d.queries if int(q.id[1:]) <= 56]
    assert len(docs) == len(part_one) == 56 and set(docs) == set(part_one)
    monkeypatch.setattr(encoder, "_run_model", lambda texts: pytest.fail(f"{len(texts)} texts are not cached"))
    h = encoder.encode([docs[i] for i in part_one]).double()
    r = hyde(h, d.doc_emb.double())
    G = d.doc_emb.double().numpy()
    Hn = h.numpy() / np.linalg.norm(h.numpy(), axis=1, keepdims=True)
    best = [max(range(len(G)), key=lambda j, i=i: float(Hn[i] @ G[j])) for i in range(len(Hn))]
    assert r.best.tolist() == best


def test_hypothetical_documents_do_not_copy_the_book():
    """The stand-ins for an LLM's answers must not quote the passages HyDE is scored on (that would flatter it):
    no hypothetical document shares a run of 8 or more consecutive words with any passage of the corpus."""
    import re

    from llmbook.rag import encoder, pipeline

    def words(text):
        return re.findall(r"[a-z0-9]+", text.lower())

    n = 8
    grams = set()
    for p in pipeline.book_data().passages:
        w = words(encoder.passage_text(p))
        grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    copied = {qid: " ".join(w[i:i + n]) for qid, doc in load_hypothetical_documents().items()
              for w in [words(doc)] for i in range(len(w) - n + 1) if tuple(w[i:i + n]) in grams}
    assert not copied, f"hypothetical documents repeat the book's wording: {copied}"
    # the check can fire: a sentence of a passage, planted in a document, is caught
    planted = words(encoder.passage_text(pipeline.book_data().passages[0]))[:n]
    assert tuple(planted) in grams

def test_dense_prf_is_rocchio_on_top_k():
    g = torch.Generator().manual_seed(5)
    q, docs = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.randn(20, 8, generator=g, dtype=torch.float64)
    scores = q @ docs.T
    got = dense_prf(q, docs, scores, k=4, alpha=1.0, beta=0.5)
    for i in range(3):
        top = np.argsort(-scores[i].numpy(), kind="stable")[:4]
        ref = q[i].numpy() + 0.5 * docs.numpy()[top].mean(0)
        np.testing.assert_allclose(got[i].numpy(), ref / np.linalg.norm(ref), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the Try-it solutions of book/30-query-expansion.ipynb state."""
    from tests.try_it import assert_states

    # 1: beta that turns q = (1, 0) by 60 degrees toward the centroid (0, 2)
    beta = math.tan(math.radians(60)) / 2
    qn = rocchio(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([[0.0, 1.0], [0.0, 3.0]],
                 dtype=torch.float64), beta=beta, gamma=0.0)
    assert abs(math.degrees(math.atan2(qn[1].item(), qn[0].item())) - 60) < 1e-9
    # 2: RM3 weights and the lambda below which the feedback word outweighs the query word
    PR = relevance_model(torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64),
                         torch.tensor([0.75, 0.25], dtype=torch.float64))
    Pq = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    assert rm3_interpolate(Pq, PR, 0.5).tolist() == [0.6875, 0.25, 0.0625]
    lam_star = 0.125 / 1.125
    above, below = rm3_interpolate(Pq, PR, lam_star + 1e-9), rm3_interpolate(Pq, PR, lam_star - 1e-9)
    assert above[0] > above[1] and below[0] < below[1]
    # 3: eight identical hypothetical documents orthogonal to the query: cos(v, q) = 1 / sqrt(65)
    h = torch.tensor([[[0.0, 1.0]] * 8], dtype=torch.float64)
    r = hyde(h, torch.tensor([[1.0, 0.0]], dtype=torch.float64), q=torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    assert abs(r.scores.item() - 1 / math.sqrt(65)) < 1e-12
    assert_states("30-query-expansion.ipynb", [f"{beta:.4f}", "0.6875", "0.25", "0.0625", f"{lam_star:.4f}",
                                               f"{1 / math.sqrt(65):.4f}"])
