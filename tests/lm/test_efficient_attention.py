"""Chapter 3, efficient attention (ids 03.09-03.12) against independent oracles.

* Linear attention: the kernel-ratio formula evaluated query by query in float64 (``F64``: 1e-12).
* Performer: the closed form ``exp(q.k)``; Monte-Carlo tolerances come from the estimator's variance
  ``exp(2 q.k) (exp(|q + k|^2) - 1) / m`` (i.i.d. directions), at 5 standard errors.
* Linformer: ``F.scaled_dot_product_attention`` on the identity / explicitly projected keys (``F32``).
* Reformer: ``numpy.argmax`` of ``[xR, -xR]``; ``F.scaled_dot_product_attention`` with the
  bucket-equality mask; the collision probability ``1 - theta / pi`` of a random hyperplane.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.efficient_attention import (
    favor_features,
    linear_attention,
    linear_attention_recurrent,
    linformer_attention,
    linformer_projection,
    lsh_attention,
    lsh_hash,
    lsh_rotations,
    performer_attention,
    random_features,
)

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=30, deadline=None, derandomize=True)


def kernel_ratio_loop(q, k, v, phi, causal):
    """out_i = sum_j phi(q_i).phi(k_j) v_j / sum_j phi(q_i).phi(k_j), one query at a time (float64)."""
    B, H, T_q, _ = q.shape
    T_k = k.shape[2]
    out = torch.zeros(B, H, T_q, v.shape[-1], dtype=torch.float64)
    for i in range(T_q):
        last = i + T_k - T_q if causal else T_k - 1
        w = (phi(q[:, :, i : i + 1]) * phi(k[:, :, : last + 1])).sum(-1)  # (B, H, j)
        out[:, :, i] = (w.unsqueeze(-1) * v[:, :, : last + 1]).sum(-2) / w.sum(-1, keepdim=True)
    return out


def elu1(x):
    return F.elu(x) + 1


# ================================================================= 03.09 linear attention


@pytest.mark.equation("03.09", oracle="kernel-ratio formula evaluated query by query (float64)")
@pytest.mark.parametrize("causal, T_q, T_k", [(False, 6, 9), (True, 7, 7), (True, 3, 8)])
def test_linear_attention_matches_explicit_formula(causal, T_q, T_k):
    q = torch.randn(2, 3, T_q, 5, dtype=torch.float64)
    k, v = torch.randn(2, 3, T_k, 5, dtype=torch.float64), torch.randn(2, 3, T_k, 4, dtype=torch.float64)
    ref = kernel_ratio_loop(q, k, v, elu1, causal)
    torch.testing.assert_close(linear_attention(q, k, v, "elu", causal=causal), ref, **F64)
    relu_ref = kernel_ratio_loop(q.abs(), k.abs(), v, F.relu, causal)  # |x|: no all-zero feature row
    torch.testing.assert_close(linear_attention(q.abs(), k.abs(), v, "relu", causal=causal), relu_ref, **F64)


@pytest.mark.equation("03.09", oracle="kernel-ratio formula evaluated query by query (float64)")
def test_recurrent_form_equals_parallel_causal_form():
    q, k, v = (torch.randn(2, 3, 11, 4, dtype=torch.float64) for _ in range(3))
    rnn = linear_attention_recurrent(q, k, v)
    torch.testing.assert_close(rnn, kernel_ratio_loop(q, k, v, elu1, causal=True), **F64)
    torch.testing.assert_close(rnn, linear_attention(q, k, v, causal=True), **F64)
    # head-less inputs and a custom feature map
    torch.testing.assert_close(linear_attention_recurrent(q[:, 0], k[:, 0], v[:, 0], torch.exp),
                               linear_attention(q[:, 0], k[:, 0], v[:, 0], torch.exp, causal=True), **F64)


@pytest.mark.equation("03.09", oracle="kernel-ratio formula evaluated query by query (float64)")
@SETTINGS
@given(st.integers(1, 9), st.integers(1, 4), st.integers(0, 10_000))
def test_recurrent_equals_parallel_for_all_shapes(T, D, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, D, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    torch.testing.assert_close(linear_attention_recurrent(q, k, v), linear_attention(q, k, v, causal=True), **F64)


# ================================================================= 03.10 Performer FAVOR+


Q = torch.tensor([0.3, -0.5, 0.2, 0.4], dtype=torch.float64)
K = torch.tensor([0.1, -0.3, 0.6, -0.2], dtype=torch.float64)
VAR = math.exp(2 * Q @ K) * (math.exp(((Q + K) ** 2).sum()) - 1)  # variance of one feature's estimate


@pytest.mark.equation("03.10", oracle="closed form exp(q.k) (float64), tolerance 5 standard errors")
@pytest.mark.parametrize("orthogonal", [False, True])
def test_favor_is_unbiased_for_the_softmax_kernel(orthogonal):
    g = torch.Generator().manual_seed(10)
    m = 200_000
    omega = random_features(m, 4, orthogonal=orthogonal, generator=g, dtype=torch.float64)
    estimate = (favor_features(Q, omega) * favor_features(K, omega)).sum().item()
    exact = math.exp(Q @ K)
    # orthogonal directions have no more variance than i.i.d. ones for positive features, so the i.i.d. bound holds
    assert abs(estimate - exact) < 5 * math.sqrt(VAR / m), (estimate, exact)


@pytest.mark.equation("03.10", oracle="closed form exp(q.k) (float64); MSE against the variance formula / m")
def test_favor_error_shrinks_like_one_over_m():
    """Mean squared error over R = 2000 independent draws of m i.i.d. directions equals VAR / m up to
    Monte-Carlo noise (the squared errors of a log-normal-like estimate are heavy-tailed: a +-35 % band)."""
    g = torch.Generator().manual_seed(11)
    R, exact = 2000, math.exp(Q @ K)
    mse = {}
    for m in (4, 16, 64, 256):
        omega = torch.randn(R, m, 4, generator=g, dtype=torch.float64)
        phi_q = torch.exp(omega @ Q - Q @ Q / 2) / math.sqrt(m)  # (R, m): features of each draw
        phi_k = torch.exp(omega @ K - K @ K / 2) / math.sqrt(m)
        torch.testing.assert_close(phi_q[0], favor_features(Q, omega[0]), **F64)
        est = (phi_q * phi_k).sum(-1)
        mse[m] = ((est - exact) ** 2).mean().item()
        assert mse[m] * m / VAR == pytest.approx(1.0, rel=0.35), (m, mse[m] * m / VAR)
    assert mse[4] > mse[16] > mse[64] > mse[256]


@pytest.mark.equation("03.10", oracle="torch.nn.functional.scaled_dot_product_attention (exact softmax attention)")
def test_performer_attention_approaches_softmax_attention():
    """RMS error over 10 draws of the directions falls roughly like 1/sqrt(m) (16x the features: ~4x
    smaller). Small-norm q, k (std 0.5): the estimator's variance grows like exp(|q + k|^2)."""
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    v = torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64)
    for causal in (False, True):
        exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        rms = [torch.stack([(performer_attention(q, k, v, n_features=m, causal=causal, generator=g) - exact)
                            .pow(2).mean() for _ in range(10)]).mean().sqrt().item() for m in (16, 256, 4096)]
        assert rms[0] > 2.5 * rms[1] > 6 * rms[2] and rms[2] < 0.02, rms


