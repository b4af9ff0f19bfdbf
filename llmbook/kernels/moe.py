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

:func:`moe_dispatch` picks PyTorch's ``grouped_mm`` for CUDA tensors it suits, Triton for other CUDA tensors the
kernel supports, and PyTorch elsewhere: on an H200 (``benchmarks/results/moe_dispatch.json``, 2026-12-04) the
grouped PyTorch path was faster than the Triton kernel in six of the seven shapes timed. Triton
is imported lazily, only when its backend runs: ``import llmbook.kernels.moe`` needs neither Triton
nor a GPU. The kernel is in :mod:`llmbook.kernels.moe_kernels`; availability, the interpreter mode and
the errors are those of :mod:`llmbook.kernels.runtime`, shared with the other kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import check_positive_int
from llmbook.kernels import runtime
from llmbook.kernels.runtime import triton_available  # noqa: F401  (kept importable here; documented in runtime)

__all__ = [
    "moe_dispatch",
    "moe_dispatch_loop",
    "moe_dispatch_torch",
    "moe_dispatch_triton",
    "permute_by_expert",
    "align_block_size",
    "has_grouped_mm",
]

BACKENDS = ("auto", "loop", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OP = "moe_dispatch"
KERNEL_MODULE = "llmbook.kernels.moe_kernels"


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
    ``topk_ids`` holds integer expert ids in ``[0, E)``.

    >>> permute_by_expert(torch.tensor([[2, 0], [0, 1]]), 4)
    (tensor([1, 2, 3, 0]), tensor([2, 1, 1, 0]))
    >>> permute_by_expert(torch.tensor([[2, 0], [0, 4]]), 4)
    Traceback (most recent call last):
    ...
    ValueError: topk_ids must lie in [0, E) = [0, 4), got range [0, 4]
    """
    if not isinstance(topk_ids, Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must hold integer expert ids, got dtype {topk_ids.dtype}")
    check_positive_int(E, "E")
    if topk_ids.numel() and (topk_ids.min() < 0 or topk_ids.max() >= E):
        raise ValueError(f"topk_ids must lie in [0, E) = [0, {E}), got range "
                         f"[{topk_ids.min().item()}, {topk_ids.max().item()}]")
    return _permute(topk_ids, E)


def _permute(topk_ids: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """:func:`permute_by_expert` for ids already checked."""
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
    order, counts = _permute(topk_ids, E)
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


def align_block_size(topk_ids: Int[Tensor, "N K"], E: int, BLOCK_M: int) -> tuple[Tensor, Tensor]:
    """Pad each expert's run of the sorted assignments to a multiple of ``BLOCK_M`` rows.

    Returns ``(sorted_ids, block_expert)``: ``sorted_ids`` (``(M_pad,)``) lists the flat assignment
    indices expert by expert, padded with the sentinel ``N K``; ``block_expert`` (``(M_pad / BLOCK_M,)``)
    gives the expert of each block. Empty experts get no block.

    >>> sorted_ids, block_expert = align_block_size(torch.tensor([[1], [1], [0]]), 3, 2)
    >>> sorted_ids.tolist(), block_expert.tolist()  # expert 0: row 2 + padding 3; expert 1: rows 0, 1
    ([2, 3, 0, 1], [0, 1])
    """
    check_positive_int(BLOCK_M, "BLOCK_M")
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
    used by the tests, which refuses bfloat16: its ``tl.dot`` on bfloat16 is wrong). Block sizes are
    explicit (powers of two, at least 16 for ``tl.dot``); there is no autotuning. Float32 inputs use
    IEEE float32 dots (not TF32); accumulation is in float32. The per-assignment outputs land in a
    float32 ``(N K, D)`` buffer at their original slots and are summed over ``K``.

    >>> x, W = torch.ones(3, 16, device="cuda"), torch.ones(2, 16, 16, device="cuda")  # doctest: +SKIP
    >>> moe_dispatch_triton(x, W, torch.tensor([[0], [1], [1]], device="cuda"),  # doctest: +SKIP
    ...                     torch.ones(3, 1, device="cuda"), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)[:, 0]
    tensor([16., 16., 16.], device='cuda:0')
    """
    N, C, D, E, K = _check(x, expert_weights, topk_ids, topk_weights)
    for b, name in ((BLOCK_M, "BLOCK_M"), (BLOCK_N, "BLOCK_N"), (BLOCK_K, "BLOCK_K")):
        runtime.check_block(b, name)
    runtime.require(OP, x, TRITON_DTYPES)
    kernel = runtime.load_kernels(KERNEL_MODULE).moe_grouped_gemm_kernel
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


def _auto_backend(x: Tensor, expert_weights: Tensor) -> str:
    """``"torch"`` where ``grouped_mm`` suits CUDA operands (measured faster), ``"triton"`` for other CUDA operands
    the kernel supports, ``"torch"`` elsewhere."""
    if not (isinstance(x, Tensor) and x.is_cuda):
        return "torch"
    if _grouped_mm_suits(x, expert_weights):
        return "torch"
    return "triton" if runtime.unsupported(OP, x, TRITON_DTYPES) is None else "torch"


def moe_dispatch(x: Float[Tensor, "N C"], expert_weights: Float[Tensor, "E C D"], topk_ids: Int[Tensor, "N K"],
                 topk_weights: Float[Tensor, "N K"], backend: str = "auto", **options) -> Float[Tensor, "N D"]:
    r"""MoE dispatch :math:`y_n = \sum_k w_{nk}\, x_n W_{e_{nk}}` with a choice of backend.

    ``backend``: ``"auto"`` (PyTorch's ``grouped_mm`` for CUDA operands it suits, the faster on an H200; else
    Triton for CUDA tensors the kernel supports; PyTorch elsewhere),
    ``"loop"``, ``"torch"`` or ``"triton"``. ``options`` go to the chosen backend (block sizes for
    Triton, ``use_grouped_mm`` for PyTorch). Shapes ``(N, C), (E, C, D), (N, K), (N, K) -> (N, D)``.

    >>> x, W = torch.ones(3, 4), torch.stack([torch.eye(4), -torch.eye(4)])
    >>> moe_dispatch(x, W, torch.tensor([[0], [1], [0]]), torch.ones(3, 1))[:, 0]
    tensor([ 1., -1.,  1.])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = _auto_backend(x, expert_weights)
    fn = {"loop": moe_dispatch_loop, "torch": moe_dispatch_torch, "triton": moe_dispatch_triton}[backend]
    return fn(x, expert_weights, topk_ids, topk_weights, **options)
