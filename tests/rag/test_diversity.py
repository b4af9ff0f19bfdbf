"""Tests of llmbook.rag.diversity: MMR, DPP probabilities, the marginal kernel, greedy MAP.

Oracles: a brute-force float64 MMR loop written here from Carbonell & Goldstein's definition;
``numpy.linalg.det`` / ``slogdet`` / ``inv`` in float64; brute-force sums over all 2^N subsets of a
small ground set; a naive greedy MAP that recomputes ``numpy.linalg.slogdet`` for every candidate.
"""

import itertools

import numpy as np
import pytest
import torch

from llmbook.rag.diversity import (
    dpp_greedy_map,
    dpp_marginal_kernel,
    dpp_probability,
    mmr,
    quality_diversity_kernel,
)


def random_kernel(N, seed, rank=None, scale=1.0):
    """A random symmetric PSD kernel: B B^T with B (N, rank), in float64 numpy."""
    rng = np.random.default_rng(seed)
    B = rng.normal(size=(N, rank or N)) * scale
    return B @ B.T


def subsets(N):
    for r in range(N + 1):
        yield from itertools.combinations(range(N), r)


def brute_mmr(rel, sim, k, lam):
    """MMR as Carbonell & Goldstein define it, one candidate at a time, in Python floats."""
    S, picked, scores = [], [], []
    for _ in range(k):
        best, best_score = None, -np.inf
        for d in range(len(rel)):
            if d in S:
                continue
            red = max((sim[d][s] for s in S), default=0.0)
            score = lam * rel[d] - (1 - lam) * red
            if score > best_score:  # strict: ties keep the lowest index
                best, best_score = d, score
        S.append(best)
        picked.append(best)
        scores.append(best_score)
    return picked, scores


# ----------------------------------------------------------------------------------------------- 28.01


@pytest.mark.equation("28.01", oracle="brute-force float64 loop over candidates, Carbonell & Goldstein's definition")
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("lam", [0.0, 0.3, 0.5, 0.7, 1.0])
def test_mmr_matches_brute_force(seed, lam):
    rng = np.random.default_rng(seed)
    N, D = 12, 5
    X = rng.normal(size=(N, D))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    q = rng.normal(size=D)
    rel = X @ q / np.linalg.norm(q)
    sim = X @ X.T
    k = 7
    want_idx, want_scores = brute_mmr(rel.tolist(), sim.tolist(), k, lam)
    got = mmr(torch.tensor(rel), torch.tensor(sim), k, lam=lam)
    assert got.indices.tolist() == want_idx
    np.testing.assert_allclose(got.scores.numpy(), want_scores, rtol=0, atol=1e-12)


def test_mmr_limits_and_ties():
    rel = torch.tensor([0.2, 0.9, 0.5, 0.9])
    sim = torch.eye(4)
    # lam = 1: plain relevance ranking, ties to the lowest index
    assert mmr(rel, sim, 4, lam=1.0).indices.tolist() == [1, 3, 2, 0]
    assert mmr(rel, sim, 0).indices.tolist() == []
    # an exact duplicate of the top passage is pushed behind a less relevant, novel one
    rel = torch.tensor([0.9, 0.9, 0.6])
    sim = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    out = mmr(rel, sim, 3, lam=0.5)
    assert out.indices.tolist() == [0, 2, 1]
    np.testing.assert_allclose(out.scores.tolist(), [0.45, 0.3, 0.45 - 0.5], atol=1e-7)


def test_mmr_errors():
    rel, sim = torch.rand(4), torch.rand(4, 4)
    with pytest.raises(ValueError, match="k must be an int in"):
        mmr(rel, sim, 5)
    with pytest.raises(ValueError, match="sim_d must be"):
        mmr(rel, torch.rand(3, 3), 2)
    with pytest.raises(ValueError, match="square"):
        mmr(rel, torch.rand(4, 3), 2)
    with pytest.raises(ValueError, match="lam"):
        mmr(rel, sim, 2, lam=1.5)
    with pytest.raises(TypeError):
        mmr(rel, sim, 2.0)
    with pytest.raises(ValueError):
        mmr(torch.tensor([0.1, float("nan"), 0.2, 0.3]), sim, 2)


# ----------------------------------------------------------------------------------------------- 28.02


@pytest.mark.equation("28.02", oracle="numpy.linalg.det(L_Y) / det(L + I) (normaliser by numpy.linalg.slogdet) "
                                      "over all 2^N subsets, which sum to 1")