# ================================================================= 03.11 Linformer


@pytest.mark.equation("03.11", oracle="torch.nn.functional.scaled_dot_product_attention (E = F = identity)")
def test_linformer_with_identity_projection_is_full_attention():
    q, k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 5)
    torch.testing.assert_close(linformer_attention(q, k, v, torch.eye(12)), F.scaled_dot_product_attention(q, k, v),
                               **F32)
    E = torch.eye(12).expand(3, 12, 12)  # per-head projections
    torch.testing.assert_close(linformer_attention(q, k, v, E, E), F.scaled_dot_product_attention(q, k, v), **F32)


@pytest.mark.equation("03.11", oracle="torch.nn.functional.scaled_dot_product_attention on E K and F V")
def test_linformer_matches_attention_on_projected_keys():
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 3, 20, 8, generator=g) for _ in range(3))
    E, Fp = linformer_projection(20, 6, "gaussian", generator=g), linformer_projection(20, 6, "gaussian", generator=g)
    ref = F.scaled_dot_product_attention(q, torch.einsum("kt,bhtd->bhkd", E, k), torch.einsum("kt,bhtd->bhkd", Fp, v))
    torch.testing.assert_close(linformer_attention(q, k, v, E, Fp), ref, **F32)


@pytest.mark.equation("03.11", oracle="torch.nn.functional.adaptive_avg_pool1d; F.scaled_dot_product_attention")
@pytest.mark.parametrize("T, k_dim", [(12, 4), (13, 5), (8, 8)])
def test_linformer_pooling_projection(T, k_dim):
    x = torch.randn(3, T, dtype=torch.float64)
    E = linformer_projection(T, k_dim, dtype=torch.float64)
    torch.testing.assert_close(x @ E.T, F.adaptive_avg_pool1d(x.unsqueeze(0), k_dim)[0], **F64)
    if T % k_dim == 0:  # keys and values constant on each pooled segment: pooling loses nothing
        seg = T // k_dim
        q = torch.randn(1, 2, 7, 4, dtype=torch.float64)
        k, v = (torch.randn(1, 2, k_dim, 4, dtype=torch.float64).repeat_interleave(seg, dim=2) for _ in range(2))
        torch.testing.assert_close(linformer_attention(q, k, v, E), F.scaled_dot_product_attention(q, k, v), **F64)


