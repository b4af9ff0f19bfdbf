r"""FlashAttention-2 in Triton (chapter 3): exact attention without the :math:`T_q\times T_k` matrix.

A program owns one tile of queries and streams tiles of keys and values past it, keeping a running
row maximum :math:`m_i`, a running denominator :math:`l_i` and an unnormalised output (the online
softmax of catalogue equation 03.13):

.. math::

    m_i = \max(m_i^{old}, m_i^{block}),\qquad
    l_i = e^{m_i^{old}-m_i}\,l_i^{old} + e^{m_i^{block}-m_i}\,l_i^{block}.

Only :math:`O` and the per-row log-sum-exp :math:`L_i = m_i + \log l_i` are written to memory. The
backward pass recomputes :math:`P = \exp(S - L)` tile by tile from that :math:`L`: first
:math:`\Delta_i = \sum_d O_{id}\,dO_{id}`, then one kernel per key tile for :math:`dK, dV` and one per
query tile for :math:`dQ` (no atomics).

Shapes are batch-first: ``q`` is ``(B, H, T_q, D)`` and ``k, v`` are ``(B, H_kv, T_k, D)`` with
``H_kv`` dividing ``H`` (grouped-query attention when ``H_kv < H``), or ``(B, T, D)`` for one head.
With ``causal=True`` query ``i`` sees key ``j`` iff ``j <= i + T_k - T_q``: the last query is aligned
with the last key (FlashAttention-2's convention), and a query that sees no key returns zeros with
:math:`L_i = -\infty`.

Triton is imported on first use, never at import time, so ``import llmbook`` works without it. Under
``TRITON_INTERPRET=1`` (set before Triton is first imported) the same kernels run on the CPU in
Triton's interpreter, which is how the tests check them on machines without a GPU; the interpreter
cannot autotune, so pass ``block_m`` and ``block_n`` there. :func:`flash_attention` picks the
backend: Triton for CUDA tensors, the tiled PyTorch version of :mod:`llmbook.lm.flash` elsewhere.
"""

from __future__ import annotations

import math
import os
from functools import cache, partial

import torch
from jaxtyping import Float
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmbook.lm.attention import attention_scale
from llmbook.registry import implements

__all__ = [
    "flash_attention",
    "flash_attention_triton",
    "flash_attention_forward",
    "FlashAttentionFunction",
    "triton_available",
]

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 128
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "triton", "torch")

triton = None  # the modules are bound by _triton() on first use; the kernels below read `tl` at compile time
tl = None


def triton_available() -> bool:
    """True if Triton can be imported (it is an optional dependency).

    >>> isinstance(triton_available(), bool)
    True
    """
    try:
        _triton()
    except ImportError:
        return False
    return True


def _triton():
    """Import Triton once and bind the module globals the kernel bodies read."""
    global triton, tl
    if triton is None:
        import triton as _t
        import triton.language as _tl

        triton, tl = _t, _tl
    return triton


_INTERPRETED: bool | None = None


