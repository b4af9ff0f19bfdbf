"""Chapter 3, FlashAttention in pure PyTorch (ids 03.13, 03.14) and the CPU half of claim C12.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` for the output and ``torch.logsumexp``
of explicitly computed scores for the log-sum-exp; ``torch.autograd`` through SDPA and
``torch.autograd.gradcheck`` (finite differences) for the gradients.

Tolerances: float64 ``rtol = atol = 1e-10`` (``F64``: a tiled sum reorders additions), float32
``rtol = atol = 2e-5`` (``F32``), bfloat16 inputs against a float32 reference ``atol = 2e-2``.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.flash import (
    TiledAttention,
    merge_attention_states,
    naive_attention,
    peak_tensor_bytes,
    tiled_attention,
    tiled_attention_backward,
    tiled_attention_forward,
)

F64 = dict(rtol=1e-10, atol=1e-10)
F32 = dict(rtol=2e-5, atol=2e-5)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def causal_attend(T_q, T_k):
    """Bottom-right causal mask, written with tril: query i sees keys j <= i + T_k - T_q."""
    return torch.ones(T_q, T_k, dtype=torch.bool).tril(T_k - T_q)


def reference(q, k, v, causal, scale=None):
    """(o, lse) from torch: SDPA for o, torch.logsumexp of the masked explicit scores for lse."""
    T_q, T_k = q.shape[-2], k.shape[-2]
    tau = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = causal_attend(T_q, T_k) if causal else None
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = q @ k.transpose(-1, -2) * tau
    if causal:
        s = s.masked_fill(~mask, float("-inf"))
    return o, torch.logsumexp(s, -1)


def rand(*shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


CASES = [  # (T_q, T_k, block_q, block_k): ragged tails, T_q != T_k both ways, a single tile
    (37, 37, 8, 16), (64, 64, 64, 64), (5, 29, 4, 8), (29, 11, 8, 4), (1, 40, 64, 7), (50, 50, 128, 128),
]


@pytest.mark.equation("03.13", "03.14", oracle="F.scaled_dot_product_attention; torch.logsumexp of the scores")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T_q, T_k, block_q, block_k", CASES)
def test_tiled_forward_matches_torch(T_q, T_k, block_q, block_k, causal):
    q, k, v = rand(2, 3, T_q, 16), rand(2, 3, T_k, 16), rand(2, 3, T_k, 8)
    o, lse = tiled_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    ref_o, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(o, ref_o, **F64)
    torch.testing.assert_close(lse, ref_lse, **F64)  # -inf == -inf for rows that see no key
    assert lse.shape == (2, 3, T_q)
    no_key = torch.isinf(ref_lse)
    assert (o[no_key] == 0).all()


@pytest.mark.equation("03.13", "03.14", oracle="F.scaled_dot_product_attention (float32, bfloat16, (B, T, D))")
def test_tiled_forward_dtypes_and_headless_shapes():
    q, k, v = (torch.randn(2, 45, 32) for _ in range(3))
    o, lse = tiled_attention_forward(q, k, v, causal=True, scale=0.2, block_q=16, block_k=16)
    ref_o, ref_lse = reference(q, k, v, True, scale=0.2)
    torch.testing.assert_close(o, ref_o, **F32)
    torch.testing.assert_close(lse, ref_lse, **F32)
    assert lse.shape == (2, 45)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ob, lseb = tiled_attention_forward(qb, kb, vb, causal=True, block_q=16, block_k=16)
    assert ob.dtype == torch.bfloat16 and lseb.dtype == torch.float32
    ref32 = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), is_causal=True)
    torch.testing.assert_close(ob.float(), ref32, atol=2e-2, rtol=0)


@pytest.mark.equation("03.13", "03.14", oracle="F.scaled_dot_product_attention")
@SETTINGS
@given(st.integers(1, 40), st.integers(1, 40), st.integers(1, 17), st.integers(1, 17), st.booleans())
def test_tiled_equals_reference_for_all_shapes_and_blocks(T_q, T_k, block_q, block_k, causal):
    g = torch.Generator().manual_seed(T_q * 1000 + T_k)
    q = torch.randn(1, 2, T_q, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, T_k, 4, generator=g, dtype=torch.float64) for _ in range(2))
    o, lse = tiled_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    ref_o, ref_lse = reference(q, k, v, causal)
    torch.testing.assert_close(o, ref_o, **F64)
    torch.testing.assert_close(lse, ref_lse, **F64)


@pytest.mark.equation("03.14", oracle="F.scaled_dot_product_attention over all keys")
def test_merging_two_key_halves_gives_full_attention():
    q, k, v = rand(2, 2, 9, 8), rand(2, 2, 20, 8), rand(2, 2, 20, 8)
    o_a, lse_a = naive_attention(q, k[:, :, :7], v[:, :, :7])
    o_b, lse_b = naive_attention(q, k[:, :, 7:], v[:, :, 7:])
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = reference(q, k, v, False)
    torch.testing.assert_close(o, ref_o, **F64)
    torch.testing.assert_close(lse, ref_lse, **F64)


def test_naive_attention_matches_torch():
    for causal, (T_q, T_k) in [(False, (6, 9)), (True, (9, 9)), (True, (9, 4))]:
        q, k, v = rand(2, 2, T_q, 8), rand(2, 2, T_k, 8), rand(2, 2, T_k, 8)
        for a, b in zip(naive_attention(q, k, v, causal=causal), reference(q, k, v, causal), strict=True):
            torch.testing.assert_close(a, b, **F64)


# ================================================================= backward


@pytest.mark.equation("03.13", "03.14", oracle="torch.autograd through F.scaled_dot_product_attention")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T_q, T_k, block_q, block_k", [(37, 37, 8, 16), (5, 29, 4, 8), (33, 70, 16, 16)])
def test_tiled_gradients_match_autograd(T_q, T_k, block_q, block_k, causal):
    q, k, v = rand(2, 2, T_q, 8, requires_grad=True), rand(2, 2, T_k, 8, requires_grad=True), \
        rand(2, 2, T_k, 6, requires_grad=True)
    do = torch.randn(2, 2, T_q, 6, dtype=torch.float64)
    mask = causal_attend(T_q, T_k) if causal else None
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), (q, k, v), do)
    ours = torch.autograd.grad(tiled_attention(q, k, v, causal, None, block_q, block_k), (q, k, v), do)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **F64)
    # the function form agrees with the autograd.Function
    with torch.no_grad():
        o, lse = tiled_attention_forward(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
        direct = tiled_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=block_q, block_k=block_k)
    for a, b in zip(direct, ref, strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.equation("03.13", "03.14", oracle="torch.autograd.gradcheck (finite differences)")
def test_tiled_attention_passes_gradcheck():
    # T_q > T_k with causal: the first queries see no key (zero output, zero gradient)
    q, k, v = rand(1, 2, 7, 3, requires_grad=True), rand(1, 2, 5, 3, requires_grad=True), \
        rand(1, 2, 5, 2, requires_grad=True)
    for causal in (False, True):
        assert torch.autograd.gradcheck(lambda a, b, c, causal=causal: TiledAttention.apply(a, b, c, causal, 0.7, 3, 2),
                                        (q, k, v))


def test_float32_gradients_and_headless_shapes():
    q, k, v = (torch.randn(2, 40, 16, requires_grad=True) for _ in range(3))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum(), (q, k, v))
    ours = torch.autograd.grad(tiled_attention(q, k, v, causal=True, block_q=16, block_k=8).square().sum(), (q, k, v))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# ================================================================= claim C12 (CPU half): memory


def test_peak_tensor_bytes_counts_known_allocations():
    x = torch.ones(100, 100)  # allocated before: not counted

    def f():
        a = x * 2  # 40 000 bytes
        b = a @ a  # 40 000 bytes, with a alive
        del a
        return b.sum()  # 4 bytes, a freed

    _, peak = peak_tensor_bytes(f)
    assert peak == 80_000


def test_claim_c12_tiled_memory_grows_linearly_naive_quadratically():
    """Peak tensor bytes (PyTorch dispatcher accounting) at T, 2T, 4T. Peak = a T + c (linear) has
    increments in ratio 2; peak = a T^2 + b T + c (quadratic) has increments in ratio ~4."""
    peaks = {}
    Ts = (256, 512, 1024)
    for T in Ts:
        q, k, v = (torch.randn(1, 1, T, 16) for _ in range(3))
        (o, lse), peaks["tiled", T] = peak_tensor_bytes(tiled_attention_forward, q, k, v, True, None, 128, 128)
        peaks["tiled backward", T] = peak_tensor_bytes(tiled_attention_backward, q, k, v, o, lse, o, True, None,
                                                       128, 128)[1]
        peaks["naive", T] = peak_tensor_bytes(naive_attention, q, k, v, causal=True)[1]

    def increment_ratio(name):
        return (peaks[name, Ts[2]] - peaks[name, Ts[1]]) / (peaks[name, Ts[1]] - peaks[name, Ts[0]])

    assert increment_ratio("tiled") == pytest.approx(2.0, rel=0.02)
    assert increment_ratio("tiled backward") == pytest.approx(2.0, rel=0.02)
    assert increment_ratio("naive") == pytest.approx(4.0, rel=0.05)
    assert peaks["naive", 1024] > 10 * peaks["tiled", 1024]


def test_autograd_function_saves_no_score_matrix():
    """What TiledAttention keeps for backward: q, k, v, o (T x D each) and lse (T), nothing T x T."""
    saved = []
    q, k, v = (torch.randn(1, 2, 100, 8, requires_grad=True) for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        o = tiled_attention(q, k, v, causal=True)
    assert sorted(saved) == sorted([(1, 2, 100, 8)] * 4 + [(1, 2, 100)])
    assert o.grad_fn is not None


# ================================================================= bad input


def test_bad_inputs_are_rejected():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="must equal H"):
        tiled_attention_forward(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        tiled_attention_forward(q, q, q, block_q=0)
    with pytest.raises(ValueError, match=r"scale must lie in \(0.0, inf\), got 0.0"):
        tiled_attention_forward(q, q, q, scale=0.0)
    with pytest.raises(ValueError, match="contains NaN"):
        tiled_attention(q.masked_fill(q > 0, float("nan")), q, q)
    o, lse = tiled_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="lse"):
        tiled_attention_backward(q, q, q, o, lse[..., :3], o)


# ================================================================= issue 11: merge_attention_states checks its inputs


def test_merge_attention_states_validates_pairs():
    o, lse = torch.randn(2, 5, 4), torch.randn(2, 5)
    cases = [
        ((o, lse, o[:, :3], lse), ValueError, r"o_a \(2, 5, 4\) and o_b \(2, 3, 4\) must have the same shape"),
        ((o, lse, o, lse[:, :3]), ValueError, r"lse_a \(2, 5\) and lse_b \(2, 3\) must have the same shape"),
        ((o, lse[:, :3], o, lse[:, :3]), ValueError, r"lse_a \(2, 3\) must be o_a \(2, 5, 4\) without its last axis"),
        ((o, lse, o.double(), lse), TypeError, r"o_a \(torch.float32\) and o_b \(torch.float64\) must share one dtype"),
        ((o, lse, o, lse.double()), TypeError, r"lse_a \(torch.float32\) and lse_b \(torch.float64\) must share"),
        ((o, lse.masked_fill(lse > 0, float("nan")), o, lse), ValueError, r"lse_a contains NaN"),
        ((o, lse, o, torch.full_like(lse, float("inf"))), ValueError, r"lse_b contains \+inf"),
        ((o.masked_fill(o > 0, float("inf")), lse, o, lse), ValueError, r"o_a contains inf"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            merge_attention_states(*args)
    # an empty key set (lse = -inf) is legal: the merge is the other half (oracle: identity)
    out, out_lse = merge_attention_states(o, lse, torch.zeros_like(o), torch.full_like(lse, float("-inf")))
    torch.testing.assert_close(out, o, rtol=0, atol=0)
    torch.testing.assert_close(out_lse, lse, rtol=0, atol=0)


def test_chapter_3_states_the_recorded_cpu_benchmark():
    """The chapter's sentences on the tiled loop against PyTorch's fused SDPA match the recorded ratios."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bench, nb = root / "benchmarks" / "results" / "attention_cpu.json", root / "book" / "03-attention.ipynb"
    if not (bench.exists() and nb.exists()):
        pytest.skip("needs a source checkout with the recorded benchmark")
    rows = json.loads(bench.read_text())["rows"]
    ratios = [r["ratios"]["time_tiled_over_sdpa"] for r in rows]
    bound = next(r["bound"] for r in rows if r["T"] == 4096)
    assert min(ratios) > 1 and bound["time_tiled_over_sdpa"] > 1.2  # slower than SDPA: what the prose says
    text = " ".join("\n".join("".join(c["source"]) for c in json.loads(nb.read_text(encoding="utf-8"))["cells"]
                              if c["cell_type"] == "markdown").split())
    mm = bound["time_matmuls_only_over_sdpa"]  # the loop's matmuls alone, over SDPA
    for s in (f"{min(ratios):.1f} to {max(ratios):.1f} times in the table",
              f"{bound['time_tiled_over_sdpa']:.1f} times at $T = 4096$ in the second run",
              f"finds {mm:.2f}", f"$1.2 - {mm:.2f} \\approx {1.2 - mm:.2f}$"):
        assert s in text, f"book/03-attention.ipynb does not state {s!r}"
