"""Tests of llmbook.agents.curiosity. Oracles: the networks evaluated by hand in float64 numpy from their
weights (closed form of Linear-ReLU-Linear), ``torch.nn.functional.cross_entropy`` on hand-built logits."""

import numpy as np
import pytest
import torch

from llmbook.agents import curiosity as C


def _np_mlp(net, x):
    W1, b1 = net[0].weight.detach().double().numpy(), net[0].bias.detach().double().numpy()
    W2, b2 = net[2].weight.detach().double().numpy(), net[2].bias.detach().double().numpy()
    return np.maximum(x @ W1.T + b1, 0) @ W2.T + b2


@pytest.mark.equation("36.08", oracle="float64 numpy closed form of both MLPs from their weights")
def test_rnd_reward_closed_form():
    rnd = C.RND(6, d_out=5, hidden=7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s = torch.randn(9, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = ((_np_mlp(rnd.predictor, s.numpy()) - _np_mlp(rnd.target, s.numpy())) ** 2).sum(-1)
    np.testing.assert_allclose(rnd(s).detach().numpy(), ref, rtol=1e-12, atol=1e-14)
    assert not any(p.requires_grad for p in rnd.target.parameters())


def test_rnd_novelty_falls_with_visits():
    """Training on one state lowers its reward far more than that of an unvisited state."""
    rnd = C.RND(16, generator=torch.Generator().manual_seed(0))
    S = C.frozenlake_one_hot(16)
    before = rnd(S).detach()
    opt = torch.optim.Adam(rnd.predictor.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        rnd(S[:1]).mean().backward()
        opt.step()
    after = rnd(S).detach()
    ratio = after / before
    assert ratio[0] < 1e-3 * ratio[1:].min()  # the visited state's reward fell 1000x more than any other's


@pytest.mark.equation("36.09", oracle="float64 numpy closed form of encoder and forward model; F.cross_entropy")
def test_icm_reward_closed_form():
    icm = C.ICM(5, 3, d_feat=4, hidden=6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    s, s2 = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    a = torch.randint(0, 3, (7,), generator=g)
    phi, phi2 = _np_mlp(icm.phi, s.numpy()), _np_mlp(icm.phi, s2.numpy())
    pred = _np_mlp(icm.forward_model, np.concatenate([phi, np.eye(3)[a.numpy()]], -1))
    ref = ((pred - phi2) ** 2).sum(-1)
    np.testing.assert_allclose(icm(s, a, s2).detach().numpy(), ref, rtol=1e-12, atol=1e-14)
    fwd, inv = icm.losses(s, a, s2)
    assert fwd.item() == pytest.approx(ref.mean(), rel=1e-12)
    logits = _np_mlp(icm.inverse_model, np.concatenate([phi, phi2], -1))
    lse = np.log(np.exp(logits).sum(-1))
    assert inv.item() == pytest.approx((lse - logits[np.arange(7), a.numpy()]).mean(), rel=1e-12)
    with pytest.raises(ValueError):
        icm(s, torch.full((7,), 3), s2)


def test_frozenlake_env_is_real():
    env = C.frozenlake_env()
    assert env.observation_space.n == 16 and env.action_space.n == 4
    assert C.frozenlake_one_hot(16).sum(0).tolist() == [1.0] * 16
