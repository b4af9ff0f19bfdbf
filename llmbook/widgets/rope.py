"""The RoPE widget: the pairs as clock hands, the score against distance, and every pair's wavelength.

Sliders: the position ``m`` of the query (the offset), the context-extension method (none, position
interpolation, NTK-aware, YaRN) and its factor ``s``. Three panels:

1. a clock with one hand per frequency pair (pairs ``j = 0, 4, ..., 28``, fast outside, slow inside):
   each hand is that pair of a query after :func:`~llmbook.lm.rope.apply_rope` at position ``m``, so it
   has turned by :math:`m\\theta_j'`. Behind each hand, the ring is grey over the angles the unscaled model
   saw in training (:math:`[0, L_{train}\\theta_j]`, the whole ring once a pair completed a turn) and red
   over the angles the scaled pair reaches at the target length but training never showed;
2. the score of a fixed query and key against their distance, for query and key both shifted to the
   position ``m`` (the curve does not move: RoPE is relative), unscaled in grey and scaled in colour;
3. the wavelength ``2 pi / theta_j`` of every pair against the training and target lengths, with the
   clock's pairs marked in their hands' colours.

Every frame shows a visible rotation: at each offset of :data:`OFFSETS` some hand has turned by at least
:data:`MIN_VISIBLE_ANGLE` (the tests check it for every frame). :func:`rope_view` is the pure computation
(tested in ``tests/widgets/test_rope.py``); it calls :mod:`llmbook.lm.rope` and
:mod:`llmbook.lm.context_extension` and holds no math of its own. :func:`draw_rope` draws a view and
returns an updater, so the explorer renders all frames on one figure. :func:`rope_explorer` wraps both
in an :class:`~llmbook.widgets.explorer.Explorer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from llmbook._checks import check_choice, check_int, check_nonnegative_int, check_positive_int, check_range
from llmbook.lm.context_extension import scaled_inv_freq, unseen_angle_pairs
from llmbook.lm.rope import apply_rope, rope_cos_sin, rope_inv_freq
from llmbook.widgets.explorer import Explorer, Param

__all__ = ["METHOD_LABELS", "OFFSETS", "PAIRS", "FACTORS", "MIN_VISIBLE_ANGLE", "RopeView", "rope_view",
           "draw_rope", "rope_explorer"]

#: Context-extension methods offered by the widget (keys of :func:`~llmbook.lm.context_extension.scaled_inv_freq`).
METHOD_LABELS = {"none": "none", "pi": "PI", "ntk": "NTK-aware", "yarn": "YaRN"}
#: The static grid has 6 positions x 4 methods x 2 factors = 48 frames. They reach 32 000, inside the target
#: length 16 * 2048 = 32 768 of the larger factor; with the smaller factor (target 8192) position 32 000 lies
#: beyond the target, and the clock's title says so. At position 10 PI x16 still turns pair 0 by 0.63 rad.
OFFSETS = [10, 100, 1000, 4000, 8000, 32000]
FACTORS = [4.0, 16.0]
#: The pairs drawn as clock hands (for D = 64 their wavelengths run from 6 to about 11 000 tokens).
PAIRS = (0, 4, 8, 12, 16, 20, 24, 28)
#: A rotation smaller than this (radians, about 17 degrees, away from a whole number of turns) is hard to see.
MIN_VISIBLE_ANGLE = 0.3


@dataclass
class RopeView:
    """Everything the widget draws for one setting. ``P`` is the number of clock pairs."""

    offset: int
    method: str
    factor: float
    L_train: int
    L_target: int
    pairs: tuple[int, ...]  # (P,) the pairs drawn as hands, fast to slow
    thetas: torch.Tensor  # (P,) their (scaled) frequencies theta_j', radians per token
    angles: torch.Tensor  # (P,) offset * theta_j': how far each hand has turned (not reduced mod 2 pi)
    hands_at_0: torch.Tensor  # (P, 2) pair j of the query (1, 0) at position 0
    hands_at_offset: torch.Tensor  # (P, 2) the same pairs after apply_rope at position offset
    seen_angles: torch.Tensor  # (P,) largest angle each pair saw in training (unscaled, capped at 2 pi)
    reached_angles: torch.Tensor  # (P,) largest angle each pair reaches at the target length with the scaling
    distances: torch.Tensor  # (N,) relative distances n - m
    scores: torch.Tensor  # (N,) score / D of q at offset and k at offset + distance, scaled frequencies
    scores_unscaled: torch.Tensor  # (N,) the same without scaling
    wavelengths: torch.Tensor  # (D/2,) 2 pi / theta_j', scaled
    wavelengths_unscaled: torch.Tensor  # (D/2,)
    unseen: int  # pairs (of all D/2) that reach angles never seen in training
    attention_factor: float

    @property
    def visible_turn(self) -> float:
        """The largest rotation of any hand, measured from the nearest whole turn (radians, in [0, pi])."""
        r = torch.remainder(self.angles, 2 * math.pi)
        return float(torch.minimum(r, 2 * math.pi - r).max())


def _scores(q: torch.Tensor, k: torch.Tensor, offset: int, distances: torch.Tensor, inv_freq: torch.Tensor,
            attention_factor: float) -> torch.Tensor:
    """q at position ``offset``, k at ``offset + distance``: score / D per distance (float64 angles)."""
    D = q.shape[0]
    cos_q, sin_q = rope_cos_sin(torch.tensor([offset], dtype=torch.float64), D, inv_freq=inv_freq.double(),
                                dtype=torch.float64)
    cos_k, sin_k = rope_cos_sin(offset + distances, D, inv_freq=inv_freq.double(), dtype=torch.float64)
    q_rot = apply_rope(q[None], cos_q, sin_q)[0]
    k_rot = apply_rope(k.expand(len(distances), D), cos_k, sin_k)
    return attention_factor ** 2 * (k_rot @ q_rot) / D


@lru_cache(maxsize=64)
def _curves(offset: int, method: str, factor: float, D: int, base: float, L_train: int, n_points: int):
    """The decay curves of one setting (cached: the live explorer asks again for the same curves)."""
    L_target = int(round(factor * L_train))
    inv0 = rope_inv_freq(D, base)
    inv, a = scaled_inv_freq(method, D, base, factor, L_train)
    ones = torch.ones(D, dtype=torch.float64)
    distances = torch.unique(torch.logspace(0, math.log10(L_target - 1), n_points, dtype=torch.float64).round())
    scores = _scores(ones, ones, offset, distances, inv, a)
    unscaled = scores if method == "none" else _scores(ones, ones, offset, distances, inv0, 1.0)
    return inv0, inv, a, distances, scores, unscaled


def rope_view(offset: int = 1000, method: str = "none", factor: float = 4.0, D: int = 64, base: float = 10000.0,
              L_train: int = 2048, pairs: tuple[int, ...] = PAIRS, n_points: int = 200) -> RopeView:
    r"""The widget's numbers for one slider setting.

    The hands are the pairs of the query :math:`q = (1, \dots, 1, 0, \dots, 0)` (half-split layout: every
    pair starts at angle 0) rotated to position ``offset``. The score curve uses ``q = k = (1, ..., 1)``,
    so the score divided by ``D`` is the mean of :math:`\cos(\Delta\theta_j)` over the pairs: RoPE's
    long-term decay curve, 1 at distance 0 and shrinking with oscillations. Distances are log-spaced from
    1 to ``L_target = factor * L_train`` for every method (``none`` included, to show what the unscaled
    model meets there).

    >>> v = rope_view(offset=100, method="pi", factor=4.0)
    >>> v.L_target, v.pairs[:3], round(float(v.angles[0]), 2)  # PI: pair 0 turns by 100 / 4 radians
    (8192, (0, 4, 8), 25.0)
    """
    check_choice(method, "method", tuple(METHOD_LABELS))
    D, L_train = check_positive_int(D, "D"), check_positive_int(L_train, "L_train")
    if not pairs:
        raise ValueError("pairs must name at least one frequency pair")
    pairs = tuple(check_int(j, "pair", low=0, high=D // 2 - 1,
                            what=f"an int in [0, D/2) = [0, {D // 2}), one of the D/2 frequency pairs")
                  for j in pairs)
    offset = check_nonnegative_int(offset, "offset (a position)")
    n_points = check_int(n_points, "n_points", low=2)
    check_range(factor, "factor", 1.0)
    L_target = int(round(factor * L_train))
    if L_target < 2:
        raise ValueError(f"L_target = factor * L_train = {factor} * {L_train} must be >= 2 (distances from 1)")
    inv0, inv, a, distances, scores, unscaled = _curves(offset, method, float(factor), D, float(base), L_train,
                                                        n_points)
    # the hands: the query (1, 0) in every pair, rotated by apply_rope to positions 0 and offset
    h = D // 2
    q = torch.cat([torch.ones(h, dtype=torch.float64), torch.zeros(h, dtype=torch.float64)])
    cos, sin = rope_cos_sin(torch.tensor([0, offset], dtype=torch.float64), D, inv_freq=inv.double(),
                            dtype=torch.float64)
    q_rot = apply_rope(q.expand(2, D), cos, sin)
    idx = torch.tensor(pairs)
    thetas = inv.double()[idx]
    return RopeView(
        offset=offset, method=method, factor=float(factor), L_train=L_train, L_target=L_target, pairs=pairs,
        thetas=thetas, angles=offset * thetas,
        hands_at_0=torch.stack([q_rot[0, idx], q_rot[0, idx + h]], -1),
        hands_at_offset=torch.stack([q_rot[1, idx], q_rot[1, idx + h]], -1),
        seen_angles=torch.clamp(L_train * inv0.double()[idx], max=2 * math.pi),
        reached_angles=(L_target - 1) * thetas,
        distances=distances, scores=scores, scores_unscaled=unscaled,
        wavelengths=2 * math.pi / inv.double(), wavelengths_unscaled=2 * math.pi / inv0.double(),
        unseen=int(unseen_angle_pairs(inv, L_train, L_target, base).sum()), attention_factor=a,
    )


def _short(n: float) -> str:
    """1, 10, 100, 1k, 10k, 100k, 1M: tick labels without mathtext (fast to draw)."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:g}{suffix}"
    return f"{n:g}"


