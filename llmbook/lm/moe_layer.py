r"""The mixture-of-experts layer and a routing simulation (chapter 14), built on :mod:`llmbook.lm.moe`.

:class:`MoELayer` puts the routing equations of :mod:`llmbook.lm.moe` together (router, top-k,
capacity, experts, combine); :func:`simulate_routing` trains a toy router to show routing collapse
and the two cures (the auxiliary loss and the selection bias). Symbols as in :mod:`llmbook.lm.moe`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import lru_cache

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import check_module_input, check_positive_int, check_range
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.moe import (
    _matrices,
    capacity_mask,
    expert_capacity,
    expert_load,
    moe_output,
    switch_routing,
    top_k_routing,
    update_routing_bias,
)
from llmbook.lm.probability import softmax

__all__ = ["MoELayer", "Routing", "RoutingSimulation", "simulate_routing", "BALANCE"]


# ================================================================= the layer


@dataclass
class Routing:
    """The routing decisions of one :class:`MoELayer` call (``N = B*T`` tokens)."""

    logits: Tensor  # (N, E) router logits z
    probs: Tensor  # (N, E) g(x)
    topk_ids: Tensor  # (N, K)
    topk_weights: Tensor  # (N, K), from g (never from the routing bias)
    keep: Tensor  # (N, K) bool, False where capacity dropped the assignment
    capacity: int | None  # per-expert capacity, None when unlimited


class MoELayer(nn.Module):
    r"""A sparse mixture-of-experts feed-forward layer: router, top-k, capacity, experts, combine.

    Each expert is an FFN. ``activation="swiglu"`` gives Mixtral's
    :math:`W_2(\mathrm{silu}(W_1x)\odot W_3x)` with ``W_in = [W_1; W_3]`` of shape ``(E, 2 d_ff, C)`` (the
    layout of ``MixtralExperts.gate_up_proj``); ``"relu"``/``"gelu"`` give :math:`W_2\,\phi(W_1x)` with
    ``W_in`` of shape ``(E, d_ff, C)`` (Switch). ``W_out`` is ``(E, C, d_ff)`` and the router ``W_g`` is ``(E, C)``.

    ``capacity_factor=None`` keeps every assignment; otherwise each expert takes at most
    :func:`~llmbook.lm.moe.expert_capacity` of the ``N = B*T`` tokens' assignments and dropped ones output zero (the
    residual connection around the layer carries those tokens through). The buffer ``routing_bias``
    (zeros) is DeepSeek's selection bias; :meth:`update_bias` moves it.

    ``forward``: ``(B, T, C) -> ((B, T, C), Routing)``.

    >>> layer = MoELayer(C=8, d_ff=16, E=4, K=2, generator=torch.Generator().manual_seed(0))
    >>> y, r = layer(torch.randn(2, 3, 8))
    >>> tuple(y.shape), tuple(r.topk_ids.shape), int(r.keep.sum())
    ((2, 3, 8), (6, 2), 12)
    """

    def __init__(self, C: int, d_ff: int, E: int, K: int, *, activation: str = "swiglu", renormalize: bool = True,
                 capacity_factor: float | None = None, generator: torch.Generator | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        C, d_ff, E, K = (check_positive_int(v, n) for v, n in ((C, "C"), (d_ff, "d_ff"), (E, "E"), (K, "K")))
        if K > E:
            raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
        m = _matrices(activation)
        if capacity_factor is not None:
            check_range(capacity_factor, "capacity_factor", 0.0, low_open=True)
        self.C, self.d_ff, self.E, self.K = C, d_ff, E, K
        self.activation, self.renormalize, self.capacity_factor = activation, renormalize, capacity_factor
        dtype = dtype or torch.get_default_dtype()

        def init(*shape, fan_in):
            return nn.Parameter(torch.randn(*shape, generator=generator, dtype=dtype) / math.sqrt(fan_in))

        self.W_g = init(E, C, fan_in=C)
        self.W_in = init(E, (m - 1) * d_ff, C, fan_in=C)
        self.W_out = init(E, C, d_ff, fan_in=d_ff)
        self.register_buffer("routing_bias", torch.zeros(E, dtype=dtype))

    def expert(self, e: int, rows: Float[Tensor, "n C"]) -> Float[Tensor, "n C"]:
        """Run expert ``e`` on a batch of rows (fp16/bf16 rows are computed in float32, rounded once)."""
        h = upcast_half(rows) @ upcast_half(self.W_in[e]).T
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.relu(h) if self.activation == "relu" else F.gelu(h)
        return restore_half(h @ upcast_half(self.W_out[e]).T, rows.dtype)

    def route(self, x: Float[Tensor, "N C"]) -> Routing:
        """Router logits, probabilities, top-k choices and the capacity mask for ``N`` tokens."""
        logits = upcast_half(x) @ upcast_half(self.W_g).T  # fp16/bf16: routed in float32
        probs = softmax(logits)
        use_bias = bool(self.routing_bias.any())
        if self.K == 1 and not self.renormalize and not use_bias:  # Switch: the raw gate of the argmax
            w, ids = switch_routing(probs)
        else:
            w, ids = top_k_routing(probs, self.K, renormalize=self.renormalize,
                                   bias=upcast_half(self.routing_bias) if use_bias else None)
        logits, probs, w = (restore_half(t, x.dtype) for t in (logits, probs, w))
        capacity = None
        keep = torch.ones_like(ids, dtype=torch.bool)
        if self.capacity_factor is not None:
            capacity = expert_capacity(x.shape[0], self.E, self.K, self.capacity_factor)
            keep = capacity_mask(ids, self.E, capacity)
        return Routing(logits, probs, ids, w, keep, capacity)

    def forward(self, x: Float[Tensor, "B T C"]) -> tuple[Float[Tensor, "B T C"], Routing]:
        x = check_module_input(self, x, d=self.C, symbol="C", ndim=3, contract="(B, T, C)")
        if x.shape[0] * x.shape[1] == 0:
            raise ValueError(f"x must hold at least one token, got shape {tuple(x.shape)}")
        B, T, C = x.shape
        xs = x.reshape(B * T, C)
        r = self.route(xs)
        experts = [lambda rows, e=e: self.expert(e, rows) for e in range(self.E)]
        y = moe_output(xs, experts, r.topk_ids, r.topk_weights, keep=r.keep)
        return y.reshape(B, T, C), r

    @torch.no_grad()
    def update_bias(self, routing: Routing, u: float) -> None:
        """One auxiliary-loss-free balancing step on ``routing_bias`` from the load of ``routing``."""
        load = expert_load(routing.topk_ids, self.E)
        self.routing_bias.copy_(update_routing_bias(self.routing_bias, load, u))


# ================================================================= a small routing simulation


@dataclass
class RoutingSimulation:
    """The history of :func:`simulate_routing` (``S`` steps) and its final routing."""

    load: Tensor  # (S, E) assignments per expert at each step
    imbalance: Tensor  # (S,) max / mean load
    main_loss: Tensor  # (S,) the task loss (mean squared error per coordinate)
    probs: Tensor  # (N, E) router probabilities at the last step
    topk_ids: Tensor  # (N, K) choices at the last step
    topk_weights: Tensor  # (N, K) combine weights at the last step
    bias: Tensor  # (E,) final routing bias (zeros unless balance == "bias")
    first_probs: Tensor  # (N, E) router probabilities at the first step, before any training
    topk_ids_history: Tensor  # (S, N, K) the choices at every step
    topk_weights_history: Tensor  # (S, N, K) the combine weights at every step


BALANCE = ("none", "aux", "bias")


def simulate_routing(E: int = 8, K: int = 2, *, N: int = 256, C: int = 16, steps: int = 200, balance: str = "none",
                     alpha: float = 0.3, u: float = 0.003, shared: float = 0.9, noise: float = 1.5, skew: float = 0.0,
                     lr_router: float = 0.1, lr_expert: float = 1.0, seed: int = 0,
                     balance_from: int = 0) -> RoutingSimulation:
    r"""Train a toy top-``K`` MoE by full-batch gradient descent and record how its router spreads the tokens.

    The ``N`` tokens come from ``E`` clusters (centres plus Gaussian ``noise``, rescaled to norm
    :math:`\sqrt{C}`). Token :math:`x` of cluster :math:`c` has the target
    :math:`x\,(\text{shared}\,A_0 + \sqrt{1 - \text{shared}^2}\,A_c)`: a linear map common to all tokens
    plus one of its own cluster. Each expert is a linear map ``(C, C)`` (initial scale 0.1). The router
    is :math:`\mathrm{softmax}(W_g x + r)` with a learned bias :math:`r` per expert (GPT-OSS's router
    has one too), top-``K`` renormalised as in Mixtral, or the raw gate for ``K = 1`` as in Switch.

    The router starts close to indifferent (:math:`W_g` of scale 0.01 and
    :math:`r = -\text{skew}\cdot\log(1 + e)`, zero by default), so the first routing is only as uneven
    as a random assignment of the clusters. What happens to the balance after that comes from
    training: an expert that gets more tokens gets more gradient, learns the shared map first, looks
    better to the router than its partners, and the router's bias hands it more tokens still.
    ``skew > 0`` starts the router with a preference for low-numbered experts instead.

    ``balance``: ``"none"``; ``"aux"`` adds :func:`~llmbook.lm.moe.load_balancing_loss` with strength ``alpha``;
    ``"bias"`` selects with a routing bias moved by :func:`~llmbook.lm.moe.update_routing_bias` with step ``u``.
    ``balance_from`` (0-based step, default 0) switches the balancing on only from that step: the steps before
    it train exactly as ``balance="none"`` does, which shows whether a remedy can undo a collapse that has
    already happened.
    The gradients are written out by hand (the tests compare them with autograd), which makes a run of
    200 steps take a fraction of a second. Everything is float64 and seeded by ``seed``: the history
    is reproducible bit for bit, and runs are cached by their arguments (each call returns its own copy).
    The loop runs on one thread: its tensors are far too small to gain from intra-op parallelism, and on
    a busy machine idle worker threads slow it down several times over.

    >>> sim = simulate_routing(E=4, K=1, N=16, C=4, steps=3)
    >>> tuple(sim.load.shape), sim.load.sum(-1).tolist(), tuple(sim.topk_ids_history.shape)
    ((3, 4), [16, 16, 16], (3, 16, 1))
    """
    E, K, N, C, steps = (check_positive_int(v, n)
                         for v, n in ((E, "E"), (K, "K"), (N, "N"), (C, "C"), (steps, "steps")))
    if K > E:
        raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    for value, name in ((alpha, "alpha"), (u, "u"), (noise, "noise"), (skew, "skew"), (lr_router, "lr_router"),
                        (lr_expert, "lr_expert")):
        check_range(value, name, 0.0)
    check_range(shared, "shared", 0.0, 1.0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if isinstance(balance_from, bool) or not isinstance(balance_from, int) or not 0 <= balance_from <= steps:
        raise ValueError(f"balance_from must be an int step in [0, steps = {steps}], got {balance_from!r}")
    sim = _simulate_cached(E, K, N, C, steps, balance, float(alpha), float(u), float(shared), float(noise),
                           float(skew), float(lr_router), float(lr_expert), seed, balance_from)
    return RoutingSimulation(**{f.name: getattr(sim, f.name).clone() for f in fields(sim)})  # the caller's own copy


@lru_cache(maxsize=32)
def _simulate_cached(*args) -> RoutingSimulation:
    """Runs are cached by their arguments: the chapter and its widget train the same three models."""
    with _one_thread():
        return _simulate(*args)


@contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _toy_task(E, N, C, shared, noise, skew, seed):
    """Tokens ``x`` (N, C), targets (N, C) and the initial ``W_g`` (E, C), ``r`` (E,), expert maps ``W`` (E, C, C)."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    cluster = torch.arange(N) % E
    centres = torch.randn(E, C, generator=g, dtype=f64)
    x = centres[cluster] + noise * torch.randn(N, C, generator=g, dtype=f64)
    x = x / x.norm(dim=-1, keepdim=True) * math.sqrt(C)
    A = torch.randn(E, C, C, generator=g, dtype=f64) / math.sqrt(C)  # each cluster's own map
    A_0 = torch.randn(C, C, generator=g, dtype=f64) / math.sqrt(C)  # the map every token shares
    target = math.sqrt(1.0 - shared**2) * torch.einsum("nc,ncd->nd", x, A[cluster]) + shared * (x @ A_0)
    W_g = 0.01 * torch.randn(E, C, generator=g, dtype=f64)
    r = -skew * torch.log1p(torch.arange(E, dtype=f64))
    W = 0.1 * torch.randn(E, C, C, generator=g, dtype=f64)
    return x, target, W_g, r, W


