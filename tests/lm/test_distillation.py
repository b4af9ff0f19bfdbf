"""Chapter 7, distillation: 07.09 knowledge distillation, 07.10 hidden-state distillation.

Tolerances, stated once:

* float64 against torch.nn.functional / torch.nn / autograd / a float64 closed form:
  ``rtol = atol = 1e-12`` (``F64``);
* the high-temperature limit, an approximation of order 1/T: relative ``1e-2`` at T = 1000.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from llmbook.lm.distillation import distillation_loss, hidden_state_distillation_loss, uniform_layer_map

F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def logits(*shape, seed=0, scale=3.0):
    return scale * torch.randn(*shape, generator=gen(seed), dtype=torch.float64)


def kd_reference(z_S, z_T, T, reduction="batchmean"):
    return F.kl_div(F.log_softmax(z_S / T, -1), F.softmax(z_T / T, -1), reduction=reduction) * T**2


# ================================================================= 07.09 knowledge distillation


@pytest.mark.equation("07.09", oracle="torch.nn.functional.kl_div(log_softmax(z_S/T), softmax(z_T/T), "
                                      "reduction='batchmean') * T^2")
@pytest.mark.parametrize("T", [0.5, 1.0, 2.0, 8.0])
def test_distillation_loss_matches_kl_div(T):
    z_S, z_T = logits(12, 9, seed=1), logits(12, 9, seed=2)
    torch.testing.assert_close(distillation_loss(z_S, z_T, tau=T), kd_reference(z_S, z_T, T), **F64)
    torch.testing.assert_close(distillation_loss(z_S, z_T, tau=T, reduction="sum"),
                               kd_reference(z_S, z_T, T, "sum"), **F64)
    torch.testing.assert_close(distillation_loss(z_S, z_T, tau=T, reduction="none"),
                               kd_reference(z_S, z_T, T, "none").sum(-1), **F64)
    # (B, T, V) logits: "mean" averages over every position, kl_div's batchmean over the flattened rows
    z3_S, z3_T = logits(2, 5, 9, seed=3), logits(2, 5, 9, seed=4)
    torch.testing.assert_close(distillation_loss(z3_S, z3_T, tau=T),
                               kd_reference(z3_S.reshape(10, 9), z3_T.reshape(10, 9), T), **F64)


@pytest.mark.equation("07.09", oracle="torch.autograd: the gradient T (p_S - p_T) per row")
def test_distillation_gradient_is_t_times_the_probability_gap():
    T = 4.0
    z_S, z_T = logits(6, 7, seed=5).requires_grad_(), logits(6, 7, seed=6)
    distillation_loss(z_S, z_T, tau=T, reduction="sum").backward()
    expected = T * (torch.softmax(z_S.detach() / T, -1) - torch.softmax(z_T / T, -1))
    torch.testing.assert_close(z_S.grad, expected, **F64)


def test_high_temperature_distillation_matches_centred_logits():
    """Hinton et al.: as T grows, T^2 KL -> (1/2V) sum_i ((z_S - mean z_S) - (z_T - mean z_T))_i^2."""
    z_S, z_T = logits(5, 10, seed=7), logits(5, 10, seed=8)
    V = 10
    centred = (z_S - z_S.mean(-1, keepdim=True)) - (z_T - z_T.mean(-1, keepdim=True))
    limit = centred.square().sum(-1) / (2 * V)
    np.testing.assert_allclose(distillation_loss(z_S, z_T, tau=1000.0, reduction="none").numpy(), limit.numpy(),
                               rtol=1e-2)


@SETTINGS
@given(seed=st.integers(0, 1000), T=st.floats(0.1, 20.0))
def test_distillation_loss_is_nonnegative_and_zero_only_for_the_teacher(seed, T):
    z_S, z_T = logits(4, 6, seed=seed), logits(4, 6, seed=seed + 1)
    assert bool((distillation_loss(z_S, z_T, tau=T, reduction="none") >= -1e-12).all())
    # shifting every logit of a row by a constant changes nothing: the student then equals the teacher
    assert distillation_loss(z_T + 3.0, z_T, tau=T).item() == pytest.approx(0.0, abs=1e-12)


def test_distillation_loss_handles_masked_teacher_logits():
    z_T = torch.tensor([[0.0, -math.inf, 1.0]], dtype=torch.float64)
    z_S = torch.tensor([[0.5, 2.0, 0.0]], dtype=torch.float64)
    ref = kd_reference(z_S, z_T, 2.0)  # kl_div treats 0 * log 0 as 0, as we do
    torch.testing.assert_close(distillation_loss(z_S, z_T, tau=2.0), ref, **F64)


def test_distillation_loss_rejects_bad_input():
    z = logits(2, 3)
    with pytest.raises(ValueError, match="must have the same shape"):
        distillation_loss(z, logits(2, 4))
    with pytest.raises(ValueError, match=r"tau must lie in \(0.0, inf\)"):
        distillation_loss(z, z, tau=0.0)
    with pytest.raises(TypeError, match="share one dtype"):
        distillation_loss(z, z.float())
    with pytest.raises(ValueError, match="NaN"):
        distillation_loss(z, torch.full((2, 3), math.nan, dtype=torch.float64))


# ================================================================= 07.10 hidden-state distillation


def states(L, d, seed, B=2, T=5):
    return [torch.randn(B, T, d, generator=gen(seed + l), dtype=torch.float64) for l in range(L)]


@pytest.mark.equation("07.10", oracle="torch.nn.MSELoss on the projected states, summed over layers; numpy einsum")
def test_hidden_state_distillation_matches_mse_on_projected_states():
    H_S, H_T = states(4, 6, seed=10), states(12, 8, seed=20)
    W = [torch.randn(6, 8, generator=gen(30 + l), dtype=torch.float64) for l in range(4)]
    m = [2, 5, 8, 11]
    mse, sse = nn.MSELoss(), nn.MSELoss(reduction="sum")
    expected_mean = sum(mse(H_S[l] @ W[l], H_T[m[l]]) for l in range(4))
    torch.testing.assert_close(hidden_state_distillation_loss(H_S, H_T, W), expected_mean, **F64)
    per_layer = torch.stack([mse(H_S[l] @ W[l], H_T[m[l]]) for l in range(4)])
    torch.testing.assert_close(hidden_state_distillation_loss(H_S, H_T, W, reduction="none"), per_layer, **F64)
    total = sum(float(np.sum((np.einsum("btd,de->bte", H_S[l].numpy(), W[l].numpy()) - H_T[m[l]].numpy()) ** 2))
                for l in range(4))
    assert hidden_state_distillation_loss(H_S, H_T, W, reduction="sum").item() == pytest.approx(total, rel=1e-12)
    assert sse(H_S[0] @ W[0], H_T[2]).item() == pytest.approx(
        hidden_state_distillation_loss(H_S[:1], H_T[2:3], W[:1], reduction="sum").item(), rel=1e-12)
    # a stacked tensor is the same as a list, and an explicit map overrides the uniform one
    torch.testing.assert_close(hidden_state_distillation_loss(torch.stack(H_S), torch.stack(H_T), torch.stack(W)),
                               expected_mean, **F64)
    torch.testing.assert_close(hidden_state_distillation_loss(H_S, H_T, W, layer_map=[0, 0, 1, 1]),
                               sum(mse(H_S[l] @ W[l], H_T[l // 2]) for l in range(4)), **F64)


@pytest.mark.equation("07.10", oracle="torch.autograd: d/dW ||H W - H_T||^2 = 2 H^T (H W - H_T)")
def test_the_projection_receives_the_gradient():
    H_S, H_T = states(1, 3, seed=40), states(1, 4, seed=50)
    W = torch.randn(3, 4, generator=gen(60), dtype=torch.float64, requires_grad=True)
    hidden_state_distillation_loss(H_S, H_T, [W], reduction="sum").backward()
    H, R = H_S[0].reshape(-1, 3), H_T[0].reshape(-1, 4)
    torch.testing.assert_close(W.grad, 2 * H.T @ (H @ W.detach() - R), **F64)


def test_uniform_layer_map_is_tinybert_s():
    assert uniform_layer_map(4, 12) == [2, 5, 8, 11]
    assert uniform_layer_map(6, 12) == [1, 3, 5, 7, 9, 11]
    assert uniform_layer_map(3, 3) == [0, 1, 2]
    assert uniform_layer_map(5, 12)[-1] == 11


def test_hidden_state_distillation_rejects_bad_input():
    H_S, H_T = states(2, 6, seed=1), states(4, 8, seed=2)
    with pytest.raises(ValueError, match="pass W to project"):
        hidden_state_distillation_loss(H_S, H_T)
    with pytest.raises(ValueError, match=r"W\[0\] must have shape \(6, 8\)"):
        hidden_state_distillation_loss(H_S, H_T, [torch.zeros(6, 7, dtype=torch.float64)] * 2)
    with pytest.raises(ValueError, match="one projection per student layer"):
        hidden_state_distillation_loss(H_S, H_T, [torch.zeros(6, 8, dtype=torch.float64)])
    with pytest.raises(ValueError, match="layer_map must name one teacher layer per student layer"):
        hidden_state_distillation_loss(H_S, H_S, layer_map=[0])
    with pytest.raises(ValueError, match=r"layer_map\[l\] must be an int in \[0, 1\]"):
        hidden_state_distillation_loss(H_S, H_S, layer_map=[0, 2])
    with pytest.raises(ValueError, match="L_S <= L_T"):
        hidden_state_distillation_loss(H_T, H_S, [torch.zeros(8, 6, dtype=torch.float64)] * 4)
    with pytest.raises(TypeError, match="sequence of tensors"):
        hidden_state_distillation_loss("abc", H_T)
    with pytest.raises(ValueError, match="at least one layer"):
        hidden_state_distillation_loss([], H_T)
