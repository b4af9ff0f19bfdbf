"""Tests of llmbook.agents.dqn (chapter 33) against torch.nn.functional, autograd and float64 closed forms."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmbook.agents import dqn


def _batch(B=32, A=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, generator=g, dtype=torch.float64)
    Qo, Qt = (torch.randn(B, A, generator=g, dtype=torch.float64) for _ in range(2))
    d = torch.rand(B, generator=g) < 0.25
    return r, Qo, Qt, d


@pytest.mark.equation("33.06", oracle="brute-force numpy loop (argmax of one table, value from the other)")
def test_double_q_target_matches_loop():
    r, Qo, Qt, d = _batch()
    Y = dqn.double_q_target(r, Qo, Qt, 0.9, d).numpy()
    ref = [r[i].item() + (0.0 if d[i] else 0.9 * Qt[i, int(np.argmax(Qo[i].numpy()))].item()) for i in range(len(r))]
    np.testing.assert_allclose(Y, ref, atol=1e-15)


@pytest.mark.equation("33.06", oracle="closed form E[max of 2 iid N(0, 1)] = 1/sqrt(pi); double estimator unbiased")
def test_double_estimator_removes_maximisation_bias():
    """True action values all 0; two independent noisy estimates. The max of one overestimates by
    E[max(Z1, Z2)] = 1/sqrt(pi) (0.564); selecting with one and evaluating with the other is unbiased."""
    g = torch.Generator().manual_seed(0)
    N = 200_000
    Q1, Q2 = (torch.randn(N, 2, generator=g, dtype=torch.float64) for _ in range(2))
    zero = torch.zeros(N, dtype=torch.float64)
    single = dqn.double_q_target(zero, Q1, Q1, 1.0)  # select and evaluate with the same estimate: the max
    double = dqn.double_q_target(zero, Q1, Q2, 1.0)
    se = 1 / math.sqrt(N)
    assert abs(single.mean().item() - 1 / math.sqrt(math.pi)) < 5 * se
    assert abs(double.mean().item()) < 5 * se
    # Try-it 3 of the chapter: a valuer sharing 90 % of the chooser's noise keeps 90 % of the bias
    corr = dqn.double_q_target(zero, Q1, 0.9 * Q1 + 0.1 * Q2, 1.0)
    assert abs(corr.mean().item() - 0.9 / math.sqrt(math.pi)) < 5 * se


def _nets(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    tgt = copy.deepcopy(net)
    with torch.no_grad():
        for p in tgt.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return net, tgt


@pytest.mark.equation("33.07", oracle="torch.nn.functional.mse_loss / huber_loss with a torch.no_grad target; autograd")
@pytest.mark.parametrize("loss", ["mse", "huber"])
def test_dqn_loss_matches_functional(loss):
    net, tgt = _nets()
    g = torch.Generator().manual_seed(1)
    s, s2 = (torch.randn(20, 6, generator=g, dtype=torch.float64) for _ in range(2))
    a = torch.randint(3, (20,), generator=g)
    r = 3 * torch.randn(20, generator=g, dtype=torch.float64)  # some TD errors beyond delta = 1
    d = torch.rand(20, generator=g) < 0.3
    L = dqn.dqn_loss(net(s), a, r, tgt(s2), 0.9, d, loss=loss)
    L.backward()
    ours = [p.grad.clone() for p in net.parameters()]
    assert all(p.grad is None for p in tgt.parameters())  # no gradient flows into the target network
    net.zero_grad()
    with torch.no_grad():
        Y = r + 0.9 * (~d).double() * tgt(s2).max(1).values
    pred = net(s).gather(1, a[:, None]).squeeze(1)
    ref = F.mse_loss(pred, Y) if loss == "mse" else F.huber_loss(pred, Y, delta=1.0)
    ref.backward()
    torch.testing.assert_close(L, ref, atol=1e-12, rtol=0)
    for p, q in zip(ours, [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


@pytest.mark.equation("33.07", oracle="brute-force loop with the double-Q target (Q_next_online)")
def test_dqn_loss_double_variant():
    r, Qo, Qt, d = _batch(B=8, A=4, seed=3)
    Q = torch.randn(8, 4, dtype=torch.float64)
    a = torch.arange(8) % 4
    L = dqn.dqn_loss(Q, a, r, Qt, 0.7, d, Q_next_online=Qo).item()
    ref = np.mean([(r[i].item() + (0 if d[i] else 0.7 * Qt[i, int(Qo[i].argmax())].item()) - Q[i, a[i]].item()) ** 2
                   for i in range(8)])
    assert abs(L - ref) < 1e-12


@pytest.mark.equation("33.08", oracle="float64 closed form in numpy from the two linear streams' weights")
def test_dueling_head_closed_form():
    torch.manual_seed(0)
    head = dqn.DuelingHead(5, 4).double()
    x = torch.randn(7, 5, dtype=torch.float64)
    Q = head(x).detach().numpy()
    W_v, b_v = head.value.weight.detach().numpy(), head.value.bias.detach().numpy()
    W_a, b_a = head.advantage.weight.detach().numpy(), head.advantage.bias.detach().numpy()
    V_np = x.numpy() @ W_v.T + b_v
    A_np = x.numpy() @ W_a.T + b_a
    np.testing.assert_allclose(Q, V_np + A_np - A_np.mean(1, keepdims=True), atol=1e-13)
    V, A = head.parts(x)
    np.testing.assert_allclose(V.detach().numpy(), Q.mean(1), atol=1e-13)  # V identified: the mean of Q
    np.testing.assert_allclose((V[:, None] + A).detach().numpy(), Q, atol=1e-13)
    assert A.sum(1).abs().max() < 1e-13


@pytest.mark.equation("33.08", oracle="float64 closed form: a constant added to the advantages leaves Q unchanged")
def test_dueling_head_identifiability():
    torch.manual_seed(1)
    head = dqn.DuelingHead(3, 6).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    Q0 = head(x).detach().clone()
    V0, A0 = (t.detach().clone() for t in head.parts(x))
    with torch.no_grad():
        head.advantage.bias.add_(2.5)  # A + c
    torch.testing.assert_close(head(x), Q0, atol=1e-13, rtol=0)
    V1, A1 = head.parts(x)
    torch.testing.assert_close(V1, V0, atol=1e-13, rtol=0)
    torch.testing.assert_close(A1, A0, atol=1e-13, rtol=0)
    # without the mean subtraction (V + c, A - c) would be an equally good decomposition: the naive sum changes
    with torch.no_grad():
        naive = head.value(x) + head.advantage(x)
    assert (naive - Q0).abs().min() > 2.0


def test_errors():
    with pytest.raises(ValueError, match="a must be"):
        dqn.dqn_loss(torch.zeros(2, 3), torch.tensor([0, 3]), torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="loss"):
        dqn.dqn_loss(torch.zeros(2, 3), torch.tensor([0, 1]), torch.zeros(2), torch.zeros(2, 3), loss="l1")
    with pytest.raises(ValueError, match="one shape"):
        dqn.double_q_target(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="d_in"):
        dqn.DuelingHead(3, 2)(torch.zeros(2, 4))
