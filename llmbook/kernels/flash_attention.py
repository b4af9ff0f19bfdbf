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
cannot autotune, so there the block sizes default to ``INTERPRETER_BLOCKS``. On CUDA the autotuner
picks them, keyed on the sequence lengths rounded up to a power of two (:func:`length_bucket`).
:func:`flash_attention` picks the backend: Triton for CUDA tensors the kernel supports, the tiled
PyTorch version of :mod:`llmbook.lm.flash` for everything else. The ``@triton.jit`` kernels and their
autotuning table are in :mod:`llmbook.kernels.flash_attention_kernels`, imported on first use; this
module holds the host side (shapes, launches, autograd, dispatch), and
:mod:`llmbook.kernels.runtime` the Triton set-up shared with the other kernels.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor
from torch.autograd.function import once_differentiable

from llmbook.kernels import runtime
from llmbook.kernels.runtime import triton_available  # noqa: F401  (kept importable here; documented in runtime)
from llmbook.lm.attention import attention_scale

__all__ = [
    "flash_attention",
    "flash_attention_triton",
    "flash_attention_forward",
    "flash_attention_backward",
    "FlashAttentionFunction",
    "length_bucket",
]

LOG2E = math.log2(math.e)
MAX_HEAD_DIM = 128
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "triton", "torch")
OP = "flash_attention"
KERNEL_MODULE = "llmbook.kernels.flash_attention_kernels"
INTERPRETER_BLOCKS: tuple[int, int] | None = (32, 32)  # (block_m, block_n) where autotuning is impossible
TORCH_BLOCKS = 64  # the tiled PyTorch path's default tile


def length_bucket(T: int) -> int:
    """The autotuner's key for a sequence length: ``T`` rounded up to a power of two, at least 16.

    Block sizes that are fastest for ``T`` are fastest for lengths close to it, so a KV cache that
    grows by one key per decoding step is tuned once per doubling of its length, not at every step.

    >>> [length_bucket(T) for T in (1, 16, 17, 100, 128, 129)]
    [16, 16, 32, 128, 128, 256]
    """
    return max(16, 1 << (T - 1).bit_length())


def _kernels():
    """The kernel module (``KERNELS``, ``TUNED``, ``TUNING``), imported on first use."""
    return runtime.load_kernels(KERNEL_MODULE)



