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


# ----------------------------------------------------------------------------------------------
# the value over beliefs: finite-horizon value iteration on alpha-vectors


def _np_belief_step(b, a, o, T, O):  # noqa: E741
    """numpy Bayes filter (written here, independent of the module): joint Pr(s', o | b, a) and its sum."""
    joint = O[a, :, o] * (b @ T[:, a, :])
    return joint / joint.sum(), joint.sum()


def _trees(h, A, W):
    """Every policy tree of depth h: (action, (subtree for each observation)) or (action, ())."""
    if h == 1:
        return [(a, ()) for a in range(A)]
    subs = _trees(h - 1, A, W)
    return [(a, kids) for a in range(A) for kids in itertools.product(subs, repeat=W)]


def _tree_value(tree, b, T, R, O, gamma):  # noqa: E741
    """Expected discounted reward of executing a policy tree from belief b, by forward simulation of beliefs."""
    a, kids = tree
    v = float(b @ R[:, a])
    for o, kid in enumerate(kids):
        b2, p_o = _np_belief_step(b, a, o, T, O)
        if p_o > 0:
            v += gamma * p_o * _tree_value(kid, b2, T, R, O, gamma)
    return v


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_value_over_beliefs_matches_brute_force_policy_trees(gamma):
    # oracle: enumerate all 3, 27 and 2187 policy trees of horizons 1-3, value each by forward belief simulation
    t = envs.tiger_pomdp(gamma=gamma)
    T, R, O = t.T.numpy(), t.R.numpy(), t.O.numpy()  # noqa: E741
    ps = np.linspace(0, 1, 21)
    res = pomdp.value_iteration_alpha(t.T, t.R, t.O, t.gamma, 3)
    for h in (1, 2, 3):
        trees = _trees(h, 3, 2)
        assert len(trees) == {1: 3, 2: 27, 3: 2187}[h]
        brute = np.array([max(_tree_value(tr, np.array([p, 1 - p]), T, R, O, gamma) for tr in trees) for p in ps])
        ours = pomdp.belief_value(res[h - 1][0], torch.tensor(np.stack([ps, 1 - ps], -1)))[0].numpy()
        np.testing.assert_allclose(ours, brute, rtol=0, atol=1e-9)
    # horizon 1 in closed form: listen (-1), open-left (10 - 110 p), open-right (110 p - 100), p = P(tiger left)
    v1 = pomdp.belief_value(res[0][0], torch.tensor(np.stack([ps, 1 - ps], -1)))[0].numpy()
    np.testing.assert_allclose(v1, np.maximum.reduce([-np.ones_like(ps), 10 - 110 * ps, 110 * ps - 100]), atol=1e-12)
    if gamma == 1.0:  # at b = (0.5, 0.5): listen then listen (-2); horizon 3: listen twice, then open if both agree
        v = [pomdp.belief_value(G, t.b0)[0].item() for G, _ in res]
        assert abs(v[0] + 1) < 1e-12 and abs(v[1] + 2) < 1e-12, v
        # listen twice; if the two agree (probability 0.85^2 + 0.15^2) open the other door, else listen again
        v3 = -2 + (10 * 0.85**2 - 100 * 0.15**2) - (1 - 0.85**2 - 0.15**2)
        assert abs(v[2] - v3) < 1e-12, (v, v3)


def test_alpha_backup_enumerates_the_policy_trees_and_actions():
    # the unpruned backup of the 3 horizon-1 vectors is the 27 horizon-2 trees: their values at the corners b = e_s
    t = envs.tiger_pomdp()
    T, R, O = t.T.numpy(), t.R.numpy(), t.O.numpy()  # noqa: E741
    G1 = pomdp.value_iteration_alpha(t.T, t.R, t.O, t.gamma, 1)[0][0]
    vecs, acts = pomdp.alpha_backup(G1, t.T, t.R, t.O, t.gamma)
    assert vecs.shape == (27, 2) and acts.tolist() == [a for a in range(3) for _ in range(9)]
    trees = [tr for tr in _trees(2, 3, 2)]
    corners = np.array([[_tree_value(tr, np.eye(2)[s], T, R, O, t.gamma) for s in range(2)] for tr in trees])
    ours = {tuple(np.round(v, 9)) for v in vecs.numpy()}
    assert ours <= {tuple(np.round(v, 9)) for v in corners}  # every backed-up vector is some tree's value
    np.testing.assert_allclose(np.sort(vecs.numpy().max(0)), np.sort(corners.max(0)), atol=1e-12)


def test_prune_alpha_keeps_exactly_the_upper_envelope():
    rng = np.random.default_rng(3)
    ps = np.linspace(0, 1, 20_001)
    for _ in range(20):
        G = rng.normal(size=(int(rng.integers(1, 40)), 2))
        kept, acts = pomdp.prune_alpha(torch.tensor(G), torch.arange(len(G)))
        env_all = (np.outer(ps, G[:, 0]) + np.outer(1 - ps, G[:, 1])).max(1)
        env_kept = (np.outer(ps, kept[:, 0].numpy()) + np.outer(1 - ps, kept[:, 1].numpy())).max(1)
        np.testing.assert_allclose(env_kept, env_all, rtol=0, atol=1e-12)  # nothing needed was dropped
        on_top = (np.outer(ps, G[:, 0]) + np.outer(1 - ps, G[:, 1])).argmax(1)
        assert set(acts.tolist()) == set(on_top.tolist())  # and nothing unneeded kept (random lines: no ties)
        np.testing.assert_array_equal(kept.numpy(), G[acts.numpy()])


def test_value_over_beliefs_bad_input():
    t = envs.tiger_pomdp()
    with pytest.raises(ValueError, match="two hidden states"):
        pomdp.prune_alpha(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="Gamma must"):
        pomdp.alpha_backup(torch.zeros(2, 3), t.T, t.R, t.O, 0.9)
    with pytest.raises(ValueError, match="R must"):
        pomdp.alpha_backup(torch.zeros(1, 2), t.T, t.R.T, t.O, 0.9)
    with pytest.raises(ValueError, match="horizon"):
        pomdp.value_iteration_alpha(t.T, t.R, t.O, 0.9, -1)
    with pytest.raises(ValueError, match="two hidden states"):
        pomdp.value_iteration_alpha(torch.ones(3, 1, 3) / 3, torch.zeros(3, 1), torch.ones(1, 3, 1), 0.9, 2)
    with pytest.raises(ValueError, match="b must"):
        pomdp.belief_value(torch.zeros(2, 2), torch.tensor([0.2, 0.9]))
    with pytest.raises(ValueError, match="Gamma must"):
        pomdp.belief_value(torch.zeros(2, 2), torch.tensor([0.2, 0.3, 0.5]))
    with pytest.raises(ValueError, match="actions must"):
        pomdp.prune_alpha(torch.zeros(2, 2), torch.zeros(3))
