"""The routing widget: how a mixture of experts' load drifts while it trains, and what capacity and balancing do.

:func:`routing_view` is the pure computation (tested in ``tests/widgets/test_routing.py``): it
trains the toy MoE of :func:`llmbook.lm.moe_layer.simulate_routing` with the chosen balancing method
(the router starts near balance) and applies the expert capacity to its routing at the chosen
training step. :func:`draw_routing` paints the load per expert against the capacity, dropped
assignments hatched, and the load imbalance over training with the step marked.
:func:`routing_explorer` wraps both in an :class:`~llmbook.widgets.explorer.Explorer`;
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
           "ALPHA", "U", "N_TOKENS", "STEPS", "SHOWN_STEPS", "CAPACITY_FACTORS", "LABELS"]

#: Balancing strength 1 means this auxiliary-loss weight alpha ...
ALPHA = 0.3
#: ... or this bias step u; the ``strength`` slider multiplies them.
U = 0.003
N_TOKENS = 256
#: Training steps of every simulation.
STEPS = 200
#: The static explorer's grid, with E = 8, K = 2 and strength 1 fixed (3 x 3 x 3 = 27 frames), shows the start
#: (near balance), a step where the unbalanced router is collapsing, and the end of training ...
SHOWN_STEPS = [1, 20, 200]
#: ... and three capacity factors.
CAPACITY_FACTORS = [1.0, 1.25, 2.0]
LABELS = {"none": "no balancing", "aux": "auxiliary loss", "bias": "routing bias"}


@lru_cache(maxsize=64)
def _simulation(E: int, K: int, balance: str, strength: float, seed: int):
    return simulate_routing(E, K, N=N_TOKENS, steps=STEPS, balance=balance, alpha=ALPHA * strength,
                            u=U * strength, seed=seed)


@dataclass
class RoutingView:
    """Everything the widget draws for one setting."""

    E: int
    K: int
    balance: str
    step: int  # the training step shown, 1 ... STEPS
    capacity: int  # per-expert capacity ceil(c N K / E)
    load: torch.Tensor  # (E,) assignments each expert was chosen for at that step
    kept: torch.Tensor  # (E,) of those, the ones within capacity
    dropped: int  # assignments beyond capacity, = sum(max(0, load - capacity))
    dropped_tokens: int  # tokens that lost every one of their K experts (only the residual carries them)
    imbalance: torch.Tensor  # (S,) max / mean load over the training steps
    imbalance_none: torch.Tensor  # (S,) the same run without balancing, for comparison
    main_loss: float  # the task loss at that step
    main_loss_none: float  # the task loss of the unbalanced run at that step


def routing_view(E: int = 8, K: int = 2, capacity_factor: float = 1.25, step: int = STEPS, balance: str = "none",
                 strength: float = 1.0, seed: int = 0) -> RoutingView:
    """Train the toy MoE (``N = 256`` tokens, 200 steps), then dispatch its routing at ``step`` with capacity.

    ``balance`` is ``"none"``, ``"aux"`` (auxiliary loss with weight ``ALPHA * strength``) or ``"bias"``
    (routing bias with step ``U * strength``). Simulations are cached, so moving only the step or the
    capacity slider is instant.

    >>> v = routing_view(E=8, K=2, capacity_factor=1.25, step=200, balance="none")
    >>> v.capacity, int(v.load.sum()), v.dropped == int((v.load - v.capacity).clamp(min=0).sum())
    (80, 512, True)
    """
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    E, K, step = int(E), int(K), int(step)
    if K > E:
        raise ValueError(f"K ({K}) cannot exceed the number of experts E ({E})")
    if not 1 <= step <= STEPS:
        raise ValueError(f"step must lie in [1, {STEPS}], got {step}")
    sim = _simulation(E, K, balance, float(strength), seed)
    none = sim if balance == "none" else _simulation(E, K, "none", 1.0, seed)
    ids = sim.topk_ids_history[step - 1]
    capacity = expert_capacity(N_TOKENS, E, K, float(capacity_factor))
    keep = capacity_mask(ids, E, capacity)
    load = expert_load(ids, E)
    kept = expert_load(ids, E, keep)
    return RoutingView(
        E, K, balance, step, capacity, load, kept, int((~keep).sum()), int((~keep).all(-1).sum()),
        sim.imbalance, none.imbalance, float(sim.main_loss[step - 1]), float(none.main_loss[step - 1]),
    )


def _colour(e: int, E: int):
    import matplotlib

    return matplotlib.colormaps["tab20" if E > 10 else "tab10"](e % 20)


def draw_routing(view: RoutingView, fig):
    """Load against capacity at the chosen step (left) and the imbalance over training (right).

    Returns an updater (the :class:`~llmbook.widgets.explorer.Explorer` protocol) that moves the bars,
    lines and texts to another view and renders the frame itself: the axes, ticks, curves and legends
    are drawn once per ``(E, K, balance)`` and kept as a background, on which each frame draws only
    what changes (blitting). It returns the frame's pixels; the figure itself stays complete, so
    ``fig.savefig`` works as usual. A view with another ``E``, ``K`` or balancing method redraws the figure.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    state = {}

    def build(v: RoutingView) -> None:
        fig.clear()
        ax_load = fig.add_axes((0.085, 0.17, 0.37, 0.63))
        ax_imb = fig.add_axes((0.59, 0.17, 0.39, 0.63))
        x = np.arange(v.E)
        processed = ax_load.bar(x, np.zeros(v.E), color=[_colour(e, v.E) for e in range(v.E)], label="processed")
        dropped = ax_load.bar(x, np.zeros(v.E), color="white", edgecolor="#CC3311", hatch="///", label="dropped")
        cap = ax_load.axhline(0, color="black", ls="--", lw=1, label="capacity")
        ax_load.set_xticks(x, [str(e) for e in x] if v.E <= 8 else [str(e) if e % 2 == 0 else "" for e in x])
        ax_load.set(xlabel="expert", ylabel="assignments", ylim=(0, N_TOKENS * 1.32))
        ax_load.legend(fontsize=9, loc="upper left", ncol=3, handlelength=1.2, columnspacing=0.8,
                       borderaxespad=0.2)
        load_title = ax_load.text(0.5, 1.03, " ", fontsize=10, ha="center", va="bottom", transform=ax_load.transAxes)

        steps = np.arange(1, len(v.imbalance) + 1)
        if v.balance != "none":
            ax_imb.plot(steps, v.imbalance_none.numpy(), color="#999999", lw=1, label=LABELS["none"])
        ax_imb.plot(steps, v.imbalance.numpy(), color="#0072B2", lw=1.5, label=LABELS[v.balance])
        ax_imb.axhline(1.0, color="black", lw=0.8, ls=":")
        marker = ax_imb.axvline(1, color="#D55E00", lw=1)
        dot, = ax_imb.plot([1], [1], "o", color="#D55E00", ms=5)
        ax_imb.set(xlabel="training step", ylabel="max / mean load", xlim=(0, len(steps) + 1),
                   ylim=(0.8, (v.E / v.K) * 1.15))
        ax_imb.legend(fontsize=9, loc="center right")
        imb_title = ax_imb.text(0.5, 1.03, " ", fontsize=10, ha="center", va="bottom", transform=ax_imb.transAxes)
        head = fig.text(0.01, 0.985, " ", fontsize=10, ha="left", va="top")
        moving = [*processed, *dropped, cap, load_title, marker, dot, imb_title, head]
        for artist in moving:  # the background: everything but what the frames change
            artist.set_visible(False)
        canvas.draw()
        background = canvas.copy_from_bbox(fig.bbox)
        for artist in moving:
            artist.set_visible(True)
        state.update(key=(v.E, v.K, v.balance), processed=processed, dropped=dropped, cap=cap,
                     load_title=load_title, marker=marker, dot=dot, imb_title=imb_title, head=head,
                     moving=moving, background=background)

    def update(v: RoutingView) -> np.ndarray:
        if state.get("key") != (v.E, v.K, v.balance):
            build(v)
        kept, load = v.kept.numpy(), v.load.numpy()
        for bar, k in zip(state["processed"], kept, strict=True):
            bar.set_height(k)
        for bar, k, n in zip(state["dropped"], kept, load, strict=True):
            bar.set_y(k)
            bar.set_height(n - k)
        state["cap"].set_ydata([v.capacity, v.capacity])
        state["load_title"].set_text(f"capacity {v.capacity}: {v.dropped} of {N_TOKENS * v.K} dropped")
        state["marker"].set_xdata([v.step, v.step])
        state["dot"].set_data([v.step], [float(v.imbalance[v.step - 1])])
        state["imb_title"].set_text(f"imbalance {float(v.imbalance[v.step - 1]):.2f} at step {v.step}")
        loss = f"task loss {v.main_loss:.3f}"
        if v.balance != "none":
            loss += f" (unbalanced {v.main_loss_none:.3f})"
        state["head"].set_text(f"{LABELS[v.balance]}, step {v.step} of {len(v.imbalance)}: {loss}")
        canvas.restore_region(state["background"])
        for artist in state["moving"]:
            fig.draw_artist(artist)
        return np.array(canvas.buffer_rgba())  # a copy: the canvas is reused for the next frame

    update(view)
    return update