def _loss_and_grads(x, target, W_g, r, W, b, K, alpha, balance):
    """One forward pass of the toy MoE and the gradients of its loss, by hand.

    Returns ``(main_loss, probs, topk_ids, topk_weights, load, (dW_g, dr, dW))``; the loss is the mean
    squared error, plus ``alpha`` times the balancing loss when ``balance == "aux"``.
    """
    N, C = x.shape
    E = W_g.shape[0]
    probs = torch.softmax(torch.addmm(r, x, W_g.T), -1)  # (N, E); small logits, plain softmax is safe
    # renormalised over the K chosen (Mixtral); the raw gate for K = 1 (Switch), which keeps a router gradient
    w, ids = top_k_routing(probs, K, renormalize=K > 1, bias=b if balance == "bias" else None)
    load = expert_load(ids, E)
    combine = torch.zeros_like(probs).scatter_(1, ids, w)  # (N, E): w where chosen, 0 elsewhere
    out = (x @ W.transpose(0, 1).reshape(C, E * C)).view(N, E, C)  # every expert on every token (cheap here)
    y = (combine.unsqueeze(-1) * out).sum(1)
    residual = y - target
    main = residual.pow(2).mean()
    dy = residual * (2.0 / (N * C))
    dw = (out * dy.unsqueeze(1)).sum(-1).gather(1, ids)  # (N, K): d loss / d combine weight
    dg = dw  # d loss / d g: for K = 1 the weight is the gate itself ...
    if K > 1:  # ... else through w = g / sum(g)
        dg = (dw - (dw * w).sum(-1, keepdim=True)) / probs.gather(1, ids).sum(-1, keepdim=True)
    dprobs = torch.zeros_like(probs).scatter_(1, ids, dg)
    if balance == "aux":  # alpha E sum_e f_e P_e with P_e = mean_n g_ne: d / d g_ne = alpha E f_e / N
        dprobs = dprobs + alpha * E * load.to(probs.dtype) / N**2
    dz = probs * (dprobs - (probs * dprobs).sum(-1, keepdim=True))  # through the softmax
    dW = ((combine.T.unsqueeze(1) * x.T).reshape(E * C, N) @ dy).view(E, C, C)  # (E C, N) @ (N, C)
    return main, probs, ids, w, load, (dz.T @ x, dz.sum(0), dW)


def _simulate(E, K, N, C, steps, balance, alpha, u, shared, noise, skew, lr_router, lr_expert, seed, balance_from=0):
    x, target, W_g, r, W = _toy_task(E, N, C, shared, noise, skew, seed)
    b = torch.zeros(E, dtype=x.dtype)
    loads, losses, all_ids, all_w = [], [], [], []
    first_probs = None
    for step in range(steps):
        mode = balance if step >= balance_from else "none"
        main, probs, ids, w, load, (dW_g, dr, dW) = _loss_and_grads(x, target, W_g, r, W, b, K, alpha, mode)
        if first_probs is None:
            first_probs = probs
        W_g = W_g - lr_router * dW_g
        r = r - lr_router * dr
        W = W - lr_expert * dW
        if mode == "bias":
            b = update_routing_bias(b, load, u)
        loads.append(load)
        losses.append(main)
        all_ids.append(ids)
        all_w.append(w)
    load = torch.stack(loads)
    imbalance = load.max(-1).values / load.double().mean(-1)
    return RoutingSimulation(load, imbalance, torch.stack(losses), probs, ids, w, b, first_probs,
                             torch.stack(all_ids), torch.stack(all_w))
