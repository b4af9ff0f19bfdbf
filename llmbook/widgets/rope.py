"""The RoPE widget: one rotating pair, the score against distance, and every pair's wavelength.

Sliders: the position offset (where the query sits), the frequency pair ``j`` to look at, and the
context-extension method and factor (none, position interpolation, NTK-aware, YaRN). Three panels:

1. the 2-D pair ``j`` of a query at position 0 and at the offset, on the unit circle, with the range of
   angles the unscaled model saw in training (shaded) and the range the scaled pair reaches at the
   target length (the outer arc);
2. the score of a fixed query and key against their distance, for query and key both shifted by the
   offset (the curve does not move: RoPE is relative), unscaled in grey and scaled in colour;
3. the wavelength ``2 pi / theta_j`` of every pair against the training and target lengths.

:func:`rope_view` is the pure computation (tested in ``tests/widgets/test_rope.py``); it calls
:mod:`llmbook.lm.positions` and :mod:`llmbook.lm.context_extension` and holds no math of its own.
:func:`rope_explorer` wraps it in an :class:`~llmbook.widgets.explorer.Explorer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmbook._checks import check_choice, check_int, check_nonnegative_int, check_positive_int, check_range
from llmbook.lm.context_extension import scaled_inv_freq, unseen_angle_pairs
from llmbook.lm.rope import apply_rope, rope_cos_sin, rope_inv_freq
from llmbook.widgets.explorer import Explorer, Param

__all__ = ["METHOD_LABELS", "OFFSETS", "PAIRS", "FACTORS", "RopeView", "rope_view", "draw_rope", "rope_explorer"]

#: Context-extension methods offered by the widget (keys of :func:`~llmbook.lm.context_extension.scaled_inv_freq`).
METHOD_LABELS = {"none": "none", "pi": "PI", "ntk": "NTK-aware", "yarn": "YaRN"}
#: Static grid (3 x 2 x 4 x 2 = 48 frames).
OFFSETS = [0, 6, 600]
PAIRS = [6, 26]
FACTORS = [4.0, 16.0]


@dataclass
class RopeView:
    """Everything the widget draws for one setting."""

    offset: int
    pair: int
    method: str
    factor: float
    L_train: int
    L_target: int
    theta: float  # the (scaled) frequency of the chosen pair, radians per token
    angle: float  # offset * theta: the rotation of the pair at the offset
    pair_at_0: torch.Tensor  # (2,) the pair of the query at position 0
    pair_at_offset: torch.Tensor  # (2,) the same pair after apply_rope at position offset
    seen_angle: float  # largest angle of this pair seen in training (unscaled, capped at 2 pi)
    reached_angle: float  # largest angle this pair reaches at the target length with the scaling
    distances: torch.Tensor  # (N,) relative distances n - m
    scores: torch.Tensor  # (N,) score of q at offset and k at offset + distance, scaled frequencies
    scores_unscaled: torch.Tensor  # (N,) the same without scaling
    wavelengths: torch.Tensor  # (D/2,) 2 pi / theta_j', scaled
    wavelengths_unscaled: torch.Tensor  # (D/2,)
    unseen: int  # pairs that reach angles never seen in training
    attention_factor: float


def _scores(q: torch.Tensor, k: torch.Tensor, offset: int, distances: torch.Tensor, inv_freq: torch.Tensor,
            attention_factor: float) -> torch.Tensor:
    """q at position ``offset``, k at ``offset + distance``: one dot product per distance (float64 angles)."""
    D = q.shape[0]
    cos_q, sin_q = rope_cos_sin(torch.tensor([offset], dtype=torch.float64), D, inv_freq=inv_freq.double(),
                                dtype=torch.float64)
    cos_k, sin_k = rope_cos_sin(offset + distances.double(), D, inv_freq=inv_freq.double(), dtype=torch.float64)
    q_rot = apply_rope(q[None], cos_q, sin_q)[0]
    k_rot = apply_rope(k.expand(len(distances), D), cos_k, sin_k)
    return attention_factor ** 2 * (k_rot @ q_rot) / D


def rope_view(offset: int = 0, pair: int = 6, method: str = "none", factor: float = 4.0, D: int = 64,
              base: float = 10000.0, L_train: int = 2048, n_points: int = 250) -> RopeView:
    r"""The widget's numbers for one slider setting.

    The query and key are fixed at ``q = k = (1, ..., 1)``, so the score divided by ``D`` is the mean of
    :math:`\cos(\Delta\theta_j)` over the pairs: RoPE's long-term decay curve, 1 at distance 0 and
    shrinking with oscillations. Distances are log-spaced from 1 to ``L_target = factor * L_train`` for
    every method (``none`` included, to show what the unscaled model meets there).
    """
    check_choice(method, "method", tuple(METHOD_LABELS))
    D, L_train = check_positive_int(D, "D"), check_positive_int(L_train, "L_train")
    pair = check_int(pair, "pair", low=0, high=D // 2 - 1,
                     what=f"an int in [0, D/2) = [0, {D // 2}), one of the D/2 frequency pairs")
    offset = check_nonnegative_int(offset, "offset (a position)")
    n_points = check_int(n_points, "n_points", low=2)
    check_range(factor, "factor", 1.0)
    L_target = int(round(factor * L_train))
    if L_target < 2:
        raise ValueError(f"L_target = factor * L_train = {factor} * {L_train} must be >= 2 (distances from 1)")
    inv0 = rope_inv_freq(D, base)
    inv, a = scaled_inv_freq(method, D, base, factor, L_train)
    q = torch.ones(D, dtype=torch.float64)
    k = q
    # the pair j of q: channels (j, j + D/2) in the half-split layout
    cos, sin = rope_cos_sin(torch.tensor([0, offset], dtype=torch.float64), D, inv_freq=inv.double(),
                            dtype=torch.float64)
    q_rot = apply_rope(q.expand(2, D), cos, sin)
    h = D // 2
    distances = torch.unique(torch.logspace(0, math.log10(L_target - 1), n_points, dtype=torch.float64).round())
    theta = float(inv[pair])
    return RopeView(
        offset=offset, pair=pair, method=method, factor=float(factor), L_train=L_train, L_target=L_target,
        theta=theta, angle=offset * theta,
        pair_at_0=q_rot[0, [pair, pair + h]], pair_at_offset=q_rot[1, [pair, pair + h]],
        seen_angle=min(L_train * float(inv0[pair]), 2 * math.pi),
        reached_angle=(L_target - 1) * theta,
        distances=distances,
        scores=_scores(q, k, offset, distances, inv, a),
        scores_unscaled=_scores(q, k, offset, distances, inv0, 1.0),
        wavelengths=2 * math.pi / inv.double(), wavelengths_unscaled=2 * math.pi / inv0.double(),
        unseen=int(unseen_angle_pairs(inv, L_train, L_target, base).sum()), attention_factor=a,
    )


def draw_rope(view: RopeView, fig) -> None:
    """Three panels: the rotating pair, the score against distance, the wavelengths."""
    import numpy as np

    ax_rot, ax_score, ax_wave = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1.6, 1.3]})
    label = METHOD_LABELS[view.method]
    # 1. the pair on the circle
    r = float(view.pair_at_0.norm())
    t = np.linspace(0, 2 * np.pi, 200)
    ax_rot.plot(r * np.cos(t), r * np.sin(t), color="#DDDDDD", lw=1)
    phi0 = math.atan2(float(view.pair_at_0[1]), float(view.pair_at_0[0]))
    seen = np.linspace(phi0, phi0 + view.seen_angle, 100)
    ax_rot.fill(np.r_[0, r * np.cos(seen), 0], np.r_[0, r * np.sin(seen), 0], color="#BBBBBB", alpha=0.5, lw=0)
    reach = np.linspace(phi0, phi0 + min(view.reached_angle, 2 * np.pi), 100)
    ax_rot.plot(1.12 * r * np.cos(reach), 1.12 * r * np.sin(reach), color="C3", lw=2)
    for vec, c in ((view.pair_at_0, "#777777"), (view.pair_at_offset, "C0")):
        ax_rot.annotate("", xy=(float(vec[0]), float(vec[1])), xytext=(0, 0),
                        arrowprops=dict(arrowstyle="->", color=c, lw=2))
    ax_rot.set_aspect("equal")
    ax_rot.set_xlim(-1.3 * r, 1.3 * r)
    ax_rot.set_ylim(-1.3 * r, 1.3 * r)
    ax_rot.set_axis_off()
    ax_rot.set_title(f"pair {view.pair}: {view.offset}·θ = {view.angle % (2 * math.pi):.2f} rad", fontsize=9)
    # 2. score against distance
    d = view.distances.numpy()
    ax_score.semilogx(d, view.scores_unscaled.numpy(), color="#999999", lw=1, label="no scaling")
    if view.method != "none":
        ax_score.semilogx(d, view.scores.numpy(), color="C0", lw=1.2, label=label)
    ax_score.axvline(view.L_train, color="C3", ls="--", lw=1)
    ax_score.set_xlabel("relative distance n − m (log)")
    ax_score.set_ylabel("score / D")
    ax_score.set_title(f"offset {view.offset}: curve unchanged", fontsize=9)
    ax_score.legend(loc="lower left", fontsize=7)
    # 3. wavelengths
    j = np.arange(len(view.wavelengths))
    ax_wave.semilogy(j, view.wavelengths_unscaled.numpy(), color="#BBBBBB", lw=1.5)
    ax_wave.semilogy(j, view.wavelengths.numpy(), color="C0", lw=1.5)
    ax_wave.axhline(view.L_train, color="C3", ls="--", lw=1)
    ax_wave.axhline(view.L_target, color="C3", ls=":", lw=1)
    ax_wave.plot([view.pair], [float(view.wavelengths[view.pair])], "o", color="C1")
    ax_wave.set_xlabel("pair j")
    ax_wave.set_ylabel("wavelength (tokens)")
    ax_wave.set_title(f"{label} ×{view.factor:g}: {view.unseen} pairs unseen", fontsize=9)
    fig.tight_layout()


def rope_explorer(D: int = 64, L_train: int = 2048) -> Explorer:
    """Sliders for offset, pair, method and factor over :func:`rope_view` (48 precomputed frames)."""
    return Explorer(
        lambda offset, pair, method, factor: rope_view(offset, pair, method, factor, D=D, L_train=L_train),
        draw_rope,
        [Param("offset", OFFSETS, label="offset m"),
         Param("pair", PAIRS, label="pair j"),
         Param("method", list(METHOD_LABELS), label="method", fmt=METHOD_LABELS.get),
         Param("factor", FACTORS, label="factor s", step=1.0)],
        figsize=(8.4, 2.5),
        dpi=64,
        title="RoPE explorer",
    )
