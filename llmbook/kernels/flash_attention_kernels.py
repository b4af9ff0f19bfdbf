r"""The Triton kernels of :mod:`llmbook.kernels.flash_attention`, and their autotuning table.

This module imports Triton when it is imported, so :mod:`llmbook.kernels.flash_attention` imports it
on first use only (:func:`llmbook.kernels.runtime.load_kernels`). The kernels are ``@triton.jit``
functions, as in Triton's fused-attention tutorial: the forward and the dQ kernels share the key-tile
loop's pieces (``_kv_bounds``, ``_kv_scores``) and each runs it twice through its inner helper
(``_attn_fwd_inner``, ``_attn_dq_inner``): once over the key tiles every query of the tile
sees in full, without masks, and once over the diagonal and the ragged tail, with them.

``KERNELS`` holds the kernels launched with explicit block sizes, ``TUNED`` the autotuned ones. The
autotuner is keyed on the sequence lengths rounded up to a power of two (``TQ_BUCKET``, ``TK_BUCKET``),
not on the lengths, so a growing KV cache is tuned once per doubling, not at every decoding step.
"""

from __future__ import annotations

from functools import partial

import torch

from llmbook.kernels.runtime import triton_for_kernels

triton, tl = triton_for_kernels()  # stand-ins that define nothing runnable where triton is not installed


# ====================================================================================== kernel bodies
# Every tensor is contiguous, so a row of Q/K/V/O is HEAD_DIM elements and a head is T * HEAD_DIM.
# BLOCK_D >= 16 is HEAD_DIM rounded up to a power of two (tl.dot needs K >= 16); EVEN_D says no padding
# columns exist. exp2 is used throughout with log2(e) folded into qk_scale; LSE is stored in natural-log
# units. TQ_BUCKET and TK_BUCKET are read by the autotuner only.


