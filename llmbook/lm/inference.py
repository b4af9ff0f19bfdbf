r"""Production inference math (chapter 17, ids 17.01, 17.02, 17.05-17.11): FLOPs, latency, the roofline.

**FLOPs.** A multiply–add counts as two floating-point operations (the convention of
``torch.utils.flop_counter.FlopCounterMode`` and of Kaplan et al., 2020). A weight matrix of shape
:math:`(k, m)` applied to one token costs :math:`2km`, so a model whose matrix multiplications use
:math:`N` parameters costs :math:`2N` FLOPs per token forward and :math:`6N` forward and backward (the
backward pass needs one product for the input gradient and one for the weight gradient). The only
FLOPs that are not "two per parameter" are the attention scores :math:`QK^\top` and the weighted sum
:math:`AV`, which multiply activations by activations: :math:`4Td` per token per layer for a context of
:math:`T` tokens when every score is computed, :math:`2(T+1)d` on average when a causal kernel skips
the masked half (:func:`attention_flops`). An embedding lookup is an index, not a product: it costs
nothing, but a tied LM head multiplies by the same matrix and costs :math:`2Vd` (:func:`matmul_params`
counts it once, as the head). Against the :math:`24d^2` of a standard layer's weights (:math:`4d^2`
attention projections, :math:`8d^2` MLP) the ratio is :math:`T/(6d)` with every score computed, and
about :math:`T/(12d)` for a causal kernel: the crossover at :math:`n_{ctx} = 12\,d_{model}` that Kaplan et
al. (2020, sec. 2.1) state, whose context term :math:`2 n_{layer} n_{ctx} d_{attn}` per token is the causal
count.

**Time.** A GPU step takes at least its FLOPs divided by the peak rate and its bytes divided by the
memory bandwidth. Prefill (the prompt, many tokens at once) is compute-bound
(:func:`prefill_latency`); decoding one token per sequence reads every weight and the whole KV cache
to do two FLOPs per weight, and is bandwidth-bound (:func:`decode_latency`). Arithmetic intensity
(:func:`arithmetic_intensity`, FLOPs per byte) against the ridge point :math:`P_{peak}/BW` of the
roofline (:func:`roofline`; Williams, Waterman and Patterson, 2009) says which one applies. Serving
metrics: time to first token (:func:`ttft`), time per output token (:func:`tpot`) and
:func:`throughput`.

Hardware numbers (:data:`H200`) are the vendor's peak figures, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from llmbook._checks import check_nonnegative_int, check_positive_int, check_range
from llmbook.registry import implements

__all__ = ["Accelerator", "H200", "attention_flops", "mlp_flops", "matmul_params", "FlopBreakdown",
           "transformer_flops", "prefill_latency", "decode_latency", "ttft", "tpot", "throughput",
           "arithmetic_intensity", "roofline", "decode_step_cost"]


@dataclass(frozen=True)
class Accelerator:
    """A device's peak dense compute ``peak_flops`` (FLOP/s) and memory bandwidth ``BW`` (bytes/s)."""

    name: str
    peak_flops: float
    BW: float

    @property
    def ridge(self) -> float:
        """The ridge point :math:`P_{peak}/BW` (FLOPs per byte) where the roofline bends."""
        return self.peak_flops / self.BW


#: NVIDIA H200 SXM at its vendor peaks (989 TFLOP/s dense bf16, twice that with 2-of-4 sparsity; 4.8 TB/s of HBM3e).
H200 = Accelerator("NVIDIA H200 SXM (vendor peak, dense bf16)", 989e12, 4.8e12)


def _nonneg(x, name: str) -> float:
    return float(check_range(x, name, 0.0))


# --------------------------------------------------------------------------- 17.01 / 17.02 FLOPs


