"""Chapter 21 probabilistic retrieval against float64 closed forms written independently here.

Oracles: plain-Python loops with ``math.log`` (query likelihood with Dirichlet / Jelinek-Mercer
smoothing, the BIM with RSJ half-count estimates), and brute-force enumeration of all N! rankings for
the probability ranking principle. Every computation is float64 -> tolerance 1e-12.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch

from llmbook.rag import language_models as LM
from llmbook.rag import sparse

WORDS = [f"w{i}" for i in range(20)]


def _collection(seed: int, N: int = 15, B: int = 5):
    rng = random.Random(seed)
    docs = [[rng.choice(WORDS[: rng.randint(3, 20)]) for _ in range(rng.randint(1, 15))] for _ in range(N)]
    queries = [[rng.choice(WORDS) for _ in range(rng.randint(1, 4))] for _ in range(B)]
    queries.append(["unseen", WORDS[1], WORDS[1]])
    return queries, docs


def _py_ql(q, d, docs, smoothing, mu=0.0, lam=0.0):
    total = sum(len(x) for x in docs)
    s = 0.0
    for t in q:  # repetition = count(t, q)
        cC = sum(x.count(t) for x in docs)
        if cC == 0:
            continue  # a term unseen in the collection is dropped
        pC = cC / total
        if smoothing == "dirichlet":
            p = (d.count(t) + mu * pC) / (len(d) + mu)
        else:
            p = (1 - lam) * d.count(t) / len(d) + lam * pC
        s += math.log(p) if p > 0 else -math.inf
    return s


@pytest.mark.equation("21.10", oracle="plain-Python float64 sum of math.log")
@pytest.mark.equation("21.11", oracle="plain-Python float64 closed form (count + mu P(t|C)) / (|d| + mu)")
@pytest.mark.parametrize("mu", [0.5, 10.0, 2000.0])
@pytest.mark.parametrize("seed", range(2))
def test_query_likelihood_dirichlet(mu, seed):
    queries, docs = _collection(seed)
    got = LM.query_likelihood_scores(queries, docs, smoothing="dirichlet", mu=mu)
    expected = [[_py_ql(q, d, docs, "dirichlet", mu=mu) for d in docs] for q in queries]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)


@pytest.mark.equation("21.10", oracle="plain-Python float64 sum of math.log")
@pytest.mark.equation("21.12", oracle="plain-Python float64 closed form (1 - lam) P_ML + lam P(t|C)")
@pytest.mark.parametrize("lam", [0.0, 0.1, 0.7, 1.0])
def test_query_likelihood_jelinek_mercer(lam):
    queries, docs = _collection(3)
    got = LM.query_likelihood_scores(queries, docs, smoothing="jm", lam=lam)
    expected = [[_py_ql(q, d, docs, "jm", lam=lam) for d in docs] for q in queries]
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    if lam == 0.0:  # maximum likelihood: a missing term makes the query impossible
        assert torch.isneginf(got).any()
        assert torch.equal(got, LM.query_likelihood_scores(queries, docs, smoothing="none"))


@pytest.mark.equation("21.11", oracle="float64 closed form; probabilities sum to 1 over the vocabulary")
@pytest.mark.equation("21.12", oracle="float64 closed form; probabilities sum to 1 over the vocabulary")
def test_smoothed_models_are_distributions():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (6, 9), generator=g).to(torch.float64)
    counts[0] = 0  # an empty document
    L = counts.sum(1)
    p_C = counts.sum(0) / counts.sum()
    Pd = LM.dirichlet_smoothing(counts, L, p_C, mu=3.0)
    Pj = LM.jelinek_mercer_smoothing(counts, L, p_C, lam=0.4)
    np.testing.assert_allclose(Pd.sum(1).numpy(), np.ones(6), atol=1e-12)
    np.testing.assert_allclose(Pj[1:].sum(1).numpy(), np.ones(5), atol=1e-12)
    n, t = 2, 4
    closed = (counts[n, t].item() + 3.0 * p_C[t].item()) / (L[n].item() + 3.0)
    assert Pd[n, t].item() == pytest.approx(closed, abs=1e-15)
    np.testing.assert_allclose(Pd[0].numpy(), p_C.numpy(), atol=1e-15)  # an empty document is the collection


def _py_bim(q, docs, rel):
    N, R = len(docs), sum(rel)
    out = []
    for d in docs:
        s = 0.0
        for t in set(q):
            if t not in d:
                continue
            df = sum(t in x for x in docs)
            r = sum(t in x for x, y in zip(docs, rel, strict=True) if y)
            p, u = (r + 0.5) / (R + 1), (df - r + 0.5) / (N - R + 1)
            s += math.log(p * (1 - u) / (u * (1 - p)))
        out.append(s)
    return out


@pytest.mark.equation("21.14", oracle="plain-Python float64 RSJ half-count log odds")
@pytest.mark.parametrize("seed", range(3))
def test_bim_with_and_without_relevance(seed):
    queries, docs = _collection(seed)
    rng = random.Random(seed)
    rel = [[rng.random() < 0.3 for _ in docs] for _ in queries]
    got = LM.bim_scores(queries, docs, relevant=torch.tensor(rel))
    np.testing.assert_allclose(got.numpy(), [_py_bim(q, docs, r) for q, r in zip(queries, rel, strict=True)],
                               rtol=0, atol=1e-12)
    # no relevance information: p = 1/2 and the weight is the RSJ idf, i.e. binary BM25 with k1 = 0
    got0 = LM.bim_scores(queries, docs)
    np.testing.assert_allclose(got0.numpy(), [_py_bim(q, docs, [False] * len(docs)) for q in queries], atol=1e-12)
    binq = [sorted(set(q)) for q in queries]
    np.testing.assert_allclose(got0.numpy(), sparse.bm25_scores(binq, docs, k1=0.0, idf_kind="rsj").numpy(), atol=1e-12)


def _expected_prefix_metrics(p, order, k):
    prec = sum(p[i] for i in order[:k]) / k
    dcg = sum(p[i] / math.log2(r + 2) for r, i in enumerate(order))
    return prec, dcg


@pytest.mark.equation("21.13", oracle="brute force over all N! rankings (expected precision@k and DCG)")
@pytest.mark.parametrize("seed", range(4))
def test_probability_ranking_principle_is_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(6, generator=g, dtype=torch.float64)
    order = LM.probability_ranking(p).tolist()
    pl = p.tolist()
    for k in (1, 2, 3, 5):
        best_prec = max(_expected_prefix_metrics(pl, perm, k)[0] for perm in itertools.permutations(range(6)))
        assert _expected_prefix_metrics(pl, order, k)[0] == pytest.approx(best_prec, abs=1e-12)
    best_dcg = max(_expected_prefix_metrics(pl, perm, 1)[1] for perm in itertools.permutations(range(6)))
    assert _expected_prefix_metrics(pl, order, 1)[1] == pytest.approx(best_dcg, abs=1e-12)
    # and any ranking that swaps a better document below a worse one loses expected DCG
    worse = order[:]
    worse[0], worse[-1] = worse[-1], worse[0]
    assert _expected_prefix_metrics(pl, worse, 1)[1] < best_dcg


def test_errors():
    with pytest.raises(ValueError, match="smoothing"):
        LM.query_likelihood_scores([["a"]], [["a"]], smoothing="laplace")
    with pytest.raises(ValueError, match="lam must lie"):
        LM.query_likelihood_scores([["a"]], [["a"]], smoothing="jm", lam=1.5)
    with pytest.raises(ValueError, match="p_rel"):
        LM.probability_ranking(torch.tensor([0.2, 1.2]))
    with pytest.raises(TypeError, match="bool"):
        LM.bim_scores([["a"]], [["a"]], relevant=torch.ones(1, 1))
