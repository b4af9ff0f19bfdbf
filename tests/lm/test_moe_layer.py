"""The MoE layer's bias update and the routing simulation (llmbook.lm.moe_layer): claim C13's dynamics.

The equations the layer is built from are tested in test_moe.py against transformers.
"""

import math

import numpy as np
import pytest
import torch

from llmbook.lm.moe import expert_load, load_imbalance
from llmbook.lm.moe_layer import MoELayer, simulate_routing


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_moe_layer_update_bias_moves_against_the_load():
    layer = MoELayer(4, 4, 4, 1, generator=gen(0))
    _, r = layer(torch.randn(1, 16, 4, generator=gen(1)))
    load = expert_load(r.topk_ids, 4)
    layer.update_bias(r, 0.05)
    np.testing.assert_allclose(layer.routing_bias.numpy(), 0.05 * np.sign(load.float().mean().item() - load.numpy()))


def test_claim_C13_routing_collapses_without_balancing_and_not_with_it():
    final = {}
    for balance in ["none", "aux", "bias"]:
        sim = simulate_routing(balance=balance, skew=1.0, seed=0)
        final[balance] = float(sim.imbalance[-20:].mean())
        assert sim.load.shape == (200, 8) and bool((sim.load.sum(-1) == 256 * 2).all())
        assert math.isclose(float(sim.imbalance[-1]), load_imbalance(sim.load[-1]), rel_tol=1e-12)
    assert final["none"] > 3.0, final  # most tokens on two or three of eight experts (4.0 = two experts)
    assert final["aux"] < 1.5 and final["bias"] < 1.5, final


def test_simulation_is_deterministic_and_validates():
    a = simulate_routing(E=4, K=1, N=32, C=4, steps=5, balance="bias", seed=3)
    b = simulate_routing(E=4, K=1, N=32, C=4, steps=5, balance="bias", seed=3)
    assert torch.equal(a.load, b.load) and torch.equal(a.main_loss, b.main_loss) and torch.equal(a.bias, b.bias)
    with pytest.raises(ValueError, match="balance must be one of"):
        simulate_routing(balance="dropout")
    with pytest.raises(ValueError, match=r"K \(5\) cannot exceed"):
        simulate_routing(E=4, K=5)
    with pytest.raises(ValueError, match="load must be a non-empty"):
        load_imbalance(torch.zeros(3))


def test_moe_layer_huge_capacity_factor_and_input_kinds():
    """Issue 11: MoELayer(capacity_factor=1e30) raised OverflowError; int/bool x reached the router's matmul."""
    x = torch.randn(2, 3, 4, generator=gen(0))
    free, huge = MoELayer(4, 8, 4, 2, generator=gen(1)), MoELayer(4, 8, 4, 2, capacity_factor=1e30, generator=gen(1))
    (y_free, _), (y_huge, r_huge) = free(x), huge(x)
    assert bool(r_huge.keep.all()) and r_huge.capacity > 2**63
    torch.testing.assert_close(y_huge, y_free, rtol=0, atol=0)  # an unlimited capacity drops nothing
    for dt in (torch.int64, torch.bool):
        with pytest.raises(TypeError, match=rf"x must be a real floating-point tensor, got dtype {dt}"):
            free(x.to(dt))
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, C\) with C = 4, got \(2, 3, 5\)"):
        free(torch.randn(2, 3, 5))
