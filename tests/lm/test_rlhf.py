"""Chapter 10, RLHF (10.01, 10.04-10.07, 10.14-10.17), claim C15, and the Try-it numbers.

Oracles: ``torch.nn.functional.cross_entropy``, ``torch.distributions.kl_divergence`` on categoricals,
``scipy.signal.lfilter`` (GAE as a discounted cumulative sum) and a brute-force double loop,
float64 closed forms written out element by element, leave-one-out loops, ``F.mse_loss`` and autograd.

Tolerances, stated once: float64 against an oracle ``rtol = atol = 1e-12`` (``F64``); float32
against a float64 reference relative ``1e-6`` (``F32``).
"""

import math

import numpy as np
import pytest
import scipy.signal
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from llmbook.lm import rlhf

F64 = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=1e-6, atol=1e-6)


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- 10.01 SFT


@pytest.mark.equation("10.01", oracle="F.cross_entropy(reduction='sum', ignore_index=-100) / B")
def test_sft_loss():
    g = gen(0)
    logits = 2 * torch.randn(4, 9, 17, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 17, (4, 9), generator=g)
    labels[:, :3] = -100  # prompt tokens do not count
    labels[2, -3:] = -100  # padding
    ref = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum") / 4
    torch.testing.assert_close(rlhf.sft_loss(logits, labels), ref, **F64)
    per_example = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(-1)
    torch.testing.assert_close(rlhf.sft_loss(logits, labels, reduction="none"), per_example, **F64)
    with pytest.raises(ValueError, match="token ids"):
        rlhf.sft_loss(logits, labels.masked_fill(labels == -100, -1))


# --------------------------------------------------------------------------- 10.04 the KL-regularised objective


@pytest.mark.equation("10.04", oracle="torch.distributions.kl_divergence(Categorical, Categorical); E[r] by sum")
def test_kl_regularized_objective():
    g = gen(1)
    log_pi = torch.log_softmax(2 * torch.randn(6, 10, generator=g, dtype=torch.float64), -1)
    log_pi_ref = torch.log_softmax(torch.randn(6, 10, generator=g, dtype=torch.float64), -1)
    r = torch.randn(6, 10, generator=g, dtype=torch.float64)
    beta = 0.3
    kl = kl_divergence(Categorical(logits=log_pi), Categorical(logits=log_pi_ref))
    ref = (log_pi.exp() * r).sum(-1) - beta * kl
    torch.testing.assert_close(rlhf.kl_regularized_objective(r, log_pi, log_pi_ref, beta), ref, **F64)
    # a response the policy never produces adds nothing, even where pi_ref is 0 too
    log_pi[0, 0] = -math.inf
    log_pi_ref[0, 0] = -math.inf
    assert torch.isfinite(rlhf.kl_regularized_objective(r, log_pi, log_pi_ref, beta)).all()


def test_kl_penalized_reward_is_an_unbiased_sample_of_the_objective():
    """Monte Carlo: the mean of r - beta (log pi - log pi_ref) over y ~ pi approaches the exact objective."""
    g = gen(2)
    log_pi = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64), -1)
    log_pi_ref = torch.log_softmax(torch.randn(12, generator=g, dtype=torch.float64), -1)
    r = torch.randn(12, generator=g, dtype=torch.float64)
    y = torch.multinomial(log_pi.exp(), 200_000, replacement=True, generator=g)
    sampled = rlhf.kl_penalized_reward(r[y], log_pi[y], log_pi_ref[y], 0.5)
    exact = rlhf.kl_regularized_objective(r, log_pi, log_pi_ref, 0.5)
    assert abs(sampled.mean() - exact) < 4 * sampled.std() / math.sqrt(len(y))


def test_optimal_policy_has_zero_gradient():
    """The objective's gradient w.r.t. the logits of pi vanishes at pi* (autograd)."""
    g = gen(3)
    log_pi_ref = torch.log_softmax(torch.randn(3, 7, generator=g, dtype=torch.float64), -1)
    r = torch.randn(3, 7, generator=g, dtype=torch.float64)
    z = rlhf.optimal_policy(log_pi_ref, r, 0.2).clone().requires_grad_()
    rlhf.kl_regularized_objective(r, torch.log_softmax(z, -1), log_pi_ref, 0.2).sum().backward()
    assert z.grad.abs().max() < 1e-12


