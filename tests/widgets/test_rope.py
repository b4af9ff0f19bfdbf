"""The RoPE widget's computation, checked against direct float64 calculations and transformers."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmbook.widgets import rope as rw
from llmbook.widgets.explorer import MAX_DISPLAY_WIDTH_PX, figure_png, torch_threads


def test_hands_turn_by_position_times_theta():
    v = rw.rope_view(offset=37, method="none")
    theta = 10000.0 ** (-2 * np.array(v.pairs) / 64)  # float64 closed form
    np.testing.assert_allclose(v.thetas.numpy(), theta, rtol=1e-6)
    # the hands start at (1, 0) and end at (cos 37 theta_j, sin 37 theta_j)
    np.testing.assert_allclose(v.hands_at_0.numpy(), np.tile([1.0, 0.0], (len(v.pairs), 1)), atol=0)
    ref = np.stack([np.cos(37 * theta), np.sin(37 * theta)], -1)
    np.testing.assert_allclose(v.hands_at_offset.numpy(), ref, rtol=1e-5, atol=1e-5)
    # position interpolation divides every angle by the factor
    pi = rw.rope_view(offset=400, method="pi", factor=16.0)
    np.testing.assert_allclose(pi.angles.numpy(), 400 * theta / 16, rtol=1e-6)


def test_scores_are_the_mean_cosine_and_do_not_depend_on_the_offset():
    v0 = rw.rope_view(offset=0, method="none", factor=4.0)
    v1 = rw.rope_view(offset=600, method="none", factor=4.0)
    # the model's frequencies are Llama's float32 ones; the angles and cosines are float64
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_theta=10000.0)
    theta = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0].double().numpy()
    ref = np.cos(v0.distances.numpy()[:, None] * theta[None, :]).mean(1)  # q = k = ones: mean of cos
    np.testing.assert_allclose(v0.scores_unscaled.numpy(), ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(v1.scores_unscaled.numpy(), ref, rtol=1e-9, atol=1e-9)
    assert v0.distances[-1] == 4 * 2048 - 1


@pytest.mark.parametrize("method, rope_type", [("pi", "linear"), ("yarn", "yarn")])
def test_wavelengths_follow_transformers_frequencies(method, rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 16.0}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = 2048
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=2048 * 16,
                      rope_parameters=params)
    inv_ref, a_ref = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    v = rw.rope_view(method=method, factor=16.0)
    np.testing.assert_allclose(v.wavelengths.numpy(), 2 * np.pi / inv_ref.double().numpy(), rtol=1e-6)
    assert v.attention_factor == pytest.approx(a_ref)
    slow = v.seen_angles < 2 * math.pi  # fast pairs saw every angle; slow ones stay within what they saw
    assert v.unseen == 0 and bool(slow.any())
    assert bool((v.reached_angles[slow] <= v.seen_angles[slow] * (1 + 1e-6)).all())


def test_without_scaling_slow_pairs_leave_the_trained_range():
    v = rw.rope_view(method="none", factor=16.0)
    slow = 2 * math.pi / v.thetas > 2048  # pairs that never finished a turn in training
    assert v.unseen == 11 and bool(slow.any())
    assert bool((v.reached_angles[slow] > v.seen_angles[slow]).all())
    assert bool((v.seen_angles[~slow] == 2 * math.pi).all())
    assert torch.equal(v.scores, v.scores_unscaled)


def test_bad_input():
    with pytest.raises(ValueError, match="method must be one of"):
        rw.rope_view(method="alibi")
    with pytest.raises(ValueError, match="frequency pairs"):
        rw.rope_view(pairs=(0, 32))
    with pytest.raises(ValueError, match="at least one frequency pair"):
        rw.rope_view(pairs=())


def test_every_frame_shows_a_visible_rotation():
    """Issue 13: no frame of the grid where nothing visibly turns ("0.00 rad")."""
    threads = torch_threads(1)
    try:
        worst = math.inf
        for offset in rw.OFFSETS:
            for method in rw.METHOD_LABELS:
                for factor in rw.FACTORS:
                    v = rw.rope_view(offset, method, factor)
                    # the hands' angles read from the rotated vectors (atan2), independent of v.angles
                    phi = torch.atan2(v.hands_at_offset[:, 1], v.hands_at_offset[:, 0]).abs()
                    worst = min(worst, float(phi.max()))
                    assert v.visible_turn == pytest.approx(float(phi.max()), abs=1e-6)
    finally:
        torch_threads(threads)
    assert worst >= rw.MIN_VISIBLE_ANGLE
    assert 0 not in rw.OFFSETS


def test_explorer_frames_are_readable_small_and_equal_to_a_fresh_drawing():
    ex = rw.rope_explorer()
    assert ex.grid_size == len(rw.OFFSETS) * len(rw.METHOD_LABELS) * len(rw.FACTORS) == 48
    assert ex.dpi >= 100 and ex.figsize[0] * ex.dpi <= MAX_DISPLAY_WIDTH_PX
    first = ex.png(offset=10, method="none", factor=4.0)
    png = ex.png(offset=300, method="yarn", factor=16.0)  # blitted on the cached figure
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 40_000
    image = Image.open(io.BytesIO(png))
    assert image.size == (round(ex.figsize[0] * ex.dpi), round(ex.figsize[1] * ex.dpi)) and image.mode == "P"
    assert ex.smallest_text_pt(offset=300, method="yarn", factor=16.0) >= 9
    # the blitted frame is the frame a new explorer draws from scratch for the same point
    assert png == rw.rope_explorer().png(offset=300, method="yarn", factor=16.0)
    assert first != png
    # and it looks like the figure rendered whole by matplotlib, without blitting
    from matplotlib.figure import Figure

    fig = Figure(figsize=ex.figsize, dpi=ex.dpi)  # no Agg canvas: draw_rope does not blit
    rw.draw_rope(rw.rope_view(300, "yarn", 16.0), fig)
    whole = np.asarray(Image.open(io.BytesIO(figure_png(fig, tight=False, colors=None))).convert("RGB"), float)
    blitted = np.asarray(image.convert("RGB"), float)
    assert whole.shape == blitted.shape and np.abs(whole - blitted).mean() < 3


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # issue 11: rope_view failed inside torch / math on bad input
        ({"pairs": (-1,)}, ValueError,
         r"pair must be an int in \[0, D/2\) = \[0, 32\), one of the D/2 frequency pairs"),
        ({"pairs": (1.5,)}, TypeError, r"pair must be an int in \[0, D/2\).*, got 1.5 \(float\)"),
        ({"D": 0}, ValueError, r"D must be a positive int, got 0"),
        ({"offset": -3}, ValueError, r"offset \(a position\) must be a non-negative int, got -3"),
        ({"offset": 2.5}, TypeError, r"offset \(a position\) must be a non-negative int, got 2.5"),
        ({"factor": 0.5}, ValueError, r"factor must lie in \[1.0, inf\), got 0.5"),
        ({"factor": float("inf")}, ValueError, r"factor must lie in \[1.0, inf\), got inf"),
        ({"L_train": 1, "factor": 1.0}, ValueError, r"L_target = factor \* L_train = 1.0 \* 1 must be >= 2"),
        ({"n_points": 1}, ValueError, r"n_points must be an int >= 2, got 1"),
        ({"method": None}, ValueError, r"method must be one of .*, got None"),
    ],
)
def test_rope_view_rejects_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rw.rope_view(**kwargs)
