"""Tests of llmbook.rag.graph_context: the message-passing layer and the book's graphs.

Oracles: an explicit per-node loop in float64 (Python sums over each node's neighbours, numpy for the
matrix-vector products, ``math.exp`` for GAT's softmax); pair counting by Python sets for the
co-occurrence graph; per-query personalised PageRank for the batched re-ranker. Tolerance 1e-12.
"""

import math

import numpy as np
import pytest
import torch

from llmbook.rag import graph_context as gc
from llmbook.rag.graph import personalized_pagerank


def loop_aggregate(h, A, Ws, Wn, alpha, act):
    """h_v' = act(Ws h_v + sum over u with A[v, u] > 0 of alpha[v, u] Wn h_u), one node at a time."""
    N = len(h)
    out = []
    for v in range(N):
        nbrs = [u for u in range(N) if A[v][u] > 0]
        if alpha is None:
            deg = sum(A[v][u] for u in nbrs)
            weights = {u: A[v][u] / deg for u in nbrs}
        else:
            weights = {u: alpha[v][u] for u in nbrs}
        z = Ws @ h[v] + sum((weights[u] * (Wn @ h[u]) for u in nbrs), np.zeros(Ws.shape[0]))
        out.append({"relu": np.maximum(z, 0), "tanh": np.tanh(z), "identity": z}[act])
    return np.array(out)


def loop_attention(h, A, W, a, slope):
    N, D = len(h), W.shape[0]
    z = h @ W.T
    out = np.zeros((N, N))
    for v in range(N):
        nbrs = [u for u in range(N) if A[v][u] > 0]
        e = {}
        for u in nbrs:
            s = a[:D] @ z[v] + a[D:] @ z[u]
            e[u] = s if s > 0 else slope * s
        norm = sum(math.exp(x) for x in e.values())
        for u in nbrs:
            out[v, u] = math.exp(e[u]) / norm
    return out


def random_case(seed, N=7, D_in=5, D_out=4):
    rng = np.random.default_rng(seed)
    A = (rng.random((N, N)) < 0.4) * rng.uniform(0.2, 2.0, (N, N))
    A[N - 1] = 0.0  # an isolated receiver
    return (rng.normal(size=(N, D_in)), A, rng.normal(size=(D_out, D_in)), rng.normal(size=(D_out, D_in)),
            rng.normal(size=(N, N)), rng.normal(size=2 * D_out))


# ----------------------------------------------------------------------------------------------- 31.06


@pytest.mark.equation("31.06", oracle="explicit per-node loop over neighbours in float64 (numpy)")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("act", ["relu", "tanh", "identity"])
@pytest.mark.parametrize("weights", ["mean", "given", "gat"])
def test_aggregate_matches_a_per_node_loop(seed, act, weights):
    h, A, Ws, Wn, alpha, a = random_case(seed)
    if weights == "gat":
        alpha = gc.attention_weights(torch.tensor(h), torch.tensor(A), torch.tensor(Wn), torch.tensor(a)).numpy()
        np.testing.assert_allclose(alpha, loop_attention(h, A, Wn, a, 0.2), rtol=0, atol=1e-12)
    al = None if weights == "mean" else alpha
    want = loop_aggregate(h, A, Ws, Wn, al, act)
    got = gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn),
                       None if al is None else torch.tensor(al), activation=act)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


def test_aggregate_batch_lowp_and_errors():
    h, A, Ws, Wn, alpha, _ = random_case(9)
    H = torch.tensor(np.stack([h, -h]))
    out = gc.aggregate(H, torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn))
    for b in range(2):
        np.testing.assert_allclose(out[b].numpy(), loop_aggregate(H[b].numpy(), A, Ws, Wn, None, "relu"), atol=1e-12)
    half = gc.aggregate(*(torch.tensor(x).half() for x in (h, A, Ws, Wn)))
    assert half.dtype == torch.float16
    with pytest.raises(ValueError, match="activation"):
        gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn), activation="gelu")
    with pytest.raises(ValueError, match="non-negative"):
        gc.aggregate(torch.tensor(h), -torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn))
    with pytest.raises(ValueError, match="D_in"):
        gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws[:, :2]), torch.tensor(Wn))


def test_attention_rows_are_distributions_over_neighbours():
    h, A, _, Wn, _, a = random_case(3)
    al = gc.attention_weights(torch.tensor(h), torch.tensor(A), torch.tensor(Wn), torch.tensor(a))
    has = (A > 0).any(1)
    np.testing.assert_allclose(al.sum(-1).numpy()[has], 1.0, atol=1e-12)
    assert (al.numpy()[~has] == 0).all() and (al.numpy()[A == 0] == 0).all()


# ----------------------------------------------------------------------------------------------- the book's graphs


def test_entity_graph_counts_pairs_of_terms_sharing_a_passage():
    eg = gc.entity_graph()
    T = len(eg.terms)
    assert eg.A.shape == (T, T) and torch.equal(eg.A, eg.A.T) and (eg.A.diagonal() == 0).all()
    from llmbook.rag.pipeline import book_data

    sets = [set(ts) for ts in book_data().doc_terms]
    rng = np.random.default_rng(0)
    for s, t in rng.integers(0, T, (20, 2)).tolist():
        if s != t:
            want = sum(eg.terms[s] in x and eg.terms[t] in x for x in sets)
            assert eg.A[s, t].item() == want
    # the index: words of equation names used by at least 3 and at most 5% of the passages, counted here by sets
    from llmbook.rag.sparse import analyze
    from llmbook.registry import catalogue

    words = {w for e in catalogue().values() for w in analyze(e.name)}
    df = {t: sum(t in x for x in sets) for t in eg.terms}
    assert set(eg.terms) <= words and all(3 <= n <= 0.05 * len(sets) for n in df.values())
    band = {w for w in words if len(w) >= 3 and not w.isdigit() and 3 <= sum(w in x for x in sets) <= 0.05 * len(sets)}
    assert band == set(eg.terms)


def test_graph_rerank_is_per_query_ppr_seeded_by_reciprocal_rank():
    rng = np.random.default_rng(0)
    N = 12
    W = rng.random((N, N)) * (rng.random((N, N)) < 0.3)
    W = torch.tensor(W + W.T)
    scores = torch.tensor(rng.normal(size=(3, N)))
    got = gc.graph_rerank(scores, W, k=3, alpha=0.4)
    for b in range(3):
        v = torch.zeros(N, dtype=torch.float64)
        for r, j in enumerate(np.argsort(-scores[b].numpy())[:3].tolist()):
            v[j] = 1.0 / (r + 1)
        np.testing.assert_allclose(got[b].numpy(), personalized_pagerank(W, v, 0.4).numpy(), atol=1e-12)


def test_entity_graph_exclude_leaves_out_a_chapters_passages():
    from llmbook.rag.pipeline import book_data

    d = book_data()
    eg, eg_without = gc.entity_graph(d), gc.entity_graph(d, exclude=(1,))
    n1 = sum(p.chapter == 1 for p in d.passages)
    assert eg_without.X.shape[0] == len(d.passages) - n1 and (eg_without.X.sum(0) > 0).all()
    # the same graph by hand: drop chapter 1's rows, then the terms no other chapter uses
    rows = [n for n, p in enumerate(d.passages) if p.chapter != 1]
    cols = [j for j in range(len(eg.terms)) if eg.X[rows, j].sum() > 0]
    Xk = eg.X[rows][:, cols]
    assert eg_without.terms == tuple(eg.terms[j] for j in cols)
    assert torch.equal(eg_without.A, Xk.T @ Xk - torch.diag((Xk.T @ Xk).diagonal()))