@pytest.mark.parametrize("N,seed,rank", [(1, 0, None), (4, 1, None), (7, 2, 3), (10, 3, None), (10, 4, 6)])
def test_dpp_probabilities_all_subsets(N, seed, rank):
    L = random_kernel(N, seed, rank) / N
    sign, logdet = np.linalg.slogdet(L + np.eye(N))
    assert sign > 0
    Lt = torch.tensor(L)
    total = 0.0
    for Y in subsets(N):
        want = np.linalg.det(L[np.ix_(Y, Y)]) / np.exp(logdet) if Y else 1 / np.exp(logdet)
        got = float(dpp_probability(Lt, torch.tensor(Y, dtype=torch.long)))
        assert abs(got - max(want, 0.0)) <= 1e-12 + 1e-9 * abs(want), (Y, got, want)
        total += got
    assert abs(total - 1.0) <= 1e-12


def test_dpp_log_probability_and_singular_sets():
    L = random_kernel(5, 7, rank=2)  # rank 2: every set of 3 items is linearly dependent
    Lt = torch.tensor(L)
    Y = torch.tensor([0, 3])
    want = np.log(np.linalg.det(L[np.ix_([0, 3], [0, 3])])) - np.linalg.slogdet(L + np.eye(5))[1]
    assert abs(float(dpp_probability(Lt, Y, log=True)) - want) < 1e-12
    assert float(dpp_probability(Lt, torch.tensor([0, 1, 2]))) < 1e-12


def test_dpp_huge_scale_stays_finite():
    # L = 1e30 * ones: float64 loses the 1 of L + I (the problem is ill-posed at this scale), but no NaN
    L = torch.full((4, 4), 1e30, dtype=torch.float64)
    p = float(dpp_probability(L, torch.tensor([2])))
    assert 0.0 <= p <= 1.0
    assert float(dpp_probability(L, torch.tensor([0, 1]))) == 0.0
    assert torch.isfinite(dpp_marginal_kernel(L)).all()


