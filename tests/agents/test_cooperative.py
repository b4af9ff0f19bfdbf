"""Tests of llmbook.agents.cooperative (chapter 39: VDN, QMIX, MADDPG).

Oracles: brute force over all A^N joint actions (VDN), torch.autograd gradients of the mixer and the
mixing formula written out in float64 (QMIX), and the closed-form deterministic policy gradient of a
linear-quadratic example plus central finite differences (MADDPG).
"""

import itertools

import numpy as np
import pytest
import torch

from llmbook.agents import cooperative as C


@pytest.mark.equation("39.03", oracle="brute force over all A^N joint actions")
def test_vdn_brute_force():
    gen = torch.Generator().manual_seed(0)
    B, N, A = 4, 3, 4
    Q = torch.randn(B, N, A, generator=gen, dtype=torch.float64)
    for b in range(B):
        table = {a: sum(Q[b, i, a[i]].item() for i in range(N)) for a in itertools.product(range(A), repeat=N)}
        for a, q in list(table.items())[::7]:
            assert C.vdn(Q[b:b + 1], torch.tensor([a]))[0].item() == pytest.approx(q, abs=1e-12)
        best = max(table, key=table.get)
        Q_tot, a_greedy = C.vdn(Q[b:b + 1])
        assert tuple(a_greedy[0].tolist()) == best
        assert Q_tot.item() == pytest.approx(table[best], abs=1e-12)
    with pytest.raises(ValueError, match="lie in"):
        C.vdn(Q, torch.full((B, N), A))


def test_non_monotone_joint_value_breaks_decentralised_greedy():
    """The counterpoint: a joint table that is not a sum (a coordination game) can have its joint argmax
    away from the per-agent argmaxes of the best additive fit, which is why VDN/QMIX restrict the class."""
    Qj = torch.tensor([[8.0, -12.0, -12.0], [-12.0, 0.0, 0.0], [-12.0, 0.0, 0.0]], dtype=torch.float64)
    # least-squares VDN fit Q1(a1) + Q2(a2) by the normal equations of the (9 x 6) design matrix
    X = torch.zeros(9, 6, dtype=torch.float64)
    for a1, a2 in itertools.product(range(3), range(3)):
        X[3 * a1 + a2, a1] = X[3 * a1 + a2, 3 + a2] = 1.0
    w = torch.linalg.lstsq(X, Qj.reshape(9, 1), driver="gelsd").solution.squeeze()
    _, a = C.vdn(torch.stack([w[:3], w[3:]])[None])
    assert a[0].tolist() != [0, 0]  # the fitted decomposition misses the optimum (0, 0)


def _mixer_reference(mixer, Q, s):
    """The QMIX formula written out in float64 from the mixer's parameters."""
    p = {k: v.double() for k, v in mixer.state_dict().items()}
    s = s.double()
    W1 = (s @ p["hyper_w1.weight"].T + p["hyper_w1.bias"]).reshape(-1, mixer.N, mixer.E).abs()
    b1 = s @ p["hyper_b1.weight"].T + p["hyper_b1.bias"]
    W2 = (s @ p["hyper_w2.weight"].T + p["hyper_w2.bias"]).abs()
    hidden = torch.relu(s @ p["hyper_b2.0.weight"].T + p["hyper_b2.0.bias"])
    hb = hidden @ p["hyper_b2.2.weight"].T + p["hyper_b2.2.bias"]
    h = torch.nn.functional.elu(torch.einsum("bn,bne->be", Q.double(), W1) + b1)
    return (h * W2).sum(-1) + hb.squeeze(-1)


@pytest.mark.equation("39.04", oracle="torch.autograd gradients; the mixing formula written out in float64")
def test_qmix_monotonicity_autograd():
    gen = torch.Generator().manual_seed(0)
    N, d_s, B = 4, 6, 256
    mono = C.QMixer(N, d_s, embed=8, generator=gen, dtype=torch.float64)
    free = C.QMixer(N, d_s, embed=8, monotonic=False, generator=gen, dtype=torch.float64)
    s = torch.randn(B, d_s, generator=gen, dtype=torch.float64)
    Q = (3 * torch.randn(B, N, generator=gen, dtype=torch.float64)).requires_grad_()
    torch.testing.assert_close(mono(Q, s), _mixer_reference(mono, Q, s), atol=1e-12, rtol=0)
    g_mono = torch.autograd.grad(mono(Q, s).sum(), Q)[0]
    g_free = torch.autograd.grad(free(Q, s).sum(), Q)[0]
    assert (g_mono >= 0).all()
    assert (g_free < 0).float().mean() > 0.2  # without abs, about half the partial derivatives are negative
    # monotone => the per-agent argmax is the joint argmax (brute force over 3^N joint actions)
    Qi = torch.randn(8, N, 3, generator=gen, dtype=torch.float64)
    for b in range(8):
        joint = torch.tensor(list(itertools.product(range(3), repeat=N)))
        vals = mono(Qi[b, torch.arange(N), joint], s[b:b + 1].expand(len(joint), -1))  # (A^N,)
        assert joint[vals.argmax()].tolist() == Qi[b].argmax(-1).tolist()