@triton.jit
def _kv_bounds(start_m, Tq, Tk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles ``[0, lo_mask)`` need no mask for the query tile at ``start_m``; ``[lo_mask, hi)`` hold the
    diagonal and the ragged tail; tiles past ``hi`` are masked for every row of the tile and never visited."""
    offset = Tk - Tq
    n_full = (Tk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + offset, Tk), 0)
        lo_mask = tl.minimum(tl.maximum(start_m + offset + 1, 0) // BLOCK_N * BLOCK_N, n_full)
    else:
        hi = Tk
        lo_mask = n_full
    return lo_mask, hi


@triton.jit
def _kv_scores(q, k_base, v_base, start_n, offs_m, offs_n, offs_d, qk_scale, Tk, offset,
               CAUSAL: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
               PRECISION: tl.constexpr):
    """Load the key/value tile at ``start_n``; return ``(k, v, s)`` with the scores ``s = q k^T qk_scale``
    (log2 units), ``-inf`` where the key is past ``Tk`` or hidden by the causal mask (when ``MASKED``)."""
    cols = start_n + offs_n
    kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
    if MASKED or not EVEN_D:
        kv_mask = (cols[:, None] < Tk) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_base + kv_off)
        v = tl.load(v_base + kv_off)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        keep = cols[None, :] < Tk
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + offset)
        s = tl.where(keep, s, float("-inf"))
    return k, v, s


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, qk_scale, Tk, offset,
                    CAUSAL: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax over the key tiles ``[lo, hi)``: returns the updated ``(acc, l_i, m_i)``."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _kv_scores(q, k_base, v_base, start_n, offs_m, offs_n, offs_d, qk_scale, Tk, offset,
                             CAUSAL, MASKED, HEAD_DIM, EVEN_D, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:  # a row that has seen no key yet keeps m = -inf; shift by 0 instead (no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, qk_scale, H, Tq, Tk, GROUP, TQ_BUCKET, TK_BUCKET,
              CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # heaviest query tiles first: better load balance at the end of the grid
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_hkv = (off_bh % H) // GROUP
    H_kv = H // GROUP
    q_base = Q + off_bh.to(tl.int64) * Tq * HEAD_DIM
    k_base = K + (off_b * H_kv + off_hkv).to(tl.int64) * Tk * HEAD_DIM
    v_base = V + (off_b * H_kv + off_hkv).to(tl.int64) * Tk * HEAD_DIM

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM
    q_off = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_base + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offset = Tk - Tq
    lo_mask, hi = _kv_bounds(pid_m * BLOCK_M, Tq, Tk, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, 0, lo_mask, offs_m, offs_n, offs_d, qk_scale,
                                    Tk, offset, CAUSAL, False, HEAD_DIM, EVEN_D, PRECISION, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, lo_mask, hi, offs_m, offs_n, offs_d, qk_scale,
                                    Tk, offset, CAUSAL, True, HEAD_DIM, EVEN_D, PRECISION, BLOCK_N)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows with no visible key: O = 0, LSE = -inf
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # log2 units -> natural log
    o_base = O + off_bh.to(tl.int64) * Tq * HEAD_DIM
    tl.store(o_base + q_off, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + off_bh.to(tl.int64) * Tq + offs_m, lse, mask=m_ok)


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, Tq,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Tq
    mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    off = off_bh.to(tl.int64) * Tq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(O + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + off_bh.to(tl.int64) * Tq + offs_m, tl.sum(o * do, 1), mask=m_ok)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, H, Tq, Tk, GROUP, TQ_BUCKET, TK_BUCKET,
                   CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # one program per key tile of one key/value head; it loops over the GROUP query heads that share it
    pid_n = tl.program_id(0)
    off_bkv = tl.program_id(1)
    H_kv = H // GROUP
    off_b = off_bkv // H_kv
    off_hkv = off_bkv % H_kv
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_off = off_bkv.to(tl.int64) * Tk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    kv_mask = (offs_n[:, None] < Tk) & d_ok[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # query tiles [lo, m_full) straddle the diagonal (masked); [m_full, m_end) see the whole key tile.
    # Rows past Tq load q = dO = 0, LSE = Delta = 0 and so add exactly zero to dK and dV.
    offset = Tk - Tq
    n0 = pid_n * BLOCK_N
    m_end = (Tq + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if CAUSAL:
        m_full = tl.minimum((tl.maximum(n0 + BLOCK_N - 1 - offset, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, m_end)
        lo = tl.minimum(tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M, m_full)
    else:
        m_full = 0
        lo = 0

    for g in range(GROUP):
        off_bh = (off_b * H + off_hkv * GROUP + g).to(tl.int64)
        q_base = Q + off_bh * Tq * HEAD_DIM
        do_base = DO + off_bh * Tq * HEAD_DIM
        for phase in tl.static_range(0 if CAUSAL else 1, 2):  # non-causal: no diagonal phase
            if phase == 0:
                start = lo
                stop = m_full
            else:
                start = m_full
                stop = m_end
            for start_m in range(start, stop, BLOCK_M):
                rows = start_m + offs_m
                r_ok = rows < Tq
                qd_off = rows[:, None] * HEAD_DIM + offs_d[None, :]
                q = tl.load(q_base + qd_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
                do = tl.load(do_base + qd_off, mask=r_ok[:, None] & d_ok[None, :], other=0.0)
                lse2 = tl.load(LSE + off_bh * Tq + rows, mask=r_ok, other=0.0) * 1.4426950408889634
                delta = tl.load(DELTA + off_bh * Tq + rows, mask=r_ok, other=0.0)
                qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
                pT = tl.math.exp2(qkT - lse2[None, :])
                if phase == 0:  # also zeroes rows that see no key at all (LSE = -inf makes pT = inf)
                    pT = tl.where(offs_n[:, None] <= rows[None, :] + offset, pT, 0.0)
                dv = tl.dot(pT.to(DO.dtype.element_ty), do, dv, input_precision=PRECISION)
                dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                dsT = pT * (dpT - delta[None, :])
                dk = tl.dot(dsT.to(Q.dtype.element_ty), q, dk, input_precision=PRECISION)

    dk = dk * sm_scale
    tl.store(DK + kv_off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_dq_inner(dq, q, do, lse2, delta, k_base, v_base, lo, hi, offs_m, offs_n, offs_d, qk_scale, Tk, offset,
                   CAUSAL: tl.constexpr, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """``dq += dS K`` over the key tiles ``[lo, hi)``, with ``P = exp2(S - L)`` recomputed per tile."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v, s = _kv_scores(q, k_base, v_base, start_n, offs_m, offs_n, offs_d, qk_scale, Tk, offset,
                             CAUSAL, MASKED, HEAD_DIM, EVEN_D, PRECISION)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, H, Tq, Tk, GROUP, TQ_BUCKET, TK_BUCKET,
                 CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    off_b = off_bh // H
    off_hkv = (off_bh % H) // GROUP
    H_kv = H // GROUP
    k_base = K + (off_b * H_kv + off_hkv).to(tl.int64) * Tk * HEAD_DIM
    v_base = V + (off_b * H_kv + off_hkv).to(tl.int64) * Tk * HEAD_DIM

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM
    q_off = off_bh.to(tl.int64) * Tq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    lse2 = tl.load(LSE + off_bh.to(tl.int64) * Tq + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    # a row that sees no key has LSE = -inf and only masked scores (-inf): shift by 0 to get P = 0, not NaN
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + off_bh.to(tl.int64) * Tq + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offset = Tk - Tq
    lo_mask, hi = _kv_bounds(pid_m * BLOCK_M, Tq, Tk, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _attn_dq_inner(dq, q, do, lse2, delta, k_base, v_base, 0, lo_mask, offs_m, offs_n, offs_d, qk_scale, Tk,
                        offset, CAUSAL, False, HEAD_DIM, EVEN_D, PRECISION, BLOCK_N)
    dq = _attn_dq_inner(dq, q, do, lse2, delta, k_base, v_base, lo_mask, hi, offs_m, offs_n, offs_d, qk_scale, Tk,
                        offset, CAUSAL, True, HEAD_DIM, EVEN_D, PRECISION, BLOCK_N)

    dq = dq * sm_scale
    tl.store(DQ + q_off, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ====================================================================================== kernel objects


# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on CUDA, for 16-bit inputs with head
# dimensions up to 64 and up to 128, and for float32 (IEEE dots without tensor cores: small tiles). Chosen
# from an sm_90 compile of each candidate (shared memory, registers, spills): the ones that spill heavily
# are left out, so that compiling and timing them all stays short. Forward: 128 query rows against 64 or
# 128 keys. dK/dV keeps BLOCK_N key rows resident and streams BLOCK_M query rows past them; dQ is the
# mirror image.
TUNING = {
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3)],
        "fp32": [(32, 32, 4, 2), (32, 32, 4, 3), (64, 32, 8, 2)],
    },
    "dkdv": {
        64: [(32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3)],
        128: [(32, 128, 8, 3), (64, 128, 8, 2), (64, 64, 8, 3), (32, 64, 4, 3), (32, 64, 8, 3)],
        "fp32": [(32, 32, 4, 2), (16, 64, 4, 2), (32, 64, 8, 2)],
    },
    "dq": {
        64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4)],
        "fp32": [(32, 32, 4, 2), (64, 32, 8, 2), (64, 16, 4, 2)],
    },
}
# bucketed lengths (see llmbook.kernels.flash_attention.length_bucket), not the lengths themselves
TUNING_KEY = ["TQ_BUCKET", "TK_BUCKET", "GROUP", "CAUSAL", "HEAD_DIM"]