def test_dpp_errors():
    L = torch.eye(3)
    with pytest.raises(ValueError, match="distinct"):
        dpp_probability(L, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"\[0, N\)"):
        dpp_probability(L, torch.tensor([3]))
    with pytest.raises(TypeError):
        dpp_probability(L, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="symmetric"):
        dpp_probability(torch.tensor([[1.0, 0.5], [0.0, 1.0]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="positive semi-definite"):
        dpp_marginal_kernel(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    with pytest.raises(ValueError, match="square"):
        dpp_marginal_kernel(torch.ones(2, 3))


# ----------------------------------------------------------------------------------------------- 28.03


@pytest.mark.equation("28.03", oracle="L @ numpy.linalg.inv(L + I) in float64; diagonal and pair minors against "
                                      "brute-force sums of det(L_Y)/det(L+I) over all subsets")
@pytest.mark.parametrize("N,seed,rank", [(3, 0, None), (6, 1, 2), (9, 2, None)])
def test_marginal_kernel(N, seed, rank):
    L = random_kernel(N, seed, rank) / 2
    K = dpp_marginal_kernel(torch.tensor(L)).numpy()
    np.testing.assert_allclose(K, L @ np.linalg.inv(L + np.eye(N)), rtol=0, atol=1e-12)
    Z = np.linalg.det(L + np.eye(N))
    P = {Y: (np.linalg.det(L[np.ix_(Y, Y)]) if Y else 1.0) / Z for Y in subsets(N)}
    for i in range(N):
        incl = sum(p for Y, p in P.items() if i in Y)
        assert abs(K[i, i] - incl) < 1e-12
        for j in range(i + 1, N):
            both = sum(p for Y, p in P.items() if i in Y and j in Y)
            assert abs(K[i, i] * K[j, j] - K[i, j] ** 2 - both) < 1e-12


def test_marginal_kernel_duplicates_repel():
    # two identical items: each alone would be drawn with prob. 1/2; together they cannot both be drawn
    L = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    K = dpp_marginal_kernel(L)
    assert abs(float(K[0, 0]) - 1 / 3) < 1e-12  # P({0}) + P({0, 2}) = (1 + 1) / 6
    assert abs(float(K[0, 0] * K[1, 1] - K[0, 1] ** 2)) < 1e-12
    assert abs(float(K[2, 2]) - 0.5) < 1e-12


# ----------------------------------------------------------------------------------------------- helpers


def naive_greedy(L, k, eps=1e-10):
    """Greedy MAP that recomputes log det L_{Y + i} with numpy for every candidate i."""
    Y, logdet = [], 0.0
    for _ in range(k):
        best, best_val = None, -np.inf
        for i in range(len(L)):
            if i in Y:
                continue
            s, v = np.linalg.slogdet(L[np.ix_(Y + [i], Y + [i])])
            v = v if s > 0 else -np.inf
            if v > best_val:
                best, best_val = i, v
        if best is None or best_val - logdet < np.log(eps):
            break
        Y.append(best)
        logdet = best_val
    return Y, logdet


@pytest.mark.parametrize("seed", range(8))
def test_greedy_map_matches_naive(seed):
    rng = np.random.default_rng(seed)
    N = 12
    X = rng.normal(size=(N, 8))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    qual = np.exp(0.5 * rng.normal(size=N))
    L = qual[:, None] * (X @ X.T) * qual[None, :]  # a random quality-diversity kernel of rank 8
    got = dpp_greedy_map(torch.tensor(L), 7)
    want, logdet = naive_greedy(L, 7)
    assert got.indices.tolist() == want
    assert abs(float(got.log_gains.sum()) - logdet) < 1e-9


def test_greedy_map_stops_on_singular_sets():
    L = random_kernel(8, 3, rank=3)
    got = dpp_greedy_map(torch.tensor(L))
    assert len(got.indices) == 3
    assert got.indices.tolist() == naive_greedy(L, 8)[0]


def test_quality_diversity_kernel():
    rng = np.random.default_rng(0)
    q, X = np.exp(rng.normal(size=5)), rng.normal(size=(5, 3))
    S = X @ X.T
    L = quality_diversity_kernel(torch.tensor(q), torch.tensor(S)).numpy()
    np.testing.assert_allclose(L, np.diag(q) @ S @ np.diag(q), rtol=1e-14, atol=0)
    # det L_Y = prod q_i^2 det S_Y
    Y = [0, 2, 4]
    np.testing.assert_allclose(np.linalg.det(L[np.ix_(Y, Y)]), np.prod(q[Y] ** 2) * np.linalg.det(S[np.ix_(Y, Y)]),
                               rtol=1e-10)
    with pytest.raises(ValueError, match="non-negative"):
        quality_diversity_kernel(torch.tensor([-1.0, 1.0]), torch.eye(2))


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the Try-it solutions of book/28-diversity.ipynb state."""
    from tests.try_it import assert_states

    # 1: MMR's second pick switches at lam = 0.85 / 1.2
    sim_q = torch.tensor([0.9, 0.85, 0.5], dtype=torch.float64)
    sim_d = torch.tensor([[1.0, 0.95, 0.1], [0.95, 1.0, 0.2], [0.1, 0.2, 1.0]], dtype=torch.float64)
    lam_star = 0.85 / 1.2
    assert mmr(sim_q, sim_d, 2, lam=lam_star - 1e-9).indices.tolist() == [0, 2]
    assert mmr(sim_q, sim_d, 2, lam=lam_star + 1e-9).indices.tolist() == [0, 1]
    assert mmr(sim_q, sim_d, 2, lam=0.70).indices.tolist() == [0, 2]
    assert mmr(sim_q, sim_d, 2, lam=0.72).indices.tolist() == [0, 1]

    # 2: the pair probability (1 - s^2) / (4 - s^2) and the s that halves it
    def pair(s):
        L = torch.tensor([[1.0, s], [s, 1.0]], dtype=torch.float64)
        return float(dpp_probability(L, torch.tensor([0, 1])))

    s_half = (4 / 7) ** 0.5
    assert abs(pair(0.0) - 0.25) < 1e-12 and abs(pair(s_half) - 0.125) < 1e-12
    # 3: four exact copies and four unrelated passages
    L = torch.ones(4, 4, dtype=torch.float64)
    K = dpp_marginal_kernel(L)
    p_empty = float(dpp_probability(L, torch.tensor([], dtype=torch.long)))
    p_indep = float(dpp_marginal_kernel(torch.eye(4, dtype=torch.float64))[0, 0])
    assert abs(float(dpp_probability(L, torch.tensor([0, 1])))) < 1e-12
    assert_states("28-diversity.ipynb", [
        f"{lam_star:.4f}", f"$s = {s_half:.4f}$", f"At $s = 0.9$ the pair has probability {pair(0.9):.4f}",
        f"at $s = 0.99$ {pair(0.99):.4f}", f"$P(\\emptyset) = {p_empty:.1f}$",
        f"included with probability {float(K[0, 0]):.1f}", f"\\operatorname{{tr}}K = {float(K.trace()):.1f}$",
        f"with probability {p_indep:.1f} each",
    ])