def test_qmix_checks():
    mixer = C.QMixer(2, 3)
    with pytest.raises(ValueError, match=r"\(B, N\) = \(B, 2\)"):
        mixer(torch.zeros(5, 3), torch.zeros(5, 3))


@pytest.mark.equation("39.05", oracle="closed-form gradient of a linear-quadratic example; central finite differences")
def test_maddpg_gradient_linear_quadratic():
    """Linear policies a_i = K_i o_i, critic Q(x, a) = -sum_j |a_j - x M_j|^2 + a_0^T C a_1.

    The expected gradient of Q w.r.t. K_i is E[(dQ/da_i) o_i^T], with dQ/da_i written by hand.
    """
    gen = torch.Generator().manual_seed(0)
    B, N, d_x, d_o, d_a = 64, 3, 5, 3, 2
    x = torch.randn(B, d_x, generator=gen, dtype=torch.float64)
    O = torch.randn(N, d_x, d_o, generator=gen, dtype=torch.float64)  # o_i = x O_i
    M = torch.randn(N, d_x, d_a, generator=gen, dtype=torch.float64)
    Cm = torch.randn(d_a, d_a, generator=gen, dtype=torch.float64)  # coupling a_0^T C a_1
    buffer = torch.randn(B, N, d_a, generator=gen, dtype=torch.float64)

    def critic(x, a):
        target = torch.einsum("bx,nxa->bna", x, M)
        return -((a - target) ** 2).sum((-1, -2)) + torch.einsum("bi,ij,bj->b", a[:, 0], Cm, a[:, 1])

    for i in range(N):
        K = torch.randn(d_o, d_a, generator=gen, dtype=torch.float64, requires_grad=True)
        o_i = x @ O[i]

        def loss(K, o_i=o_i, i=i):
            return C.maddpg_actor_loss(critic, x, buffer, o_i @ K, i)

        g = torch.autograd.grad(loss(K), K)[0]
        with torch.no_grad():
            a = buffer.clone()
            a[:, i] = o_i @ K
            dQ = -2 * (a[:, i] - x @ M[i])
            if i == 0:
                dQ += a[:, 1] @ Cm.T
            if i == 1:
                dQ += a[:, 0] @ Cm
            closed = -(o_i.T @ dQ) / B  # gradient of the loss -E[Q]
            torch.testing.assert_close(g, closed, atol=1e-12, rtol=0)
            h, E = 1e-6, torch.zeros_like(K)
            E[1, 0] = h
            fd = (loss(K + E) - loss(K - E)) / (2 * h)
            assert fd.item() == pytest.approx(g[1, 0].item(), abs=1e-7)
    # the other agents' buffered actions carry no gradient
    buf = buffer.clone().requires_grad_()
    C.maddpg_actor_loss(critic, x, buf, torch.zeros(B, d_a, dtype=torch.float64, requires_grad=True), 0).backward()
    assert buf.grad is None or (buf.grad == 0).all()
    with pytest.raises(ValueError, match="i must be"):
        C.maddpg_actor_loss(critic, x, buffer, buffer[:, 0], 3)


# ----------------------------------------------------------------------------- learning on a matrix game
COORD = torch.tensor([[8.0, -12.0, -12.0], [-12.0, 0.0, 0.0], [-12.0, 0.0, 0.0]], dtype=torch.float64)


def _mixer_params(R=3, N=2, E=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((R, N, E), (R, E), (R, E), (R,))]


