"""Tests of llmbook.rag.packing: the context knapsack, lost in the middle, the compression score.

Oracles: brute force over all 2^N subsets and ``scipy.optimize.milp`` (HiGHS, exact on these integer
programs) for the knapsack; brute force over all k! permutations for the ordering; float64 closed forms
written here in numpy for the weights and the score.
"""

import itertools

import numpy as np
import pytest
import torch

from llmbook.rag import packing as pk
from tests.try_it import assert_states

NB = "27-chunking.ipynb"


# ----------------------------------------------------------------------------------------------- 27.04


def brute_knapsack(u, l, B):
    best, best_set = 0.0, ()
    for r in range(len(u) + 1):
        for S in itertools.combinations(range(len(u)), r):
            if sum(l[i] for i in S) <= B and sum(u[i] for i in S) > best + 1e-12:
                best, best_set = sum(u[i] for i in S), S
    return best, best_set


@pytest.mark.equation("27.04", oracle="brute force over all 2^N subsets (N <= 10)")
@pytest.mark.parametrize("seed", range(25))
def test_knapsack_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    N = int(rng.integers(1, 11))
    u = np.round(rng.normal(1.0, 1.0, size=N), 3)
    l = rng.integers(0, 12, size=N)
    B = int(rng.integers(0, 30))
    got = pk.knapsack(torch.tensor(u), torch.tensor(l), B)
    best, _ = brute_knapsack(u.tolist(), l.tolist(), B)
    assert got.value.item() == pytest.approx(best, abs=1e-9)
    idx = got.indices.tolist()
    assert got.length == int(l[idx].sum()) <= B
    assert float(u[idx].sum()) == pytest.approx(best, abs=1e-9)


@pytest.mark.equation("27.04", oracle="scipy.optimize.milp (HiGHS branch and bound, exact for integer programs)")
@pytest.mark.parametrize("seed", range(6))
def test_knapsack_matches_milp(seed):
    from scipy.optimize import Bounds, LinearConstraint, milp

    rng = np.random.default_rng(100 + seed)
    N = 40
    u = rng.uniform(0, 1, size=N)
    l = rng.integers(20, 400, size=N)
    B = 2000
    res = milp(-u, constraints=LinearConstraint(l[None, :], 0, B), integrality=np.ones(N), bounds=Bounds(0, 1),
               options={"mip_rel_gap": 0})
    got = pk.knapsack(torch.tensor(u), torch.tensor(l), B)
    assert got.value.item() == pytest.approx(-res.fun, abs=1e-9)


def test_greedy_is_not_optimal():
    u, l = torch.tensor([2.0, 9.0]), torch.tensor([1, 5])
    assert pk.greedy_pack(u, l, 5).value.item() == 2.0
    assert pk.knapsack(u, l, 5).value.item() == 9.0
    # greedy is never better than the DP, and the DP never exceeds the budget
    rng = np.random.default_rng(0)
    for _ in range(20):
        u = torch.tensor(rng.uniform(0, 1, size=12))
        l = torch.tensor(rng.integers(1, 50, size=12))
        g, d = pk.greedy_pack(u, l, 100), pk.knapsack(u, l, 100)
        assert g.value.item() <= d.value.item() + 1e-12 and g.length <= 100 and d.length <= 100


def test_knapsack_edges():
    out = pk.knapsack(torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 0, 7]), 0)
    assert out.indices.tolist() == [0] and out.length == 0
    assert pk.knapsack(torch.zeros(0), torch.zeros(0, dtype=torch.long), 5).indices.tolist() == []
    with pytest.raises(TypeError):
        pk.knapsack(torch.ones(2), torch.ones(2), 3)
    with pytest.raises(ValueError, match="non-negative"):
        pk.knapsack(torch.ones(2), torch.tensor([1, -1]), 3)


# ----------------------------------------------------------------------------------------------- 27.05


@pytest.mark.equation("27.05", oracle="float64 closed form alpha + beta * |2 pos / L - 1| in numpy")
@pytest.mark.parametrize("alpha,beta", [(0.5, 0.5), (0.2, 1.0), (1.0, 0.0), (0.3, -0.1)])
def test_lost_in_middle_weight_closed_form(alpha, beta):
    pos = np.linspace(0, 19, 39)
    got = pk.lost_in_middle_weight(torch.tensor(pos), 19, alpha, beta)
    np.testing.assert_allclose(got.numpy(), alpha + beta * np.abs(2 * pos / 19 - 1), rtol=0, atol=1e-15)


@pytest.mark.equation("27.05", oracle="brute force over all k! orders of the weighted utility sum_k w_k u_pi(k)")
@pytest.mark.parametrize("seed", range(8))
def test_ends_first_order_is_optimal(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 8))
    u = rng.uniform(0, 1, size=k)
    w = pk.lost_in_middle_weight(torch.arange(k, dtype=torch.float64), max(k - 1, 1), 0.3, 0.7).numpy()
    best = max(sum(w[s] * u[p[s]] for s in range(k)) for p in itertools.permutations(range(k)))
    perm = pk.ends_first_order(torch.tensor(u)).tolist()
    assert sorted(perm) == list(range(k))
    assert sum(w[s] * u[perm[s]] for s in range(k)) == pytest.approx(best, abs=1e-12)


# ----------------------------------------------------------------------------------------------- 27.06


@pytest.mark.equation("27.06", oracle="float64 closed form lam * rel - (1 - lam) * len in numpy, and the keep rule")
@pytest.mark.parametrize("lam", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_compression_score_closed_form(lam):
    rng = np.random.default_rng(3)
    rel, length = rng.uniform(-1, 1, size=(4, 6)), rng.uniform(0, 2, size=(6,))
    got = pk.compression_score(torch.tensor(rel), torch.tensor(length), lam)
    np.testing.assert_allclose(got.numpy(), lam * rel - (1 - lam) * length, rtol=0, atol=1e-15)
    if 0 < lam:
        np.testing.assert_array_equal(got.numpy() > 0, rel > (1 - lam) / lam * length)


def test_compression_score_errors():
    with pytest.raises(ValueError):
        pk.compression_score(torch.ones(3), torch.ones(4), 0.5)
    with pytest.raises(ValueError):
        pk.compression_score(torch.ones(3), torch.ones(3), 1.5)


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the packing Try-it solutions of book/27-chunking.ipynb state."""
    # 2. greedy vs DP
    u, l = torch.tensor([0.9, 0.8, 0.75, 0.3]), torch.tensor([300, 500, 480, 100])
    g, d = pk.greedy_pack(u, l, 800), pk.knapsack(u, l, 800)
    stated = [f"greedy {g.indices.tolist()} ({g.value.item():.2f})", f"DP {d.indices.tolist()} ({d.value.item():.2f})"]
    # 3. lost in the middle, 5 slots, alpha = 0.4, beta = 0.6
    w = pk.lost_in_middle_weight(torch.arange(5), 4, 0.4, 0.6)
    u5 = torch.tensor([0.9, 0.7, 0.5, 0.3, 0.1], dtype=torch.float64)
    perm = pk.ends_first_order(u5)
    stated += [f"{(w.double() * u5[perm]).sum().item():.3f}", f"{(w.double() * u5).sum().item():.3f}",
               f"{perm.tolist()}"]
    assert_states(NB, stated)
