"""Chapter 4, llmbook.lm.positions (04.01, 04.02, 04.08, 04.09) against independent oracles; RoPE is in test_rope.py.

Tolerances, stated once:

* the half-split RoPE against ``transformers`` (float32, same recipe): exact equality;
* other float32 comparisons: ``rtol = atol = 1e-5`` (``F32``);
* float64 against float64 closed forms: ``rtol = atol = 1e-12`` (``F64``).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings

from llmbook.lm.positions import (
    LearnedPositionEmbedding,
    apply_xpos,
    nope_embedding,
    sinusoidal_encoding,
    xpos_scale,
)
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


# ================================================================= 04.01 sinusoidal


@pytest.mark.equation("04.01", oracle="float64 closed form sin(pos / 10000^(2i/d)), cos(...) by explicit loops")
def test_sinusoidal_matches_the_paper_closed_form_interleaved():
    T, d = 50, 16
    pe = sinusoidal_encoding(T, d, dtype=torch.float64)
    ref = np.zeros((T, d))
    for pos in range(T):
        for i in range(d // 2):
            ref[pos, 2 * i] = math.sin(pos / 10000 ** (2 * i / d))
            ref[pos, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / d))
    np.testing.assert_allclose(pe.numpy(), ref, **F64)
    # the concatenated layout holds the same numbers: all sines, then all cosines
    cat = sinusoidal_encoding(T, d, dtype=torch.float64, layout="concatenated")
    np.testing.assert_allclose(cat.numpy(), np.concatenate([ref[:, 0::2], ref[:, 1::2]], 1), **F64)
    assert sinusoidal_encoding(T, d).dtype == torch.float32


def test_sinusoidal_bad_input():
    with pytest.raises(ValueError, match="positive even"):
        sinusoidal_encoding(4, 5)
    with pytest.raises(ValueError, match="layout"):
        sinusoidal_encoding(4, 4, layout="zigzag")
    with pytest.raises(ValueError, match=">= 0"):
        sinusoidal_encoding(-1, 4)


# ================================================================= 04.02 learned


@pytest.mark.equation("04.02", oracle="torch.nn.functional.embedding of arange(T) with the copied table")
def test_learned_positions_add_table_rows():
    pe = LearnedPositionEmbedding(16, 8)
    tok = torch.randn(2, 5, 8)
    ref = tok + F.embedding(torch.arange(3, 8), pe.weight)[None]
    torch.testing.assert_close(pe(tok, offset=3), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exceed the learned table"):
        pe(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match=r"tok_emb must have shape \(B, T, d\) with d = 8, got \(1, 3, 7\)"):
        pe(torch.randn(1, 3, 7))


@pytest.mark.equation("04.08", oracle="float64 closed form Re sum_j zeta_j^((m-n)/B) q~_j conj(k~_j) e^(i(m-n)theta_j)")
def test_xpos_score_matches_closed_form_and_is_relative():
    T, D, B, gamma = 40, 16, 512.0, 0.4
    q, k = torch.randn(T, D, dtype=torch.float64), torch.randn(T, D, dtype=torch.float64)
    qx, kx = apply_xpos(q, k, gamma=gamma, scale_base=B)
    ours = (qx @ kx.T).numpy()
    h = D // 2
    zq = q.numpy()[:, :h] + 1j * q.numpy()[:, h:]  # half-split pairs (j, j + D/2)
    zk = k.numpy()[:, :h] + 1j * k.numpy()[:, h:]
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)
    zeta = (np.arange(0, D, 2) / D + gamma) / (1 + gamma)
    ref = np.empty((T, T))
    for m in range(T):
        for n in range(T):
            ref[m, n] = np.real(np.sum(zeta ** ((m - n) / B) * zq[m] * np.conj(zk[n]) * np.exp(1j * (m - n) * theta)))
    # rope_cos_sin forms its angles in float32 (as Llama does): 1e-5
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    # shifting both positions leaves the score alone
    qs, ks = apply_xpos(q, k, positions=torch.arange(T) + 300, gamma=gamma, scale_base=B)
    np.testing.assert_allclose((qs @ ks.T).numpy(), ours, rtol=1e-4, atol=1e-4)
    assert torch.equal(xpos_scale(1, 8), torch.ones(1, 8))


# ================================================================= 04.09 NoPE


@pytest.mark.equation("04.09", oracle="torch.nn.functional.embedding")
def test_nope_is_the_token_embedding_and_attention_is_permutation_equivariant():
    E = torch.randn(20, 8)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    h = nope_embedding(ids, E)
    torch.testing.assert_close(h, F.embedding(ids, E), rtol=0, atol=0)
    perm = torch.tensor([4, 2, 0, 1, 3])
    out = F.scaled_dot_product_attention(h, h, h)  # no mask, no positions
    out_p = F.scaled_dot_product_attention(h[:, perm], h[:, perm], h[:, perm])
    torch.testing.assert_close(out_p, out[:, perm], **F32)
    with pytest.raises(ValueError, match=r"ids must be token ids in \[0, V\) = \[0, 20\), got range \[20, 20\]"):
        nope_embedding(torch.tensor([20]), E)
    with pytest.raises(TypeError, match="ids must be a tensor of integer token ids, got dtype torch.float32"):
        nope_embedding(torch.tensor([1.0]), E)
    # issue 11: bool ids used to index as a mask (E[[True, False, ...]] picks rows silently)
    with pytest.raises(TypeError, match="ids must be a tensor of integer token ids, got dtype torch.bool"):
        nope_embedding(torch.ones(20, dtype=torch.bool), E)


def _xpos_pairs(q, k, delta, gamma=0.4, B=512.0, base=10000.0):
    """Per-pair float64 closed form of xPos's score at m - n = delta (half-split pairs (j, j + D/2)):
    zeta_j^(delta/B) [(a c + b d) cos(delta theta_j) - (b c - a d) sin(delta theta_j)], and its |.| bound."""
    q, k = q.double(), k.double()
    D = q.shape[-1]
    h = D // 2
    j = torch.arange(h, dtype=torch.float64)
    theta, zeta = base ** (-2 * j / D), (2 * j / D + gamma) / (1 + gamma)
    delta = torch.as_tensor(delta, dtype=torch.float64)[..., None]
    a, b, c, d = q[..., :h], q[..., h:], k[..., :h], k[..., h:]
    decay = zeta ** (delta / B)
    score = (decay * ((a * c + b * d) * torch.cos(delta * theta) - (b * c - a * d) * torch.sin(delta * theta))).sum(-1)
    bound = (decay * (a.abs() + b.abs()) * (c.abs() + d.abs())).sum(-1)
    return score, bound


def test_xpos_at_position_50000_is_finite_issue_case():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, generator=g)
    q2, k2 = apply_xpos(q, q.clone(), positions=torch.tensor([50000]))
    assert torch.isfinite(q2).all() and torch.isfinite(k2).all()
    # m = n: the rotations cancel and the scales cancel, the score is |q|^2 (float32: rtol 1e-5)
    torch.testing.assert_close((q2 * k2).sum(), (q.double() ** 2).sum().float(), rtol=1e-5, atol=1e-5)


@pytest.mark.equation("04.08", oracle="float64 closed form of the xPos score; shift invariance")
@pytest.mark.parametrize("offset", [0, 50000])
def test_xpos_scores_match_the_closed_form_and_depend_on_m_minus_n_only(offset):
    g = torch.Generator().manual_seed(1)
    T, D = 32, 16
    q, k = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    pos = torch.arange(T) + offset
    q2, k2 = apply_xpos(q, k, pos)
    S = q2.double() @ k2.double().T
    ref, bound = _xpos_pairs(q[:, None], k[None], pos[:, None] - pos[None, :])
    # float32 angles at m ~ 5e4 carry ~3e-3 rad of rounding (as Llama's tables): 2e-3 of the bound
    assert ((S - ref).abs() / bound).max() < (1e-5 if offset == 0 else 2e-3)
    # the relative-position property, float64: shifting every position changes no score
    (q0, k0), (q1, k1) = apply_xpos(q.double(), k.double(), pos), apply_xpos(q.double(), k.double(), pos + 777)
    torch.testing.assert_close(q0 @ k0.T, q1 @ k1.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2), (torch.float32, 1e-4)])
def test_xpos_at_T_8192_in_low_precision(dtype, tol):
    # centred positions keep s_m within zeta_min^(+-8) ~ [4.5e-5, 2.2e4]: finite in fp16 for |q_j| < 2.9
    g = torch.Generator().manual_seed(2)
    T, D = 8192, 64
    q, k = ((torch.randn(T, D, generator=g) * 0.5).to(dtype) for _ in range(2))
    q2, k2 = apply_xpos(q, k)
    assert q2.dtype == k2.dtype == dtype
    assert torch.isfinite(q2).all() and torch.isfinite(k2).all()
    idx = torch.tensor([0, 1, 100, 4096, 8000, 8191])
    S = q2[idx].double() @ k2[idx].double().T
    ref, bound = _xpos_pairs(q[idx][:, None], k[idx][None], idx[:, None] - idx[None, :])
    assert ((S - ref).abs() / bound).max() < tol


def test_learned_positions_check_sizes_offset_and_input():
    """Issue 11: n_max/d of True, 2.5, NaN reached torch.randn; offset True passed; a bool tok_emb was added."""
    for kw, err, text in [(dict(n_max=True, d=4), TypeError, r"n_max must be a positive int, got True \(bool\)"),
                          (dict(n_max=8, d=2.5), TypeError, r"d must be a positive int, got 2.5 \(float\)"),
                          (dict(n_max="8", d=4), TypeError, r"n_max must be a positive int, got '8' \(str\)"),
                          (dict(n_max=0, d=4), ValueError, "n_max must be a positive int, got 0")]:
        with pytest.raises(err, match=text):
            LearnedPositionEmbedding(**kw)
    pe = LearnedPositionEmbedding(8, 4)
    tok = torch.randn(2, 3, 4)
    for bad, err, text in [(True, TypeError, r"offset must be a non-negative int, got True \(bool\)"),
                           (float("nan"), TypeError, r"offset must be a non-negative int, got nan \(float\)"),
                           (-1, ValueError, "offset must be a non-negative int, got -1")]:
        with pytest.raises(err, match=text):
            pe(tok, offset=bad)
    with pytest.raises(TypeError, match="tok_emb must be a real floating-point tensor, got dtype torch.bool"):
        pe(tok > 0)
    with pytest.raises(TypeError, match="tok_emb must be a tensor, got list"):
        pe(tok.tolist())




# ================================================================= the chapter's Try-it solutions



def test_try_it_solutions_of_chapter_4():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm import context_extension as cx
    from llmbook.lm import position_bias as pb
    from llmbook.lm.rope import apply_rope, rope_cos_sin, rope_inv_freq
    from llmbook.lm.training import pretrained_tiny

    stated = []
    # 1. the explorer's model: D = 64, L_train = 2048; out-of-range pairs at s = 4 and 16
    D, L_train = 64, 2048
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)  # float64 closed form
    never_turned = int((2 * np.pi / theta > L_train).sum())
    assert never_turned == 11
    counts, worst = {}, {}
    for method in ("none", "pi", "ntk", "yarn"):
        for s in (4.0, 16.0):
            inv, _ = cx.scaled_inv_freq(method, D, 10000.0, s, L_train)
            counts[method, s] = int(cx.unseen_angle_pairs(inv, L_train, int(s * L_train)).sum())
            slow = L_train * theta < 2 * np.pi
            worst[method, s] = float(((s * L_train - 1) * inv.double().numpy()[slow] / (L_train * theta[slow])).max())
    assert counts["none", 4.0] == counts["none", 16.0] == never_turned
    assert worst["none", 4.0] == pytest.approx(4.0, rel=1e-3) and worst["none", 16.0] == pytest.approx(16.0, rel=1e-3)
    assert counts["ntk", 4.0] == counts["ntk", 16.0] == 10
    assert counts["pi", 4.0] == counts["pi", 16.0] == counts["yarn", 4.0] == counts["yarn", 16.0] == 0
    stated += ["11 of the 32 pairs", "10 pairs", f"{worst['ntk', 4.0]:.2f}× at $s = 4$",
               f"{worst['ntk', 16.0]:.2f}× at", "0 pairs out of range"]
    assert f"{worst['ntk', 4.0]:.2f}" == "1.56" and f"{worst['ntk', 16.0]:.2f}" == "2.45"
    # 2. ALiBi slopes for H = 6: the 4 of H = 4, then the first two odd-indexed ones of H = 8
    s6, s4, s8 = (pb.alibi_slopes(H).tolist() for H in (6, 4, 8))
    assert s6 == [2.0 ** -e for e in (2, 4, 6, 8, 1, 3)]
    assert s6[:4] == s4 and s6[4:] == s8[0::2][:2]
    stated.append("$[2^{-2}, 2^{-4}, 2^{-6}, 2^{-8}, 2^{-1}, 2^{-3}]$")
    # 3. only the key moves: the score changes; (m, m + 5) keeps it for every m, and the norms stay
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(0, 106), 16, dtype=torch.float64)

    def score(m, n):
        return float(apply_rope(q[None], cos[m:m + 1], sin[m:m + 1])[0] @ apply_rope(k[None], cos[n:n + 1],
                                                                                        sin[n:n + 1])[0])

    assert abs(score(0, 0) - score(0, 5)) > 1e-3
    assert all(score(m, m + 5) == pytest.approx(score(0, 5), abs=1e-12) for m in (1, 17, 100))
    assert float(apply_rope(q[None], cos[5:6], sin[5:6]).norm()) == pytest.approx(float(q.norm()), abs=1e-12)
    stated.append("$n - m = 5$")
    # 4. dynamic NTK below the training length
    assert cx.dynamic_ntk_alpha(1000, 4096, 8.0) == 1.0 == 8.0 * max(1000, 4096) / 4096 - 7
    stated += [r"$T = \max(1000, 4096) = 4096$", r"$\alpha = 8\cdot 1 - 7 = 1$"]
    # 5. the tiny GPT: D = 32, context 64
    cfg = pretrained_tiny()[0].config
    assert (cfg.head_dim, cfg.max_seq_len, cfg.rope_theta) == (32, 64, 10000.0)
    sweep = (cfg.max_seq_len - 1) * rope_inv_freq(cfg.head_dim, cfg.rope_theta).double().numpy()
    ref = 63 * 10.0 ** (-np.arange(16) / 4)  # 63 * 10000^(-2j/32)
    np.testing.assert_allclose(sweep, ref, rtol=1e-6)
    full_turn = sweep >= 2 * np.pi
    assert full_turn.tolist() == [True] * 5 + [False] * 11
    assert int(np.argmax(sweep < 1.0)) == 8
    stated += ["(5 pairs; pair 4 only just",
               f"${63} \\times {ref[4] / 63:.1f} = {ref[4]:.1f} > 2\\pi \\approx {2 * np.pi:.2f}$",
               f"Pair 7 still turns by {ref[7]:.2f} rad", f"pair 8 by {ref[8]:.2f} rad", "from pair 8 on"]
    assert_states("04-positions.ipynb", stated)
