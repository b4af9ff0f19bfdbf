"""The routing widget: where a mixture of experts sends its tokens, and what capacity and balancing do.

:func:`routing_view` is the pure computation (tested in ``tests/widgets/test_routing.py``): it
trains the toy router of :func:`llmbook.lm.moe_layer.simulate_routing` with the chosen balancing method,
then applies the expert capacity to its final routing. :func:`draw_routing` paints the load per
expert against capacity, the combine weights of a few tokens and the load imbalance over the
training steps. :func:`routing_explorer` wraps both in an :class:`~llmbook.widgets.explorer.Explorer`;
:func:`show_routing` shows all six sliders live (Jupyter, Colab) and three of them, precomputed,
on the static website.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from llmbook.lm.moe import capacity_mask, expert_capacity, expert_load
from llmbook.lm.moe_layer import BALANCE, simulate_routing
from llmbook.widgets.explorer import Explorer, Param, has_stack, on_colab

__all__ = ["RoutingView", "routing_view", "draw_routing", "routing_explorer", "show_routing",
           "ALPHA", "U", "SKEWS", "CAPACITY_FACTORS"]

#: Balancing strength 1 means this auxiliary-loss weight alpha ...
ALPHA = 0.3
#: ... or this bias step u; the ``strength`` slider multiplies them.
U = 0.003
N_TOKENS = 256
#: Router skews on the static explorer's grid, with E = 8, K = 2 and strength 1 fixed (3 x 3 x 3 = 27 frames).
SKEWS = [0.0, 1.0, 2.0]
CAPACITY_FACTORS = [1.0, 1.25, 2.0]
#: The tokens whose combine weights are drawn: spread over the priority order, so late ones show drops.
SHOWN_TOKENS = [0, 85, 170, 255]


@lru_cache(maxsize=64)
def _simulation(E: int, K: int, skew: float, balance: str, strength: float, seed: int):
    return simulate_routing(E, K, N=N_TOKENS, balance=balance, alpha=ALPHA * strength, u=U * strength,
                            skew=skew, seed=seed)


@dataclass
class RoutingView:
    """Everything the widget draws for one setting."""

    E: int
    K: int
    balance: str
    capacity: int  # per-expert capacity ceil(c N K / E)
    load: torch.Tensor  # (E,) assignments each expert was chosen for, at the last step
    kept: torch.Tensor  # (E,) of those, the ones within capacity
    dropped: int  # assignments beyond capacity, = sum(max(0, load - capacity))
    dropped_tokens: int  # tokens that lost every one of their K experts (only the residual carries them)
    imbalance: torch.Tensor  # (S,) max / mean load over the training steps
    imbalance_none: torch.Tensor  # (S,) the same run without balancing, for comparison
    token_ids: torch.Tensor  # (n, K) experts of the tokens SHOWN_TOKENS
    token_weights: torch.Tensor  # (n, K) their combine weights
    token_keep: torch.Tensor  # (n, K) whether each assignment fit within capacity
    main_loss: float  # the task loss at the last step


def routing_view(E: int = 8, K: int = 2, capacity_factor: float = 1.25, skew: float = 1.0, balance: str = "none",
                 strength: float = 1.0, seed: int = 0) -> RoutingView:
    """Train the toy router (``N = 256`` tokens, 200 steps), then dispatch its final routing with capacity.

    ``skew`` is the router's initial preference for low-numbered experts; ``balance`` is ``"none"``,
    ``"aux"`` (auxiliary loss with weight ``ALPHA * strength``) or ``"bias"`` (routing bias with
    step ``U * strength``). Simulations are cached, so moving only the capacity slider is instant.

    >>> v = routing_view(E=8, K=2, capacity_factor=1.25, skew=1.0, balance="none")
    >>> v.capacity, int(v.load.sum()), v.dropped == int((v.load - v.capacity).clamp(min=0).sum())
    (80, 512, True)
    """
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    E, K = int(E), int(K)
    if K > E:
        raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
    sim = _simulation(E, K, float(skew), balance, float(strength), seed)
    none = sim if balance == "none" else _simulation(E, K, float(skew), "none", 1.0, seed)
    capacity = expert_capacity(N_TOKENS, E, K, float(capacity_factor))
    keep = capacity_mask(sim.topk_ids, E, capacity)
    load = expert_load(sim.topk_ids, E)
    kept = expert_load(sim.topk_ids, E, keep)
    return RoutingView(
        E, K, balance, capacity, load, kept, int((~keep).sum()), int((~keep).all(-1).sum()),
        sim.imbalance, none.imbalance, sim.topk_ids[SHOWN_TOKENS], sim.topk_weights[SHOWN_TOKENS],
        keep[SHOWN_TOKENS], float(sim.main_loss[-1]),
    )


def _colour(e: int, E: int):
    import matplotlib

    return matplotlib.colormaps["tab20" if E > 10 else "tab10"](e % 20)


def draw_routing(view: RoutingView, fig) -> None:
    """Load against capacity, combine weights of a few tokens, and imbalance over the training steps."""
    ax_load, ax_w, ax_imb = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.25, 1.0, 1.1]})
    x = np.arange(view.E)
    kept, load = view.kept.numpy(), view.load.numpy()
    ax_load.bar(x, kept, color=[_colour(e, view.E) for e in range(view.E)], label="processed")
    ax_load.bar(x, load - kept, bottom=kept, color="white", edgecolor="#CC3311", hatch="///", label="dropped")
    ax_load.axhline(view.capacity, color="black", ls="--", lw=1, label=f"capacity {view.capacity}")
    ax_load.set_xticks(x, [str(e) for e in x] if view.E <= 16 else None)
    ax_load.set(xlabel="expert", ylabel="assignments", ylim=(0, max(load.max(), view.capacity) * 1.45))
    ax_load.set_title(f"dropped {view.dropped} of {N_TOKENS * view.K} assignments", fontsize=9)
    ax_load.legend(fontsize=7, loc="upper right", ncol=2)

    n = view.token_ids.shape[0]
    for t in range(n):
        left = 0.0
        for k in range(view.K):
            e, w = int(view.token_ids[t, k]), float(view.token_weights[t, k])
            kept_k = bool(view.token_keep[t, k])
            ax_w.barh(t, w, left=left, color=_colour(e, view.E) if kept_k else "white",
                      edgecolor="#CC3311" if not kept_k else "white", hatch=None if kept_k else "///")
            if w > 0.12:
                ax_w.text(left + w / 2, t, f"e{e}", ha="center", va="center", fontsize=7)
            left += w
    ax_w.set_yticks(range(n), [f"token {t}" for t in SHOWN_TOKENS], fontsize=7)
    ax_w.invert_yaxis()
    ax_w.set(xlim=(0, 1), xlabel="combine weight")
    ax_w.set_title(f"top-{view.K} weights (hatched: dropped)", fontsize=9)

    steps = np.arange(1, len(view.imbalance) + 1)
    if view.balance != "none":
        ax_imb.plot(steps, view.imbalance_none.numpy(), color="#999999", lw=1, label="no balancing")
    ax_imb.plot(steps, view.imbalance.numpy(), color="#0077BB", lw=1.5,
                label={"none": "no balancing", "aux": "auxiliary loss", "bias": "routing bias"}[view.balance])
    ax_imb.axhline(1.0, color="black", lw=0.8, ls=":")
    ax_imb.set(xlabel="training step", ylabel="max / mean load", ylim=(0.9, (view.E / view.K) * 1.25))
    ax_imb.set_title(f"imbalance (task loss {view.main_loss:.3f})", fontsize=9)
    ax_imb.legend(fontsize=7, loc="upper right")
    fig.tight_layout()


def routing_explorer(full: bool = False) -> Explorer:
    """Sliders over the routing view.

    ``full=False`` (the static grid): skew, capacity factor and balancing method, with ``E = 8``,
    ``K = 2`` and strength 1 fixed: 27 precomputed frames. ``full=True`` (live): all six sliders.

    >>> routing_explorer().grid_size, len(routing_explorer(full=True).params)
    (27, 6)
    """
    skew = Param("skew", SKEWS if not full else [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0], label="router skew",
                 default=1.0, step=0.25)
    cf = Param("capacity_factor", CAPACITY_FACTORS if not full else [0.5, 1.0, 1.25, 1.5, 2.0, 3.0],
               label="capacity c", default=1.25, step=0.05)
    balance = Param("balance", list(BALANCE), label="balancing")
    if full:
        params = [Param("E", [4, 8, 12, 16], label="experts E", default=8, step=1), Param("K", [1, 2, 3, 4],
                  label="top-K", default=2), cf, skew, balance,
                  Param("strength", [0.0, 0.5, 1.0, 2.0, 3.0], label="strength", default=1.0, step=0.1)]

        def compute(**kw):
            kw["K"] = min(kw["K"], kw["E"])
            return routing_view(**kw)
    else:
        params = [skew, cf, balance]

        def compute(**kw):
            return routing_view(E=8, K=2, strength=1.0, **kw)

    return Explorer(compute, draw_routing, params, figsize=(10.0, 3.2), dpi=72, title="routing explorer")


def show_routing(mode: str = "auto", progress: bool = False):
    """All six sliders live where a kernel runs (Colab, or ``mode="live"``); the 27-frame static view elsewhere."""
    if mode not in ("auto", "live", "static"):
        raise ValueError(f"mode must be 'auto', 'live' or 'static', got {mode!r}")
    if mode == "auto":
        mode = "live" if on_colab() or not has_stack() else "static"
    return routing_explorer(full=mode == "live").show(mode, progress=progress)
