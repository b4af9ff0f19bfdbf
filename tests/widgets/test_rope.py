"""The RoPE widget's computation, checked against direct float64 calculations and transformers."""

import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmbook.widgets import rope as rw


def test_pair_rotation_is_offset_times_theta():
    v = rw.rope_view(offset=37, pair=6, method="none")
    theta = 10000.0 ** (-2 * 6 / 64)
    assert v.theta == pytest.approx(theta, rel=1e-6)
    c, s = math.cos(37 * theta), math.sin(37 * theta)
    x, y = v.pair_at_0.tolist()
    np.testing.assert_allclose(v.pair_at_offset.numpy(), [c * x - s * y, s * x + c * y], rtol=1e-6, atol=1e-6)
    assert v.pair_at_0.tolist() == [1.0, 1.0]  # q = ones is untouched at position 0


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
    v = rw.rope_view(pair=26, method=method, factor=16.0)
    np.testing.assert_allclose(v.wavelengths.numpy(), 2 * np.pi / inv_ref.double().numpy(), rtol=1e-6)
    assert v.attention_factor == pytest.approx(a_ref)
    assert v.unseen == 0 and v.reached_angle <= v.seen_angle * (1 + 1e-6)


def test_without_scaling_slow_pairs_leave_the_trained_range():
    v = rw.rope_view(pair=26, method="none", factor=16.0)
    assert v.unseen > 0 and v.reached_angle > v.seen_angle
    assert torch.equal(v.scores, v.scores_unscaled)


def test_bad_input():
    with pytest.raises(ValueError, match="method must be one of"):
        rw.rope_view(method="alibi")
    with pytest.raises(ValueError, match="frequency pairs"):
        rw.rope_view(pair=32)


def test_explorer_grid_is_small_and_renders():
    ex = rw.rope_explorer()
    assert ex.grid_size == len(rw.OFFSETS) * len(rw.PAIRS) * len(rw.METHOD_LABELS) * len(rw.FACTORS) <= 60
    png = ex.png(offset=6, pair=26, method="yarn", factor=16.0)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 60_000


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # issue 11: rope_view failed inside torch / math on bad input
        ({"pair": -1}, ValueError, r"pair must be an int in \[0, D/2\) = \[0, 32\), one of the D/2 frequency pairs"),
        ({"pair": 1.5}, TypeError, r"pair must be an int in \[0, D/2\).*, got 1.5 \(float\)"),
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
