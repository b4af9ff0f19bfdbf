"""Tests of llmbook.agents.memory.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` with ``scale=1`` (memory read), float64 closed
forms written from Park et al.'s definitions with numpy (episodic score), ``math.exp`` / ``math.log`` (decay and
half-life), a brute-force Python loop over pairs with ``math`` cosines (write decision), and a Python loop that
sorts each row by hand (retrieval-augmented policy).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.agents import memory as MEM


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.equation("42.01", oracle="torch.nn.functional.scaled_dot_product_attention with scale=1, float64")
def test_memory_read_matches_torch_sdpa():
    B, N, D, Dv = 3, 7, 5, 4
    q = torch.randn(B, D, generator=_g(), dtype=torch.float64)
    K = torch.randn(B, N, D, generator=_g(1), dtype=torch.float64)
    M = torch.randn(B, N, Dv, generator=_g(2), dtype=torch.float64)
    c, alpha = MEM.memory_read(q, K, M, return_weights=True)
    ref = F.scaled_dot_product_attention(q[:, None], K, M, scale=1.0)[:, 0]
    torch.testing.assert_close(c, ref, atol=1e-12, rtol=0)
    # weights against a numpy softmax of q.k (no 1/sqrt(D)): the default scale is 1
    s = np.einsum("bd,bnd->bn", q.numpy(), K.numpy())
    a = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(alpha.numpy(), a / a.sum(1, keepdims=True), atol=1e-12)
    # a different scale changes the read, and it matches torch's too
    c2 = MEM.memory_read(q, K, M, scale=1 / math.sqrt(D))
    torch.testing.assert_close(c2, F.scaled_dot_product_attention(q[:, None], K, M)[:, 0], atol=1e-12, rtol=0)
    assert (c2 - c).abs().max() > 1e-3


def test_memory_read_contract():
    with pytest.raises(ValueError, match="one B and one N"):
        MEM.memory_read(torch.zeros(2, 3), torch.zeros(2, 4, 3), torch.zeros(2, 5, 1))
    with pytest.raises(ValueError, match="scale"):
        MEM.memory_read(torch.zeros(1, 3), torch.zeros(1, 4, 3), torch.zeros(1, 4, 1), scale=0.0)


def _minmax_np(x):
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(hi > lo, (x - lo) / np.where(hi > lo, hi - lo, 1), 0.5)


@pytest.mark.equation("42.02", oracle="float64 numpy closed form of Park et al.'s min-max normalised weighted sum")
def test_episodic_score_matches_closed_form():
    rng = np.random.default_rng(0)
    rel, rec, sal = rng.normal(size=(4, 9)), rng.uniform(size=(4, 9)), rng.integers(1, 11, size=(4, 9)) * 1.0
    sal[1] = 5.0  # a constant component: 0.5 for every candidate
    w = (1.0, 0.5, 2.0)
    ours = MEM.episodic_score(torch.tensor(rel), torch.tensor(rec), torch.tensor(sal),
                              lambda_r=w[0], lambda_t=w[1], lambda_s=w[2])
    ref = w[0] * _minmax_np(rel) + w[1] * _minmax_np(rec) + w[2] * _minmax_np(sal)
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-12)
    assert ours.min() >= 0 and ours.max() <= sum(w) + 1e-12
    raw = MEM.episodic_score(torch.tensor(rel), torch.tensor(rec), torch.tensor(sal), normalize=False)
    np.testing.assert_allclose(raw.numpy(), rel + rec + sal, atol=1e-12)
    # without normalisation the 1-10 salience dominates the top pick; with it, it does not always
    assert not np.array_equal(ours.argmax(-1).numpy(), raw.argmax(-1).numpy())


@pytest.mark.equation("42.03", oracle="math.exp per element and the half-life identity ln 2 / lambda")
def test_exponential_decay_and_half_life():
    t_i = torch.tensor([0.0, 3.5, 10.0, 17.25], dtype=torch.float64)
    lam = 0.13
    ours = MEM.exponential_decay(20.0, t_i, lam)
    ref = [math.exp(-lam * (20.0 - x)) for x in t_i.tolist()]
    assert ours.tolist() == pytest.approx(ref, rel=1e-14)
    h = MEM.half_life(lam)
    assert h == pytest.approx(math.log(2) / lam, rel=1e-15)
    half = MEM.exponential_decay(torch.tensor(5.0 + h, dtype=torch.float64), torch.tensor([5.0], dtype=torch.float64),
                                 lam)
    assert half.item() == pytest.approx(0.5, abs=1e-14)
    # Generative Agents' 0.995 per hour: half-life of 138.3 hours
    assert MEM.half_life(-math.log(0.995)) == pytest.approx(math.log(2) / -math.log(0.995), rel=1e-15)
    assert MEM.half_life(0.0) == math.inf
    with pytest.raises(ValueError, match="future"):
        MEM.exponential_decay(1.0, torch.tensor([2.0]), 0.1)


def _cos(a, b):
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    if na == 0 or nb == 0:
        return 0.0
    return sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)


@pytest.mark.equation("42.04", oracle="brute-force Python loop over all (candidate, memory) pairs with math cosines")
def test_write_decision_brute_force():
    g = _g(3)
    m = torch.randn(12, 4, generator=g, dtype=torch.float64)
    M = torch.randn(6, 4, generator=g, dtype=torch.float64)
    m[0] = 2.0 * M[2]  # a duplicate up to scale: novelty 0
    m[1] = 0.0  # a zero vector: cosine 0 with everything, novelty 1
    imp = torch.rand(12, generator=g, dtype=torch.float64)
    d = MEM.write_decision(m, M, imp, tau_n=0.3, tau_i=0.4)
    for b in range(12):
        nov = 1 - max(_cos(m[b].tolist(), M[j].tolist()) for j in range(6))
        assert d.novelty[b].item() == pytest.approx(nov, abs=1e-12)
        assert bool(d.write[b]) == (nov > 0.3 and imp[b].item() > 0.4)
    assert d.novelty[0].item() == pytest.approx(0.0, abs=1e-12) and not d.write[0]
    assert d.write.any() and not d.write.all()
    # the stream version against a loop that keeps a Python list
    E = torch.randn(30, 3, generator=g, dtype=torch.float64)
    imp = torch.rand(30, generator=g, dtype=torch.float64)
    kept = []
    for t in range(30):
        nov = 1 - max((_cos(E[t].tolist(), E[j].tolist()) for j in kept), default=0.0)
        if nov > 0.2 and imp[t].item() > 0.3:
            kept.append(t)
    ours = MEM.write_stream(E, imp, tau_n=0.2, tau_i=0.3)
    assert torch.nonzero(ours).flatten().tolist() == kept
    assert 0 < len(kept) < 30


@pytest.mark.equation("42.05", oracle="Python loop: sort each row by hand, softmax of the k best stored scores")
def test_retrieval_augmented_policy_loop():
    g = _g(5)
    B, N, k, tau = 5, 11, 3, 0.7
    s = torch.randn(B, N, generator=g, dtype=torch.float64)
    s[0, 4] = -math.inf  # not retrievable
    mem = torch.rand(B, N, generator=g) > 0.4
    mem[3] = False  # nothing stored: the prior acts
    prior = torch.softmax(torch.randn(N, generator=g, dtype=torch.float64), 0)
    pi = MEM.retrieval_augmented_policy(s, mem, k=k, tau=tau, prior=prior)
    for b in range(B):
        cand = sorted((j for j in range(N) if mem[b, j] and math.isfinite(s[b, j].item())),
                      key=lambda j: -s[b, j].item())[:k]
        if not cand:
            ref = prior.tolist()
        else:
            z = sum(math.exp(s[b, j].item() / tau) for j in cand)
            ref = [math.exp(s[b, j].item() / tau) / z if j in cand else 0.0 for j in range(N)]
        assert pi[b].tolist() == pytest.approx(ref, abs=1e-12)
    torch.testing.assert_close(pi.sum(-1), torch.ones(B, dtype=torch.float64))


def test_try_it_numbers_of_chapter_42():
    from tests.try_it import assert_states

    h = MEM.half_life(-math.log(0.995))
    day = MEM.exponential_decay(24.0, torch.tensor([0.0], dtype=torch.float64), -math.log(0.995)).item()
    q, K, M = torch.tensor([[1.0, 0.0]]), torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]), torch.tensor([[[10.0], [0.0]]])
    stated = [f"{h:.1f} hours", f"{day:.4f}"]
    for scale in (1.0, 5.0):
        c, a = MEM.memory_read(q.double(), K.double(), M.double(), scale=scale, return_weights=True)
        ref = [math.exp(scale) / (math.exp(scale) + 1), 1 / (math.exp(scale) + 1)]  # closed-form softmax of (s, 0)
        assert a[0].tolist() == pytest.approx(ref, abs=1e-12)
        stated += [f"({a[0, 0].item():.4f}, {a[0, 1].item():.4f})", f"{c.item():.3f}"]
    assert_states("42-memory.ipynb", stated)
