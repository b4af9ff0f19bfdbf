r"""Three costs of serving beyond one GPU's arithmetic (chapter 17): tensor-parallel communication,
prefix caching and model bandwidth utilisation.

**Tensor parallelism** (Megatron-LM, Shoeybi et al., 2019). A model too large or too slow for one GPU is
split inside every layer over :math:`p` GPUs: the query/key/value projections and the MLP's first
matrices by columns (each GPU owns :math:`H/p` heads and :math:`d_{ff}/p` hidden units), the output
projection and the MLP's last matrix by rows. Each GPU then holds a *partial sum* of the sublayer's
output, and one all-reduce of a :math:`(B, T, d)` tensor per sublayer makes it whole: two all-reduces per
layer in the forward pass, two more in the backward pass (:func:`tp_allreduce_bytes`,
:func:`tensor_parallel_forward`). A ring all-reduce of :math:`M` bytes makes every GPU send (and
receive) :math:`2\frac{p-1}{p}M` bytes (:func:`ring_allreduce_bytes`).

**Prefix caching** (vLLM's automatic prefix caching; SGLang's RadixAttention, Zheng et al., 2024).
Requests that start with the same tokens (a system prompt, a few-shot preamble, a shared document)
have the same keys and values for those tokens, because attention is causal. A server that keeps them
stores and computes the prefix once instead of once per request (:func:`prefix_cache_savings`);
in a paged cache only whole blocks can be shared (:func:`shared_prefix_blocks` counts them).

**Model bandwidth utilisation** (MBU). A decode step is bandwidth-bound, so its natural efficiency is
the memory bandwidth it achieves over the peak: :math:`\mathrm{MBU} = (M_{weights} + M_{KV}) / (T_{step}
\cdot BW)` (:func:`model_bandwidth_utilization`), the decode counterpart of the model FLOPs utilisation
(MFU) of a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import check_nonnegative_int, check_positive_int, check_range, check_token_ids
from llmbook.lm.activations import ACTIVATIONS
from llmbook.lm.attention import attend
from llmbook.lm.inference import attention_flops
from llmbook.lm.rope import apply_rope, rope_cos_sin

__all__ = ["ring_allreduce_bytes", "tp_allreduce_bytes", "tensor_parallel_forward", "PrefixSavings",
           "prefix_cache_savings", "shared_prefix_blocks", "model_bandwidth_utilization"]


# --------------------------------------------------------------------------- tensor parallelism


def ring_allreduce_bytes(message_bytes: float, p: int) -> float:
    r"""Bytes each of ``p`` GPUs sends in a ring all-reduce of a ``message_bytes`` tensor: :math:`2\frac{p-1}{p}M`.

    A ring all-reduce is a reduce-scatter (:math:`p-1` steps, each GPU passing one :math:`M/p` chunk to
    its neighbour) followed by an all-gather (:math:`p-1` more). Each GPU receives as many bytes as it
    sends; for large :math:`p` this tends to :math:`2M`, independent of the number of GPUs.

    >>> ring_allreduce_bytes(1000, 8)
    1750.0
    """
    M = float(check_range(message_bytes, "message_bytes", 0.0))
    p = check_positive_int(p, "p (GPUs)")
    return 2 * (p - 1) / p * M


def tp_allreduce_bytes(B: int, T: int, d: int, *, n_layers: int = 1, bytes_per_elem: float = 2,
                       training: bool = False) -> float:
    r"""Megatron tensor-parallel all-reduce payload: :math:`2 \cdot L \cdot B \cdot T \cdot d \cdot \mathrm{bytes}`.

    Two all-reduces per layer in the forward pass, one after the attention's row-parallel output
    projection and one after the MLP's row-parallel last matrix, each of the sublayer's output
    ``(B, T, d)``; ``training=True`` adds the two of the backward pass (the gradients of the sublayers'
    inputs), four in all. Symbols: ``B`` sequences of ``T`` tokens, width ``d``, ``n_layers`` :math:`L`,
    ``bytes_per_elem`` (2 for bf16). The payload does not depend on the number of GPUs; what each GPU
    sends does (:func:`ring_allreduce_bytes`). Embedding and LM-head communication is not counted.

    >>> tp_allreduce_bytes(1, 1, 8192, n_layers=80)   # Llama-2-70B, one token, bf16: bytes
    2621440
    """
    B, T = check_nonnegative_int(B, "B"), check_nonnegative_int(T, "T")
    d, n_layers = check_positive_int(d, "d (model width)"), check_nonnegative_int(n_layers, "n_layers")
    b = check_range(bytes_per_elem, "bytes_per_elem", 0.0, low_open=True)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {training!r}")
    return (4 if training else 2) * n_layers * B * T * d * (int(b) if float(b).is_integer() else b)


def tensor_parallel_forward(model, ids: Tensor, p: int) -> tuple[Tensor, list[int]]:
    r"""A :class:`~llmbook.lm.gpt.TinyGPT` forward pass split Megatron-style over ``p`` simulated GPUs.

    GPU :math:`r` owns query heads :math:`rH/p .. (r+1)H/p - 1` (and the matching key/value heads), the
    same slice of the columns of :math:`W_O`, and hidden units :math:`r d_{ff}/p .. (r+1)d_{ff}/p - 1` of
    the SwiGLU MLP (rows of ``w_gate``, ``w_up``; columns of ``w_down``). Each computes its partial output
    of a sublayer; the all-reduce, here a sum over the ``p`` partials, restores the full ``(B, T, d)``
    output. Embedding, norms and LM head are replicated. ``ids (B, T)``; ``p`` must divide the heads,
    the key/value heads and :math:`d_{ff}`. Returns the logits ``(B, T, V)`` and the number of elements of
    every all-reduce, in order (two per layer: :func:`tp_allreduce_bytes` counts their bytes).
    """
    cfg = model.config
    ids = check_token_ids(ids, cfg.vocab_size)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
    p = check_positive_int(p, "p (GPUs)")
    attn0, mlp0 = model.blocks[0].attn, model.blocks[0].mlp
    H, H_kv, D, d_ff = attn0.n_heads, attn0.n_kv_heads, attn0.head_dim, mlp0.w_up.out_features
    if H % p or H_kv % p or d_ff % p:
        raise ValueError(f"p = {p} must divide the heads ({H}), the key/value heads ({H_kv}) and d_ff ({d_ff})")
    B, T = ids.shape
    sizes: list[int] = []

    def all_reduce(partials: list[Tensor]) -> Tensor:
        sizes.append(partials[0].numel())
        return torch.stack(partials).sum(0)

    h = model.embed(ids)
    cos, sin = rope_cos_sin(torch.arange(T), D, base=cfg.rope_theta, dtype=h.dtype)
    hq, hk, f = H // p, H_kv // p, d_ff // p
    for block in model.blocks:
        a, m, x = block.attn, block.mlp, block.norm1(h)
        partials = []
        for r in range(p):
            q = (x @ a.q_proj.weight[r * hq * D:(r + 1) * hq * D].T).view(B, T, hq, D).transpose(1, 2)
            k = (x @ a.k_proj.weight[r * hk * D:(r + 1) * hk * D].T).view(B, T, hk, D).transpose(1, 2)
            v = (x @ a.v_proj.weight[r * hk * D:(r + 1) * hk * D].T).view(B, T, hk, D).transpose(1, 2)
            q, k = apply_rope(q, cos, sin, a.rope_layout), apply_rope(k, cos, sin, a.rope_layout)
            o, _ = attend(q, k, v, None, True, D ** -0.5)
            partials.append(o.transpose(1, 2).reshape(B, T, hq * D) @ a.o_proj.weight[:, r * hq * D:(r + 1) * hq * D].T)
        h = h + all_reduce(partials)
        x, partials = block.norm2(h), []
        for r in range(p):
            rows = slice(r * f, (r + 1) * f)
            u = ACTIVATIONS[m.activation](x @ m.w_gate.weight[rows].T) * (x @ m.w_up.weight[rows].T)
            partials.append(u @ m.w_down.weight[:, rows].T)
        h = h + all_reduce(partials)
    return model.head(model.norm(h)), sizes


# --------------------------------------------------------------------------- prefix caching


@dataclass(frozen=True)
class PrefixSavings:
    """What sharing a prefix saves: the ``tokens`` shared per request, cache ``bytes`` and prefill ``flops``."""

    tokens: int
    bytes: float
    flops: float


def prefix_cache_savings(n_requests: int, P: int, *, n_params: float, n_layers: int, d: int,
                         kv_bytes_per_token: float, block_size: int = 1) -> PrefixSavings:
    r"""Cache memory and prefill FLOPs saved when ``n_requests`` requests share a prefix of ``P`` tokens.

    Only whole blocks can be shared, :math:`P_s = \lfloor P / b \rfloor\, b` tokens (``block_size`` :math:`b`;
    1 for a contiguous cache). Stored once instead of :math:`n` times, they save

    .. math:: \Delta M = (n-1)\, P_s\, m_{KV}, \qquad
              \Delta C = (n-1)\,\bigl(2 N P_s + 2 L P_s (P_s + 1) d\bigr)

    with :math:`m_{KV}` = ``kv_bytes_per_token`` (all layers), :math:`N` = ``n_params`` (matrix-product
    parameters, LM head included), :math:`L` = ``n_layers``. The second term is the causal attention among
    the prefix tokens (:func:`~llmbook.lm.inference.attention_flops` with ``causal=True``); the suffix
    still attends to the prefix, so its FLOPs are not saved. Returns :class:`PrefixSavings`.

    >>> s = prefix_cache_savings(64, 1000, n_params=6.74e9, n_layers=32, d=4096, kv_bytes_per_token=2**19,
    ...                          block_size=16)
    >>> s.tokens, round(s.bytes / 2**30, 2)
    (992, 30.52)
    """
    n = check_positive_int(n_requests, "n_requests")
    P, b = check_nonnegative_int(P, "P (prefix tokens)"), check_positive_int(block_size, "block_size")
    N = float(check_range(n_params, "n_params", 0.0))
    m = float(check_range(kv_bytes_per_token, "kv_bytes_per_token", 0.0))
    P_s = P // b * b
    flops = 2 * N * P_s + attention_flops(P_s, d, causal=True, n_layers=n_layers)
    return PrefixSavings(P_s, (n - 1) * P_s * m, (n - 1) * flops)


def shared_prefix_blocks(requests, block_size: int) -> tuple[int, int]:
    r"""KV blocks of ``requests`` (lists of token ids) without and with prefix sharing: ``(unshared, shared)``.

    A full block is identified by *all* tokens up to its end (vLLM's automatic prefix caching hashes the
    block's tokens together with its prefix), so two requests share a block exactly when they agree on
    every token up to it. A partial last block is never shared. Without sharing a request of :math:`S`
    tokens holds :math:`\lceil S/b \rceil` blocks; with sharing the pool holds the distinct full blocks
    plus every partial one. Counting, not a formula: the check of :func:`prefix_cache_savings`.

    >>> shared_prefix_blocks([[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 2, 7]], block_size=2)
    (7, 5)
    """
    b = check_positive_int(block_size, "block_size")
    requests = [list(r) for r in requests]
    unshared, full, partial = 0, set(), 0
    for r in requests:
        unshared += -(-len(r) // b)
        n_full = len(r) // b
        full.update(tuple(r[:(j + 1) * b]) for j in range(n_full))
        partial += len(r) > n_full * b
    return unshared, len(full) + partial


# --------------------------------------------------------------------------- model bandwidth utilisation


def model_bandwidth_utilization(bytes_per_step: float, step_time: float, BW: float) -> float:
    r"""Model bandwidth utilisation :math:`\mathrm{MBU} = \dfrac{M_{step} / T_{step}}{BW}`: achieved over peak.

    ``bytes_per_step`` :math:`M_{step}`: what one decode step must read, the weights plus every
    sequence's KV cache (:func:`~llmbook.lm.inference.decode_step_cost`); ``step_time`` :math:`T_{step}`
    in seconds (the measured time per output token at batch 1); ``BW`` the peak memory bandwidth in
    bytes/s. 1 means the step streams its bytes at the peak; a real engine reaches about 0.5-0.8.

    >>> model_bandwidth_utilization(14e9, 0.014, 2e12)   # 7B fp16, 14 ms per token, 2 TB/s
    0.5
    """
    M = float(check_range(bytes_per_step, "bytes_per_step", 0.0))
    t = float(check_range(step_time, "step_time (seconds)", 0.0, low_open=True))
    return M / t / float(check_range(BW, "BW (bytes/s)", 0.0, low_open=True))
