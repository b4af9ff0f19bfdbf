"""Chapter 22 (ids 22.01-22.06) against torch.nn.functional, numpy/scipy brute force, float64 closed forms and autograd.

Tolerances, stated once: every comparison runs in float64 with ``atol = 1e-12`` (scores, losses, weights
and gradients); fp16/bf16 behaviour is covered by the fuzz suite.
"""

import math

import numpy as np
import pytest
import scipy.sparse
import sklearn.metrics.pairwise as skp
import torch
import torch.nn.functional as F

from llmbook.rag import dense

ATOL = 1e-12
NOTEBOOK = "22-dense-retrieval.ipynb"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------- 22.01


@pytest.mark.equation("22.01", oracle="numpy float64 loop of f(q)^T g(d) with two torch.nn.Linear encoders; "
                                      "sklearn cosine_similarity")
def test_dual_encoder_score_matches_loop_and_sklearn():
    q, d = randn(4, 6, seed=1), randn(7, 6, seed=2)
    torch.manual_seed(0)
    f, g = torch.nn.Linear(6, 3).double(), torch.nn.Linear(6, 3).double()
    with torch.no_grad():
        s = dense.dual_encoder_score(q, d, f=f, g=g)
        fq, gd = f(q).numpy(), g(d).numpy()
    loop = np.array([[sum(fq[b, k] * gd[n, k] for k in range(3)) for n in range(7)] for b in range(4)])
    np.testing.assert_allclose(s.numpy(), loop, atol=ATOL, rtol=0)
    cos = dense.dual_encoder_score(q, d, similarity="cosine")
    np.testing.assert_allclose(cos.numpy(), skp.cosine_similarity(q.numpy(), d.numpy()), atol=ATOL, rtol=0)
    # identity encoders: the score is the raw dot product; a shared encoder (g = f) is Siamese
    np.testing.assert_allclose(dense.dual_encoder_score(q, d).numpy(), q.numpy() @ d.numpy().T, atol=ATOL, rtol=0)


def test_dual_encoder_score_rejects_bad_input():
    with pytest.raises(TypeError, match="callable"):
        dense.dual_encoder_score(randn(2, 3), randn(2, 3), f=3)
    with pytest.raises(ValueError, match="similarity"):
        dense.dual_encoder_score(randn(2, 3), randn(2, 3), similarity="l2")
    with pytest.raises(ValueError):
        dense.dual_encoder_score(randn(2, 3), randn(2, 4))


# ----------------------------------------------------------------------------------------------- 22.02


@pytest.mark.equation("22.02", oracle="torch.nn.functional.cross_entropy over the (B, candidates) similarity matrix "
                                      "divided by tau")
@pytest.mark.parametrize("K", [0, 1, 3])
@pytest.mark.parametrize("tau", [1.0, 0.05])
@pytest.mark.parametrize("similarity", ["dot", "cosine"])
def test_dpr_loss_is_cross_entropy_over_in_batch_and_hard_negatives(K, tau, similarity):
    B, D = 5, 8
    q, p = randn(B, D, seed=3), randn(B, D, seed=4)
    n = randn(B, K, D, seed=5)
    cand = torch.cat([p, n.reshape(B * K, D)])
    S = q @ cand.T if similarity == "dot" else F.normalize(q, dim=-1) @ F.normalize(cand, dim=-1).T
    ref = F.cross_entropy(S / tau, torch.arange(B), reduction="none")
    got = dense.dpr_loss(q, p, n if K else None, tau=tau, similarity=similarity, reduction="none")
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(dense.dpr_loss(q, p, n if K else None, tau=tau, similarity=similarity)),
                               float(ref.mean()), atol=ATOL, rtol=0)
    np.testing.assert_allclose(float(dense.dpr_loss(q, p, n if K else None, tau=tau, similarity=similarity,
                                                    reduction="sum")), float(ref.sum()), atol=ATOL, rtol=0)
    if K:  # only the query's own positive and hard negatives: target 0
        own = torch.stack([torch.cat([(q[b] @ p[b])[None], n[b] @ q[b]]) for b in range(B)])
        if similarity == "cosine":
            own = torch.stack([F.cosine_similarity(q[b][None], torch.cat([p[b][None], n[b]]), dim=-1)
                               for b in range(B)])
        ref2 = F.cross_entropy(own / tau, torch.zeros(B, dtype=torch.long), reduction="none")
        got2 = dense.dpr_loss(q, p, n, tau=tau, in_batch=False, similarity=similarity, reduction="none")
        np.testing.assert_allclose(got2.numpy(), ref2.numpy(), atol=ATOL, rtol=0)


