"""Tests of llmbook.agents.imitation (chapter 38: behaviour cloning's compounding error, DAgger).

Oracles: brute-force enumeration of every action and next-state sequence (exact expected cost), an
independent numpy simulation of the lane dynamics (d' = clip(d + move)), collections.Counter (majority
vote), a hand-derived expected cost, the bounds of Ross and Bagnell (2010) and Ross, Gordon and Bagnell
(2011), and the expert's labels.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

from llmbook.agents import imitation as im

TOL = 1e-12  # float64 against float64 enumeration: only rounding differs


def _random_mdp(S=3, A=2, seed=0):
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.ones(S), size=(S, A))
    return torch.tensor(P), torch.tensor(rng.random(S)), torch.tensor(rng.dirichlet(np.ones(A), size=S))


def test_expected_cost_matches_enumeration():
    P, cost, pi = _random_mdp()
    S, A = pi.shape
    T = 4
    J = im.expected_cost(P, cost, pi, T, 0)
    for t in range(1, T + 1):  # every (a_0, s_1, a_1, ..., s_{t-1}) sequence, weighted by its probability
        total = 0.0
        for seq in itertools.product(range(A), range(S), repeat=t - 1):
            s, p, c = 0, 1.0, cost[0].item()
            for k in range(t - 1):
                a, s2 = seq[2 * k], seq[2 * k + 1]
                p *= pi[s, a].item() * P[s, a, s2].item()
                s = s2
                c += cost[s].item()
            total += p * c
        assert abs(J[t - 1].item() - total) < TOL


def _simulate_lane(K, policy, eps, T, n, seed):
    """Independent numpy simulation: d' = clip(d + move - 1, -K, K), move = policy or a slip to another action."""
    rng = np.random.default_rng(seed)
    pol = np.asarray(policy)
    d = np.zeros(n, dtype=int)
    cost = np.zeros(n)
    for _ in range(T):
        cost += d != 0
        a = pol[d + K]
        slip = rng.random(n) < eps
        other = (a + rng.integers(1, 3, n)) % 3  # one of the two other actions, uniformly
        a = np.where(slip, other, a)
        d = np.clip(d + a - 1, -K, K)
    return cost


def test_lane_bc_cost_matches_simulation_and_hand_formula():
    lane = im.lane_mdp(3)
    eps, T = 0.1, 30
    straight = torch.ones(7, dtype=torch.long)
    J = im.expected_cost(lane.P, lane.cost, im.slip_policy(straight, 3, eps), T, lane.start)
    # by hand: step 1 off with prob eps; step 2 off from the centre (1 - eps) eps, from +-1 eps (1 - eps / 2)
    assert abs(J[2].item() - (eps + (1 - eps) * eps + eps * (1 - eps / 2))) < TOL
    sim = _simulate_lane(3, straight.numpy(), eps, T, 40_000, seed=0)
    se = sim.std() / np.sqrt(len(sim))
    assert abs(J[-1].item() - sim.mean()) < 4 * se


def test_majority_policy_matches_counter():
    g = torch.Generator().manual_seed(3)
    s = torch.randint(0, 4, (60,), generator=g)  # state 4 never appears
    a = torch.randint(0, 3, (60,), generator=g)
    pol = im.majority_policy(s, a, 5, 3)
    overall = collections.Counter(a.tolist())
    fallback = min(overall, key=lambda k: (-overall[k], k))
    for st in range(5):
        c = collections.Counter(a[s == st].tolist())
        want = min(c, key=lambda k: (-c[k], k)) if c else fallback
        assert pol[st].item() == want


def test_slip_policy_error_rate():
    pi = im.slip_policy(torch.tensor([0, 2, 1]), 3, 0.3)
    np.testing.assert_allclose(pi.sum(-1).numpy(), 1.0, atol=TOL)
    np.testing.assert_allclose(pi[[0, 1, 2], [0, 2, 1]].numpy(), 0.7, atol=TOL)
    assert im.slip_policy(torch.tensor([1]), 3, 0.0).tolist() == [[0.0, 1.0, 0.0]]