# ================================================================= 03.12 Reformer LSH


@pytest.mark.equation("03.12", oracle="numpy.argmax of the concatenation [xR, -xR]")
def test_lsh_hash_matches_numpy():
    g = torch.Generator().manual_seed(14)
    x, R = torch.randn(3, 50, 16, generator=g), lsh_rotations(16, 8, generator=g)
    xR = x.numpy() @ R.numpy()
    np.testing.assert_array_equal(lsh_hash(x, R).numpy(), np.argmax(np.concatenate([xR, -xR], -1), -1))
    assert torch.equal(lsh_hash(3.7 * x, R), lsh_hash(x, R))  # positive scaling never changes a bucket


@pytest.mark.equation("03.12", oracle="torch.nn.functional.scaled_dot_product_attention (one shared bucket)")
def test_lsh_attention_with_one_bucket_is_full_attention():
    q, k, v = (torch.randn(2, 2, 9, 4) for _ in range(3))
    q[..., 0], k[..., 0] = q[..., 0].abs() + 0.1, k[..., 0].abs() + 0.1
    R = torch.tensor([[1.0], [0.0], [0.0], [0.0]])  # one hyperplane that every q and k lies above
    for causal in (False, True):
        torch.testing.assert_close(lsh_attention(q, k, v, R=R, causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal), **F32)


@pytest.mark.equation("03.12", oracle="F.scaled_dot_product_attention with the mask h(q_i) == h(k_j) (numpy hashes)")
@pytest.mark.parametrize("causal", [False, True])
def test_lsh_attention_matches_bucket_masked_attention(causal):
    g = torch.Generator().manual_seed(15)
    q, k, v = torch.randn(2, 3, 24, 8, generator=g), torch.randn(2, 3, 24, 8, generator=g), torch.randn(2, 3, 24, 5)
    R = lsh_rotations(8, 4, generator=g)
    h = lambda x: np.argmax(np.concatenate([x.numpy() @ R.numpy(), -(x.numpy() @ R.numpy())], -1), -1)  # noqa: E731
    allowed = torch.from_numpy(h(q)[..., :, None] == h(k)[..., None, :])
    if causal:
        allowed &= torch.ones(24, 24, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # a query with no key: zeros
    torch.testing.assert_close(lsh_attention(q, k, v, R=R, causal=causal), ref, **F32)


@pytest.mark.equation("03.12", oracle="random-hyperplane collision probability 1 - theta/pi, 5 binomial std errors")
@pytest.mark.parametrize("theta", [0.3, 1.2, 2.5])
def test_lsh_collision_probability(theta):
    g = torch.Generator().manual_seed(16)
    D, N = 16, 3000
    x = torch.zeros(D)
    x[0] = 1.0
    y = torch.zeros(D)
    y[0], y[1] = math.cos(theta), math.sin(theta)
    xy = torch.stack([x, y])
    same = sum(int(h[0] == h[1]) for h in (lsh_hash(xy, lsh_rotations(D, 2, generator=g)) for _ in range(N)))
    p = 1 - theta / math.pi
    assert abs(same / N - p) < 5 * math.sqrt(p * (1 - p) / N), (same / N, p)


def test_lsh_extremes_for_many_buckets():
    g = torch.Generator().manual_seed(17)
    x = torch.randn(100, 16, generator=g)
    for nb in (2, 8, 32):
        R = lsh_rotations(16, nb, generator=g)
        assert torch.equal(lsh_hash(x, R), lsh_hash(2 * x, R))  # angle 0: always together
        assert not (lsh_hash(x, R) == lsh_hash(-x, R)).any()  # angle pi: never together


def test_bad_inputs_are_rejected():
    q = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="feature_map must be one of"):
        linear_attention(q, q, q, "softplus")
    with pytest.raises(ValueError, match=r"T_q \(3\) must equal T_k \(6\)"):
        linear_attention_recurrent(q[:, :3], q, q)
    with pytest.raises(ValueError, match="must share D"):
        favor_features(q, torch.randn(8, 3))
    with pytest.raises(ValueError, match="m must be a positive int"):
        random_features(0, 4)
    with pytest.raises(ValueError, match=r"E must have shape \(k, T_k\)"):
        linformer_attention(q, q, q, torch.eye(5))
    with pytest.raises(ValueError, match="kind must be 'pool' or 'gaussian'"):
        linformer_projection(6, 2, "random")
    with pytest.raises(ValueError, match=r"k_dim \(7\) must not exceed T \(6\)"):
        linformer_projection(6, 7)
    with pytest.raises(ValueError, match="n_buckets must be an even int"):
        lsh_rotations(4, 3)
    with pytest.raises(ValueError, match="must share D"):
        lsh_hash(q, torch.randn(3, 2))


