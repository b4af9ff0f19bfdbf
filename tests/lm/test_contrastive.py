"""Chapter 7, contrastive and metric losses: 07.03 InfoNCE, 07.04 NT-Xent, 07.05 triplet loss.

Tolerances, stated once:

* float64 against torch.nn.functional on independently built logits, or a float64 brute force:
  ``rtol = atol = 1e-12`` (``F64``);
* float32 inputs of magnitude 1e30 against the float64 torch result: relative ``1e-6``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.contrastive import info_nce, nt_xent, triplet_loss

F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def emb(*shape, seed=0):
    return torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def cosine_matrix(a, b):
    """Pairwise cosines by torch's own F.cosine_similarity (broadcast), independent of llmbook."""
    return F.cosine_similarity(a[:, None, :], b[None, :, :], dim=-1, eps=0.0)


# ================================================================= 07.03 InfoNCE


@pytest.mark.equation("07.03", oracle="torch.nn.functional.cross_entropy on F.cosine_similarity logits (CLIP)")
@pytest.mark.parametrize("tau", [0.07, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_in_batch_info_nce_is_cross_entropy_over_similarity_logits(tau, reduction):
    q, k = emb(6, 5, seed=1), emb(6, 5, seed=2)
    logits = cosine_matrix(q, k) / tau
    labels = torch.arange(6)
    torch.testing.assert_close(info_nce(q, k, tau=tau, reduction=reduction),
                               F.cross_entropy(logits, labels, reduction=reduction), **F64)
    clip = (F.cross_entropy(logits, labels, reduction=reduction)
            + F.cross_entropy(logits.T, labels, reduction=reduction)) / 2
    torch.testing.assert_close(info_nce(q, k, tau=tau, symmetric=True, reduction=reduction), clip, **F64)
    torch.testing.assert_close(info_nce(q, k, tau=tau, similarity="dot", reduction=reduction),
                               F.cross_entropy(q @ k.T / tau, labels, reduction=reduction), **F64)


@pytest.mark.equation("07.03", oracle="float64 brute force of the InfoNCE fraction; F.cross_entropy (MoCo queue)")
@pytest.mark.parametrize("shared", [True, False])
def test_info_nce_with_explicit_negatives_matches_the_equation(shared):
    B, N, D, tau = 4, 7, 5, 0.2
    q, k = emb(B, D, seed=3), emb(B, D, seed=4)
    neg = emb(N, D, seed=5) if shared else emb(B, N, D, seed=5)
    ours = info_nce(q, k, neg, tau=tau, reduction="none")
    for b in range(B):
        negs = neg if shared else neg[b]
        pos = math.exp(F.cosine_similarity(q[b], k[b], dim=0).item() / tau)
        others = sum(math.exp(F.cosine_similarity(q[b], negs[j], dim=0).item() / tau) for j in range(N))
        assert ours[b].item() == pytest.approx(-math.log(pos / (pos + others)), rel=1e-12, abs=1e-12)
    # MoCo's form: logits [l_pos, l_neg] with label 0
    l_pos = F.cosine_similarity(q, k, dim=-1)[:, None]
    l_neg = cosine_matrix(q, neg) if shared else F.cosine_similarity(q[:, None], neg, dim=-1)
    ref = F.cross_entropy(torch.cat([l_pos, l_neg], 1) / tau, torch.zeros(B, dtype=torch.long))
    torch.testing.assert_close(info_nce(q, k, neg, tau=tau), ref, **F64)


@SETTINGS
@given(B=st.integers(1, 8), tau=st.floats(0.05, 2.0), seed=st.integers(0, 1000))
def test_cosine_info_nce_lies_between_its_bounds_and_ignores_the_norms(B, tau, seed):
    """With cosines in [-1, 1]: log(1 + (B-1) e^{-2/tau}) <= loss <= log(1 + (B-1) e^{2/tau})."""
    q, k = emb(B, 4, seed=seed), emb(B, 4, seed=seed + 1)
    loss = info_nce(q, k, tau=tau, reduction="none")
    lo, hi = math.log1p((B - 1) * math.exp(-2 / tau)), math.log1p((B - 1) * math.exp(2 / tau))
    assert bool((loss >= lo - 1e-9).all()) and bool((loss <= hi + 1e-9).all())
    scale = torch.rand(B, 1, generator=gen(seed), dtype=torch.float64) * 10 + 0.1
    torch.testing.assert_close(info_nce(q * scale, k, tau=tau, reduction="none"), loss, rtol=1e-10, atol=1e-10)


def test_info_nce_rejects_bad_input():
    q = emb(3, 4)
    with pytest.raises(ValueError, match="must have the same shape"):
        info_nce(q, emb(2, 4))
    with pytest.raises(ValueError, match=r"tau must lie in \(0.0, inf\)"):
        info_nce(q, q, tau=0.0)
    with pytest.raises(ValueError, match="similarity must be one of"):
        info_nce(q, q, similarity="l2")
    with pytest.raises(ValueError, match="symmetric=True needs in-batch negatives"):
        info_nce(q, q, emb(5, 4), symmetric=True)
    with pytest.raises(ValueError, match=r"negatives must have shape \(N, D\) or \(B, N, D\)"):
        info_nce(q, q, emb(5, 3))
    with pytest.raises(TypeError, match="share one dtype"):
        info_nce(q, q.float())
    with pytest.raises(ValueError, match="NaN"):
        info_nce(q, torch.full((3, 4), math.nan, dtype=torch.float64))


# ================================================================= 07.04 NT-Xent


def nt_xent_brute_force(z_i, z_j, tau):
    """SimCLR's loss, one anchor at a time, straight from the catalogue's l_{i,j} (float64 math)."""
    z = torch.cat([z_i, z_j])
    n2 = z.shape[0]
    N = n2 // 2

    def sim(a, b):
        return (z[a] @ z[b] / (z[a].norm() * z[b].norm())).item()

    total = 0.0
    for i in range(n2):
        j = (i + N) % n2
        den = sum(math.exp(sim(i, k) / tau) for k in range(n2) if k != i)
        total += -math.log(math.exp(sim(i, j) / tau) / den)
    return total / n2


@pytest.mark.equation("07.04", oracle="torch.nn.functional.cross_entropy on masked F.cosine_similarity logits; "
                                      "float64 brute force of l_{i,j}")
@pytest.mark.parametrize("N, tau", [(1, 0.5), (4, 0.5), (6, 0.1)])
def test_nt_xent_matches_cross_entropy_and_brute_force(N, tau):
    z_i, z_j = emb(N, 8, seed=6), emb(N, 8, seed=7)
    z = torch.cat([z_i, z_j])
    logits = cosine_matrix(z, z) / tau
    logits.fill_diagonal_(-math.inf)
    labels = (torch.arange(2 * N) + N) % (2 * N)
    torch.testing.assert_close(nt_xent(z_i, z_j, tau), F.cross_entropy(logits, labels), **F64)
    torch.testing.assert_close(nt_xent(z_i, z_j, tau, reduction="none"),
                               F.cross_entropy(logits, labels, reduction="none"), **F64)
    assert nt_xent(z_i, z_j, tau).item() == pytest.approx(nt_xent_brute_force(z_i, z_j, tau), rel=1e-12)


def test_nt_xent_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one pair"):
        nt_xent(emb(0, 4), emb(0, 4))
    with pytest.raises(ValueError, match="must have the same shape"):
        nt_xent(emb(2, 4), emb(3, 4))
    with pytest.raises(ValueError, match=r"z_i must have shape \(N, D\)"):
        nt_xent(emb(4), emb(4))


# ================================================================= 07.05 triplet loss


@pytest.mark.equation("07.05", oracle="torch.nn.functional.triplet_margin_loss (same eps inside the distance)")
@pytest.mark.parametrize("ord", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.5])
@pytest.mark.parametrize("swap", [False, True])
def test_triplet_loss_matches_torch(ord, eps, swap):
    a, p, n = emb(16, 6, seed=8), emb(16, 6, seed=9), emb(16, 6, seed=10)
    for reduction in ("mean", "sum", "none"):
        ours = triplet_loss(a, p, n, margin=2.0, ord=ord, eps=eps, swap=swap, reduction=reduction)
        ref = F.triplet_margin_loss(a, p, n, margin=2.0, p=ord, eps=eps, swap=swap, reduction=reduction)
        torch.testing.assert_close(ours, ref, **F64)


@pytest.mark.equation("07.05", oracle="float64 closed form max(0, ||a-p|| - ||a-n|| + m)")
def test_triplet_loss_with_eps_0_is_the_plain_equation_and_keeps_leading_axes():
    a, p, n = emb(3, 4, 5, seed=11), emb(3, 4, 5, seed=12), emb(3, 4, 5, seed=13)
    ref = ((a - p).norm(dim=-1) - (a - n).norm(dim=-1) + 1.0).clamp_min(0)
    torch.testing.assert_close(triplet_loss(a, p, n, eps=0.0, reduction="none"), ref, **F64)


def test_triplet_loss_does_not_overflow_float32():
    """Distances of float32 vectors of size 1e30: the squares overflow, our scaled norm does not."""
    a, p, n = ((1e30 * emb(4, 3, seed=s)).float() for s in (14, 15, 16))
    ref = F.triplet_margin_loss(a.double(), p.double(), n.double(), margin=1.0, reduction="none")
    ours = triplet_loss(a, p, n, reduction="none")
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), ref, rtol=1e-6, atol=0.0)
    assert not torch.isfinite(F.triplet_margin_loss(a, p, n, reduction="none")).all()


def test_triplet_loss_rejects_bad_input():
    a = emb(3, 4)
    with pytest.raises(ValueError, match=r"margin must lie in \(0.0, inf\)"):
        triplet_loss(a, a, a, margin=0.0)
    with pytest.raises(ValueError, match=r"ord must lie in \[1.0, inf\]"):
        triplet_loss(a, a, a, ord=0.5)
    with pytest.raises(ValueError, match="must have the same shape"):
        triplet_loss(a, a, emb(3, 5))
    with pytest.raises(ValueError, match="inf"):
        triplet_loss(a, a, torch.full((3, 4), math.inf, dtype=torch.float64))