# --------------------------------------------------------------------------- 10.05, 10.06 PPO


def ppo_reference(logp, logp_old, A, eps):
    """PPO's clipped surrogate written element by element in float64 Python."""
    out = []
    for lp, lo, a in zip(logp.flatten().tolist(), logp_old.flatten().tolist(), A.flatten().tolist(), strict=True):
        rho = math.exp(lp - lo)
        out.append(min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a))
    return torch.tensor(out, dtype=torch.float64).reshape(logp.shape)


@pytest.mark.equation("10.05", oracle="float64 element-by-element min(rho A, clip(rho) A); autograd zero when clipped")
def test_ppo_clip_objective():
    g = gen(4)
    logp_old = -3 * torch.rand(5, 7, generator=g, dtype=torch.float64)
    logp = logp_old + 0.4 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    A = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) < 0.8
    ref = ppo_reference(logp, logp_old, A, 0.2)
    torch.testing.assert_close(rlhf.ppo_clip_objective(logp, logp_old, A, 0.2), ref.mean(), **F64)
    torch.testing.assert_close(rlhf.ppo_clip_objective(logp, logp_old, A, 0.2, mask=mask), ref[mask].mean(), **F64)
    # autograd: the gradient is rho A / N inside the trust region, and exactly 0 where clipping binds
    lp = logp.clone().requires_grad_()
    rlhf.ppo_clip_objective(lp, logp_old, A, 0.2).backward()
    rho = torch.exp(logp - logp_old)
    clipped = ((rho > 1.2) & (A > 0)) | ((rho < 0.8) & (A < 0))
    assert clipped.any() and (~clipped).any()
    assert (lp.grad[clipped] == 0).all()
    torch.testing.assert_close(lp.grad[~clipped], (rho * A)[~clipped] / A.numel(), **F64)
    # at rho = 1 the objective is the mean advantage
    torch.testing.assert_close(rlhf.ppo_clip_objective(logp_old, logp_old, A), A.mean(), **F64)
    # float32 against float64
    torch.testing.assert_close(rlhf.ppo_clip_objective(logp.float(), logp_old.float(), A.float()).double(),
                               ref.mean(), **F32)
    with pytest.raises(TypeError, match="bool"):
        rlhf.ppo_clip_objective(logp, logp_old, A, mask=mask.double())


@pytest.mark.equation("10.06", oracle="F.mse_loss; float64 max((V-R)^2, (V_old + clip(V - V_old) - R)^2) by hand")
def test_value_loss():
    g = gen(5)
    V, R, V_old = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(rlhf.value_loss(V, R), F.mse_loss(V, R), **F64)
    mask = torch.rand(4, 6, generator=g) < 0.6
    torch.testing.assert_close(rlhf.value_loss(V, R, mask=mask), F.mse_loss(V[mask], R[mask]), **F64)
    expected = []
    for v, rr, vo in zip(V.flatten().tolist(), R.flatten().tolist(), V_old.flatten().tolist(), strict=True):
        v_clip = vo + min(max(v - vo, -0.1), 0.1)
        expected.append(max((v - rr) ** 2, (v_clip - rr) ** 2))
    expected = torch.tensor(expected, dtype=torch.float64).mean()
    torch.testing.assert_close(rlhf.value_loss(V, R, V_old=V_old, eps_v=0.1), expected, **F64)


# --------------------------------------------------------------------------- 10.07 GAE


def gae_loop(r, V, gamma, lam):
    """Brute force: the double sum over t and l, in float64 Python."""
    B, T = r.shape
    A = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            for l_ in range(T - t):
                delta = r[b, t + l_] + gamma * V[b, t + l_ + 1] - V[b, t + l_]
                A[b, t] += (gamma * lam) ** l_ * delta
    return A


