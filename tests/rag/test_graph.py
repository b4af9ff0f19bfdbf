"""Tests of llmbook.rag.graph: adjacency, PageRank, personalised PageRank, modularity, path relevance.

Oracles: networkx 3 (``to_numpy_array``, ``pagerank`` with scipy at tol 1e-12 and the same dangling
convention, ``community.modularity`` weighted, ``all_simple_paths`` and ``dijkstra_path_length``),
and the float64 closed form p = (1 - alpha) (I - alpha P^T)^{-1} v solved with numpy.
Tolerances: the power iteration stops when the L1 change of a step is below N * tol (tol = 1e-12, as
networkx), which leaves at most alpha / (1 - alpha) * N * tol from the fixed point: that bound against
the closed form, 1e-9 against networkx's own iteration, 1e-12 for exact arithmetic (sums, products).
"""

import math

import networkx as nx
import numpy as np
import pytest
import torch

from llmbook.rag.graph import (
    adjacency,
    best_path,
    modularity,
    pagerank,
    path_relevance,
    personalized_pagerank,
    transition_matrix,
)
from tests.try_it import assert_states

NB = "31-graphrag.ipynb"


def random_digraph(N, seed, p=0.3, dangling=2):
    """A weighted random digraph whose last ``dangling`` nodes have no out-edges."""
    rng = np.random.default_rng(seed)
    A = (rng.random((N, N)) < p) * rng.uniform(0.1, 2.0, (N, N))
    np.fill_diagonal(A, 0.0)
    A[N - dangling:] = 0.0
    return A


def random_graph(N, seed, p=0.3):
    A = np.triu(random_digraph(N, seed, p, dangling=0), 1)
    return A + A.T


def nx_digraph(A):
    return nx.from_numpy_array(A, create_using=nx.DiGraph)


# ----------------------------------------------------------------------------------------------- 31.01


@pytest.mark.equation("31.01", oracle="networkx.to_numpy_array of a Graph / DiGraph built edge by edge")
@pytest.mark.parametrize("directed", [False, True])
def test_adjacency_matches_networkx(directed):
    rng = np.random.default_rng(0)
    N, E = 7, 20
    src, dst = rng.integers(0, N, E), rng.integers(0, N, E)
    w = rng.uniform(0.1, 1.0, E)
    G = nx.DiGraph() if directed else nx.Graph()
    G.add_nodes_from(range(N))
    for i, j, x in zip(src.tolist(), dst.tolist(), w.tolist(), strict=True):  # repeated edges add up
        G.add_edge(i, j, weight=G[i][j]["weight"] + x if G.has_edge(i, j) else x)
    want = nx.to_numpy_array(G, nodelist=range(N), weight="weight")
    got = adjacency(torch.tensor(src), torch.tensor(dst), torch.tensor(w), N=N, directed=directed)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    assert (got.numpy() == got.numpy().T).all() != directed or np.allclose(want, want.T)


