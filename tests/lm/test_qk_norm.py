"""Chapter 5: QK-norm against transformers' Qwen3 q_norm / k_norm and torch's layer_norm; the logit bound.

Tolerances, stated once:

* float32 against ``transformers``' ``Qwen3RMSNorm`` (same recipe: float32 statistics): ``rtol = atol = 1e-6``;
* float64 against ``torch.nn.functional.layer_norm`` / ``rms_norm``: ``rtol = atol = 1e-12``;
* the Cauchy-Schwarz bound on the scores: exact inequality, and attained to ``1e-9`` relative when a key is a
  positive multiple of a query (``eps = 0``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from llmbook.lm.qk_norm import qk_logit_bound, qk_norm

F64 = dict(rtol=1e-12, atol=1e-12)


def test_qk_norm_matches_qwen3_q_norm_and_k_norm():
    """Qwen3 applies Qwen3RMSNorm(head_dim) to q_proj(x).view(B, T, H, D) before the transpose to (B, H, T, D)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, H_kv, D = 2, 5, 4, 2, 16
    q_btHd = torch.randn(B, T, H, D, generator=g) * 7
    k_btHd = torch.randn(B, T, H_kv, D, generator=g) * 0.3 + 2
    q_norm, k_norm = Qwen3RMSNorm(D, eps=1e-6), Qwen3RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=g))
        k_norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=g))
    ref_q, ref_k = q_norm(q_btHd).transpose(1, 2), k_norm(k_btHd).transpose(1, 2)
    q_hat, k_hat = qk_norm(q_btHd.transpose(1, 2), k_btHd.transpose(1, 2), q_norm.weight, k_norm.weight, eps=1e-6)
    assert q_hat.shape == (B, H, T, D) and k_hat.shape == (B, H_kv, T, D)
    torch.testing.assert_close(q_hat, ref_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_hat, ref_k, rtol=1e-6, atol=1e-6)


def test_qk_norm_layer_kind_matches_torch_layer_norm_without_bias():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 2, 6, 8, generator=g, dtype=torch.float64) * 4 + 1
    k = torch.randn(3, 2, 9, 8, generator=g, dtype=torch.float64) - 3
    w_q, w_k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    q_hat, k_hat = qk_norm(q, k, w_q, w_k, eps=1e-5, kind="layer")
    torch.testing.assert_close(q_hat, F.layer_norm(q, (8,), w_q, None, 1e-5), **F64)
    torch.testing.assert_close(k_hat, F.layer_norm(k, (8,), w_k, None, 1e-5), **F64)
    q_hat, k_hat = qk_norm(q, k, eps=1e-5)  # default: RMSNorm with unit gains
    torch.testing.assert_close(q_hat, F.rms_norm(q, (8,), None, 1e-5), **F64)
    torch.testing.assert_close(k_hat, F.rms_norm(k, (8,), None, 1e-5), **F64)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_scores_obey_the_bound_for_any_weight_scale(kind):
    g = torch.Generator().manual_seed(2)
    D = 32
    w_q = 1 + 0.5 * torch.rand(D, generator=g, dtype=torch.float64)
    w_k = torch.rand(D, generator=g, dtype=torch.float64)
    bound = qk_logit_bound(D, w_q, w_k)
    assert math.isclose(bound, math.sqrt(D) * w_q.abs().max().item() * w_k.abs().max().item(), rel_tol=1e-15)
    q = torch.randn(4, 10, D, generator=g, dtype=torch.float64)
    k = torch.randn(4, 12, D, generator=g, dtype=torch.float64)
    for s in (1e-3, 1.0, 1e3, 1e6):  # the scale of W_Q, W_K: raw scores grow as s^2, normalised ones do not
        q_hat, k_hat = qk_norm(s * q, s * k, w_q, w_k, eps=0.0, kind=kind)
        scores = q_hat @ k_hat.transpose(-1, -2) / math.sqrt(D)
        assert scores.abs().max() <= bound
        ref_q, ref_k = qk_norm(q, k, w_q, w_k, eps=0.0, kind=kind)
        torch.testing.assert_close(scores, ref_q @ ref_k.transpose(-1, -2) / math.sqrt(D), rtol=1e-9, atol=1e-9)
    # attained with unit gains when k is a positive multiple of q (RMSNorm: the normalised vectors coincide)
    q_hat, k_hat = qk_norm(q[:, :1], 5 * q[:, :1], eps=0.0)
    top = (q_hat * k_hat).sum(-1) / math.sqrt(D)
    torch.testing.assert_close(top, torch.full_like(top, qk_logit_bound(D)), rtol=1e-9, atol=0)


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match=r"q \(2, 4\) and k \(2, 5\) disagree on the head width D: 4 != 5"):
        qk_norm(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="kind must be one of 'rms', 'layer', got 'batch'"):
        qk_norm(torch.randn(2, 4), torch.randn(2, 4), kind="batch")
    with pytest.raises(ValueError, match="weight must have shape"):
        qk_norm(torch.randn(2, 4), torch.randn(2, 4), weight_q=torch.ones(3))
    with pytest.raises(ValueError, match=r"weight_k must have shape \(D,\) = \(4,\), got \(3,\)"):
        qk_logit_bound(4, None, torch.ones(3))
    with pytest.raises(ValueError, match=r"D \(the head width\) must be a positive int, got 0"):
        qk_logit_bound(0)
    with pytest.raises(ValueError, match="q must have shape"):
        qk_norm(torch.randn(4), torch.randn(2, 4))