def _interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter, which is fixed when ``triton`` is first imported."""
    global _INTERPRETED
    if _INTERPRETED is None:
        _triton()
        from triton.runtime.interpreter import InterpretedFunction

        imported_interpreted = isinstance(tl.zeros, InterpretedFunction)
        knobs = getattr(triton, "knobs", None)
        asked = knobs.runtime.interpret if knobs else os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if imported_interpreted != bool(asked):
            raise RuntimeError("TRITON_INTERPRET changed after triton was imported: set it (or unset it) before "
                               "the first import of triton in this process, e.g. in a test module or conftest.py")
        _INTERPRETED = imported_interpreted
    return _INTERPRETED


def _alloc(shape, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Uninitialised memory for a kernel output (the tests replace this to poison it with NaN)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


# ====================================================================================== kernel bodies
# Plain functions, wrapped with triton.jit by _kernels() on first use. Every tensor is contiguous, so
# a row of Q/K/V/O is HEAD_DIM elements and a head is T * HEAD_DIM. BLOCK_D >= 16 is HEAD_DIM rounded
# up to a power of two (tl.dot needs K >= 16); EVEN_D says no padding columns exist. exp2 is used
# throughout with log2(e) folded into qk_scale; LSE is stored in natural-log units.


def _attn_fwd(Q, K, V, O, LSE, qk_scale, H, Tq, Tk, GROUP,
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

    # key tiles [0, lo_mask) need no mask; [lo_mask, hi) hold the diagonal and the ragged tail;
    # tiles past hi are entirely masked for every row of this tile and are never visited
    offset = Tk - Tq
    n_full = (Tk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(pid_m * BLOCK_M + BLOCK_M + offset, Tk), 0)
        lo_mask = tl.minimum(tl.maximum(pid_m * BLOCK_M + offset + 1, 0) // BLOCK_N * BLOCK_N, n_full)
    else:
        hi = Tk
        lo_mask = n_full

    for phase in tl.static_range(2):
        if phase == 0:
            start = 0
            stop = lo_mask
        else:
            start = lo_mask
            stop = hi
        for start_n in range(start, stop, BLOCK_N):
            cols = start_n + offs_n
            kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
            if phase == 0 and EVEN_D:
                k = tl.load(k_base + kv_off)
                v = tl.load(v_base + kv_off)
            else:
                kv_mask = (cols[:, None] < Tk) & d_ok[None, :]
                k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if phase == 1:
                keep = cols[None, :] < Tk
                if CAUSAL:
                    keep = keep & (cols[None, :] <= offs_m[:, None] + offset)
                qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            if phase == 1:  # a row that has seen no key yet keeps m = -inf; shift by 0 instead (no NaN)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.math.exp2(qk - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
            m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows with no visible key: O = 0, LSE = -inf
    acc = acc / l_safe[:, None]
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # log2 units -> natural log
    o_base = O + off_bh.to(tl.int64) * Tq * HEAD_DIM
    tl.store(o_base + q_off, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + off_bh.to(tl.int64) * Tq + offs_m, lse, mask=m_ok)


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


def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, H, Tq, Tk, GROUP,
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


def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, H, Tq, Tk, GROUP,
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
    delta = tl.load(DELTA + off_bh.to(tl.int64) * Tq + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    offset = Tk - Tq
    n_full = (Tk // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(pid_m * BLOCK_M + BLOCK_M + offset, Tk), 0)
        lo_mask = tl.minimum(tl.maximum(pid_m * BLOCK_M + offset + 1, 0) // BLOCK_N * BLOCK_N, n_full)
    else:
        hi = Tk
        lo_mask = n_full

    for phase in tl.static_range(2):
        if phase == 0:
            start = 0
            stop = lo_mask
        else:
            start = lo_mask
            stop = hi
        for start_n in range(start, stop, BLOCK_N):
            cols = start_n + offs_n
            kv_off = cols[:, None] * HEAD_DIM + offs_d[None, :]
            if phase == 0 and EVEN_D:
                k = tl.load(k_base + kv_off)
                v = tl.load(v_base + kv_off)
            else:
                kv_mask = (cols[:, None] < Tk) & d_ok[None, :]
                k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            p = tl.math.exp2(qk - lse2[:, None])
            if phase == 1:
                keep = cols[None, :] < Tk
                if CAUSAL:
                    keep = keep & (cols[None, :] <= offs_m[:, None] + offset)
                p = tl.where(keep, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(K.dtype.element_ty), k, dq, input_precision=PRECISION)

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
TUNING_KEY = ["Tq", "Tk", "GROUP", "CAUSAL", "HEAD_DIM"]


def _tuning_class(dtype: torch.dtype, head_dim: int):
    if dtype == torch.float32:
        return "fp32"
    return 64 if head_dim <= 64 else 128


def _configs(kind: str):
    """Every candidate of one kernel, for all head dimensions (``_prune`` keeps the ones for this call)."""
    config = _triton().Config
    tiles = dict.fromkeys(t for tiles in TUNING[kind].values() for t in tiles)
    return [config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def _prune(kind: str, configs, named_args, **kwargs):
    wanted = set(TUNING[kind][_tuning_class(named_args["Q"].dtype, kwargs["HEAD_DIM"])])
    keep = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return keep or configs[:1]


def _tuning_bench(fn, quantiles):
    """How the autotuner times a candidate: short do_bench runs (the tests replace this)."""
    return _triton().testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@cache
def _kernels(interpreted: bool):
    """The kernel bodies wrapped by ``triton.jit`` (launched with explicit block sizes) and by ``autotune``."""
    t = _triton()
    jit = {name: t.jit(fn) for name, fn in (("fwd", _attn_fwd), ("pre", _attn_bwd_preprocess),
                                           ("dkdv", _attn_bwd_dkdv), ("dq", _attn_bwd_dq))}
    tuned = {name: t.autotune(_configs(name), key=TUNING_KEY,
                              prune_configs_by={"early_config_prune": partial(_prune, name)},
                              do_bench=lambda fn, quantiles: _tuning_bench(fn, quantiles))(jit[name])
             for name in ("fwd", "dkdv", "dq")}
    return jit, tuned


# ====================================================================================== host side


def _as_4d(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
    """Validate the shape contract and return 4-D views plus whether the input was ``(B, T, D)``.

    Unlike :func:`llmbook.lm.attention.check_attention_inputs` this reads no tensor values (a NaN scan
    would synchronise the GPU on every call), and it requires ``v`` to have the head width of ``k``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if not (q.ndim == k.ndim == v.ndim) or q.ndim not in (3, 4):
        raise ValueError("q, k, v must all be (B, T, D) or all be (B, H, T, D), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise TypeError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                        f"on {q.device}/{k.device}/{v.device}")
    squeeze = q.ndim == 3
    if squeeze:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    B, H, Tq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k and v must be (B={B}, H_kv, T_k, D={D}) to match q {tuple(q.shape)}, "
                         f"got {tuple(k.shape)}")
    H_kv = k.shape[1]
    if H_kv == 0 or H % H_kv != 0:
        raise ValueError(f"the number of query heads H ({H}) must be a multiple of the key/value heads H_kv ({H_kv})")
    if B == 0 or H == 0 or Tq == 0 or k.shape[2] == 0 or D == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)} (B, H, T_q, T_k and D must be >= 1)")
    return q, k, v, squeeze


