"""The routing widget's computation, checked against direct counts of its own routing, and its frames."""

import io
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from PIL import Image

from llmbook.lm.moe_layer import simulate_routing
from llmbook.widgets import explorer
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


@pytest.mark.parametrize("E, K, cf, step", [(8, 2, 1.25, 200), (8, 2, 1.0, 20), (4, 1, 1.1, 1)])
def test_view_counts_match_a_direct_dispatch(E, K, cf, step):
    v = rw.routing_view(E=E, K=K, capacity_factor=cf, step=step, balance="none")
    frac = Fraction(str(cf))
    assert v.capacity == -(-frac.numerator * rw.N_TOKENS * K // (frac.denominator * E))
    sim = simulate_routing(E, K, N=rw.N_TOKENS, steps=rw.STEPS, balance="none")  # the same seeded run
    ids = sim.topk_ids_history[step - 1].numpy()
    keep = brute_force(ids, E, v.capacity)
    load = np.bincount(ids.ravel(), minlength=E)
    np.testing.assert_array_equal(v.load.numpy(), load)
    np.testing.assert_array_equal(v.load.numpy(), sim.load[step - 1].numpy())
    np.testing.assert_array_equal(v.kept.numpy(), np.minimum(load, v.capacity))
    assert v.dropped == int(np.maximum(load - v.capacity, 0).sum()) == int((~keep).sum())
    assert v.dropped_tokens == int((~keep).all(1).sum())
    assert torch.equal(v.imbalance, v.imbalance_none)
    assert math.isclose(float(v.imbalance[step - 1]), load.max() / load.mean(), rel_tol=1e-12)
    assert v.main_loss == v.main_loss_none == float(sim.main_loss[step - 1])


def test_collapse_overflows_capacity_and_balancing_repairs_it():
    start = {b: rw.routing_view(step=1, balance=b) for b in ["none", "aux", "bias"]}
    end = {b: rw.routing_view(step=200, balance=b) for b in ["none", "aux", "bias"]}
    # step 1 is the same routing for all three (nothing has trained yet), and it is near balance
    assert all(torch.equal(v.load, start["none"].load) for v in start.values())
    assert float(start["none"].imbalance[0]) < 2.0
    # without balancing the routing collapses and overflows the capacity; both remedies repair it
    assert end["none"].dropped > 150 > 4 * max(end["aux"].dropped, end["bias"].dropped)
    assert end["none"].dropped > 2 * start["none"].dropped
    for b in ("aux", "bias"):
        assert torch.equal(end[b].imbalance_none, end["none"].imbalance)
        assert float(end[b].imbalance[-20:].mean()) < 1.7 < 3.0 < float(end["none"].imbalance[-20:].mean())
    # strength 0 switches balancing off: the same run as "none"
    assert torch.equal(rw.routing_view(balance="bias", strength=0.0).load, end["none"].load)
    # a capacity of the busiest expert's load drops nothing (Try-it 1 of the chapter)
    assert rw.routing_view(balance="none", capacity_factor=3.5).dropped == 0
    assert rw.routing_view(balance="none", capacity_factor=3.45).dropped > 0


def test_bad_input():
    with pytest.raises(ValueError, match="balance must be one of"):
        rw.routing_view(balance="dropout")
    with pytest.raises(ValueError, match=r"K \(5\) cannot exceed"):
        rw.routing_view(E=4, K=5)
    with pytest.raises(ValueError, match=r"step must lie in \[1, 200\], got 0"):
        rw.routing_view(step=0)
    with pytest.raises(ValueError, match="mode must be"):
        rw.show_routing(mode="web")


def _rgb(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)


def test_static_frames_are_readable_distinct_and_match_a_full_redraw():
    ex = rw.routing_explorer()
    assert ex.grid_size == 27 and [p.name for p in ex.params] == ["balance", "step", "capacity_factor"]
    assert ex.dpi >= explorer.MIN_DPI >= 100
    assert ex.figsize[0] * ex.dpi <= explorer.MAX_DISPLAY_WIDTH_PX  # shown at its natural size on the page
    frames = ex.frames()
    assert len(set(frames.values())) == 27  # no two grid points give the same picture
    first = _rgb(next(iter(frames.values())))
    assert first.shape == (round(ex.figsize[1] * ex.dpi), round(ex.figsize[0] * ex.dpi), 3)
    for values in ({"balance": "none", "step": 200, "capacity_factor": 1.25},
                   {"balance": "bias", "step": 1, "capacity_factor": 2.0}):
        assert ex.smallest_text_pt(**values) >= 9.0
        # the blitted frame against the same view drawn from scratch on a new figure (palette noise aside)
        idx = tuple(p.values.index(values[p.name]) for p in ex.params)
        fig = Figure(figsize=ex.figsize, dpi=ex.dpi)
        rw.draw_routing(rw.routing_view(E=8, K=2, **values), fig)
        full = _rgb(explorer.figure_png(fig, dpi=ex.dpi, tight=False))
        differs = (np.abs(full - _rgb(frames[idx])).max(-1) > 40).mean()
        assert differs < 0.02, differs


def test_live_explorer_redraws_for_another_number_of_experts():
    full = rw.routing_explorer(full=True)
    assert [p.name for p in full.params] == ["E", "K", "balance", "step", "capacity_factor", "strength"]
    a = full.png(E=8, K=2, step=50)
    b = full.png(E=12, K=3, step=50, balance="aux")  # the updater rebuilds the figure for other E, K, balance
    assert a[:8] == b[:8] == b"\x89PNG\r\n\x1a\n" and a != b
    box = rw.show_routing(mode="live")
    assert len(box.children[0].children) == 6
