r"""MoE dispatch: every token through its ``K`` experts, as one grouped matrix multiply.

The operation (chapter 14, the sparse output with linear experts) is

.. math:: y_n = \sum_{k=1}^{K} w_{nk}\, x_n W_{e_{nk}}

for ``N`` tokens ``x`` (``(N, C)``), expert weights ``W`` (``(E, C, D)``), expert ids ``e``
(``topk_ids``, ``(N, K)``) and gate weights ``w`` (``topk_weights``, ``(N, K)``). Three backends:

* :func:`moe_dispatch_loop`: the reference, one Python iteration per expert;
* :func:`moe_dispatch_torch`: permute the ``N K`` assignments so that each expert's rows are
  contiguous, run one grouped GEMM (``torch.nn.functional.grouped_mm`` where the installed torch
  has it and the operands suit it, else a padded batched matmul), scale by the gates, un-permute
  and sum over ``K``;
* :func:`moe_dispatch_triton`: a Triton kernel that gathers the rows of each block by index, runs
  that block's expert GEMM and applies the gate in its epilogue, storing straight into the
  un-permuted slots.

:func:`moe_dispatch` picks Triton for CUDA tensors and PyTorch elsewhere. Triton is imported
lazily, only when its backend runs: ``import llmbook.kernels.moe`` needs neither Triton nor a GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

__all__ = [
    "moe_dispatch",
    "moe_dispatch_loop",
    "moe_dispatch_torch",
    "moe_dispatch_triton",
    "permute_by_expert",
    "align_block_size",
    "triton_available",
    "has_grouped_mm",
]

BACKENDS = ("auto", "loop", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(x, expert_weights, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    """Validate the operands; return ``(N, C, D, E, K)``."""
    for t, name in ((x, "x"), (expert_weights, "expert_weights"), (topk_ids, "topk_ids"),
                    (topk_weights, "topk_weights")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.ndim != 2 or expert_weights.ndim != 3:
        raise ValueError(f"x must be (N, C) and expert_weights (E, C, D), got {tuple(x.shape)} and "
                         f"{tuple(expert_weights.shape)}")
    N, C = x.shape
    E, C_w, D = expert_weights.shape
    if C_w != C:
        raise ValueError(f"x (N, C) = {tuple(x.shape)} and expert_weights (E, C, D) = "
                         f"{tuple(expert_weights.shape)} disagree on C")
    if x.dtype not in FLOAT_DTYPES or expert_weights.dtype != x.dtype:
        raise TypeError(f"x and expert_weights must share a floating dtype, got {x.dtype} and {expert_weights.dtype}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != N or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be (N, K) with N = {N}, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer expert ids, got dtype {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got dtype {topk_weights.dtype}")
    if N == 0 or C == 0 or D == 0 or E == 0 or topk_ids.shape[1] == 0:
        raise ValueError(f"empty operands: N = {N}, C = {C}, D = {D}, E = {E}, K = {topk_ids.shape[1]}")
    if topk_ids.min() < 0 or topk_ids.max() >= E:
        raise ValueError(f"topk_ids must lie in [0, E) = [0, {E}), got range "
                         f"[{topk_ids.min().item()}, {topk_ids.max().item()}]")
    devices = {x.device, expert_weights.device, topk_ids.device, topk_weights.device}
    if len(devices) != 1:
        raise ValueError(f"all operands must be on one device, got {sorted(map(str, devices))}")
    return N, C, D, E, topk_ids.shape[1]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ================================================================= (a) the reference loop


def moe_dispatch_loop(x: Float[Tensor, "N C"], expert_weights: Float[Tensor, "E C D"], topk_ids: Int[Tensor, "N K"],
                      topk_weights: Float[Tensor, "N K"]) -> Float[Tensor, "N D"]:
    r"""Reference :math:`y_n = \sum_k w_{nk} x_n W_{e_{nk}}`, one iteration per expert that has tokens.

    Accumulates in float32 (float64 for float64 inputs) and returns ``x.dtype``.

    >>> x, W = torch.ones(2, 3), torch.stack([torch.eye(3), 2 * torch.eye(3)])
    >>> moe_dispatch_loop(x, W, torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0.5, 0.5], [1.0, 0.0]]))
    tensor([[1.5000, 1.5000, 1.5000],
            [2.0000, 2.0000, 2.0000]])
    """
    N, C, D, E, K = _check(x, expert_weights, topk_ids, topk_weights)
    acc = _acc_dtype(x.dtype)
    y = torch.zeros(N, D, dtype=acc, device=x.device)
    for e in range(E):
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        out = x[token].to(acc) @ expert_weights[e].to(acc)
        y.index_add_(0, token, out * topk_weights[token, slot].to(acc).unsqueeze(-1))
    return y.to(x.dtype)


# ================================================================= (b) grouped PyTorch


def permute_by_expert(topk_ids: Int[Tensor, "N K"], E: int) -> tuple[Tensor, Tensor]:
    """Sort the ``N K`` assignments by expert (stable); return ``(order, counts)``.

    ``order[j]`` is the flat assignment index ``n * K + k`` placed at row ``j`` of the permuted
    batch, ``counts[e]`` the number of rows of expert ``e`` (``(E,)``, zeros for empty experts).

    >>> permute_by_expert(torch.tensor([[2, 0], [0, 1]]), 4)
    (tensor([1, 2, 3, 0]), tensor([2, 1, 1, 0]))
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    return order, counts


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch.nn.functional.grouped_mm`` (or the older ``torch._grouped_mm``).

    >>> isinstance(has_grouped_mm(), bool)
    True
    """
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def _grouped_mm_suits(xs: Tensor, W: Tensor) -> bool:
    """grouped_mm wants 16-byte aligned rows, fp32/fp16/bf16, and on CUDA bf16 on sm80+."""
    if not has_grouped_mm() or xs.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    size = xs.element_size()
    if (xs.shape[1] * size) % 16 or (W.shape[2] * size) % 16:
        return False
    if xs.is_cuda:
        return xs.dtype == torch.bfloat16 and torch.cuda.get_device_capability(xs.device) >= (8, 0)
    return xs.device.type == "cpu"


def _padded_bmm(xs: Tensor, W: Tensor, counts: Tensor) -> Tensor:
    """The grouped GEMM as one batched matmul over ``(E, M, C)`` zero-padded groups, ``M = max count``."""
    E, M = W.shape[0], int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(E, device=xs.device), counts)
    row = torch.arange(xs.shape[0], device=xs.device) - starts[expert]
    padded = xs.new_zeros(E, M, xs.shape[1])
    padded[expert, row] = xs
    return torch.bmm(padded, W)[expert, row]


def moe_dispatch_torch(x: Float[Tensor, "N C"], expert_weights: Float[Tensor, "E C D"],
                       topk_ids: Int[Tensor, "N K"], topk_weights: Float[Tensor, "N K"], *,
                       use_grouped_mm: bool | None = None) -> Float[Tensor, "N D"]:
    r"""Permute, grouped GEMM, gate, un-permute, combine: :math:`y_n = \sum_k w_{nk} x_n W_{e_{nk}}`.

    ``use_grouped_mm``: ``None`` uses ``grouped_mm`` when the operands suit it (16-byte aligned
    rows; float32/16 on CPU, bfloat16 on sm80+ GPUs) and the padded ``bmm`` otherwise; ``True``
    forces it (errors where unsupported); ``False`` forces the padded ``bmm``. The GEMM runs in the
    input dtype; the gate and the sum over ``K`` run in float32 (float64 for float64 inputs).

    >>> x, W = torch.ones(2, 4), torch.stack([torch.eye(4), 2 * torch.eye(4)])
    >>> moe_dispatch_torch(x, W, torch.tensor([[1], [0]]), torch.tensor([[0.5], [1.0]]))
    tensor([[1., 1., 1., 1.],
            [1., 1., 1., 1.]])
    """
    N, C, D, E, K = _check(x, expert_weights, topk_ids, topk_weights)
    order, counts = permute_by_expert(topk_ids, E)
    xs = x[order // K]  # gather: row j of the permuted batch is the token of assignment order[j]
    ys = None
    if use_grouped_mm or (use_grouped_mm is None and _grouped_mm_suits(xs, expert_weights)):
        if not has_grouped_mm():
            raise RuntimeError("use_grouped_mm=True but this torch has no grouped_mm")
        offs = torch.cumsum(counts, 0).to(torch.int32)
        try:
            ys = _grouped_mm(xs.contiguous(), expert_weights.contiguous(), offs)
        except RuntimeError:
            if use_grouped_mm:  # forced: report; automatic: an unsupported layout falls back below
                raise
    if ys is None:
        ys = _padded_bmm(xs, expert_weights, counts)
    acc = _acc_dtype(x.dtype)
    ys = ys.to(acc) * topk_weights.reshape(-1)[order].to(acc).unsqueeze(-1)  # gate
    out = torch.empty_like(ys).index_copy_(0, order, ys)  # un-permute: back to slot n * K + k
    return out.view(N, K, D).sum(1).to(x.dtype)  # combine


# ================================================================= (c) Triton


def triton_available() -> bool:
    """Whether ``import triton`` works (it is optional: only the GPU backend needs it).

    >>> isinstance(triton_available(), bool)
    True
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    """Whether triton was imported in its CPU interpreter mode (fixed at its first import).

    ``triton.jit`` decorates triton's own library functions when ``triton`` is first imported, so
    ``TRITON_INTERPRET=1`` must be set before that import; a later change cannot take effect and is
    reported here rather than failing deep inside the kernel.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    imported_interpreted = isinstance(tl.zeros, InterpretedFunction)
    wanted = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")
    if imported_interpreted != wanted:
        raise RuntimeError("TRITON_INTERPRET changed after triton was imported: set it (or unset it) before the "
                           "first import of triton in this process, e.g. at the top of a test module or conftest.py")
    return imported_interpreted


@functools.cache
def _kernel(interpret: bool):
    """Build the Triton kernel on first use; ``interpret`` keys the cache (``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates, so interpreted and compiled kernels are distinct objects)."""
    import triton
    import triton.language as tl

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

    return moe_grouped_gemm_kernel


def align_block_size(topk_ids: Int[Tensor, "N K"], E: int, BLOCK_M: int) -> tuple[Tensor, Tensor]:
    """Pad each expert's run of the sorted assignments to a multiple of ``BLOCK_M`` rows.

    Returns ``(sorted_ids, block_expert)``: ``sorted_ids`` (``(M_pad,)``) lists the flat assignment
    indices expert by expert, padded with the sentinel ``N K``; ``block_expert`` (``(M_pad / BLOCK_M,)``)
    gives the expert of each block. Empty experts get no block.

    >>> sorted_ids, block_expert = align_block_size(torch.tensor([[1], [1], [0]]), 3, 2)
    >>> sorted_ids.tolist(), block_expert.tolist()  # expert 0: row 2 + padding 3; expert 1: rows 0, 1
    ([2, 3, 0, 1], [0, 1])
    """
    order, counts = permute_by_expert(topk_ids, E)
    NK = topk_ids.numel()
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    padded_starts = (torch.cumsum(blocks, 0) - blocks) * BLOCK_M
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(E, device=topk_ids.device), counts)
    dest = padded_starts[expert] + torch.arange(NK, device=topk_ids.device) - starts[expert]
    sorted_ids = torch.full((int(blocks.sum()) * BLOCK_M,), NK, dtype=torch.int32, device=topk_ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(torch.arange(E, device=topk_ids.device, dtype=torch.int32), blocks)
    return sorted_ids, block_expert


def moe_dispatch_triton(x: Float[Tensor, "N C"], expert_weights: Float[Tensor, "E C D"],
                        topk_ids: Int[Tensor, "N K"], topk_weights: Float[Tensor, "N K"], *,
                        BLOCK_M: int = 64, BLOCK_N: int = 64, BLOCK_K: int = 32) -> Float[Tensor, "N D"]:
    r"""The Triton grouped GEMM: gather by index, one expert per block, gate in the epilogue.

    Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` (the slow reference interpreter,
    used by the tests). Block sizes are explicit (powers of two, at least 16 for ``tl.dot``); there is
    no autotuning. Float32 inputs use IEEE float32 dots (not TF32); accumulation is in float32. The
    per-assignment outputs land in a float32 ``(N K, D)`` buffer at their original slots and are
    summed over ``K``.

    >>> x, W = torch.ones(3, 16, device="cuda"), torch.ones(2, 16, 16, device="cuda")  # doctest: +SKIP
    >>> moe_dispatch_triton(x, W, torch.tensor([[0], [1], [1]], device="cuda"),  # doctest: +SKIP
    ...                     torch.ones(3, 1, device="cuda"), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)[:, 0]
    tensor([16., 16., 16.], device='cuda:0')
    """
    N, C, D, E, K = _check(x, expert_weights, topk_ids, topk_weights)
    if x.dtype == torch.float64:
        raise TypeError("the triton backend supports float32, float16 and bfloat16, not float64")
    for b, name in ((BLOCK_M, "BLOCK_M"), (BLOCK_N, "BLOCK_N"), (BLOCK_K, "BLOCK_K")):
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b!r}")
    if not triton_available():
        raise RuntimeError("the triton backend needs the triton package (pip install triton)")
    interpret = _interpreting()
    if not (x.is_cuda or interpret):
        raise RuntimeError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")
    kernel = _kernel(interpret)
    sorted_ids, block_expert = align_block_size(topk_ids, E, BLOCK_M)
    out = torch.zeros(N * K, D, dtype=torch.float32, device=x.device)
    gate = topk_weights.reshape(-1).contiguous()
    grid = (block_expert.numel(), (D + BLOCK_N - 1) // BLOCK_N)
    if grid[0]:
        kernel[grid](
            x, expert_weights, gate, out, sorted_ids, block_expert,
            N * K, C, D, K,
            x.stride(0), x.stride(1), *expert_weights.stride(), out.stride(0), out.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: exact IEEE dots, not TF32
        )
    return out.view(N, K, D).sum(1).to(x.dtype)


# ================================================================= the entry point


def moe_dispatch(x: Float[Tensor, "N C"], expert_weights: Float[Tensor, "E C D"], topk_ids: Int[Tensor, "N K"],
                 topk_weights: Float[Tensor, "N K"], backend: str = "auto", **options) -> Float[Tensor, "N D"]:
    r"""MoE dispatch :math:`y_n = \sum_k w_{nk}\, x_n W_{e_{nk}}` with a choice of backend.

    ``backend``: ``"auto"`` (Triton for CUDA tensors when triton is installed, PyTorch otherwise),
    ``"loop"``, ``"torch"`` or ``"triton"``. ``options`` go to the chosen backend (block sizes for
    Triton, ``use_grouped_mm`` for PyTorch). Shapes ``(N, C), (E, C, D), (N, K), (N, K) -> (N, D)``.

    >>> x, W = torch.ones(3, 4), torch.stack([torch.eye(4), -torch.eye(4)])
    >>> moe_dispatch(x, W, torch.tensor([[0], [1], [0]]), torch.ones(3, 1))[:, 0]
    tensor([ 1., -1.,  1.])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if isinstance(x, Tensor) and x.is_cuda and triton_available() else "torch"
    fn = {"loop": moe_dispatch_loop, "torch": moe_dispatch_torch, "triton": moe_dispatch_triton}[backend]
    return fn(x, expert_weights, topk_ids, topk_weights, **options)
