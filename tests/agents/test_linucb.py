"""Tests of llmbook.agents.linucb. Oracles: ``numpy.linalg.solve`` and the explicit ``numpy.linalg.inv`` in float64."""

import numpy as np
import pytest
import torch

from llmbook.agents import linucb as L


def _problem(seed, K=3, d=4, n=20):
    rng = np.random.default_rng(seed)
    A, b = np.stack([np.eye(d)] * K), np.zeros((K, d))
    for _ in range(n):
        x, a, r = rng.normal(size=d), rng.integers(K), rng.normal()
        A[a] += np.outer(x, x)
        b[a] += r * x
    return A, b, rng.normal(size=(5, K, d))


@pytest.mark.equation("36.06", oracle="numpy.linalg.solve (ridge) and numpy.linalg.inv (width), float64")
def test_linucb_matches_numpy():
    A, b, X = _problem(0)
    out = L.linucb(torch.tensor(X), torch.tensor(A), torch.tensor(b), alpha=0.7)
    for k in range(3):
        theta = np.linalg.solve(A[k], b[k])
        np.testing.assert_allclose(out.theta[k].numpy(), theta, rtol=1e-12, atol=1e-13)
        for i in range(5):
            w = np.sqrt(X[i, k] @ np.linalg.inv(A[k]) @ X[i, k])
            assert out.width[i, k].item() == pytest.approx(w, rel=1e-12)
            assert out.scores[i, k].item() == pytest.approx(X[i, k] @ theta + 0.7 * w, rel=1e-12, abs=1e-13)


def test_linucb_update_and_errors():
    A = torch.eye(2, dtype=torch.float64).expand(1, 2, 2, 2).clone()
    f64 = dict(dtype=torch.float64)
    A2, b2 = L.linucb_update(A, torch.zeros(1, 2, 2, **f64), torch.tensor([[1.0, 2.0]], **f64), torch.tensor([1]),
                             torch.tensor([0.5], **f64))
    np.testing.assert_allclose(A2[0, 1].numpy(), np.eye(2) + np.outer([1, 2], [1, 2]))
    np.testing.assert_allclose(b2[0, 1].numpy(), [0.5, 1.0])
    with pytest.raises(ValueError, match="positive definite"):
        L.linucb(torch.ones(2, 2), -torch.eye(2).expand(2, 2, 2), torch.zeros(2, 2), 1.0)


def test_simulated_linucb_learns():
    theta = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    run = L.simulate_linucb(theta, 400, alpha=1.0, runs=4, seed=0)
    per_round = run.regret.diff(dim=-1).mean(0)
    assert per_round[-100:].mean() < 0.25 * per_round[:50].mean()  # sublinear: the late regret rate collapses
    assert (run.theta_hat.mean(0) - theta).abs().max() < 0.5