@pytest.mark.equation("39.04", oracle="torch.autograd gradients; the mixing formula in numpy")
def test_monotonic_mix_formula_and_monotonicity():
    W1, b1, W2, b2 = _mixer_params()
    Q = (3 * torch.randn(3, 50, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)).requires_grad_()
    out = C.monotonic_mix(Q, W1, b1, W2, b2)
    q, w1, w2 = Q.detach().numpy(), np.abs(W1.numpy()), np.abs(W2.numpy())
    z = np.einsum("rbn,rne->rbe", q, w1) + b1.numpy()[:, None]
    h = np.where(z > 0, z, np.expm1(z))  # ELU
    ref = (h * w2[:, None]).sum(-1) + b2.numpy()[:, None]
    np.testing.assert_allclose(out.detach().numpy(), ref, atol=1e-12)
    g = torch.autograd.grad(out.sum(), Q)[0]
    assert (g >= 0).all()
    g_free = torch.autograd.grad(C.monotonic_mix(Q, W1, b1, W2, b2, monotonic=False).sum(), Q)[0]
    assert (g_free < 0).any()  # the counter-example: without abs the mixer is not monotone
    with pytest.raises(ValueError, match="W2 must be"):
        C.monotonic_mix(Q, W1, b1, W2[:, :2], b2)


def _lstsq_additive(payoff):
    A1, A2 = payoff.shape
    X = torch.zeros(A1 * A2, A1 + A2, dtype=torch.float64)
    for a1, a2 in itertools.product(range(A1), range(A2)):
        X[A2 * a1 + a2, a1] = X[A2 * a1 + a2, A1 + a2] = 1.0
    w = torch.linalg.lstsq(X, payoff.reshape(-1, 1), driver="gelsd").solution
    return (X @ w).reshape(A1, A2)


def test_training_converges_to_the_least_squares_fits_under_uniform_data():
    """Uniform exploration: VDN's Q_tot -> the least-squares additive fit (torch.linalg.lstsq), an independent
    learner's Q_i(a) -> the payoff's mean over the partner's uniform actions; within 4 standard errors."""
    R = 40
    kw = dict(runs=R, steps=500, eps_start=1.0, eps_end=1.0, generator=torch.Generator().manual_seed(0))
    vdn_run = C.train_matrix_game(COORD, "vdn", **kw)
    Q_tot = vdn_run["Q_tot"]
    se = (Q_tot.std(0) / R**0.5).max()
    assert (Q_tot.mean(0) - _lstsq_additive(COORD)).abs().max() < 4 * se
    assert not vdn_run["optimal"][-1].any()  # the additive fit misses (0, 0)
    kw["generator"] = torch.Generator().manual_seed(0)
    ind = C.train_matrix_game(COORD, "independent", **kw)
    for i, means in enumerate((COORD.mean(1), COORD.mean(0))):
        se = (ind["Q"][i].std(0) / R**0.5).max()
        assert (ind["Q"][i].mean(0) - means).abs().max() < 4 * se
    assert ind["Q_tot"] is None


@pytest.mark.parametrize("method", ["independent", "vdn", "qmix"])
def test_factorisable_payoff_is_fitted_and_solved(method):
    """On an additive payoff u_i + v_j every method can represent the team value; all runs find the optimum,
    and VDN / QMIX fit every entry (the exploration covers all joint actions)."""
    u, v = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64), torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    payoff = u[:, None] + v[None, :]
    out = C.train_matrix_game(payoff, method, runs=10, steps=600, eps_end=0.3, lr=0.05)
    assert out["optimal"][-1].all()
    assert (out["greedy"][-1] == torch.tensor([1, 0])).all()
    if method != "independent":
        assert (out["Q_tot"] - payoff).abs().mean() < 0.1


def test_qmix_fits_a_monotone_non_additive_payoff_better_than_vdn():
    payoff = torch.tensor([[0.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # monotone in each agent, not a sum
    kw = dict(runs=10, steps=800, eps_start=1.0, eps_end=1.0)
    err = {m: (C.train_matrix_game(payoff, m, **kw)["Q_tot"] - payoff).abs().max(-1).values.max(-1).values.mean()
           for m in ("vdn", "qmix")}
    assert abs(err["vdn"] - 1.0) < 0.2  # the best additive fit is off by exactly 1 on every entry
    assert err["qmix"] < 0.4


def test_train_matrix_game_bad_input():
    with pytest.raises(ValueError, match="method"):
        C.train_matrix_game(COORD, "qtran")
    with pytest.raises(ValueError, match="N >= 2"):
        C.train_matrix_game(torch.zeros(3), "vdn")
    with pytest.raises(ValueError, match="eps_end"):
        C.train_matrix_game(COORD, "vdn", eps_end=2.0)