@pytest.mark.equation("22.02", oracle="autograd against the float64 closed form "
                                      "dL/dq_b = (sum_c p_bc d_c - d+_b) / (B tau)")
def test_dpr_loss_gradient_closed_form():
    B, K, D, tau = 4, 2, 5, 0.3
    q = randn(B, D, seed=6).requires_grad_()
    p, n = randn(B, D, seed=7), randn(B, K, D, seed=8)
    dense.dpr_loss(q, p, n, tau=tau).backward()
    cand = torch.cat([p, n.reshape(B * K, D)])
    P = torch.softmax(q.detach() @ cand.T / tau, -1)
    expected = (P @ cand - p) / (B * tau)
    np.testing.assert_allclose(q.grad.numpy(), expected.numpy(), atol=ATOL, rtol=0)


def test_dpr_loss_small_tau_and_bad_input():
    q = torch.eye(3)
    # tau so small that s / tau overflows float32: computed in float64, finite
    assert torch.isfinite(dense.dpr_loss(q * 1e30, q, tau=1e-10)).all()
    assert float(dense.dpr_loss(torch.zeros(0, 3), torch.zeros(0, 3))) == 0.0
    with pytest.raises(ValueError, match="tau"):
        dense.dpr_loss(q, q, tau=0.0)
    with pytest.raises(ValueError, match="hard negatives"):
        dense.dpr_loss(q, q, in_batch=False)
    with pytest.raises(ValueError, match="d_neg"):
        dense.dpr_loss(q, q, torch.zeros(2, 1, 3))
    with pytest.raises(TypeError, match="in_batch"):
        dense.dpr_loss(q, q, in_batch=1)


# ----------------------------------------------------------------------------------------------- 22.03


def maxsim_loop(E_q, E_d, q_len, d_len):
    """ColBERT by hand: for each pair the full (T_q, T_d) numpy similarity matrix, max over columns, sum."""
    out = np.zeros((len(E_q), len(E_d)))
    for b in range(len(E_q)):
        for n in range(len(E_d)):
            if d_len[n] == 0:
                out[b, n] = -math.inf if q_len[b] else 0.0
                continue
            M = E_q[b, :q_len[b]] @ E_d[n, :d_len[n]].T
            out[b, n] = M.max(axis=1).sum()
    return out


@pytest.mark.equation("22.03", oracle="explicit loop over (query, document) pairs: numpy max over the full token "
                                      "similarity matrix, summed; padding removed by slicing")
def test_maxsim_matches_loop_with_padding():
    B, N, Tq, Td, D = 3, 5, 4, 6, 7
    E_q, E_d = randn(B, Tq, D, seed=9), randn(N, Td, D, seed=10)
    q_len, d_len = [4, 2, 1], [6, 3, 1, 0, 5]
    q_mask = torch.arange(Tq)[None] < torch.tensor(q_len)[:, None]
    d_mask = torch.arange(Td)[None] < torch.tensor(d_len)[:, None]
    got = dense.maxsim(E_q, E_d, q_mask=q_mask, d_mask=d_mask)
    ref = maxsim_loop(E_q.numpy(), E_d.numpy(), q_len, d_len)
    np.testing.assert_allclose(got.numpy(), ref, atol=ATOL, rtol=0)
    full = dense.maxsim(E_q, E_d)
    np.testing.assert_allclose(full.numpy(), maxsim_loop(E_q.numpy(), E_d.numpy(), [Tq] * B, [Td] * N), atol=ATOL,
                               rtol=0)