def routing_explorer(full: bool = False) -> Explorer:
    """Sliders over the routing view.

    ``full=False`` (the static grid): balancing method, training step and capacity factor, with
    ``E = 8``, ``K = 2`` and strength 1 fixed: 27 precomputed frames. ``full=True`` (live): all six sliders.

    >>> routing_explorer().grid_size, len(routing_explorer(full=True).params)
    (27, 6)
    """
    balance = Param("balance", list(BALANCE), label="balancing", fmt=LABELS.get)
    step = Param("step", SHOWN_STEPS if not full else [1, 10, 20, 50, 100, STEPS], label="step", default=STEPS,
                 step=1)
    cf = Param("capacity_factor", CAPACITY_FACTORS if not full else [0.5, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
               label="capacity c", default=1.25, step=0.05)
    if full:
        params = [Param("E", [4, 8, 12, 16], label="experts E", default=8, step=1), Param("K", [1, 2, 3, 4],
                  label="top-K", default=2), balance, step, cf,
                  Param("strength", [0.0, 0.5, 1.0, 2.0, 3.0], label="strength", default=1.0, step=0.1)]

        def compute(**kw):
            kw["K"] = min(kw["K"], kw["E"])
            return routing_view(**kw)
    else:
        params = [balance, step, cf]

        def compute(**kw):
            return routing_view(E=8, K=2, strength=1.0, **kw)

    return Explorer(compute, draw_routing, params, figsize=(7.4, 3.4), title="routing explorer")


def show_routing(mode: str = "auto", progress: bool = False):
    """All six sliders live where a kernel runs (Colab, or ``mode="live"``); the 27-frame static view elsewhere."""
    if mode not in ("auto", "live", "static"):
        raise ValueError(f"mode must be 'auto', 'live' or 'static', got {mode!r}")
    if mode == "auto":
        mode = "live" if on_colab() or not has_stack() else "static"
    return routing_explorer(full=mode == "live").show(mode, progress=progress)
