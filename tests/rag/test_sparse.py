"""Chapter 21 sparse retrieval against rank-bm25, bm25s, scikit-learn and float64 closed forms.

Idf variants and flooring of the oracles (read from their sources, rank-bm25 0.2.2 and bm25s 0.3.16):

* rank-bm25 ``BM25Okapi``: RSJ idf ``log((N - df + 0.5)/(df + 0.5))``; a NEGATIVE weight becomes
  ``epsilon * mean(RSJ idf over the whole vocabulary)`` (our ``idf_kind="rsj_floor"``); tf part
  ``tf (k1 + 1)/(tf + k1 (1 - b + b |d|/avgdl))``: identical to ours -> 1e-12.
* rank-bm25 ``BM25Plus``: idf ``log((N + 1)/df)``; adds ``delta * idf`` for EVERY query term, present
  in d or not (so it ranks exactly like Okapi BM25 with that idf); ours adds it only for present terms
  (Lv and Zhai) -> equal after adding ``delta * idf`` of the absent terms, 1e-12.
* rank-bm25 ``BM25L``: idf ``log((N + 1)/(df + 0.5))``; multiplies each term's contribution by an
  extra ``tf`` -> equal where every tf is 0 or 1 (documents of distinct terms), 1e-12.
* bm25s ``method="lucene"`` (its default): idf ``log(1 + (N - df + 0.5)/(df + 0.5))`` and tf part
  WITHOUT the ``(k1 + 1)`` factor (rank-equivalent) -> ours / (k1 + 1); ``"robertson"``: RSJ idf with the
  ratio floored at 1 (negative weights -> 0, our ``"rsj_clip"``); ``"atire"``: ``log(N/df)`` and the
  ``(k1 + 1)`` factor; ``"bm25l"``/``"bm25+"``: as ours plus, for every query term ABSENT from d, its
  ``idf * tfc(0)`` (the formula at tf = 0: ``delta`` for BM25+, ``(k1 + 1) delta/(k1 + delta)`` for BM25L).
  For BM25+ that makes bm25s a per-query constant away from Okapi BM25 (same ranking); for BM25L the
  added amount depends on d, so bm25s's BM25L ranks differently from Lv and Zhai's. bm25s defaults:
  ``k1=1.5, b=0.75, delta=0.5, method="lucene"``, float32; it runs in float64 here
  (``dtype="float64"``) -> 1e-10.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from llmbook.rag import sparse

WORDS = [f"w{i}" for i in range(30)]


def _collection(seed: int, N: int = 25, B: int = 6, distinct: bool = False):
    rng = random.Random(seed)
    docs = []
    for _ in range(N):
        L = rng.randint(1, 20)
        docs.append(rng.sample(WORDS, L) if distinct else [rng.choice(WORDS[: rng.randint(3, 30)]) for _ in range(L)])
    queries = [[rng.choice(WORDS) for _ in range(rng.randint(1, 5))] for _ in range(B)]
    queries.append(["unseen", WORDS[0]])
    return queries, docs


@pytest.mark.equation("21.06", oracle="rank_bm25.BM25Okapi (RSJ idf, epsilon floor)")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("k1", "b"), [(1.2, 0.75), (1.5, 0.75), (0.5, 0.0), (2.0, 1.0)])
def test_bm25_okapi_matches_rank_bm25(seed, k1, b):
    from rank_bm25 import BM25Okapi

    queries, docs = _collection(seed)
    ref = BM25Okapi(docs, k1=k1, b=b, epsilon=0.25)
    expected = np.stack([ref.get_scores(q) for q in queries])
    got = sparse.bm25_scores(queries, docs, k1=k1, b=b, idf_kind="rsj_floor", epsilon=0.25)
    assert got.dtype == torch.float64 and got.shape == (len(queries), len(docs))
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.equation("21.06", oracle="rank_bm25.BM25Okapi on the book's corpus")
def test_bm25_on_book_matches_rank_bm25_and_is_fast():
    import time

    from rank_bm25 import BM25Okapi

    from llmbook.rag import pipeline

    d = pipeline.book_data()
    t = time.perf_counter()
    got = sparse.bm25_scores(d.query_terms, d.doc_terms, idf_kind="rsj_floor")
    assert time.perf_counter() - t < 2.0  # well under a second on an idle machine
    ref = BM25Okapi([list(x) for x in d.doc_terms], k1=1.2, b=0.75)
    expected = np.stack([ref.get_scores(list(q)) for q in d.query_terms])
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-11)


def _py_bm25(q, docs, k1, b, w, variant="okapi", delta=0.0):
    """Plain-Python float64 BM25 over one query: a loop over query terms and documents."""
    avgdl = sum(len(d) for d in docs) / len(docs)
    out = []
    for d in docs:
        s = 0.0
        for t in q:
            tf = d.count(t)
            if tf == 0:
                continue
            norm = 1 - b + b * len(d) / avgdl
            if variant == "l":
                c = tf / norm
                s += w(t) * (k1 + 1) * (c + delta) / (k1 + c + delta)
            else:
                s += w(t) * (tf * (k1 + 1) / (tf + k1 * norm) + (delta if variant == "plus" else 0.0))
        out.append(s)
    return out


@pytest.mark.equation("21.01", oracle="collections-free Python list.count")
@pytest.mark.parametrize("seed", range(3))
def test_term_stats_counts(seed):
    queries, docs = _collection(seed)
    s = sparse.term_stats(queries, docs)
    for j, t in enumerate(s.vocabulary):
        for n, d in enumerate(docs):
            assert s.counts[n, j].item() == d.count(t)
        assert s.df[j].item() == sum(t in d for d in docs)
        for i, q in enumerate(queries):
            assert s.query_counts[i, j].item() == q.count(t)
    assert s.doc_len.tolist() == [len(d) for d in docs]
    assert sorted(s.all_df.tolist()) == sorted(sum(t in d for d in docs) for t in {t for d in docs for t in d})


@pytest.mark.equation("21.03", oracle="math.log closed form")
@pytest.mark.equation("21.04", oracle="math.log closed form (Robertson-Sparck Jones)")
def test_idf_closed_forms():
    N = 10
    df = torch.arange(1, N + 1, dtype=torch.float64)
    forms = {
        "log": lambda n: math.log(N / n),
        "rsj": lambda n: math.log((N - n + 0.5) / (n + 0.5)),
        "lucene": lambda n: math.log(1 + (N - n + 0.5) / (n + 0.5)),
        "bm25l": lambda n: math.log((N + 1) / (n + 0.5)),
        "bm25plus": lambda n: math.log((N + 1) / n),
        "sklearn": lambda n: math.log(N / n) + 1,
        "sklearn_smooth": lambda n: math.log((N + 1) / (n + 1)) + 1,
    }
    for kind, f in forms.items():
        got = sparse.idf(df, N, kind=kind)
        np.testing.assert_allclose(got.numpy(), [f(n) for n in range(1, N + 1)], rtol=1e-15, atol=1e-15)
    assert (sparse.idf(df, N, kind="rsj")[df > N / 2] < 0).all()  # RSJ goes negative past half the docs
    with pytest.raises(ValueError, match="df must lie in"):
        sparse.idf(torch.tensor([11.0]), N)


@pytest.mark.equation("21.06", oracle="plain-Python float64 loop (Lucene idf, the default)")
@pytest.mark.equation("21.07", oracle="plain-Python float64 loop (BM25+, delta on present terms)")
@pytest.mark.equation("21.08", oracle="plain-Python float64 loop (BM25L)")
@pytest.mark.parametrize("variant", ["okapi", "plus", "l"])
def test_bm25_variants_closed_form(variant):
    queries, docs = _collection(7)
    N = len(docs)

    def w(t):
        n = sum(t in d for d in docs)
        return math.log(1 + (N - n + 0.5) / (n + 0.5))

    delta = {"okapi": 0.0, "plus": 1.0, "l": 0.5}[variant]
    got = sparse.bm25_scores(queries, docs, k1=1.3, b=0.6, variant=variant)
    expected = [_py_bm25(q, docs, 1.3, 0.6, w, variant, delta) for q in queries]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)


def _absent_idf(queries, docs, w):
    return np.array([[sum(w(t) for t in q if t not in d) for d in docs] for q in queries])


@pytest.mark.equation("21.07", oracle="rank_bm25.BM25Plus (+ delta idf of the absent terms)")
@pytest.mark.parametrize("seed", range(3))
def test_bm25plus_matches_rank_bm25(seed):
    from rank_bm25 import BM25Plus

    queries, docs = _collection(seed)
    N = len(docs)
    ref = BM25Plus(docs, k1=1.2, b=0.75, delta=1.0)
    expected = np.stack([ref.get_scores(q) for q in queries])
    got = sparse.bm25_scores(queries, docs, variant="plus", delta=1.0, idf_kind="bm25plus").numpy()
    # rank-bm25 adds delta * idf for every query term known to the collection, present in d or not
    w = lambda t: math.log((N + 1) / sum(t in d for d in docs)) if any(t in d for d in docs) else 0.0  # noqa: E731
    np.testing.assert_allclose(got + 1.0 * _absent_idf(queries, docs, w), expected, rtol=0, atol=1e-12)
    # ... which makes rank-bm25's BM25+ rank exactly like Okapi BM25 with the same idf
    okapi = sparse.bm25_scores(queries, docs, idf_kind="bm25plus").numpy()
    np.testing.assert_allclose(expected - okapi, (expected - okapi)[:, :1].repeat(N, 1), atol=1e-12)


@pytest.mark.equation("21.08", oracle="rank_bm25.BM25L on documents of distinct terms (tf <= 1)")
@pytest.mark.parametrize("seed", range(3))
def test_bm25l_matches_rank_bm25_when_tf_at_most_one(seed):
    from rank_bm25 import BM25L

    queries, docs = _collection(seed, distinct=True)
    ref = BM25L(docs, k1=1.2, b=0.75, delta=0.5)
    expected = np.stack([ref.get_scores(q) for q in queries])
    got = sparse.bm25_scores(queries, docs, variant="l", delta=0.5, idf_kind="bm25l").numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def _bm25s_scores(queries, docs, method, k1=1.2, b=0.75, delta=0.5):
    import bm25s

    r = bm25s.BM25(k1=k1, b=b, delta=delta, method=method, dtype="float64")
    r.index(docs, show_progress=False)
    known = set(t for d in docs for t in d)
    return np.stack([r.get_scores([t for t in q if t in known]) if any(t in known for t in q)
                     else np.zeros(len(docs)) for q in queries])


@pytest.mark.equation("21.06", oracle="bm25s lucene / robertson / atire (float64)")
@pytest.mark.parametrize(("method", "idf_kind", "scale"), [("lucene", "lucene", 1 / 2.2),
                                                           ("robertson", "rsj_clip", 1 / 2.2),
                                                           ("atire", "log", 1.0)])
def test_bm25_matches_bm25s(method, idf_kind, scale):
    queries, docs = _collection(3, N=40)
    expected = _bm25s_scores(queries, docs, method)
    got = sparse.bm25_scores(queries, docs, idf_kind=idf_kind).numpy() * scale
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.equation("21.07", oracle="bm25s method='bm25+' (minus delta * idf of the absent terms)")
@pytest.mark.equation("21.08", oracle="bm25s method='bm25l' (minus tfc(0) * idf of the absent terms)")
@pytest.mark.parametrize(("method", "variant", "idf_kind", "delta"), [("bm25+", "plus", "bm25plus", 1.0),
                                                                      ("bm25l", "l", "bm25l", 0.5)])
def test_bm25_variants_match_bm25s_plus_absent_terms(method, variant, idf_kind, delta):
    queries, docs = _collection(5, N=40)
    expected = _bm25s_scores(queries, docs, method, delta=delta)
    got = sparse.bm25_scores(queries, docs, variant=variant, idf_kind=idf_kind, delta=delta).numpy()
    diff = expected - got
    k1 = 1.2
    tfc0 = delta if variant == "plus" else (k1 + 1) * delta / (k1 + delta)
    N = len(docs)
    w = lambda t: sparse.idf(torch.tensor([float(sum(t in d for d in docs))]), N, kind=idf_kind).item()  # noqa: E731
    absent = _absent_idf(queries, docs, lambda t: w(t) if any(t in d for d in docs) else 0)
    np.testing.assert_allclose(diff, tfc0 * absent, rtol=1e-10, atol=1e-10)
    # relative to Okapi BM25 with the same idf: a per-query constant for BM25+ only
    okapi = sparse.bm25_scores(queries, docs, idf_kind=idf_kind).numpy()
    constant = np.allclose(expected - okapi, (expected - okapi)[:, :1], atol=1e-10)
    assert constant == (variant == "plus")


def test_bm25_errors():
    with pytest.raises(ValueError, match="at least one document"):
        sparse.bm25_scores([["a"]], [])
    with pytest.raises(ValueError, match="every document is empty"):
        sparse.bm25_scores([["a"]], [[]])
    with pytest.raises(TypeError, match="doc_terms"):
        sparse.bm25_scores([["a"]], "a b")
    with pytest.raises(ValueError, match="b must lie"):
        sparse.bm25_scores([["a"]], [["a"]], b=1.5)


@pytest.mark.equation("21.02", oracle="math.log closed form")
def test_log_tf():
    c = torch.tensor([[0.0, 1.0, 2.0], [7.0, 0.0, 100.0]])
    expected = [[0.0 if x == 0 else 1 + math.log(x) for x in row] for row in c.tolist()]
    np.testing.assert_allclose(sparse.log_tf(c).numpy(), expected, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="nonnegative"):
        sparse.log_tf(torch.tensor([-1.0]))


@pytest.mark.equation("21.05", oracle="sklearn TfidfVectorizer(smooth_idf=False[, sublinear_tf]) fitted on the docs")
@pytest.mark.parametrize("sublinear", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_tfidf_matches_sklearn(sublinear, seed):
    from sklearn.feature_extraction.text import TfidfVectorizer

    queries, docs = _collection(seed, N=30)
    vec = TfidfVectorizer(analyzer=lambda x: x, smooth_idf=False, sublinear_tf=sublinear, norm="l2")
    Xd = vec.fit_transform(docs)
    Xq = vec.transform(queries)
    expected = (Xq @ Xd.T).toarray()
    got = sparse.tfidf_scores(queries, docs, sublinear_tf=sublinear)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    # unnormalised: the dot product of raw tf * idf vectors (sklearn with norm=None)
    vec = TfidfVectorizer(analyzer=lambda x: x, smooth_idf=True, sublinear_tf=sublinear, norm=None)
    Xd = vec.fit_transform(docs)
    expected = (vec.transform(queries) @ Xd.T).toarray()
    got = sparse.tfidf_scores(queries, docs, sublinear_tf=sublinear, idf_kind="sklearn_smooth", normalize=False)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.equation("21.09", oracle="one field: bm25_scores / (k1 + 1); two fields: plain-Python float64 loop")
def test_bm25f_one_field_and_two_fields():
    queries, docs = _collection(11)
    one = sparse.bm25f_scores(queries, [docs], k1=1.4, b=0.6)
    np.testing.assert_allclose(one.numpy(), sparse.bm25_scores(queries, docs, k1=1.4, b=0.6).numpy() / 2.4,
                               rtol=0, atol=1e-12)
    titles, _ = _collection(12)
    titles = [d[:3] for d in _collection(12)[1]]
    fields, w, bs, k1 = [titles, docs], [3.0, 1.0], [0.3, 0.8], 1.2
    N = len(docs)
    avg = [sum(len(d) for d in f) / N for f in fields]
    expected = []
    for q in queries:
        row = []
        for n in range(N):
            s = 0.0
            for t in q:
                wt = sum(w[f] * fields[f][n].count(t) / (1 - bs[f] + bs[f] * len(fields[f][n]) / avg[f])
                         for f in range(2))
                df = sum(any(t in fields[f][m] for f in range(2)) for m in range(N))
                if wt > 0:
                    s += math.log(1 + (N - df + 0.5) / (df + 0.5)) * wt / (k1 + wt)
            row.append(s)
        expected.append(row)
    got = sparse.bm25f_scores(queries, fields, k1=k1, weights=w, b=bs)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="same N"):
        sparse.bm25f_scores(queries, [titles[:-1], docs])


def test_try_it_numbers():
    from tests.try_it import assert_states

    docs = [["rope", "rope", "rope", "rotates", "query", "key"], ["rope", "position"],
            ["softmax", "logit", "maximum", "subtract", "exp", "sum", "norm", "scale"]]
    s0 = sparse.bm25_scores([["rope", "query"]], docs, k1=0.0)[0].tolist()
    s1 = sparse.bm25_scores([["rope", "query"]], docs, k1=1.2)[0].tolist()
    w = sparse.idf(torch.tensor([2.0, 1.0]), 3, kind="lucene").tolist()
    assert s0[0] == pytest.approx(w[0] + w[1], abs=1e-12) and s0[2] == 0.0  # k1 = 0: idf of the present words
    rsj = sparse.idf(torch.tensor([300.0]), 400, kind="rsj").item()
    luc = sparse.idf(torch.tensor([300.0]), 400, kind="lucene").item()
    from llmbook.rag import language_models as LM

    P = LM.dirichlet_smoothing(torch.tensor([[2.0]]), torch.tensor([50.0]), torch.tensor([0.001]), mu=100.0)
    P2 = LM.dirichlet_smoothing(torch.tensor([[2.0]]), torch.tensor([50.0]), torch.tensor([0.001]), mu=2000.0)
    f = "{:.4f}".format
    assert_states("21-sparse-retrieval.ipynb", [
        f"$k_1 = 0$: {f(s0[0])}, {f(s0[1])} and 0; $k_1 = 1.2$: {f(s1[0])}, {f(s1[1])} and 0",
        f'idf of "rope" {f(w[0])} plus idf of "query" {f(w[1])}',
        f"({f(s0[1])} to {f(s1[1])})",
        f"= {f(rsj)}$ (negative", f"Lucene: $\\log(1 + 100.5/300.5) = {f(luc)}$",
        f"\\epsilon \\cdot 4.0 = 0.25 \\cdot 4.0 = {0.25 * 4.0:.1f}$",
        f"$(2 + 0.1)/150 = {f(P[0, 0].item())}$", f"$(2 + 2)/2050 = {P2[0, 0].item():.5f}$",
    ])