@pytest.mark.equation("22.03", oracle="one token per side: MaxSim reduces to the dot product (numpy)")
def test_maxsim_single_token_is_dot_product():
    E_q, E_d = randn(3, 1, 4, seed=11), randn(5, 1, 4, seed=12)
    np.testing.assert_allclose(dense.maxsim(E_q, E_d).numpy(), E_q[:, 0].numpy() @ E_d[:, 0].numpy().T,
                               atol=ATOL, rtol=0)


def test_maxsim_blocks_and_masks(monkeypatch):
    E_q, E_d = randn(2, 3, 4, seed=13), randn(9, 5, 4, seed=14)
    ref = dense.maxsim(E_q, E_d)
    # blocks of one document at a time give the same numbers
    monkeypatch.setattr(dense, "_CHUNK", 1)
    small = dense.maxsim(E_q, E_d)
    np.testing.assert_allclose(small.numpy(), ref.numpy(), atol=ATOL, rtol=0)
    with pytest.raises(TypeError, match="bool"):
        dense.maxsim(E_q, E_d, d_mask=torch.ones(9, 5))
    with pytest.raises(ValueError):
        dense.maxsim(E_q, E_d, q_mask=torch.ones(2, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- 22.04


@pytest.mark.equation("22.04", oracle="scipy.sparse CSR product and an inverted-index loop over the shared "
                                      "non-zero terms")
def test_splade_score_matches_sparse_product():
    g = gen(15)
    w_q = torch.relu(torch.randn(4, 50, generator=g, dtype=torch.float64) - 1.0)  # mostly zeros
    w_d = torch.relu(torch.randn(6, 50, generator=g, dtype=torch.float64) - 1.0)
    got = dense.splade_score(w_q, w_d)
    ref = (scipy.sparse.csr_matrix(w_q.numpy()) @ scipy.sparse.csr_matrix(w_d.numpy()).T).toarray()
    np.testing.assert_allclose(got.numpy(), ref, atol=ATOL, rtol=0)
    index = {j: [(n, w_d[n, j].item()) for n in range(6) if w_d[n, j] > 0] for j in range(50)}  # posting lists
    loop = np.zeros((4, 6))
    for b in range(4):
        for j in torch.nonzero(w_q[b]).flatten().tolist():
            for n, w in index[j]:
                loop[b, n] += w_q[b, j].item() * w
    np.testing.assert_allclose(got.numpy(), loop, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="non-negative"):
        dense.splade_score(-w_q - 1, w_d)


# ----------------------------------------------------------------------------------------------- 22.05


@pytest.mark.equation("22.05", oracle="float64 closed form with math.log1p, element by element")
@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_splade_weights_closed_form(pooling):
    B, T, V = 2, 5, 7
    z = randn(B, T, V, seed=16) * 3
    lengths = [5, 3]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    got = dense.splade_weights(z, mask=mask, pooling=pooling)
    ref = np.zeros((B, V))
    for b in range(B):
        for j in range(V):
            vals = [math.log1p(max(z[b, i, j].item(), 0.0)) for i in range(lengths[b])]
            ref[b, j] = max(vals) if pooling == "max" else sum(vals)
    np.testing.assert_allclose(got.numpy(), ref, atol=ATOL, rtol=0)
    assert (got >= 0).all()


@pytest.mark.equation("22.05", oracle="autograd against the closed-form derivative 1/(1+z) at the arg-max token "
                                      "(0 where z <= 0)")
def test_splade_weights_gradient():
    z = (randn(1, 6, 9, seed=17) * 2).requires_grad_()
    dense.splade_weights(z).sum().backward()
    zz = z.detach()[0]
    arg = zz.argmax(0)
    expected = torch.zeros_like(zz)
    for j in range(9):
        i = arg[j].item()
        if zz[i, j] > 0:
            expected[i, j] = 1.0 / (1.0 + zz[i, j])
    np.testing.assert_allclose(z.grad[0].numpy(), expected.numpy(), atol=ATOL, rtol=0)


def test_splade_weights_saturate_and_empty():
    w = dense.splade_weights(torch.tensor([[[100.0, 1e30, -5.0]]], dtype=torch.float64))
    np.testing.assert_allclose(w.numpy(), [[math.log(101.0), math.log1p(1e30), 0.0]], atol=ATOL, rtol=0)
    assert dense.splade_weights(torch.zeros(2, 0, 4)).shape == (2, 4)


# ----------------------------------------------------------------------------------------------- 22.06


@pytest.mark.equation("22.06", oracle="float64 closed form: a Python double loop over words and rows")
def test_flops_regularizer_closed_form():
    w = torch.relu(randn(6, 11, seed=18))
    got = dense.flops_regularizer(w)
    ref = sum((sum(w[i, j].item() for i in range(6)) / 6) ** 2 for j in range(11))
    assert abs(got.item() - ref) < ATOL
    assert dense.flops_regularizer(torch.zeros(0, 5)).item() == 0.0


@pytest.mark.equation("22.06", oracle="autograd against the closed form dL/dw_ij = 2 mean_j sign(w_ij) / N")
def test_flops_regularizer_gradient_and_l1_contrast():
    w = randn(5, 8, seed=19).requires_grad_()
    dense.flops_regularizer(w).backward()
    a = w.detach().abs().mean(0)
    np.testing.assert_allclose(w.grad.numpy(), (2 * a[None] * w.detach().sign() / 5).numpy(), atol=ATOL, rtol=0)
    # same total weight (L1), concentrated on one word or spread over four: FLOPS prefers spread
    one = torch.tensor([[4.0, 0, 0, 0], [4.0, 0, 0, 0]], dtype=torch.float64)
    spread = torch.tensor([[1.0, 1, 1, 1], [1.0, 1, 1, 1]], dtype=torch.float64)
    assert one.abs().sum() == spread.abs().sum()
    assert dense.flops_regularizer(one).item() == 16.0 and dense.flops_regularizer(spread).item() == 4.0


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers of the notebook's Try-it solutions, computed."""
    from tests.try_it import assert_states

    e = torch.eye(2, dtype=torch.float64)
    l05, l01 = dense.dpr_loss(e, e, tau=0.5).item(), dense.dpr_loss(e, e, tau=0.1).item()
    l_inf = dense.dpr_loss(e, e, tau=1e9).item()
    assert abs(l05 - math.log1p(math.exp(-2))) < ATOL and abs(l01 - math.log1p(math.exp(-10))) < ATOL
    E_q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    A = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    Bd = torch.tensor([[[0.6, 0.8]]], dtype=torch.float64)
    ms_a, ms_b = dense.maxsim(E_q, A).item(), dense.maxsim(E_q, Bd).item()
    pooled_a = dense.dual_encoder_score(E_q.mean(1), A.mean(1)).item()
    pooled_b = dense.dual_encoder_score(E_q.mean(1), Bd.mean(1)).item()
    best = dense.maxsim(E_q, E_q).item()
    z = torch.tensor([[[-2.0], [0.5], [3.0]]], dtype=torch.float64)
    w_max, w_sum = dense.splade_weights(z).item(), dense.splade_weights(z, pooling="sum").item()
    assert ms_b > ms_a and pooled_b > pooled_a
    assert_states(NOTEBOOK, [
        f"{l05:.4f} at", f"{l01:.2e} at", f"$\\log 2 = {l_inf:.4f}$",
        f"A scores $1 + 0 = {ms_a:.0f}$", f"B scores $0.6 + 0.8 = {ms_b:.1f}$",
        f"dot products {pooled_a:.1f} and {pooled_b:.1f}", f"MaxSim gives {best:.0f}",
        f"$\\log(1 + 3) = {w_max:.4f}$", f"= {w_sum:.4f}$", f"0.4055 + {w_max:.4f}",
    ])