def _tuning_class(dtype: torch.dtype, head_dim: int):
    if dtype == torch.float32:
        return "fp32"
    return 64 if head_dim <= 64 else 128


def _configs(kind: str):
    """Every candidate of one kernel, for all head dimensions (``_prune`` keeps the ones for this call)."""
    config = triton.Config
    tiles = dict.fromkeys(t for tiles in TUNING[kind].values() for t in tiles)
    return [config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def _prune(kind: str, configs, named_args, **kwargs):
    wanted = set(TUNING[kind][_tuning_class(named_args["Q"].dtype, kwargs["HEAD_DIM"])])
    keep = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return keep or configs[:1]


def _tuning_bench(fn, quantiles):
    """How the autotuner times a candidate: short do_bench runs (the tests replace this)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _autotuned(kind: str, kernel):
    """``kernel`` behind ``triton.autotune`` over the candidates of ``TUNING[kind]``."""
    return triton.autotune(_configs(kind), key=TUNING_KEY,
                           prune_configs_by={"early_config_prune": partial(_prune, kind)},
                           do_bench=lambda fn, quantiles: _tuning_bench(fn, quantiles))(kernel)


KERNELS = {"fwd": _attn_fwd, "pre": _attn_bwd_preprocess, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}
TUNED = {kind: _autotuned(kind, KERNELS[kind]) for kind in ("fwd", "dkdv", "dq")}
MODE_PROBE = _attn_fwd  # what llmbook.kernels.runtime.load_kernels checks the mode on