def _check_triton_inputs(q: Tensor, block_m, block_n):
    """What the Triton kernels support, each limit named in the error."""
    if not triton_available():
        raise ImportError("the Triton backend needs the optional dependency triton (pip install triton); "
                          "backend='torch' runs the tiled PyTorch version instead")
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(f"the Triton kernel supports float16, bfloat16 and float32, got {q.dtype}")
    D = q.shape[-1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the Triton kernel supports head dimensions D <= {MAX_HEAD_DIM}, got D = {D}")
    interpreted = _interpreting()
    if not interpreted and not q.is_cuda:
        raise ValueError(f"the Triton backend needs CUDA tensors (got device {q.device}); use backend='torch', "
                         "or set TRITON_INTERPRET=1 before importing triton to run the kernels in the interpreter")
    if (block_m is None) != (block_n is None):
        raise ValueError(f"give both block_m and block_n or neither, got {block_m} and {block_n}")
    if block_m is None and interpreted:
        raise ValueError("the Triton interpreter cannot autotune: pass block_m and block_n explicitly")
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b is not None and (not isinstance(b, int) or b < 16 or b & (b - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")
    return interpreted


def _meta(q: Tensor, causal: bool) -> dict:
    D = q.shape[-1]
    block_d = max(16, 1 << (D - 1).bit_length())
    return dict(CAUSAL=bool(causal), HEAD_DIM=D, BLOCK_D=block_d, EVEN_D=block_d == D,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _launch(name: str, grid_rows: int, n_programs: int, args: tuple, meta: dict, blocks, warmup=None):
    """Launch kernel ``name`` with explicit ``blocks = (BLOCK_M, BLOCK_N)`` or through its autotuner.

    With ``warmup`` (a set of kernel names) nothing runs: the kernels named there are compiled for these
    arguments (every autotuning candidate when ``blocks`` is None), which fills Triton's disk cache.
    """
    jit, tuned = _kernels(_interpreting())
    cdiv = _triton().cdiv
    tile = "BLOCK_N" if name == "dkdv" else "BLOCK_M"  # the grid runs over key tiles for dK/dV
    if blocks is None:
        if warmup is None:
            tuned[name][lambda m: (cdiv(grid_rows, m[tile]), n_programs)](*args, **meta)
        elif name in warmup:
            tuned[name].warmup(*args, grid=(1, 1), **meta)
        return
    bm, bn = blocks
    launch = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4 if bm * bn <= 64 * 64 else 8, num_stages=2)
    if warmup is None:
        jit[name][(cdiv(grid_rows, bn if name == "dkdv" else bm), n_programs)](*args, **meta, **launch)
    elif name in warmup:
        jit[name].warmup(*args, grid=(1, 1), **meta, **launch)


def _forward(q, k, v, causal, scale, blocks, warmup=None):
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = _alloc(q.shape, q)
    lse = _alloc((B, H, Tq), q, torch.float32)
    args = (q, k, v, o, lse, scale * LOG2E, H, Tq, Tk, H // H_kv)
    _launch("fwd", Tq, B * H, args, _meta(q, causal), blocks, warmup)
    return o, lse


def _backward(do, q, k, v, o, lse, causal, scale, blocks, warmup=None):
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    do = do.to(q.dtype).contiguous()
    meta = _meta(q, causal)
    delta = _alloc(lse.shape, lse)
    bm_pre = 64 if blocks is None else blocks[0]
    pre = _kernels(_interpreting())[0]["pre"]
    pre_args, pre_meta = (o, do, delta, Tq), dict(HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_M=bm_pre)
    if warmup is None:
        pre[(_triton().cdiv(Tq, bm_pre), B * H)](*pre_args, **pre_meta)
    elif "pre" in warmup:
        pre.warmup(*pre_args, grid=(1, 1), **pre_meta)
    dq, dk, dv = _alloc(q.shape, q), _alloc(k.shape, k), _alloc(v.shape, v)
    common = (scale * LOG2E, scale, H, Tq, Tk, H // H_kv)
    _launch("dkdv", Tk, B * H_kv, (q, k, v, do, lse, delta, dk, dv, *common), meta, blocks, warmup)
    _launch("dq", Tq, B * H, (q, k, v, do, lse, delta, dq, *common), meta, blocks, warmup)
    return dq, dk, dv


def _precompile(kinds, dtype: torch.dtype, head_dim: int, causal: bool, H: int, T: int = 512, device="cuda"):
    """Compile every autotuning candidate of the kernels in ``kinds`` (``"fwd", "pre", "dkdv", "dq"``).

    Nothing is launched. Triton specialises integer arguments only on ``== 1`` and divisibility by 16, so
    one ``T`` that is a multiple of 16 (and ``H`` of the same kind) covers every such length. Run this in
    worker processes to compile in parallel: a later autotuning run then finds the binaries on disk.
    """
    x = torch.zeros(1, H, T, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    o, lse = _forward(x, x, x, causal, scale, None, warmup=frozenset(kinds))
    _backward(x, x, x, x, o, lse, causal, scale, None, warmup=frozenset(kinds))


class FlashAttentionFunction(torch.autograd.Function):
    """``torch.autograd.Function`` around the Triton kernels: saves ``q, k, v, o`` and the log-sum-exp.

    ``apply(q, k, v, causal, scale, blocks)`` takes 4-D contiguous-or-not ``(B, H, T, D)`` tensors;
    ``blocks`` is ``None`` (autotune, CUDA) or ``(block_m, block_n)``. Use :func:`flash_attention_triton`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, blocks):
        o, lse = _forward(q, k, v, causal, scale, blocks)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.blocks = causal, scale, blocks
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q.contiguous(), k.contiguous(), v.contiguous(), o, lse, ctx.causal, ctx.scale,
                               ctx.blocks)
        return dq, dk, dv, None, None, None


def _blocks(block_m, block_n):
    return None if block_m is None else (block_m, block_n)


@implements("03.13")
def flash_attention_forward(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"],
                            v: Float[Tensor, "B H_kv T_k D"], causal: bool = False, scale: float | None = None, *,
                            block_m: int | None = None, block_n: int | None = None
                            ) -> tuple[Float[Tensor, "B H T_q D"], Float[Tensor, "B H T_q"]]:
    r"""Forward kernel: :math:`O = \mathrm{softmax}(S)V`, :math:`L_i = \log\sum_j e^{S_{ij}}`, :math:`S = QK^\top\tau`.

    Runs the online softmax :math:`m_i=\max(m_i^{old},m_i^{block})`,
    :math:`l_i=e^{m_i^{old}-m_i}l_i^{old}+e^{m_i^{block}-m_i}l_i^{block}` over key tiles of ``block_n``
    rows for each tile of ``block_m`` queries, and returns ``(o, lse)`` with ``lse`` in float32 (natural
    log, :math:`-\infty` for a query that sees no key). No gradient flows through this function.

    Symbols: :math:`Q, K, V` are ``q, k, v``, :math:`\tau` is ``scale`` (default :math:`1/\sqrt{D}`),
    :math:`L` is ``lse``. ``q`` is ``(B, H, T_q, D)`` or ``(B, T_q, D)``, ``k, v`` are
    ``(B, H_kv, T_k, D)`` or ``(B, T_k, D)`` with ``H_kv`` dividing ``H`` and ``D <= 128``; float16,
    bfloat16 or float32. ``block_m``/``block_n`` are powers of two >= 16, required under the
    interpreter and chosen by autotuning on CUDA when omitted.

    >>> q = torch.zeros(1, 1, 3, 16)
    >>> o, lse = flash_attention_forward(q, q, q, block_m=16, block_n=16)  # doctest: +SKIP
    >>> lse  # uniform weights over 3 keys: log 3  # doctest: +SKIP
    tensor([[[1.0986, 1.0986, 1.0986]]])
    >>> flash_attention_forward(q.expand(1, 4, 3, 16), q.expand(1, 3, 3, 16), q.expand(1, 3, 3, 16))
    Traceback (most recent call last):
    ...
    ValueError: the number of query heads H (4) must be a multiple of the key/value heads H_kv (3)
    """
    q4, k4, v4, squeeze = _as_4d(q, k, v)
    _check_triton_inputs(q4, block_m, block_n)
    with torch.no_grad():
        o, lse = _forward(q4, k4, v4, causal, attention_scale(scale, q4.shape[-1]), _blocks(block_m, block_n))
    return (o.squeeze(1), lse.squeeze(1)) if squeeze else (o, lse)


@implements("03.13")
def flash_attention_triton(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"],
                           v: Float[Tensor, "B H_kv T_k D"], causal: bool = False, scale: float | None = None, *,
                           block_m: int | None = None, block_n: int | None = None) -> Float[Tensor, "B H T_q D"]:
    r"""Differentiable FlashAttention-2 in Triton: :math:`O = \mathrm{softmax}(QK^\top\tau + M)V`.

    The forward pass is :func:`flash_attention_forward`; the backward pass recomputes
    :math:`P_{ij} = e^{S_{ij} - L_i}` per tile and uses :math:`\Delta_i = \sum_d O_{id}\,dO_{id}`:
    :math:`dV = P^\top dO`, :math:`dS = P\odot(dO\,V^\top - \Delta)`, :math:`dQ = \tau\,dS\,K`,
    :math:`dK = \tau\,dS^\top Q` (summed over the query heads that share a key/value head).

    Shapes, ``causal`` (mask :math:`M_{ij} = -\infty` for :math:`j > i + T_k - T_q`), ``scale`` and the
    block sizes are as in :func:`flash_attention_forward`. Returns ``o`` with the shape and dtype of ``q``.

    >>> q = torch.zeros(1, 1, 3, 16, requires_grad=True)
    >>> flash_attention_triton(q, q, q, block_m=16, block_n=16).sum().backward()  # doctest: +SKIP
    >>> q.grad.abs().max()  # doctest: +SKIP
    tensor(0.)
    >>> flash_attention_triton(q, q[..., :8], q[..., :8])
    Traceback (most recent call last):
    ...
    ValueError: k and v must be (B=1, H_kv, T_k, D=16) to match q (1, 1, 3, 16), got (1, 1, 3, 8)
    """
    q4, k4, v4, squeeze = _as_4d(q, k, v)
    _check_triton_inputs(q4, block_m, block_n)
    o = FlashAttentionFunction.apply(q4, k4, v4, bool(causal), attention_scale(scale, q4.shape[-1]),
                                     _blocks(block_m, block_n))
    return o.squeeze(1) if squeeze else o


@implements("03.13")
def flash_attention(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"], v: Float[Tensor, "B H_kv T_k D"],
                    causal: bool = False, scale: float | None = None, backend: str = "auto"
                    ) -> Float[Tensor, "B H T_q D"]:
    r"""Exact attention :math:`\mathrm{softmax}(QK^\top\tau + M)V` without a :math:`T_q\times T_k` matrix.

    ``backend="auto"`` runs the Triton kernel (:func:`flash_attention_triton`) for CUDA tensors when
    Triton is installed, and the tiled PyTorch version (:func:`llmbook.lm.flash.tiled_attention`, the
    same online softmax in plain torch) everywhere else; ``"triton"`` and ``"torch"`` force one.
    Differentiable with either backend.

    Symbols: :math:`Q, K, V` are ``q, k, v``, :math:`\tau` is ``scale`` (default :math:`1/\sqrt{D}`),
    :math:`M_{ij} = -\infty` where ``causal`` hides key ``j`` from query ``i`` (``j > i + T_k - T_q``),
    else 0. ``q`` is ``(B, H, T_q, D)`` or ``(B, T_q, D)``; ``k, v`` are ``(B, H_kv, T_k, D)``
    (``H_kv`` divides ``H``) or ``(B, T_k, D)``. The result has the shape and dtype of ``q``.

    >>> q = torch.zeros(1, 2, 4, 8)
    >>> v = torch.arange(32.0).reshape(1, 2, 4, 4).repeat(1, 1, 1, 2)
    >>> flash_attention(q, q, v, causal=True)[0, 0, :, 0]  # equal scores: running means of 0, 4, 8, 12
    tensor([0., 2., 4., 6.])
    >>> flash_attention(q[:, :, 2:], q, v, causal=True)[0, 0, :, 0]  # last query aligned with last key
    tensor([4., 6.])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    q4, k4, v4, squeeze = _as_4d(q, k, v)
    attention_scale(scale, q4.shape[-1])
    if backend == "auto":
        backend = "triton" if q4.is_cuda and q4.dtype in TRITON_DTYPES and triton_available() else "torch"
    if backend == "triton":
        return flash_attention_triton(q, k, v, causal=causal, scale=scale)
    from llmbook.lm.flash import tiled_attention  # imported on first use

    group = q4.shape[1] // k4.shape[1]
    if group > 1:  # grouped-query attention: each key/value head serves `group` query heads
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    o = tiled_attention(q4, k4, v4, causal=causal, scale=scale)
    return o.squeeze(1) if squeeze else o