@implements("17.01")
def attention_flops(n: int, d: int, *, n_k: int | None = None, B: int = 1, n_layers: int = 1,
                    causal: bool = False, training: bool = False) -> int:
    r"""FLOPs of the attention scores and the weighted sum: :math:`\mathrm{FLOPs}_{attn} = 4\,B\,n\,n_k\,d` per layer.

    The catalogue's :math:`O(n^2 d)`, made exact: :math:`n` queries against :math:`n_k` keys (default
    :math:`n_k = n`) of total width :math:`d = H D` cost :math:`2 n n_k d` for :math:`QK^\top` and the same
    for :math:`AV` (a multiply–add is two FLOPs). The softmax, scaling and masking are :math:`O(n n_k H)`
    and not counted (``FlopCounterMode`` counts matrix products only). The projections
    :math:`W_Q, W_K, W_V, W_O` are parameter FLOPs, not counted here.

    ``causal=True`` counts only the pairs a causal kernel computes, the last query aligned with the last
    key: :math:`n(n_k - n) + n(n+1)/2` pairs, so a prefill of :math:`n` tokens costs
    :math:`2Bn(n+1)d` (about half) and one decoded token against :math:`n_k` cached keys costs
    :math:`4Bn_kd`. Without it, every entry of the :math:`n \times n_k` score matrix is counted, as an
    implementation that masks after computing them (ours, ``torch``'s math path) does. Grouped
    key/value heads change nothing here: every query head still scores every key. ``training=True``
    multiplies by 3: the backward pass forms two products per forward product (:math:`dQ = dS\,K`,
    :math:`dK = dS^\top Q`, :math:`dA = dO\,V^\top`, :math:`dV = A^\top dO`).

    Symbols: ``n`` :math:`n` (queries), ``d`` :math:`d` (model width :math:`H D`), ``n_k`` keys, ``B`` batch,
    ``n_layers`` layers. Returns an exact ``int``.

    >>> attention_flops(1024, 4096)          # one layer, one sequence of 1024 tokens: 4 n^2 d
    17179869184
    >>> attention_flops(1, 4096, n_k=1024)   # one decoded token against 1024 cached keys: 4 n_k d
    16777216
    """
    n, d = check_nonnegative_int(n, "n (queries)"), check_positive_int(d, "d (model width H*D)")
    n_k = n if n_k is None else check_nonnegative_int(n_k, "n_k (keys)")
    B, n_layers = check_nonnegative_int(B, "B"), check_nonnegative_int(n_layers, "n_layers")
    if causal and n > n_k:
        raise ValueError(f"a causal attention of n = {n} queries needs at least as many keys, got n_k = {n_k}")
    pairs = n * (n_k - n) + n * (n + 1) // 2 if causal else n * n_k
    return (3 if training else 1) * 4 * B * n_layers * pairs * d


@implements("17.02")
def mlp_flops(n: int, d: int, d_ff: int, *, B: int = 1, n_layers: int = 1, n_matrices: int = 2,
              training: bool = False) -> int:
    r"""FLOPs of the position-wise MLP: :math:`2\,n\,d\,d_{ff}` for each of its ``n_matrices`` weight matrices.

    The catalogue writes :math:`\mathrm{FLOPs}_{MLP} \approx 2 n d d_{ff}`: that is one
    :math:`d \times d_{ff}` product over :math:`n` tokens (with a multiply–add as two FLOPs). A GPT-2 MLP
    has two matrices (up and down, ``n_matrices=2``: :math:`4ndd_{ff}`), a SwiGLU MLP (Llama) three
    (gate, up, down: :math:`6ndd_{ff}`). The activation function is element-wise and not counted.
    ``training=True`` multiplies by 3 (input and weight gradients). Returns an exact ``int``.

    >>> mlp_flops(1, 4096, 11008, n_matrices=3)   # one token through one Llama-2-7B MLP
    270532608
    """
    n, d = check_nonnegative_int(n, "n (tokens)"), check_positive_int(d, "d (model width)")
    d_ff = check_positive_int(d_ff, "d_ff (hidden width)")
    B, n_layers = check_nonnegative_int(B, "B"), check_nonnegative_int(n_layers, "n_layers")
    n_matrices = check_positive_int(n_matrices, "n_matrices (weight matrices of the MLP)")
    return (3 if training else 1) * 2 * B * n_layers * n * d * d_ff * n_matrices