def test_adjacency_errors_and_defaults():
    A = adjacency(torch.tensor([0, 2]), torch.tensor([1, 0]))
    assert A.shape == (3, 3) and A.dtype == torch.get_default_dtype() and A[1, 0] == 1.0
    with pytest.raises(ValueError, match=r"\[0, N\)"):
        adjacency(torch.tensor([0, 3]), torch.tensor([1, 0]), N=3)
    with pytest.raises(TypeError, match="src"):
        adjacency(torch.tensor([0.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="weight"):
        adjacency(torch.tensor([0, 1]), torch.tensor([1, 0]), torch.ones(3))


# ----------------------------------------------------------------------------------------------- 31.02


def stop_bound(N, alpha, tol=1e-12):
    """The error left at the stop: a last L1 step below N tol leaves at most alpha / (1 - alpha) times it."""
    return N * tol * alpha / (1 - alpha) + 1e-14


def closed_form_ppr(A, v, alpha):
    """(1 - alpha) (I - alpha P^T)^{-1} v with dangling rows of P set to v, in float64 numpy."""
    out = A.sum(1, keepdims=True)
    v = v / v.sum()
    P = np.where(out > 0, A / np.where(out > 0, out, 1.0), v[None, :])
    return (1 - alpha) * np.linalg.solve(np.eye(len(A)) - alpha * P.T, v)


@pytest.mark.equation("31.02", oracle="networkx.pagerank (scipy, tol 1e-12, weight) and the float64 closed form")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("d", [0.5, 0.85, 0.95])
def test_pagerank_matches_networkx_with_dangling_nodes(seed, d):
    A = random_digraph(12, seed)
    assert (A.sum(1) == 0).sum() >= 2  # dangling nodes present
    want = nx.pagerank(nx_digraph(A), alpha=d, tol=1e-12, max_iter=10_000, weight="weight")
    got = pagerank(torch.tensor(A), d)
    np.testing.assert_allclose(got.numpy(), [want[i] for i in range(12)], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got.numpy(), closed_form_ppr(A, np.ones(12), d), rtol=0, atol=stop_bound(12, d))
    assert abs(got.sum().item() - 1) < 1e-12


def test_pagerank_textbook_cases():
    # a symmetric cycle: uniform; a star: the hub collects most rank
    cycle = adjacency(torch.arange(5), (torch.arange(5) + 1) % 5, N=5, directed=True)
    np.testing.assert_allclose(pagerank(cycle.double()).numpy(), np.full(5, 0.2), atol=1e-12)
    star = adjacency(torch.tensor([1, 2, 3, 4]), torch.zeros(4, dtype=torch.long), N=5).double()
    pr = pagerank(star)
    assert pr.argmax().item() == 0 and pr[0].item() > 0.45
    # float32 in, float32 out
    assert pagerank(star.float()).dtype == torch.float32


# ----------------------------------------------------------------------------------------------- 31.03


@pytest.mark.equation("31.03", oracle="networkx.pagerank(personalization=v, tol 1e-12); (1-alpha)(I - alpha P^T)^-1 v")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("alpha", [0.15, 0.5, 0.85])
def test_personalized_pagerank_matches_networkx_and_closed_form(seed, alpha):
    N = 12
    A = random_digraph(N, seed)
    rng = np.random.default_rng(100 + seed)
    v = rng.random(N) * (rng.random(N) < 0.4)
    v[0] += 0.5  # at least one seed
    pers = {i: float(v[i]) for i in range(N)}
    want = nx.pagerank(nx_digraph(A), alpha=alpha, personalization=pers, tol=1e-12, max_iter=10_000, weight="weight")
    got = personalized_pagerank(torch.tensor(A), torch.tensor(v), alpha)
    np.testing.assert_allclose(got.numpy(), [want[i] for i in range(N)], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got.numpy(), closed_form_ppr(A, v, alpha), rtol=0, atol=stop_bound(N, alpha))


def test_personalized_pagerank_batch_rows_are_independent_walks():
    A = torch.tensor(random_digraph(10, 7))
    V = torch.rand(3, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    P = personalized_pagerank(A, V, 0.7)
    for b in range(3):
        np.testing.assert_allclose(P[b].numpy(), personalized_pagerank(A, V[b], 0.7).numpy(), atol=1e-12)
    # alpha = 0: no walking, the restart distribution itself
    want = (V / V.sum(1, keepdim=True)).numpy()
    np.testing.assert_allclose(personalized_pagerank(A, V, 0.0).numpy(), want, atol=1e-15)


def test_personalized_pagerank_errors():
    A = torch.ones(3, 3)
    with pytest.raises(ValueError, match="alpha"):
        personalized_pagerank(A, torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="positive sum"):
        personalized_pagerank(A, torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match="non-negative"):
        personalized_pagerank(-A, torch.ones(3), 0.5)
    with pytest.raises(ValueError, match="did not converge"):
        personalized_pagerank(torch.tensor(random_digraph(8, 0)), torch.ones(8), 0.999, max_iter=5)


def test_transition_matrix_rows_are_distributions_with_dangling_rows_v():
    A = torch.tensor(random_digraph(8, 3))
    v = torch.arange(1.0, 9.0, dtype=torch.float64)
    P = transition_matrix(A, v)
    np.testing.assert_allclose(P.sum(1).numpy(), np.ones(8), atol=1e-12)
    np.testing.assert_allclose(P[-1].numpy(), (v / v.sum()).numpy(), atol=1e-15)


# ----------------------------------------------------------------------------------------------- 31.04


@pytest.mark.equation("31.04", oracle="networkx.community.modularity(weight='weight', resolution=gamma)")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_modularity_matches_networkx(seed, gamma):
    N = 15
    A = random_graph(N, seed)
    G = nx.from_numpy_array(A)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, N) * 7 - 3  # arbitrary integer labels
    comms = [set(np.flatnonzero(labels == c).tolist()) for c in np.unique(labels)]
    want = nx.community.modularity(G, comms, weight="weight", resolution=gamma)
    got = modularity(torch.tensor(A), torch.tensor(labels), gamma)
    assert abs(got.item() - want) < 1e-12
    # the communities networkx finds score what networkx says they score
    found = nx.community.greedy_modularity_communities(G, weight="weight")
    lab = torch.tensor([next(k for k, c in enumerate(found) if n in c) for n in range(N)])
    assert abs(modularity(torch.tensor(A), lab).item() - nx.community.modularity(G, found, weight="weight")) < 1e-12


def test_modularity_self_loops_count_twice_as_in_networkx():
    G = nx.Graph([(0, 1), (1, 2), (2, 0), (3, 4)])
    G.add_edge(3, 3, weight=2.0)
    comms = [{0, 1, 2}, {3, 4}]
    A = nx.to_numpy_array(G, weight="weight")
    A[np.diag_indices(5)] *= 2  # the documented convention
    got = modularity(torch.tensor(A), torch.tensor([0, 0, 0, 1, 1]))
    assert abs(got.item() - nx.community.modularity(G, comms, weight="weight")) < 1e-12


def test_modularity_errors_and_limits():
    A = torch.tensor(random_graph(6, 1))
    assert abs(modularity(A, torch.zeros(6, dtype=torch.long)).item()) < 1e-12  # one community: Q = 0
    with pytest.raises(ValueError, match="symmetric"):
        modularity(torch.tensor(random_digraph(6, 1)), torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="without edges"):
        modularity(torch.zeros(3, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="communities"):
        modularity(A, torch.zeros(6))


# ----------------------------------------------------------------------------------------------- 31.05


@pytest.mark.equation("31.05", oracle="networkx.all_simple_paths enumerated with Python products; dijkstra on -log w")
@pytest.mark.parametrize("seed", range(3))
def test_path_relevance_and_best_path_against_all_simple_paths(seed):
    N = 8
    A = random_digraph(N, seed, p=0.4, dangling=1)
    P = transition_matrix(torch.tensor(A)).numpy()
    P[A.sum(1) == 0] = 0.0  # no jumps from the dangling node: only real edges
    G = nx.from_numpy_array(P, create_using=nx.DiGraph)
    for s, t in [(0, N - 1), (1, 5), (2, 6)]:
        paths = list(nx.all_simple_paths(G, s, t))
        want = [math.prod(G[u][x]["weight"] for u, x in zip(p, p[1:], strict=False)) for p in paths]
        if not paths:
            assert best_path(torch.tensor(P), s, t) == ([], 0.0)
            continue
        for p, w in zip(paths, want, strict=True):
            assert abs(path_relevance(torch.tensor(P), torch.tensor(p)).item() - w) < 1e-15
            assert abs(path_relevance(torch.tensor(P), torch.tensor(p), log=True).item() - math.log(w)) < 1e-12
        path, score = best_path(torch.tensor(P), s, t)
        assert abs(score - max(want)) < 1e-12
        assert abs(path_relevance(torch.tensor(P), torch.tensor(path)).item() - max(want)) < 1e-12
        H = nx.DiGraph([(u, x, {"c": -math.log(d["weight"])}) for u, x, d in G.edges(data=True)])
        assert abs(-math.log(score) - nx.dijkstra_path_length(H, s, t, weight="c")) < 1e-12


def test_path_relevance_batch_and_edge_cases():
    W = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.0, 0.8], [1.0, 0.0, 0.0]])
    assert path_relevance(W, torch.tensor([[0, 1, 2], [0, 2, 0], [1, 1, 0]])).tolist() == pytest.approx([0.4, 0.5, 0.0])
    assert path_relevance(W, torch.tensor([2])).item() == 1.0  # one node, no edge
    assert path_relevance(W, torch.tensor([1, 1]), log=True).item() == -math.inf
    with pytest.raises(ValueError, match=r"\[0, N\)"):
        path_relevance(W, torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_path(2 * W, 0, 2)


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the chapter's Try-it solutions state."""
    two = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    pr = pagerank(two)
    assert [f"{x:.4f}" for x in pr.tolist()] == ["0.3509", "0.6491"]
    assert f"{0.5 / 1.425:.4f}" == "0.3509"
    path6 = adjacency(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 2, 3, 4, 5]), N=6).double()
    halves = modularity(path6, torch.tensor([0, 0, 0, 1, 1, 1])).item()
    pairs = modularity(path6, torch.tensor([0, 0, 1, 1, 2, 2])).item()
    assert (f"{halves:.2f}", f"{pairs:.2f}") == ("0.30", "0.26")
    p3 = adjacency(torch.tensor([0, 1]), torch.tensor([1, 2]), N=3).double()
    ppr = personalized_pagerank(p3, torch.tensor([1.0, 0.0, 0.0]), 0.5)
    assert [f"{x:.4f}" for x in ppr.tolist()] == ["0.5833", "0.3333", "0.0833"]
    assert_states(NB, ["0.3509", "0.6491", "0.30", "0.26", "0.5833", "0.3333", "0.0833"])
