"""Tests of llmbook.agents.pomdp: the belief update against brute-force enumeration of hidden state sequences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from llmbook.agents import envs, pomdp


def enumerated_posterior(T, O, b0, actions, observations):
    """Pr(S_n = s | a_1..n, o_1..n) by summing the joint over every hidden sequence s_0..s_n, then conditioning."""
    S = T.shape[0]
    post = np.zeros(S)
    for seq in itertools.product(range(S), repeat=len(actions) + 1):
        p = b0[seq[0]]
        for k, (a, o) in enumerate(zip(actions, observations, strict=True)):
            p *= T[seq[k], a, seq[k + 1]] * O[a, seq[k + 1], o]
        post[seq[-1]] += p
    return post / post.sum()


@pytest.mark.equation("32.09", oracle="the tiger problem's tables (Kaelbling et al. 1998) stored exactly; invalid"
                                      " T/O/R/b0 rejected")
def test_make_pomdp():
    t = envs.tiger_pomdp()
    p = pomdp.make_pomdp(t.T, t.R, t.O, 0.95, t.b0)
    assert torch.equal(p.T, t.T) and torch.equal(p.O, t.O) and p.n_obs == 2 and p.gamma == 0.95
    assert abs(p.O[0, 0, 1].item() - 0.15) < 1e-15 and p.R[0].tolist() == [-1.0, -100.0, 10.0]
    with pytest.raises(ValueError, match="O must"):
        pomdp.make_pomdp(t.T, t.R, t.O[:2], 0.95)
    with pytest.raises(ValueError, match="sum to 1"):
        pomdp.make_pomdp(t.T, t.R, t.O * 2, 0.95)
    with pytest.raises(ValueError, match="R must"):
        pomdp.make_pomdp(t.T, t.R.T, t.O, 0.95)


@pytest.mark.equation("32.10", oracle="enumeration of all hidden state sequences of the tiger problem, joint"
                                      " conditioned by brute force (1e-12)")
def test_belief_update_matches_enumeration():
    t = envs.tiger_pomdp()
    T, O, b0 = t.T.numpy(), t.O.numpy(), t.b0.numpy()
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 7))
        actions = rng.choice(3, size=n, p=[0.7, 0.15, 0.15]).tolist()
        obs = rng.integers(2, size=n).tolist()
        b = t.b0
        for a, o in zip(actions, obs, strict=True):
            b = pomdp.belief_update(b, a, o, t.T, t.O)
        np.testing.assert_allclose(b.numpy(), enumerated_posterior(T, O, b0, actions, obs), rtol=0, atol=1e-12)


def test_belief_update_random_pomdp_and_normaliser():
    rng = np.random.default_rng(1)
    S, A, W = 3, 2, 3
    T = rng.random((S, A, S))
    T /= T.sum(-1, keepdims=True)
    O = rng.random((A, S, W))  # noqa: E741
    O /= O.sum(-1, keepdims=True)
    b0 = rng.random(S)
    b0 /= b0.sum()
    acts, obs = [0, 1, 1, 0], [2, 0, 1, 1]
    b = torch.tensor(b0)
    for a, o in zip(acts, obs, strict=True):
        b = pomdp.belief_update(b, a, o, torch.tensor(T), torch.tensor(O))
    np.testing.assert_allclose(b.numpy(), enumerated_posterior(T, O, b0, acts, obs), atol=1e-12)
    # the normaliser sums to 1 over observations; batched beliefs
    B = torch.tensor(rng.dirichlet(np.ones(S), size=4))
    tot = sum(pomdp.observation_probability(B, 1, o, torch.tensor(T), torch.tensor(O)) for o in range(W))
    torch.testing.assert_close(tot, torch.ones(4, dtype=torch.float64))


def test_tiger_listening_sharpens_and_zero_probability_rejected():
    t = envs.tiger_pomdp()
    b = t.b0
    for _ in range(2):
        b = pomdp.belief_update(b, 0, 0, t.T, t.O)
    assert abs(b[0].item() - 0.85**2 / (0.85**2 + 0.15**2)) < 1e-12
    assert pomdp.belief_update(b, 1, 0, t.T, t.O).tolist() == [0.5, 0.5]  # opening a door resets the tiger
    O = torch.zeros(1, 2, 2, dtype=torch.float64)  # noqa: E741
    O[..., 0] = 1
    with pytest.raises(ValueError, match="probability 0"):
        pomdp.belief_update(torch.tensor([0.5, 0.5]), 0, 1, torch.eye(2)[:, None, :].double(), O)


def test_try_it_numbers_of_chapter_32():
    from tests.try_it import assert_states
    t = envs.tiger_pomdp()
    b2 = pomdp.belief_update(pomdp.belief_update(t.b0, 0, 0, t.T, t.O), 0, 0, t.T, t.O)[0].item()
    b_lr = pomdp.belief_update(pomdp.belief_update(t.b0, 0, 0, t.T, t.O), 0, 1, t.T, t.O)[0].item()
    assert abs(b_lr - 0.5) < 1e-15
    assert_states("32-mdp.ipynb", [f"{b2:.4f}", "returns to 0.5"])