def matmul_params(model: nn.Module) -> int:
    r"""Parameters that take part in a matrix product: every ``nn.Linear`` weight and bias, plus an LM head.

    This is the :math:`N` of :math:`6N` per token. Normalisation gains are element-wise (no product) and
    the embedding lookup is an index: neither costs matmul FLOPs. An LM head (an attribute ``head`` with
    a ``weight``, as :class:`~llmbook.lm.gpt.TinyGPT` has) multiplies by its matrix once per token; when
    it is tied to the embedding, that matrix is counted here once, as the head.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    n = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False))
    head = getattr(model, "head", None)
    if head is not None and not isinstance(head, nn.Linear) and getattr(head, "weight", None) is not None:
        n += head.weight.numel() + (head.bias.numel() if getattr(head, "bias", None) is not None else 0)
    return n


@dataclass(frozen=True)
class FlopBreakdown:
    """The FLOPs of a decoder pass, by kind: ``param`` (:math:`2N` or :math:`6N` per token) and ``attention``."""

    param: int
    attention: int

    @property
    def total(self) -> int:
        return self.param + self.attention


def transformer_flops(model: nn.Module, T: int, B: int = 1, training: bool = True) -> FlopBreakdown:
    r"""FLOPs of ``B`` sequences of ``T`` tokens through a :class:`~llmbook.lm.gpt.TinyGPT`, by kind.

    ``param`` is :math:`2NBT` forward (:math:`6NBT` with ``training``: claim C07's :math:`6ND` with
    :math:`D = BT` tokens), :math:`N` = :func:`matmul_params`; ``attention`` is :func:`attention_flops`
    over the model's layers with every entry of the :math:`T \times T` score matrix counted (as this
    model's attention computes them). Their sum is what ``FlopCounterMode`` counts.
    """
    T, B = check_positive_int(T, "T"), check_positive_int(B, "B")
    cfg = model.config
    N = matmul_params(model)
    param = (6 if training else 2) * N * B * T
    return FlopBreakdown(param, attention_flops(T, cfg.d_model, B=B, n_layers=cfg.n_layers, training=training))


# --------------------------------------------------------------------------- 17.05-17.09 latency and serving metrics


@implements("17.05")
def prefill_latency(FLOPs_prefill: float, peak_flops: float, T_overhead: float = 0.0) -> float:
    r"""Prefill time, compute-bound.

    .. math:: T_{prefill} \approx \mathrm{FLOPs}_{prefill} / \mathrm{FLOP/s}_{GPU} + T_{overhead}

    ``FLOPs_prefill``: the prompt's FLOPs (about :math:`2N` per prompt token plus
    :func:`attention_flops`); ``peak_flops``: the rate the GPU sustains (its peak times the achieved
    utilisation, MFU; at the vendor peak this is a lower bound); ``T_overhead``: seconds of launch,
    scheduling and communication. Returns seconds.

    >>> round(prefill_latency(2 * 7e9 * 2048, 989e12) * 1e3, 2)   # a 2048-token prompt, 7B model, H200 peak: ms
    28.99
    """
    FLOPs_prefill = _nonneg(FLOPs_prefill, "FLOPs_prefill")
    peak_flops = float(check_range(peak_flops, "peak_flops (FLOP/s)", 0.0, low_open=True))
    return FLOPs_prefill / peak_flops + _nonneg(T_overhead, "T_overhead")


@implements("17.06")
def decode_latency(FLOPs_decode: float, M_read: float, peak_flops: float, BW: float, T_overhead: float = 0.0,
                   overlap: bool = False) -> float:
    r"""Time of one decode step, compute plus memory traffic plus overhead.

    .. math:: T_{decode} \approx \mathrm{FLOPs}_{decode}/\mathrm{FLOP/s}_{GPU} + M_{read}/BW + T_{overhead}

    ``FLOPs_decode``: the step's FLOPs (about :math:`2N` per sequence in the batch, plus attention over
    the cache); ``M_read``: the bytes read (every weight once per step, plus every sequence's KV cache);
    ``peak_flops`` in FLOP/s and ``BW`` in bytes/s; ``T_overhead`` in seconds. The sum assumes compute
    and memory traffic do not overlap (an upper bound). ``overlap=True`` takes their maximum instead,
    the roofline's perfect overlap (a lower bound, :func:`roofline`). At batch 1 the memory term
    dominates by two orders of magnitude, so the two agree closely. Returns seconds.

    >>> round(decode_latency(2 * 7e9, 2 * 7e9, 989e12, 4.8e12) * 1e3, 3)   # 7B fp16, batch 1, H200 peak: ms
    2.931
    """
    FLOPs_decode, M_read = _nonneg(FLOPs_decode, "FLOPs_decode"), _nonneg(M_read, "M_read (bytes)")
    peak_flops = float(check_range(peak_flops, "peak_flops (FLOP/s)", 0.0, low_open=True))
    BW = float(check_range(BW, "BW (bytes/s)", 0.0, low_open=True))
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be a bool, got {overlap!r}")
    compute, memory = FLOPs_decode / peak_flops, M_read / BW
    return (max(compute, memory) if overlap else compute + memory) + _nonneg(T_overhead, "T_overhead")


@implements("17.07")
def ttft(T_queue: float, T_prefill: float, T_schedule: float = 0.0) -> float:
    r"""Time to first token: :math:`TTFT = T_{queue} + T_{prefill} + T_{schedule}` (seconds).

    The wait before the request is admitted to a batch, its prefill (which emits the first token), and
    the scheduler's own time. What a user sees as "latency before anything appears".

    >>> ttft(0.05, 0.03, 0.002)
    0.082
    """
    return _nonneg(T_queue, "T_queue") + _nonneg(T_prefill, "T_prefill") + _nonneg(T_schedule, "T_schedule")


@implements("17.08")
def tpot(T_decode_total: float, N_generated: int) -> float:
    r"""Time per output token: :math:`TPOT = T_{decode,total} / N_{generated}` (seconds per token).

    ``T_decode_total``: the time spent decoding after the first token, ``N_generated`` the tokens it
    produced. Serving benchmarks (vLLM's) take the end-to-end latency minus TTFT over the
    :math:`N_{out} - 1` tokens after the first, which is this formula with those two arguments.

    >>> tpot(0.9, 30)
    0.03
    """
    N_generated = check_positive_int(N_generated, "N_generated")
    return _nonneg(T_decode_total, "T_decode_total") / N_generated


@implements("17.09")
def throughput(N_tokens: int, T_wall: float) -> float:
    r"""Throughput :math:`= N_{tokens} / T_{wall}` (tokens per second, over all requests together).

    >>> throughput(12_000, 4.0)
    3000.0
    """
    N_tokens = check_nonnegative_int(N_tokens, "N_tokens")
    return N_tokens / float(check_range(T_wall, "T_wall (seconds)", 0.0, low_open=True))


# --------------------------------------------------------------------------- 17.10 / 17.11 intensity and roofline


@implements("17.10")
def arithmetic_intensity(FLOPs: float, bytes_moved: float) -> float:
    r"""Arithmetic intensity :math:`AI = \mathrm{FLOPs} / \mathrm{Bytes\ moved}` (FLOPs per byte of memory traffic).

    For a product :math:`(m, k) \times (k, n)` in a format of :math:`b` bytes it is
    :math:`2mkn / (b(mk + kn + mn))`: a decode step at batch :math:`B` multiplies a :math:`(B, k)`
    activation by a :math:`(k, n)` weight, :math:`AI \approx 2B/b`, which is 1 FLOP/byte at batch 1 in
    fp16, two orders of magnitude below an H100's or H200's ridge point.

    >>> round(arithmetic_intensity(2 * 1 * 4096 * 4096, 2 * (4096 + 4096 * 4096 + 4096)), 4)   # batch 1, fp16
    0.9995
    """
    bytes_moved = float(check_range(bytes_moved, "bytes_moved", 0.0, low_open=True))
    return _nonneg(FLOPs, "FLOPs") / bytes_moved


@implements("17.11")
def roofline(AI: float, peak_flops: float, BW: float) -> float:
    r"""Attainable performance on the roofline: :math:`P \le \min(P_{peak}, BW \cdot AI)` (FLOP/s).

    Below the ridge point :math:`AI^* = P_{peak}/BW` a kernel is bandwidth-bound (the slanted roof
    :math:`BW \cdot AI`); above it, compute-bound (the flat roof :math:`P_{peak}`). ``AI`` in FLOPs per
    byte, ``peak_flops`` in FLOP/s, ``BW`` in bytes/s; ``AI = inf`` gives the peak.

    >>> roofline(1.0, 989e12, 4.8e12) / 1e12   # batch-1 fp16 decode on an H200: TFLOP/s
    4.8
    """
    AI = float(check_range(AI, "AI (FLOPs per byte)", 0.0, finite=False))
    peak_flops = float(check_range(peak_flops, "peak_flops (FLOP/s)", 0.0, low_open=True))
    BW = float(check_range(BW, "BW (bytes/s)", 0.0, low_open=True))
    return min(peak_flops, BW * AI)


def decode_step_cost(n_params: float, B: int, S: int, *, n_layers: int, d: int, kv_bytes_per_token: float,
                     bytes_per_param: float = 2.0) -> tuple[float, float]:
    r"""``(FLOPs, bytes)`` of one decode step for ``B`` sequences with ``S`` cached tokens each.

    FLOPs: :math:`2NB` for the weights plus :func:`attention_flops` of one query against :math:`S + 1`
    keys per sequence and layer. Bytes: every weight read once (``bytes_per_param`` each) plus every
    sequence's cache, :math:`B S` times ``kv_bytes_per_token`` (:func:`llmbook.lm.kv_cache.kv_cache_bytes`
    of one token). Activations are small and not counted.

    >>> f, b = decode_step_cost(7e9, 1, 0, n_layers=32, d=4096, kv_bytes_per_token=2**19)
    >>> round(f / b, 3)   # batch 1, empty cache: one FLOP per byte
    1.0
    """
    n_params = _nonneg(n_params, "n_params")
    B, S = check_nonnegative_int(B, "B"), check_nonnegative_int(S, "S")
    flops = 2 * n_params * B + attention_flops(1, d, n_k=S + 1, B=B, n_layers=n_layers)
    return flops, n_params * _nonneg(bytes_per_param, "bytes_per_param") + B * S * _nonneg(
        kv_bytes_per_token, "kv_bytes_per_token")