def test_lsh_hash_of_integer_input_does_not_truncate_R():
    # issue 11: integer x used to cast R to int64, truncating e.g. 0.4 -> 0 and -0.9 -> 0 (every bucket 0)
    x = torch.tensor([[3, -1], [-2, 5], [1, 1]])
    R = torch.tensor([[0.4, -0.9], [0.7, 0.2]])
    # oracle: the hash of the same points given as float64, computed by hand from [xR, -xR]
    xR = x.double() @ R.double()
    expected = torch.cat([xR, -xR], -1).argmax(-1)
    assert torch.equal(lsh_hash(x, R), expected)
    assert torch.equal(lsh_hash(x.tolist(), R), expected)  # a nested list is converted likewise
    with pytest.raises(TypeError, match="x must be a real floating-point tensor, got dtype torch.bool"):
        lsh_hash(x > 0, R)


def test_performer_rejects_an_omega_of_another_dtype_or_width():
    q = torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match=r"omega must have shape \(m, D\) with D = 4, got \(8, 3\)"):
        performer_attention(q, q, q, omega=torch.randn(8, 3))
    with pytest.raises(ValueError, match=r"omega must have shape \(m, D\) with D = 4, got \(4,\)"):
        performer_attention(q, q, q, omega=torch.randn(4))
    with pytest.raises(TypeError, match=r"omega \(torch.float64\) must have the dtype of q, k, v \(torch.float32\)"):
        performer_attention(q, q, q, omega=torch.randn(8, 4, dtype=torch.float64))
    # oracle: a matching omega gives the same answer as the float64 computation within float32 rounding
    omega = torch.randn(16, 4)
    out = performer_attention(q, q, q, omega=omega)
    ref = performer_attention(q.double(), q.double(), q.double(), omega=omega.double())
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: random_features(2.0, 4), TypeError, r"m must be a positive int, got 2.0 \(float\)"),
        (lambda: lsh_rotations(4, True), TypeError, r"n_buckets must be an even int >= 2, got True \(bool\)"),
        (lambda: lsh_rotations(4.0, 4), TypeError, r"D must be a positive int, got 4.0 \(float\)"),
        (lambda: linformer_projection("6", 2), TypeError, r"T must be a positive int, got '6' \(str\)"),
    ],
)
def test_sizes_reject_other_kinds(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ================================================================= fp16 / bf16 and |q|, |k| ~ 300 (issue 11)

HALF_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])


def _qkv(dtype, scale, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, T, 16, generator=g) * scale for _ in range(2))
    v = torch.randn(1, 2, T, 16, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@DTYPES
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_at_large_scale_matches_the_float64_loop(dtype, causal):
    q, k, v = _qkv(dtype, 300.0)
    phi = lambda x: F.elu(x) + 1.0  # noqa: E731
    ref = kernel_ratio_loop(q.double(), k.double(), v.double(), phi, causal)
    for out in (linear_attention(q, k, v, causal=causal),) + ((linear_attention_recurrent(q, k, v),) if causal else ()):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])