def _alloc(shape, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Uninitialised memory for a kernel output (the tests replace this to poison it with NaN)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


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


def _unsupported(q: Tensor) -> Exception | None:
    """Why the Triton kernel cannot run on the 4-D ``q`` (the exception to raise), or None."""
    err = runtime.unsupported(OP, q, TRITON_DTYPES)
    if err is None and q.shape[-1] > MAX_HEAD_DIM:
        err = ValueError(f"the Triton backend of {OP} supports head dimensions D <= {MAX_HEAD_DIM}, "
                         f"got D = {q.shape[-1]}; backend='torch' runs any D")
    return err


def _check_blocks(block_m, block_n) -> None:
    if (block_m is None) != (block_n is None):
        raise ValueError(f"give both block_m and block_n or neither, got {block_m} and {block_n}")
    if block_m is not None:
        runtime.check_block(block_m, "block_m"), runtime.check_block(block_n, "block_n")


def _auto_backend(q: Tensor, block_m, block_n) -> str:
    """``backend="auto"``: Triton for CUDA tensors the kernel runs (with these tiles), PyTorch for the rest."""
    tiles_ok = block_m is None or all(isinstance(b, int) and b >= 16 and not b & b - 1 for b in (block_m, block_n))
    return "triton" if q.is_cuda and tiles_ok and _unsupported(q) is None else "torch"


def _prepare(q, k, v, scale, block_m, block_n):
    """Validate everything for the Triton path; return ``q4, k4, v4, squeeze, scale, blocks``.

    ``blocks`` is ``(block_m, block_n)``, or None to autotune (CUDA); under the interpreter, omitted
    block sizes default to ``INTERPRETER_BLOCKS``.
    """
    q4, k4, v4, squeeze = _as_4d(q, k, v)
    scale = attention_scale(scale, q4.shape[-1])
    _check_blocks(block_m, block_n)
    err = _unsupported(q4)
    if err is not None:
        raise err
    if block_m is not None:
        blocks = (block_m, block_n)
    else:
        blocks = INTERPRETER_BLOCKS if runtime.interpreting() else None
    return q4, k4, v4, squeeze, scale, blocks


def _meta(q: Tensor, causal: bool) -> dict:
    D = q.shape[-1]
    block_d = max(16, 1 << (D - 1).bit_length())
    return dict(CAUSAL=bool(causal), HEAD_DIM=D, BLOCK_D=block_d, EVEN_D=block_d == D,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(name: str, grid_rows: int, n_programs: int, args: tuple, meta: dict, blocks, warmup=None):
    """Launch kernel ``name`` with explicit ``blocks = (BLOCK_M, BLOCK_N)`` or through its autotuner.

    With ``warmup`` (a set of kernel names) nothing runs: the kernels named there are compiled for these
    arguments (every autotuning candidate when ``blocks`` is None), which fills Triton's disk cache.
    """
    kernels = _kernels()
    tile = "BLOCK_N" if name == "dkdv" else "BLOCK_M"  # the grid runs over key tiles for dK/dV
    if blocks is None:
        if warmup is None:
            kernels.TUNED[name][lambda m: (_cdiv(grid_rows, m[tile]), n_programs)](*args, **meta)
        elif name in warmup:
            kernels.TUNED[name].warmup(*args, grid=(1, 1), **meta)
        return
    bm, bn = blocks
    launch = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4 if bm * bn <= 64 * 64 else 8, num_stages=2)
    if warmup is None:
        kernels.KERNELS[name][(_cdiv(grid_rows, bn if name == "dkdv" else bm), n_programs)](*args, **meta, **launch)
    elif name in warmup:
        kernels.KERNELS[name].warmup(*args, grid=(1, 1), **meta, **launch)


def _forward(q, k, v, causal, scale, blocks, warmup=None):
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = _alloc(q.shape, q)
    lse = _alloc((B, H, Tq), q, torch.float32)
    args = (q, k, v, o, lse, scale * LOG2E, H, Tq, Tk, H // H_kv, length_bucket(Tq), length_bucket(Tk))
    _launch("fwd", Tq, B * H, args, _meta(q, causal), blocks, warmup)
    return o, lse


def _backward(do, q, k, v, o, lse, causal, scale, blocks, warmup=None):
    B, H, Tq, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    do, o = do.to(q.dtype).contiguous(), o.contiguous()
    meta = _meta(q, causal)
    delta = _alloc(lse.shape, lse)
    bm_pre = 64 if blocks is None else blocks[0]
    pre = _kernels().KERNELS["pre"]
    pre_args, pre_meta = (o, do, delta, Tq), dict(HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_M=bm_pre)
    if warmup is None:
        pre[(_cdiv(Tq, bm_pre), B * H)](*pre_args, **pre_meta)
    elif "pre" in warmup:
        pre.warmup(*pre_args, grid=(1, 1), **pre_meta)
    dq, dk, dv = _alloc(q.shape, q), _alloc(k.shape, k), _alloc(v.shape, v)
    common = (scale * LOG2E, scale, H, Tq, Tk, H // H_kv, length_bucket(Tq), length_bucket(Tk))
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
    r"""Triton FlashAttention-2 as a ``torch.autograd.Function``, used like :class:`llmbook.lm.flash.TiledAttention`.

    ``FlashAttentionFunction.apply(q, k, v, causal=False, scale=None, block_m=None, block_n=None) -> o``
    takes ``(B, T, D)`` or ``(B, H, T, D)`` inputs (shapes as in :func:`flash_attention_forward`);
    ``scale`` defaults to :math:`1/\sqrt{D}`; omitted block sizes are autotuned on CUDA and are
    ``INTERPRETER_BLOCKS`` under the interpreter. It saves ``q, k, v``, the output and the
    log-sum-exp, whose shape is that of the input's rows (``(B, T_q)`` or ``(B, H, T_q)``), and the
    backward pass recomputes the tiles from them. :func:`flash_attention_triton` is the same call.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, block_m=None, block_n=None):
        q4, k4, v4, squeeze, scale, blocks = _prepare(q, k, v, scale, block_m, block_n)
        o, lse = _forward(q4, k4, v4, bool(causal), scale, blocks)
        if squeeze:
            o, lse = o.squeeze(1), lse.squeeze(1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.config = (bool(causal), scale, blocks)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        squeeze = q.ndim == 3
        if squeeze:
            q, k, v, o, lse, do = (x.unsqueeze(1) for x in (q, k, v, o, lse, do))
        grads = _backward(do, q.contiguous(), k.contiguous(), v.contiguous(), o, lse, *ctx.config)
        if squeeze:
            grads = tuple(g.squeeze(1) for g in grads)
        return *grads, None, None, None, None


def flash_attention_forward(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"],
                            v: Float[Tensor, "B H_kv T_k D"], causal: bool = False, scale: float | None = None, *,
                            block_m: int | None = None, block_n: int | None = None
                            ) -> tuple[Float[Tensor, "B H T_q D"], Float[Tensor, "B H T_q"]]:
    r"""Forward: :math:`O = \mathrm{softmax}(S)V`, :math:`L_i = \log\sum_j e^{S_{ij}}`, :math:`S = QK^\top/\sqrt{D}`.

    Runs the online softmax :math:`m_i=\max(m_i^{old},m_i^{block})`,
    :math:`l_i=e^{m_i^{old}-m_i}l_i^{old}+e^{m_i^{block}-m_i}l_i^{block}` over key tiles of ``block_n``
    rows for each tile of ``block_m`` queries, and returns ``(o, lse)`` with ``lse`` in float32 (natural
    log, :math:`-\infty` for a query that sees no key). No gradient flows through this function.

    Symbols: :math:`Q, K, V` are ``q, k, v``, ``scale`` replaces :math:`1/\sqrt{D}` when given,
    :math:`L` is ``lse``. ``q`` is ``(B, H, T_q, D)`` or ``(B, T_q, D)``, ``k, v`` are
    ``(B, H_kv, T_k, D)`` or ``(B, T_k, D)`` with ``H_kv`` dividing ``H`` and ``D <= 128``; float16,
    bfloat16 (not in the interpreter) or float32. ``block_m``/``block_n`` are powers of two >= 16; when
    omitted, autotuning picks them on CUDA and the interpreter uses ``INTERPRETER_BLOCKS``.

    >>> q = torch.zeros(1, 1, 3, 16)
    >>> o, lse = flash_attention_forward(q, q, q)  # doctest: +SKIP
    >>> lse  # uniform weights over 3 keys: log 3  # doctest: +SKIP
    tensor([[[1.0986, 1.0986, 1.0986]]])
    >>> flash_attention_forward(q.expand(1, 4, 3, 16), q.expand(1, 3, 3, 16), q.expand(1, 3, 3, 16))
    Traceback (most recent call last):
    ...
    ValueError: the number of query heads H (4) must be a multiple of the key/value heads H_kv (3)
    """
    q4, k4, v4, squeeze, scale, blocks = _prepare(q, k, v, scale, block_m, block_n)
    with torch.no_grad():
        o, lse = _forward(q4, k4, v4, bool(causal), scale, blocks)
    return (o.squeeze(1), lse.squeeze(1)) if squeeze else (o, lse)


def flash_attention_triton(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"],
                           v: Float[Tensor, "B H_kv T_k D"], causal: bool = False, scale: float | None = None, *,
                           block_m: int | None = None, block_n: int | None = None) -> Float[Tensor, "B H T_q D"]:
    r"""Differentiable FlashAttention-2 in Triton: :math:`O = \mathrm{softmax}(QK^\top/\sqrt{D} + M)V`.

    The forward pass is :func:`flash_attention_forward`; the backward pass recomputes
    :math:`P_{ij} = e^{S_{ij} - L_i}` per tile and uses :math:`\Delta_i = \sum_d O_{id}\,dO_{id}`:
    :math:`dV = P^\top dO`, :math:`dS = P\odot(dO\,V^\top - \Delta)`, :math:`dQ = dS\,K/\sqrt{D}`,
    :math:`dK = dS^\top Q/\sqrt{D}` (summed over the query heads that share a key/value head).

    Shapes, ``causal`` (mask :math:`M_{ij} = -\infty` for :math:`j > i + T_k - T_q`), ``scale`` and the
    block sizes are as in :func:`flash_attention_forward`. Returns ``o`` with the shape and dtype of ``q``.
    This is ``FlashAttentionFunction.apply(q, k, v, causal, scale, block_m, block_n)``.

    >>> q = torch.zeros(1, 1, 3, 16, requires_grad=True)
    >>> flash_attention_triton(q, q, q).sum().backward()  # doctest: +SKIP
    >>> q.grad.abs().max()  # doctest: +SKIP
    tensor(0.)
    >>> flash_attention_triton(q, q[..., :8], q[..., :8])
    Traceback (most recent call last):
    ...
    ValueError: k and v must be (B=1, H_kv, T_k, D=16) to match q (1, 1, 3, 16), got (1, 1, 3, 8)
    """
    return FlashAttentionFunction.apply(q, k, v, causal, scale, block_m, block_n)


def flash_attention(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"], v: Float[Tensor, "B H_kv T_k D"],
                    causal: bool = False, scale: float | None = None, backend: str = "auto", *,
                    block_m: int | None = None, block_n: int | None = None) -> Float[Tensor, "B H T_q D"]:
    r"""Exact attention :math:`\mathrm{softmax}(QK^\top/\sqrt{D} + M)V` without a :math:`T_q\times T_k` matrix.

    ``backend="auto"`` runs the Triton kernel (:func:`flash_attention_triton`) for CUDA tensors that it
    supports (Triton installed, float16/bfloat16/float32, ``D <= 128``), and the tiled PyTorch version
    (:func:`llmbook.lm.flash.tiled_attention`, the same online softmax in plain torch) for everything
    else; ``"triton"`` forces the kernel (and raises where it cannot run), ``"torch"`` the PyTorch
    version. ``block_m``/``block_n`` (both or neither) are the query and key tile sizes of either
    backend: powers of two >= 16 for Triton (default: autotuned on CUDA, ``INTERPRETER_BLOCKS`` in the
    interpreter), any positive int for PyTorch (default 64; ``"auto"`` takes PyTorch for other sizes).
    Differentiable with either backend.

    Symbols: :math:`Q, K, V` are ``q, k, v``, ``scale`` replaces :math:`1/\sqrt{D}` when given,
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
    if (block_m is None) != (block_n is None):
        raise ValueError(f"give both block_m and block_n or neither, got {block_m} and {block_n}")
    if backend == "auto":
        backend = _auto_backend(q4, block_m, block_n)
    if backend == "triton":
        return flash_attention_triton(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n)
    from llmbook.lm.flash import tiled_attention  # imported on first use

    group = q4.shape[1] // k4.shape[1]
    if group > 1:  # grouped-query attention: each key/value head serves `group` query heads
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    block_q, block_k = (TORCH_BLOCKS, TORCH_BLOCKS) if block_m is None else (block_m, block_n)
    o = tiled_attention(q4, k4, v4, causal=causal, scale=scale, block_q=block_q, block_k=block_k)
    return o.squeeze(1) if squeeze else o


def flash_attention_backward(q: Float[Tensor, "B H T_q D"], k: Float[Tensor, "B H_kv T_k D"],
                             v: Float[Tensor, "B H_kv T_k D"], o: Float[Tensor, "B H T_q D"],
                             lse: Float[Tensor, "B H T_q"], do: Float[Tensor, "B H T_q D"], causal: bool = False,
                             scale: float | None = None, backend: str = "auto", *, block_m: int | None = None,
                             block_n: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    r"""FlashAttention's backward pass as a function: ``(dq, dk, dv)`` from the forward's ``o`` and ``lse``.

    With :math:`P_{ij} = e^{S_{ij} - L_i}` recomputed per tile and :math:`\Delta_i = \sum_d O_{id}\,dO_{id}`:
    :math:`dV = P^	op dO`, :math:`dS = P\odot(dO\,V^	op - \Delta)`, :math:`dQ = dS\,K\cdot	ext{scale}`,
    :math:`dK = dS^	op Q\cdot	ext{scale}`; with grouped-query heads, ``dk, dv`` sum over the query heads that
    share a key/value head. ``o, lse`` are what :func:`flash_attention_forward` returns for the same
    ``q, k, v, causal, scale`` (``lse`` natural log, ``-inf`` for a query that sees no key); ``do`` is the
    gradient of the loss with respect to ``o``. ``backend``: ``"triton"`` (the kernels of
    :func:`flash_attention_triton`), ``"torch"`` (:func:`llmbook.lm.flash.tiled_attention_backward`, plain
    torch), or ``"auto"`` (Triton where :func:`flash_attention` would take it). Shapes and block sizes as in
    :func:`flash_attention_forward`; the gradients have the shapes and dtypes of ``q, k, v``.

    >>> q = torch.zeros(1, 1, 3, 16)
    >>> o, lse = q.clone(), torch.full((1, 1, 3), math.log(3))  # the forward of zero inputs
    >>> dq, dk, dv = flash_attention_backward(q, q, q, o, lse, torch.ones_like(q), backend="torch")
    >>> dv[0, 0, :, 0]  # each key carries 1/3 of each of the 3 queries' gradient
    tensor([1., 1., 1.])
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    q4, k4, v4, squeeze = _as_4d(q, k, v)
    scale = attention_scale(scale, q4.shape[-1])
    o4, lse4, do4 = (x.unsqueeze(1) for x in (o, lse, do)) if squeeze else (o, lse, do)
    B, H, T_q, _ = q4.shape
    want = (B, H, T_q, v4.shape[-1])
    if tuple(o4.shape) != want or tuple(do4.shape) != want or tuple(lse4.shape) != want[:3]:
        rows = tuple(q.shape[:-1])
        raise ValueError(f"o and do must have shape {rows + (v.shape[-1],)} and lse {rows} (the forward's), got "
                         f"{tuple(o.shape)}, {tuple(do.shape)} and {tuple(lse.shape)}")
    if (block_m is None) != (block_n is None):
        raise ValueError(f"give both block_m and block_n or neither, got {block_m} and {block_n}")
    if backend == "auto":
        backend = _auto_backend(q4, block_m, block_n)
    if backend == "triton":
        q4, k4, v4, _, scale, blocks = _prepare(q4, k4, v4, scale, block_m, block_n)
        grads = _backward(do4, q4.contiguous(), k4.contiguous(), v4.contiguous(), o4, lse4.float(), bool(causal),
                          scale, blocks)
    else:
        from llmbook.lm.flash import tiled_attention_backward  # imported on first use, as in flash_attention

        group = H // k4.shape[1]
        k_r, v_r = (k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)) if group > 1 else (k4, v4)
        bq, bk = (TORCH_BLOCKS, TORCH_BLOCKS) if block_m is None else (block_m, block_n)
        dq, dk, dv = tiled_attention_backward(q4, k_r, v_r, o4, lse4, do4, bool(causal), scale, bq, bk)
        if group > 1:  # each key/value head collects the gradients of the query heads it served
            dk = dk.unflatten(1, (k4.shape[1], group)).sum(2)
            dv = dv.unflatten(1, (v4.shape[1], group)).sum(2)
        grads = (dq, dk, dv)
    return tuple(g.squeeze(1) for g in grads) if squeeze else grads
