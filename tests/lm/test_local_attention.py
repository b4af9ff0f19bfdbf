"""Chapter 3, sliding-window (03.07) and sparse (03.08) attention against full attention with a mask.

The oracle is always ``torch.nn.functional.scaled_dot_product_attention`` over all keys with the
equivalent boolean mask, built here by looping over (i, j) and applying the stated rule, so neither
the mask nor the attention shares code with the implementation. Tolerance: float32 ``rtol = atol =
1e-5``; masks are compared exactly.
"""

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.local_attention import (
    sliding_window_attention,
    sliding_window_mask,
    sparse_attention,
    sparse_indices,
    sparse_mask,
)

F32 = dict(rtol=1e-5, atol=1e-5)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def loop_mask(T_q, T_k, rule):
    """Boolean (T_q, T_k) mask from a rule on absolute positions (query i sits at i + T_k - T_q)."""
    off = T_k - T_q
    return torch.tensor([[bool(rule(i + off, j)) for j in range(T_k)] for i in range(T_q)], dtype=torch.bool)


def window_rule(W, causal=True):
    return (lambda p, j: p - W < j <= p) if causal else (lambda p, j: abs(p - j) < W)


def strided_rule(l):
    return lambda i, j: j <= i and (i - j < l or (i - j) % l == 0)


def fixed_rule(l, c):
    return lambda i, j: j <= i and (j // l == i // l or j % l >= l - c)


def reference(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


# ================================================================= 03.07 sliding window


@pytest.mark.equation("03.07", oracle="F.scaled_dot_product_attention with the mask i - W < j <= i (loop-built)")
@pytest.mark.parametrize("T_q, T_k, W, block_q", [(20, 20, 4, None), (20, 20, 4, 3), (37, 37, 8, 16), (9, 9, 1, None),
                                                   (6, 6, 50, None), (5, 23, 6, 2), (33, 33, 5, 64)])
def test_sliding_window_matches_masked_full_attention(T_q, T_k, W, block_q):
    q, k, v = torch.randn(2, 4, T_q, 8), torch.randn(2, 2, T_k, 8), torch.randn(2, 2, T_k, 6)  # GQA: H_kv = 2
    allowed = loop_mask(T_q, T_k, window_rule(W))
    assert torch.equal(sliding_window_mask(T_q, T_k, W), allowed)
    torch.testing.assert_close(sliding_window_attention(q, k, v, W, block_q=block_q), reference(q, k, v, allowed),
                               **F32)


@pytest.mark.equation("03.07", oracle="F.scaled_dot_product_attention with the mask |i - j| < W (loop-built)")
@pytest.mark.parametrize("T, W, block_q", [(20, 4, None), (21, 3, 5), (7, 30, None)])
def test_bidirectional_window_matches_masked_full_attention(T, W, block_q):
    q, k, v = (torch.randn(1, 2, T, 4) for _ in range(3))
    allowed = loop_mask(T, T, window_rule(W, causal=False))
    assert torch.equal(sliding_window_mask(T, T, W, causal=False), allowed)
    out = sliding_window_attention(q, k, v, W, causal=False, block_q=block_q)
    torch.testing.assert_close(out, reference(q, k, v, allowed), **F32)


@pytest.mark.equation("03.07", oracle="F.scaled_dot_product_attention(is_causal=True)")
def test_window_covering_everything_is_causal_attention():
    q, k, v = (torch.randn(1, 12, 4) for _ in range(3))  # head-less (B, T, D)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=12),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), **F32)


# ================================================================= 03.08 sparse patterns


@pytest.mark.equation("03.08", oracle="F.scaled_dot_product_attention with the strided mask (loop-built)")
@pytest.mark.parametrize("T, l", [(16, 4), (23, 5), (10, 1), (7, 12), (30, None)])
def test_strided_matches_masked_full_attention(T, l):
    q, k, v = (torch.randn(2, 3, T, 8) for _ in range(3))
    l_eff = l if l is not None else 6  # default stride ceil(sqrt(30)) = 6
    allowed = loop_mask(T, T, strided_rule(l_eff))
    assert torch.equal(sparse_mask(T, "strided", l_eff), allowed)
    torch.testing.assert_close(sparse_attention(q, k, v, "strided", stride=l), reference(q, k, v, allowed), **F32)


@pytest.mark.equation("03.08", oracle="F.scaled_dot_product_attention with the fixed mask (loop-built)")
@pytest.mark.parametrize("T, l, c", [(16, 4, 1), (23, 5, 2), (12, 3, 3), (5, 8, 1)])
def test_fixed_matches_masked_full_attention(T, l, c):
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 1, T, 8), torch.randn(2, 1, T, 8)  # MQA heads
    allowed = loop_mask(T, T, fixed_rule(l, c))
    assert torch.equal(sparse_mask(T, "fixed", l, c), allowed)
    torch.testing.assert_close(sparse_attention(q, k, v, "fixed", stride=l, n_summary=c), reference(q, k, v, allowed),
                               **F32)


@pytest.mark.equation("03.08", oracle="the strided and fixed rules of Child et al. (2019), evaluated pair by pair")
@SETTINGS
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 9))
def test_sparse_indices_list_each_allowed_key_once(T, l, c):
    for pattern, rule in (("strided", strided_rule(l)), ("fixed", fixed_rule(l, min(c, l)))):
        idx, valid = sparse_indices(T, pattern, l, min(c, l))
        for i in range(T):
            keys = idx[i][valid[i]].tolist()
            assert len(keys) == len(set(keys))
            assert sorted(keys) == [j for j in range(T) if rule(i, j)]