@DTYPES
def test_performer_attention_at_large_scale_matches_a_float64_log_space_oracle(dtype):
    # oracle: the FAVOR+ kernel sum_r exp(l_q,r + l_k,r) formed in log space (logsumexp) in float64,
    # so nothing over- or underflows; then the kernel-weighted average of v
    omega = random_features(64, 16, generator=torch.Generator().manual_seed(1))
    w64, s = omega.double(), 16 ** -0.25

    def log_phi(x):
        x = x.double() * s
        return x @ w64.T - 0.5 * (x * x).sum(-1, keepdim=True)

    for scale in (1.0, 300.0):
        q, k, v = _qkv(dtype, scale)
        out = performer_attention(q, k, v, omega=omega)
        assert out.dtype == dtype and torch.isfinite(out).all()
        log_A = torch.logsumexp(log_phi(q).unsqueeze(-2) + log_phi(k).unsqueeze(-3), dim=-1)  # (B, H, T_q, T_k)
        ref = torch.softmax(log_A, dim=-1) @ v.double()
        torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])
        assert torch.isfinite(performer_attention(q, k, v, omega=omega, causal=True)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linformer_and_lsh_in_half_precision_match_float64(dtype):
    q, k, v = _qkv(dtype, 40.0)
    q64, k64, v64 = q.double(), k.double(), v.double()
    E = linformer_projection(8, 4, dtype=torch.float64)
    out = linformer_attention(q, k, v, E)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), F.scaled_dot_product_attention(q64, E @ k64, E @ v64), **HALF_TOL[dtype])
    R = lsh_rotations(16, 4, generator=torch.Generator().manual_seed(0))
    out = lsh_attention(q, k, v, R=R)
    assert out.dtype == dtype

    def h(x):  # the hash in float64: argmax of [xR, -xR]
        xR = x @ R.double()
        return torch.cat([xR, -xR], -1).argmax(-1)

    same_bucket = h(q64).unsqueeze(-1) == h(k64).unsqueeze(-2)
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=same_bucket).nan_to_num(0.0)
    ref = ref * same_bucket.any(-1, keepdim=True)  # a query alone in its bucket gets zeros
    torch.testing.assert_close(out.double(), ref, **HALF_TOL[dtype])


def test_favor_features_checks_kinds_and_computes_half_in_float32():
    """Issue 11: mismatched dtypes crashed in the matmul, lists in .shape; fp16 overflowed |x|^2 at |x| ~ 256."""
    g = torch.Generator().manual_seed(0)
    x, omega = torch.randn(3, 4, generator=g), random_features(6, 4, generator=g)
    with pytest.raises(TypeError, match=r"x \(torch.float64\) and omega \(torch.float32\) must share one dtype"):
        favor_features(x.double(), omega)
    with pytest.raises(TypeError, match="x must be a real floating-point tensor, got dtype torch.bool"):
        favor_features(x > 0, omega)
    torch.testing.assert_close(favor_features(x.tolist(), omega.tolist()), favor_features(x, omega), rtol=0, atol=0)
    # |x|^2 = 80000 overflows fp16 while w.x - |x|^2/2 = 0 for w = x/2: the feature is exp(-log(m)/2) = 1/sqrt(m)
    xh = torch.tensor([[200.0, 200.0, 0.0, 0.0]], dtype=torch.float16)
    oh = torch.cat([xh / 2, torch.zeros(3, 4, dtype=torch.float16)])  # m = 4
    ref = torch.exp(xh.double() @ oh.double().T - 0.5 * (xh.double() ** 2).sum(-1, keepdim=True) - 0.5 * math.log(4))
    out = favor_features(xh, oh)
    assert out.dtype == torch.float16 and out[0, 0].item() == 0.5  # 1 / sqrt(4)
    torch.testing.assert_close(out, ref.half(), rtol=2**-10, atol=0)


def test_lsh_hash_of_half_input_projects_in_float32():
    """Issue 11: fp16 x R was formed in fp16; the buckets must be those of the float32 projection of the same values."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 8, generator=g) * 2e4).clamp(-6e4, 6e4).half()  # x R overflows fp16 (+-inf ties)
    R = lsh_rotations(8, 8, generator=g).half()
    xR = x.float() @ R.float()  # oracle: float32 projection of the identical fp16 values
    assert torch.equal(lsh_hash(x, R), torch.cat([xR, -xR], -1).argmax(-1))


def test_performer_rejects_features_that_overflow_and_linformer_bool_projections():
    """Issue 11: |q| = 1e30 in float32 gave NaN (|q|^2 overflows: -inf - -inf); bool E / F_proj were accepted."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=g)
    big = q.clone()
    big[0, 0, 0, 0] = 1e30
    with pytest.raises(ValueError, match=r"q is too large for FAVOR\+ features in torch.float32: .*1e\+30"):
        performer_attention(big, q, q, n_features=16, generator=g)
    with pytest.raises(ValueError, match=r"k is too large for FAVOR\+ features in torch.float32: .*1e\+30"):
        performer_attention(q, torch.full_like(q, 1e30), q, n_features=16, generator=g)
    out = performer_attention(big.double(), q.double(), q.double(), n_features=16, generator=g)  # float64 holds 1e60
    assert torch.isfinite(out).all()
    E = linformer_projection(5, 3)
    for name in ("E", "F_proj"):
        kw = {"E": E, "F_proj": E, name: E > 0}
        with pytest.raises(TypeError, match=rf"{name} must be a real floating-point tensor, got dtype torch.bool"):
            linformer_attention(q, q, q, **kw)
