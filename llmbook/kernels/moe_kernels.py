r"""The Triton kernel of :mod:`llmbook.kernels.moe`: one expert GEMM per block of gathered rows.

This module imports Triton when it is imported, so :mod:`llmbook.kernels.moe` imports it on first
use only (:func:`llmbook.kernels.runtime.load_kernels`). Where Triton is not installed it still
imports, with decorators that do nothing (the registry imports every module).
"""

from __future__ import annotations

from llmbook.kernels.runtime import triton_for_kernels

triton, tl = triton_for_kernels()


@triton.jit
def moe_grouped_gemm_kernel(
    x_ptr, w_ptr, gate_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    NK, C, D, K,
    stride_xn, stride_xc, stride_we, stride_wc, stride_wd, stride_on, stride_od,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # one expert per block of BLOCK_M rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_id = tl.load(sorted_ids_ptr + offs_m)  # flat assignment n * K + k, or the sentinel NK (padding)
    valid = a_id < NK
    token = (a_id // K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(x_ptr + token[:, None] * stride_xn + kk[None, :] * stride_xc,
                    mask=valid[:, None] & (kk[None, :] < C), other=0.0)  # gather rows by index
        b = tl.load(w_ptr + e * stride_we + kk[:, None] * stride_wc + offs_n[None, :] * stride_wd,
                    mask=(kk[:, None] < C) & (offs_n[None, :] < D), other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    gate = tl.load(gate_ptr + a_id, mask=valid, other=0.0).to(tl.float32)
    acc = acc * gate[:, None]  # epilogue: the gate weight
    out = out_ptr + a_id.to(tl.int64)[:, None] * stride_on + offs_n[None, :] * stride_od
    tl.store(out, acc, mask=valid[:, None] & (offs_n[None, :] < D))  # scatter to the un-permuted slot


MODE_PROBE = moe_grouped_gemm_kernel  # what llmbook.kernels.runtime.load_kernels checks the mode on