def test_sparse_cost_is_sublinear_per_query():
    idx, _ = sparse_indices(1024, "strided", 32)
    assert idx.shape[1] == 32 + 1023 // 32  # l + T/l keys per query, not T


def test_bad_inputs_are_rejected():
    q = torch.randn(1, 8, 4)
    with pytest.raises(ValueError, match="window must be a positive int"):
        sliding_window_attention(q, q, q, window=0)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        sliding_window_attention(q, q, q, window=2, block_q=0)
    with pytest.raises(ValueError, match="pattern must be 'strided' or 'fixed'"):
        sparse_attention(q, q, q, "diagonal", stride=2)
    with pytest.raises(ValueError, match=r"n_summary \(c\) must be an int in \[1, stride = 2\]"):
        sparse_attention(q, q, q, "fixed", stride=2, n_summary=3)
    with pytest.raises(ValueError, match=r"T_q \(3\) must equal T_k \(8\)"):
        sparse_attention(q[:, :3], q, q, stride=2)
    with pytest.raises(ValueError, match="stride must be a positive int"):
        sparse_mask(8, "strided", 0)


# ================================================================= fp16 / bf16 (issue 11)

HALF_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_local_and_sparse_attention_in_half_precision_at_large_scores(dtype):
    # |q|, |k| ~ 40 * sqrt(D): q.k overflows fp16 unless computed in float32; oracle: torch on the
    # float64 upcast with the dense mask of the pattern
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 16, generator=g) * s for s in (40.0, 40.0, 1.0))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = sliding_window_attention(q, k, v, window=3, block_q=4)
    assert out.dtype == dtype
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=sliding_window_mask(12, window=3))
    torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])
    for pattern in ("strided", "fixed"):
        out = sparse_attention(q, k, v, pattern, stride=3)
        assert out.dtype == dtype
        ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=sparse_mask(12, pattern, 3))
        torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])


# ================================================================= issue 11: gathered_attention validates its inputs


def test_gathered_attention_validates_everything():
    from llmbook.lm.local_attention import gathered_attention

    q = torch.randn(1, 2, 4, 3)
    idx, valid = sparse_indices(4, "strided", 2)
    # oracle: with every slot listing all keys, gathered attention is plain softmax attention
    full = torch.arange(4).expand(4, 4)
    torch.testing.assert_close(gathered_attention(q, q, q, full, torch.ones(4, 4, dtype=torch.bool), 0.5),
                               F.scaled_dot_product_attention(q, q, q, scale=0.5), **F32)
    cases = [
        (dict(scale=0.0), ValueError, r"scale must lie in \(0.0, inf\), got 0.0"),
        (dict(scale=-1.0), ValueError, r"scale must lie in \(0.0, inf\), got -1.0"),
        (dict(scale=float("inf")), ValueError, r"scale must lie in \(0.0, inf\), got inf"),
        (dict(scale="1"), TypeError, r"scale must be a real number, got '1'"),
        (dict(idx=idx.float()), TypeError, r"idx must be an integer tensor, got dtype torch.float32"),
        (dict(valid=valid.long()), TypeError, r"valid must be a bool mask .*, got dtype torch.int64"),
        (dict(valid=valid[:, :1]), ValueError, r"idx \(4, \d+\) and valid \(4, 1\) must have the same shape"),
        (dict(idx=idx + 4), ValueError, r"idx must hold key indices in \[0, T_k\) = \[0, 4\)"),
        (dict(idx=idx[:3], valid=valid[:3]), ValueError, r"idx \(3, \d+\) must broadcast to \(B, H, T_q, n\)"),
        (dict(q=q[0]), ValueError, r"q, k, v must all have shape|q, k, v must have shape \(B, H, T, D\)"),
    ]
    for change, exc, match in cases:
        args = dict(q=q, k=q, v=q, idx=idx, valid=valid, scale=0.5) | change
        if "q" in change:
            args["k"] = args["v"] = args["q"]
        with pytest.raises(exc, match=match):
            gathered_attention(**args)


@pytest.mark.parametrize("bad, err", [(True, TypeError), (2.5, TypeError), ("0.5", TypeError),
                                      (float("nan"), TypeError), (0, ValueError), (3, ValueError)])
def test_n_summary_is_checked_for_every_pattern(bad, err):
    """Issue 11: the strided pattern ignored n_summary, so True, 2.5, '0.5', NaN and 0 passed silently."""
    q = torch.randn(1, 9, 4)
    for pattern in ("strided", "fixed"):
        with pytest.raises(err, match=r"n_summary \(c\) must be an int in \[1, stride = 2\], got "
                                      + re.escape(repr(bad))):
            sparse_attention(q, q, q, pattern, stride=2, n_summary=bad)