@pytest.mark.equation("10.07", oracle="scipy.signal.lfilter discounted cumulative sum of TD errors; brute-force loop")
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.0), (1.0, 1.0), (0.5, 0.3)])
def test_gae(gamma, lam):
    g = gen(6)
    r = torch.randn(3, 12, generator=g, dtype=torch.float64)
    V = torch.randn(3, 13, generator=g, dtype=torch.float64)
    A = rlhf.gae(r, V, gamma, lam)
    delta = (r + gamma * V[:, 1:] - V[:, :-1]).numpy()
    discounted = scipy.signal.lfilter([1.0], [1.0, -gamma * lam], delta[:, ::-1], axis=1)[:, ::-1]
    np.testing.assert_allclose(A.numpy(), discounted, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(A.numpy(), gae_loop(r.numpy(), V.numpy(), gamma, lam), rtol=1e-12, atol=1e-12)


def test_gae_limits():
    """lam = 0: the TD error; lam = 1: the discounted return minus V(s_t)."""
    g = gen(7)
    r = torch.randn(2, 8, generator=g, dtype=torch.float64)
    V = torch.randn(2, 9, generator=g, dtype=torch.float64)
    torch.testing.assert_close(rlhf.gae(r, V, 0.9, 0.0), r + 0.9 * V[:, 1:] - V[:, :-1], **F64)
    G = torch.zeros(2, dtype=torch.float64) + V[:, -1]
    returns = torch.zeros_like(r)
    for t in range(7, -1, -1):
        G = r[:, t] + 0.9 * G
        returns[:, t] = G
    torch.testing.assert_close(rlhf.gae(r, V, 0.9, 1.0), returns - V[:, :-1], **F64)
    with pytest.raises(ValueError, match="T \\+ 1"):
        rlhf.gae(r, V[:, :-1])


# --------------------------------------------------------------------------- 10.14 - 10.16 GRPO and RLOO


@pytest.mark.equation("10.14", oracle="float64 closed form (r - mean) / (std_{G-1} + eps) with numpy; per-group loop")
def test_grpo_advantages():
    g = gen(8)
    r = torch.randn(5, 6, generator=g, dtype=torch.float64)
    A = rlhf.grpo_advantages(r, eps=1e-4)
    rn = r.numpy()
    ref = (rn - rn.mean(1, keepdims=True)) / (rn.std(1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(A.numpy(), ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(rlhf.grpo_advantages(torch.ones(3, 4)), torch.zeros(3, 4))  # all equal: no signal, no NaN
    assert torch.equal(rlhf.grpo_advantages(torch.ones(3, 4), eps=0.0), torch.zeros(3, 4))  # not 0 / 0
    binary = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # a verifier's 0/1 reward: one success in four
    torch.testing.assert_close(rlhf.grpo_advantages(binary, eps=0.0),
                               torch.tensor([[1.5, -0.5, -0.5, -0.5]]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="G >= 2"):
        rlhf.grpo_advantages(torch.ones(3, 1))


@pytest.mark.equation("10.16", oracle="leave-one-out brute force loop; float64 k/(k-1) (r_i - mean)")
def test_rloo_advantages():
    g = gen(9)
    r = torch.randn(4, 5, generator=g, dtype=torch.float64)
    A = rlhf.rloo_advantages(r)
    brute = torch.tensor([[r[b, i].item() - np.mean([r[b, j].item() for j in range(5) if j != i]) for i in range(5)]
                          for b in range(4)], dtype=torch.float64)
    torch.testing.assert_close(A, brute, **F64)
    torch.testing.assert_close(A, 5 / 4 * (r - r.mean(-1, keepdim=True)), **F64)


@pytest.mark.equation("10.15", oracle="float64 element-wise PPO surrogate and k3 KL, per-response then group mean")
def test_grpo_objective():
    g = gen(10)
    G, T = 4, 6
    logp_old = -2 * torch.rand(G, T, generator=g, dtype=torch.float64)
    logp = logp_old + 0.3 * torch.randn(G, T, generator=g, dtype=torch.float64)
    logp_ref = logp_old + 0.2 * torch.randn(G, T, generator=g, dtype=torch.float64)
    A = rlhf.grpo_advantages(torch.randn(G, generator=g, dtype=torch.float64))
    mask = torch.ones(G, T, dtype=torch.bool)
    mask[1, 4:] = False
    beta, eps = 0.04, 0.2
    surr = ppo_reference(logp, logp_old, A[:, None].expand(G, T), eps)
    kl = torch.tensor([[math.exp(b - a) - (b - a) - 1 for a, b in zip(ra, rb, strict=True)]
                       for ra, rb in zip(logp.tolist(), logp_ref.tolist(), strict=True)], dtype=torch.float64)
    per_token = surr - beta * kl
    ref = torch.stack([per_token[i][mask[i]].mean() for i in range(G)]).mean()
    torch.testing.assert_close(rlhf.grpo_objective(logp, logp_old, logp_ref, A, eps, beta, mask), ref, **F64)
    assert (kl >= 0).all()


def test_claim_c15_group_baseline_replaces_the_value_network():
    """Zero-mean advantages per group; GRPO (beta = 0, equal lengths) is PPO's clip with those advantages."""
    g = gen(11)
    r = torch.rand(8, 6, generator=g, dtype=torch.float64).round()  # 8 prompts x 6 responses, 0/1 rewards
    r[0] = 1.0  # a group where every response succeeded
    A = rlhf.grpo_advantages(r)
    assert A.sum(-1).abs().max() < 1e-12
    assert rlhf.rloo_advantages(r).sum(-1).abs().max() < 1e-12
    G, T = 6, 5
    logp_old = -torch.rand(G, T, generator=g, dtype=torch.float64)
    logp = logp_old + 0.3 * torch.randn(G, T, generator=g, dtype=torch.float64)
    grpo = rlhf.grpo_objective(logp, logp_old, logp, A[3], beta=0.0)
    ppo = rlhf.ppo_clip_objective(logp, logp_old, A[3][:, None].expand(G, T))
    torch.testing.assert_close(grpo, ppo, **F64)
    torch.testing.assert_close(grpo, ppo_reference(logp, logp_old, A[3][:, None].expand(G, T), 0.2).mean(), **F64)


# --------------------------------------------------------------------------- 10.17 rejection sampling


@pytest.mark.equation("10.17", oracle="python filter of the kept responses, float64 mean of -log p; best-of-n loop")
def test_rejection_sampling_loss():
    g = gen(12)
    logp = -10 * torch.rand(20, generator=g, dtype=torch.float64)
    r = torch.randn(20, generator=g, dtype=torch.float64)
    kept = [-lp for lp, rr in zip(logp.tolist(), r.tolist(), strict=True) if rr >= 0.3]
    assert rlhf.rejection_sampling_loss(logp, r, 0.3).item() == pytest.approx(np.mean(kept), abs=1e-12)
    # best-of-n: 5 prompts x 4 samples, the per-prompt maximum as threshold keeps one response per prompt
    best = r.reshape(5, 4).max(-1, keepdim=True).values.expand(5, 4).reshape(20)
    loss = rlhf.rejection_sampling_loss(logp, r, best, reduction="none")
    assert int((loss != 0).sum()) == 5
    expected = [-logp[4 * i + int(r[4 * i:4 * i + 4].argmax())].item() for i in range(5)]
    assert rlhf.rejection_sampling_loss(logp, r, best).item() == pytest.approx(np.mean(expected), abs=1e-12)
    with pytest.raises(ValueError, match="no reward reaches tau"):
        rlhf.rejection_sampling_loss(logp, r, 100.0)


# --------------------------------------------------------------------------- Try it (book/10-alignment.ipynb)


def minus(x: str) -> str:
    return x.replace("-", "−")


def test_try_it_kl_leash_and_group_advantages():
    """Try it 1 (pi*(e) after "The return valu" for three betas) and 2 (a lone success in a group of 8)."""
    from llmbook.lm.training import pretrained_tiny
    from tests.try_it import assert_states

    model, tok = pretrained_tiny()
    e = int(tok.encode("e")[0])
    with torch.no_grad():
        z = model(torch.as_tensor(tok.encode("The return valu"), dtype=torch.long)[None])[0, -1]
    log_pi_ref = torch.log_softmax(z.double(), -1)
    r = -(torch.arange(len(z)) == e).double()
    stated = [f"{log_pi_ref[e].exp().item():.4f}"]
    for beta in (1.0, 0.2, 0.1):
        pi = rlhf.optimal_policy(log_pi_ref, r, beta).exp()
        closed = log_pi_ref.exp() * torch.exp(r / beta)  # oracle: normalise pi_ref e^{r / beta} by hand
        torch.testing.assert_close(pi, closed / closed.sum(), **F64)
        stated.append(f"{pi[e].item():.4f}")
    top = rlhf.optimal_policy(log_pi_ref, r, 0.1).exp().topk(2)
    assert [tok.decode([int(i)]) for i in top.indices] == ["a", "i"]
    stated += [f"({v:.4f})" for v in top.values.tolist()]
    p = log_pi_ref[e].exp().item()
    beta_half = 1 / math.log(p / (1 - p))
    assert rlhf.optimal_policy(log_pi_ref, r, beta_half).exp()[e].item() == pytest.approx(0.5, abs=1e-9)
    stated += [f"{beta_half:.3f}", f"{math.log(p / (1 - p)):.1f} nats"]
    # 2. one success in a group of eight, and no success at all
    r8 = torch.tensor([1.0] + [0.0] * 7, dtype=torch.float64)
    A_g, A_r = rlhf.grpo_advantages(r8, eps=0.0), rlhf.rloo_advantages(r8)
    assert A_g[0].item() == pytest.approx(0.875 / math.sqrt(1 / 8), abs=1e-12)  # closed form (1 - 1/8) / sqrt(1/8)
    assert A_r[1].item() == pytest.approx(-1 / 7, abs=1e-12)
    assert A_g[0] / -A_g[1] == pytest.approx(7.0) and A_r[0] / -A_r[1] == pytest.approx(7.0)
    assert torch.equal(rlhf.grpo_advantages(torch.zeros(8), eps=0.0), torch.zeros(8))
    stated += [f"{A_g[0].item():.3f}", minus(f"{A_g[1].item():.3f}"), f"{A_r[0].item():.3f}",
               minus(f"{A_r[1].item():.3f}"), f"{math.sqrt(1 / 8):.3f}"]
    assert_states("10-alignment.ipynb", stated)


def test_gae_zero_padding_ends_each_response():
    """Two responses of lengths 3 and 5 in one (2, 5) batch: zero-padded r and V give each its own GAE."""
    g = gen(13)
    r = torch.randn(2, 5, generator=g, dtype=torch.float64)
    V = torch.randn(2, 6, generator=g, dtype=torch.float64)
    r[0, 3:], V[0, 3:] = 0.0, 0.0
    V[1, 5] = 0.0
    A = rlhf.gae(r, V, 0.99, 0.9)
    alone = rlhf.gae(r[:1, :3], torch.cat([V[:1, :3], torch.zeros(1, 1, dtype=torch.float64)], 1), 0.99, 0.9)
    torch.testing.assert_close(A[:1, :3], alone, **F64)
    assert (A[0, 3:] == 0).all()


@pytest.mark.parametrize("call,err", [
    (lambda: rlhf.ppo_clip_objective(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3)), ValueError),
    (lambda: rlhf.ppo_clip_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), eps=1.5), ValueError),
    (lambda: rlhf.ppo_clip_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[0.0, math.nan, 0.0]] * 2)),
     ValueError),
    (lambda: rlhf.ppo_clip_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                     mask=torch.zeros(2, 3, dtype=torch.bool)), ValueError),
    (lambda: rlhf.gae(torch.zeros(2, 3), torch.zeros(2, 4), gamma=1.5), ValueError),
    (lambda: rlhf.gae(torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 4)), TypeError),
    (lambda: rlhf.value_loss(torch.zeros(0, 3), torch.zeros(0, 3)), ValueError),
    (lambda: rlhf.grpo_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3)), ValueError),
    (lambda: rlhf.grpo_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), beta=-1.0),
     ValueError),
    (lambda: rlhf.rloo_advantages(torch.zeros(4, 1)), ValueError),
    (lambda: rlhf.kl_regularized_objective(torch.zeros(3), torch.zeros(3), torch.zeros(3), beta=0), ValueError),
    (lambda: rlhf.sft_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3)), TypeError),
    (lambda: rlhf.rejection_sampling_loss(torch.zeros(3), torch.zeros(3), tau=True), TypeError),
])
def test_rlhf_bad_input_raises_clearly(call, err):
    with pytest.raises(err):
        call()


def test_rejection_sampling_threshold_tensor_errors():
    logp, r = -torch.ones(6), torch.arange(6.0)
    with pytest.raises(ValueError, match="broadcast"):
        rlhf.rejection_sampling_loss(logp, r, torch.zeros(4))
    with pytest.raises(TypeError):
        rlhf.rejection_sampling_loss(logp, r, torch.zeros(6, dtype=torch.bool))
    assert rlhf.rejection_sampling_loss(logp, r, torch.tensor(4.0)).item() == 1.0  # a 0-d tensor threshold
