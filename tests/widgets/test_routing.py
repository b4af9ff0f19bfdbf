"""The routing widget's computation, checked against direct counts of its own routing."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from llmbook.lm.moe_layer import simulate_routing
from llmbook.widgets import routing as rw


def brute_force(ids, E, capacity):
    """Per expert, accept assignments in GShard order (all first choices, then second ...) until full."""
    used, keep = [0] * E, np.zeros(ids.shape, dtype=bool)
    for k in range(ids.shape[1]):
        for n in range(ids.shape[0]):
            e = int(ids[n, k])
            if used[e] < capacity:
                used[e] += 1
                keep[n, k] = True
    return keep


@pytest.mark.parametrize("E, K, cf, skew", [(8, 2, 1.25, 2.0), (8, 2, 1.0, 1.0), (4, 1, 1.1, 0.0)])
def test_view_counts_match_a_direct_dispatch(E, K, cf, skew):
    v = rw.routing_view(E=E, K=K, capacity_factor=cf, skew=skew, balance="none")
    frac = Fraction(str(cf))
    assert v.capacity == -(-frac.numerator * rw.N_TOKENS * K // (frac.denominator * E))
    sim = simulate_routing(E, K, N=rw.N_TOKENS, skew=skew, balance="none")  # the same seeded run
    ids = sim.topk_ids.numpy()
    keep = brute_force(ids, E, v.capacity)
    load = np.bincount(ids.ravel(), minlength=E)
    np.testing.assert_array_equal(v.load.numpy(), load)
    np.testing.assert_array_equal(v.kept.numpy(), np.minimum(load, v.capacity))
    assert v.dropped == int(np.maximum(load - v.capacity, 0).sum()) == int((~keep).sum())
    assert v.dropped_tokens == int((~keep).all(1).sum())
    np.testing.assert_array_equal(v.token_ids.numpy(), ids[rw.SHOWN_TOKENS])
    np.testing.assert_array_equal(v.token_keep.numpy(), keep[rw.SHOWN_TOKENS])
    np.testing.assert_allclose(v.token_weights.sum(-1).numpy(), 1.0, rtol=0, atol=1e-12)
    assert torch.equal(v.imbalance, v.imbalance_none)
    assert math.isclose(float(v.imbalance[-1]), load.max() / load.mean(), rel_tol=1e-12)


def test_skewed_router_overflows_and_balancing_repairs_it():
    none = rw.routing_view(skew=1.0, balance="none", capacity_factor=1.25)
    aux = rw.routing_view(skew=1.0, balance="aux", capacity_factor=1.25)
    bias = rw.routing_view(skew=1.0, balance="bias", capacity_factor=1.25)
    assert none.dropped > 100  # collapsed onto a few experts, far beyond capacity
    assert aux.dropped < none.dropped / 4 and bias.dropped < none.dropped / 4
    for v in (aux, bias):
        assert torch.equal(v.imbalance_none, none.imbalance)
        assert float(v.imbalance[-20:].mean()) < 1.5 < 3.0 < float(none.imbalance[-20:].mean())
    # strength 0 switches balancing off: the same run as "none"
    assert torch.equal(rw.routing_view(skew=1.0, balance="bias", strength=0.0).load, none.load)
    # a generous capacity drops nothing
    assert rw.routing_view(skew=1.0, balance="none", capacity_factor=4.0).dropped == 0


def test_bad_input():
    with pytest.raises(ValueError, match="balance must be one of"):
        rw.routing_view(balance="dropout")
    with pytest.raises(ValueError, match=r"K \(5\) cannot exceed"):
        rw.routing_view(E=4, K=5)
    with pytest.raises(ValueError, match="mode must be"):
        rw.show_routing(mode="web")


def test_explorers_grid_frame_and_live_view():
    static = rw.routing_explorer()
    assert static.grid_size == 27 <= 60
    assert [p.name for p in static.params] == ["skew", "capacity_factor", "balance"]
    assert static.png(skew=1.0, capacity_factor=2.0, balance="aux")[:8] == b"\x89PNG\r\n\x1a\n"
    full = rw.routing_explorer(full=True)
    assert [p.name for p in full.params] == ["E", "K", "capacity_factor", "skew", "balance", "strength"]
    box = rw.show_routing(mode="live")
    assert len(box.children[0].children) == 6
