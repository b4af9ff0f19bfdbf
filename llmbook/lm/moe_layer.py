r"""The mixture-of-experts layer and a routing simulation (chapter 14), built on :mod:`llmbook.lm.moe`.

:class:`MoELayer` puts the routing equations of :mod:`llmbook.lm.moe` together (router, top-k,
capacity, experts, combine); :func:`simulate_routing` trains a toy router to show routing collapse
and the two cures (the auxiliary loss and the selection bias). Symbols as in :mod:`llmbook.lm.moe`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import check_module_input, check_positive_int, check_range
from llmbook.lm.moe import (
    _matrices,
    capacity_mask,
    expert_capacity,
    expert_load,
    load_balancing_loss,
    moe_output,
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
        """Run expert ``e`` on a batch of rows."""
        h = rows @ self.W_in[e].T
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.relu(h) if self.activation == "relu" else F.gelu(h)
        return h @ self.W_out[e].T

    def route(self, x: Float[Tensor, "N C"]) -> Routing:
        """Router logits, probabilities, top-k choices and the capacity mask for ``N`` tokens."""
        logits = x @ self.W_g.T
        probs = softmax(logits)
        use_bias = bool(self.routing_bias.any())
        w, ids = top_k_routing(probs, self.K, renormalize=self.renormalize,
                               bias=self.routing_bias if use_bias else None)
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
    probs: Tensor  # (N, E) final router probabilities
    topk_ids: Tensor  # (N, K) final choices
    topk_weights: Tensor  # (N, K) final combine weights
    bias: Tensor  # (E,) final routing bias (zeros unless balance == "bias")


BALANCE = ("none", "aux", "bias")


def simulate_routing(E: int = 8, K: int = 2, *, N: int = 256, C: int = 16, steps: int = 200, balance: str = "none",
                     alpha: float = 0.3, u: float = 0.003, skew: float = 1.0, lr_router: float = 0.1,
                     lr_expert: float = 0.5, seed: int = 0) -> RoutingSimulation:
    r"""Train a toy MoE by full-batch gradient descent and record how its router spreads the tokens.

    The ``N`` tokens come from ``E`` clusters, each with its own linear target map, and each expert
    is a linear map ``(C, C)``, so a balanced routing that specialises is the best solution. The
    router starts with a preference for low-numbered experts, :math:`-\text{skew}\cdot\log(1 + e)`
    added to its logits. An expert that gets more tokens learns faster, looks better to the
    router and gets still more tokens: without balancing, the routing collapses.

    ``balance``: ``"none"``; ``"aux"`` adds :func:`~llmbook.lm.moe.load_balancing_loss` with strength ``alpha``;
    ``"bias"`` selects with a routing bias moved by :func:`~llmbook.lm.moe.update_routing_bias` with step ``u``.
    Everything is float64 and seeded by ``seed``: the history is reproducible bit for bit. The loop
    runs on one thread: its tensors are far too small to gain from intra-op parallelism, and on a
    busy machine the idle worker threads slow it down several times over.

    >>> sim = simulate_routing(E=4, K=1, N=16, C=4, steps=3)
    >>> tuple(sim.load.shape), sim.load.sum(-1).tolist()
    ((3, 4), [16, 16, 16])
    """
    E, K, N, C, steps = (check_positive_int(v, n)
                         for v, n in ((E, "E"), (K, "K"), (N, "N"), (C, "C"), (steps, "steps")))
    if K > E:
        raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    for value, name in ((alpha, "alpha"), (u, "u"), (skew, "skew"), (lr_router, "lr_router"),
                        (lr_expert, "lr_expert")):
        check_range(value, name, 0.0)
    with _one_thread():
        return _simulate(E, K, N, C, steps, balance, alpha, u, skew, lr_router, lr_expert, seed)


@contextmanager
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _simulate(E, K, N, C, steps, balance, alpha, u, skew, lr_router, lr_expert, seed) -> RoutingSimulation:
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    cluster = torch.arange(N) % E
    centres = torch.randn(E, C, generator=g, dtype=f64)
    x = centres[cluster] + 0.5 * torch.randn(N, C, generator=g, dtype=f64)
    x = x / x.norm(dim=-1, keepdim=True) * math.sqrt(C)
    A = torch.randn(E, C, C, generator=g, dtype=f64) / math.sqrt(C)
    target = torch.einsum("nc,ncd->nd", x, A[cluster])
    W_g = (0.1 * torch.randn(E, C, generator=g, dtype=f64)).requires_grad_()
    r = (-skew * torch.log1p(torch.arange(E, dtype=f64))).requires_grad_()
    W = (0.1 * torch.randn(E, C, C, generator=g, dtype=f64)).requires_grad_()
    b = torch.zeros(E, dtype=f64)
    loads, losses = [], []
    for _ in range(steps):
        probs = softmax(x @ W_g.T + r)
        w, ids = top_k_routing(probs, K, bias=b if balance == "bias" else None)
        y = torch.einsum("nk,nc,nkcd->nd", w, x, W[ids])
        main = ((y - target) ** 2).mean()
        load = expert_load(ids, E)
        loss = main
        if balance == "aux":
            loss = main + load_balancing_loss(probs, ids, alpha)
        gW_g, gr, gW = torch.autograd.grad(loss, (W_g, r, W))
        with torch.no_grad():
            W_g -= lr_router * gW_g
            r -= lr_router * gr
            W -= lr_expert * gW
        if balance == "bias":
            b = update_routing_bias(b, load, u)
        loads.append(load)
        losses.append(main.detach())
    load = torch.stack(loads)
    imbalance = load.max(-1).values / load.double().mean(-1)
    return RoutingSimulation(load, imbalance, torch.stack(losses), probs.detach(), ids, w.detach(), b)