def test_deviation_cost_by_hand():
    lane = im.lane_mdp(3)
    # V(d) = |d| (the expert needs |d| steps, each off-centre); the worst single mistake moves 1 away from the
    # centre at |d| = 1 or 2: Q - V = 1 + V(|d| + 1) - V(|d|) ... = 2; with one step to go nothing can be added
    assert im.deviation_cost(lane.P, lane.cost, lane.expert, 1) == 0.0
    assert im.deviation_cost(lane.P, lane.cost, lane.expert, 2) == 1.0
    assert im.deviation_cost(lane.P, lane.cost, lane.expert, 50) == 2.0


def _bc_and_dagger(eps=0.01, T=200, seeds=range(10)):
    lane = im.lane_mdp(3)
    runs = [im.dagger(lane.P, lane.expert, T, eps=eps, iters=5, n_rollouts=4, start=lane.start,
                      generator=torch.Generator().manual_seed(s)) for s in seeds]
    cost = lambda pol: im.expected_cost(lane.P, lane.cost, im.slip_policy(pol, 3, eps), T, lane.start)  # noqa: E731
    return lane, runs, cost(runs[0].policies[0]), torch.stack([cost(r.policy) for r in runs])


def test_dagger_labels_are_the_experts_and_bc_is_its_first_iterate():
    lane, runs, _, _ = _bc_and_dagger(seeds=range(3))
    for r in runs:
        assert torch.equal(r.a, lane.expert[r.s])  # every aggregated label is the expert's action
        assert r.policies[0].tolist() == [1] * 7  # the expert's demonstrations hold only the centre: BC = STRAIGHT
        visited = r.s.unique()
        assert torch.equal(r.policy[visited], lane.expert[visited])
        assert len(visited) >= 3  # the learner's own mistakes took it off the centre, and the expert labelled it


@pytest.mark.slow
def test_compounding_error_bc_quadratic_dagger_linear():
    eps = 0.01
    lane, _, bc, dg = _bc_and_dagger(eps=eps)
    T = torch.arange(1, 201, dtype=torch.float64)
    u = im.deviation_cost(lane.P, lane.cost, lane.expert, 200)
    assert (bc <= T**2 * eps + TOL).all()  # Ross and Bagnell (2010): J <= J* + T^2 eps, J* = 0
    assert (dg <= u * T * eps + 1.0).all()  # Ross et al. (2011): J <= J* + u T eps_N + O(1), eps_N = eps here
    slope = lambda J, a, b: float(np.log(J[b - 1].item() / J[a - 1].item()) / np.log(b / a))  # noqa: E731
    assert 1.9 < slope(bc, 10, 20) < 2.05  # quadratic while eps T << 1
    assert 0.95 < slope(dg.mean(0), 10, 20) < 1.15  # linear
    assert bc[99] > 20 * dg[:, 99].max()


def test_bad_input():
    lane = im.lane_mdp(2)
    with pytest.raises(ValueError, match="eps"):
        im.slip_policy(lane.expert, 3, 1.5)
    with pytest.raises(ValueError, match="at least one"):
        im.majority_policy(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long), 3, 2)
    with pytest.raises(ValueError, match="P must hold probabilities"):
        im.expected_cost(lane.P * 2, lane.cost, lane.expert, 5, 0)
    with pytest.raises(ValueError, match="deterministic policy"):
        im.expected_cost(lane.P, lane.cost, torch.tensor([0, 1, 3, 0, 0]), 5, 0)
    with pytest.raises(ValueError, match="T"):
        im.expected_cost(lane.P, lane.cost, lane.expert, 0, 0)
    with pytest.raises(ValueError, match="s must lie"):
        im.majority_policy(torch.tensor([9]), torch.tensor([0]), 3, 2)