def _arc(r: float, a0: float, a1: float, n: int = 60):
    import numpy as np

    t = np.linspace(a0, a1, n)
    return r * np.cos(t), r * np.sin(t)


def _angle_text(a: float) -> str:
    return f"{a / (2 * math.pi):.1f} turns" if a >= 2 * math.pi else f"{a:.2g} rad"


def draw_rope(view: RopeView, fig):
    """Three panels: the hands of the clock, the score against distance, the wavelengths.

    Returns an updater ``update(view)`` that moves the artists to another view of the same ``D`` and pairs.
    On an Agg canvas the updater renders the frame itself and returns its pixels: the background (all
    but the hands and the clock's title) is drawn once per method and factor and cached, and the hands are
    blitted onto it.
    """
    import matplotlib
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.patches import Wedge
    from matplotlib.ticker import FixedLocator, NullLocator

    gs = fig.add_gridspec(2, 2, width_ratios=[1.0, 1.25], height_ratios=[1, 1])
    ax_rot = fig.add_subplot(gs[:, 0])
    ax_wave = fig.add_subplot(gs[0, 1])
    ax_score = fig.add_subplot(gs[1, 1])
    P = len(view.pairs)
    cmap = matplotlib.colormaps["viridis"]
    colours = [cmap(0.8 * k / max(P - 1, 1)) for k in range(P)]
    radii = [1.0 - 0.7 * k / max(P - 1, 1) for k in range(P)]
    ring_w = 0.6 * 0.7 / max(P - 1, 1)

    # 1. the clock: per pair a faint ring, the seen wedge (grey), the unseen reach (red), the hand
    unseen_lines, hands, tips = [], [], []
    for k in range(P):
        r = radii[k]
        ax_rot.add_patch(Wedge((0, 0), r + ring_w / 2, 0, 360, width=ring_w, color="#F2F2F2", lw=0))
        seen_deg = math.degrees(float(view.seen_angles[k]))
        ax_rot.add_patch(Wedge((0, 0), r + ring_w / 2, 0, seen_deg, width=ring_w, color="#C8C8C8", lw=0))
        (line,) = ax_rot.plot([], [], color="#CC3311", lw=3.2, solid_capstyle="butt")
        unseen_lines.append(line)
        (hand,) = ax_rot.plot([0, r], [0, 0], color=colours[k], lw=1.6)
        (tip,) = ax_rot.plot([r], [0], "o", color=colours[k], ms=5)
        hands.append(hand)
        tips.append(tip)
    ax_rot.plot([0], [0], "o", color="black", ms=3)
    ax_rot.set_aspect("equal")
    ax_rot.set_xlim(-1.1, 1.1)
    ax_rot.set_ylim(-1.22, 1.1)
    ax_rot.set_axis_off()
    rot_title = ax_rot.set_title("", fontsize=10)
    ax_rot.text(0, -1.2, f"outer ring pair {view.pairs[0]}, inner pair {view.pairs[-1]}; grey: seen in\n"
                f"training, red: reached only at the target length", ha="center", va="bottom", fontsize=9)

    # 2. wavelengths
    j = np.arange(len(view.wavelengths))
    ax_wave.semilogy(j, view.wavelengths_unscaled.numpy(), color="#BBBBBB", lw=1.5)
    (wave,) = ax_wave.semilogy(j, view.wavelengths.numpy(), color="#0077BB", lw=1.5)
    ax_wave.axhline(view.L_train, color="#CC3311", ls="--", lw=1)
    target_line = ax_wave.axhline(view.L_target, color="#CC3311", ls=":", lw=1.2)
    marks = ax_wave.scatter(list(view.pairs), view.wavelengths[list(view.pairs)].numpy(), c=colours, s=22,
                            zorder=3)
    yt = [10.0 ** e for e in range(1, 7)]
    ax_wave.yaxis.set_major_locator(FixedLocator(yt))
    ax_wave.yaxis.set_minor_locator(NullLocator())
    ax_wave.set_yticks(yt, [_short(v) for v in yt])
    ax_wave.set_ylim(3, 2e6)
    ax_wave.set_xlim(-1, len(j))
    ax_wave.set_ylabel("wavelength")
    ax_wave.set_xlabel("pair j", labelpad=1)
    wave_title = ax_wave.set_title("", fontsize=10)

    # 3. score against distance
    d = view.distances.numpy()
    (score0,) = ax_score.semilogx(d, view.scores_unscaled.numpy(), color="#999999", lw=1, label="no scaling")
    (score,) = ax_score.semilogx(d, view.scores.numpy(), color="#0077BB", lw=1.1, label="scaled")
    ax_score.axvline(view.L_train, color="#CC3311", ls="--", lw=1)
    xt = [1.0, 10.0, 100.0, 1e3, 1e4]
    ax_score.xaxis.set_major_locator(FixedLocator(xt))
    ax_score.xaxis.set_minor_locator(NullLocator())
    ax_score.set_xticks(xt, [_short(v) for v in xt])
    ax_score.set_ylim(-0.45, 1.75)
    ax_score.set_yticks([0, 0.5, 1.0, 1.5])
    ax_score.set_xlabel("distance n − m (log); dashed: L_train", labelpad=1)
    ax_score.set_ylabel("score / D")
    ax_score.set_title("q at m, k at m + Δ: one curve for every m", fontsize=10)
    legend = ax_score.legend(loc="upper right", fontsize=9, handlelength=1.2, borderpad=0.3, labelspacing=0.2)
    legend_line, legend_text = legend.get_lines()[1], legend.get_texts()[1]

    dynamic = [*hands, *tips, rot_title]  # what moves with the position; the rest is a cached background
    blit = isinstance(fig.canvas, FigureCanvasAgg)
    for artist in dynamic:
        artist.set_animated(blit)
    backgrounds = {}

    def move(v: RopeView) -> None:
        """Set every artist's data to the view ``v``."""
        if v.pairs != view.pairs or len(v.wavelengths) != len(view.wavelengths):
            raise ValueError("update needs a view with the same pairs and D as the drawn one")
        label = METHOD_LABELS[v.method]
        for k in range(P):  # the background: what depends on the method and the factor
            seen, reached = float(v.seen_angles[k]), float(v.reached_angles[k])
            if reached > seen * (1 + 1e-6) and seen < 2 * math.pi:
                unseen_lines[k].set_data(*_arc(radii[k], seen, min(reached, 2 * math.pi)))
            else:
                unseen_lines[k].set_data([], [])
        wave.set_ydata(v.wavelengths.numpy())
        target_line.set_ydata([v.L_target, v.L_target])
        marks.set_offsets(np.c_[list(v.pairs), v.wavelengths[list(v.pairs)].numpy()])
        wave_title.set_text(f"{label} ×{v.factor:g}: {v.unseen} of {len(j)} pairs out of range")
        dd = v.distances.numpy()
        score0.set_data(dd, v.scores_unscaled.numpy())
        score.set_data(dd, v.scores.numpy())
        for artist in (score, legend_line, legend_text):
            artist.set_visible(v.method != "none")
        legend_text.set_text(label)
        ax_score.set_xlim(1, v.L_target)
        for k in range(P):  # the moving part: the hands and the clock's title
            x, y = (float(c) for c in v.hands_at_offset[k] / v.hands_at_offset[k].norm() * radii[k])
            hands[k].set_data([0, x], [0, y])
            tips[k].set_data([x], [y])
        fast, slow = float(v.angles[0]), float(v.angles[-1])
        beyond = " (past L_target)" if v.offset >= v.L_target else ""
        rot_title.set_text(f"m = {v.offset}{beyond}: pair {v.pairs[0]} turned\n{_angle_text(fast)}, "
                           f"pair {v.pairs[-1]} {_angle_text(slow)}")

    def update(v: RopeView):
        move(v)
        if not blit:
            return None
        canvas = fig.canvas
        key = (v.method, v.factor, v.L_target)
        if key in backgrounds:
            canvas.restore_region(backgrounds[key])
        else:
            canvas.draw()  # everything but the animated artists
            if len(backgrounds) < 16:  # the static grid has 8; the live sliders may ask for many
                backgrounds[key] = canvas.copy_from_bbox(fig.bbox)
        for artist in dynamic:
            fig.draw_artist(artist)
        return np.asarray(canvas.buffer_rgba())

    move(view)
    fig.tight_layout(pad=0.4, h_pad=0.6, w_pad=0.8)
    return update


def rope_explorer(D: int = 64, L_train: int = 2048) -> Explorer:
    """Sliders for the position, the method and the factor over :func:`rope_view` (48 precomputed frames)."""
    return Explorer(
        lambda offset, method, factor: rope_view(offset, method, factor, D=D, L_train=L_train),
        draw_rope,
        [Param("offset", OFFSETS, label="position m", default=1000),
         Param("method", list(METHOD_LABELS), label="method", fmt=METHOD_LABELS.get),
         Param("factor", FACTORS, label="factor s", step=1.0)],
        figsize=(7.2, 3.7),
        title="RoPE explorer",
    )
