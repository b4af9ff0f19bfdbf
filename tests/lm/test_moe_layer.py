"""The MoE layer's bias update and the routing simulation (llmbook.lm.moe_layer): claim C13's dynamics.

The equations the layer is built from are tested in test_moe.py against transformers. The simulation's
hand-written gradients are compared with autograd (float64, ``rtol = 1e-10``, ``atol = 1e-12``).
"""

import math

import numpy as np
import pytest
import torch

from llmbook.lm.moe import expert_load, load_balancing_loss, load_imbalance, top_k_routing
from llmbook.lm.moe_layer import MoELayer, _loss_and_grads, _toy_task, simulate_routing


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_moe_layer_update_bias_moves_against_the_load():
    layer = MoELayer(4, 4, 4, 1, generator=gen(0))
    _, r = layer(torch.randn(1, 16, 4, generator=gen(1)))
    load = expert_load(r.topk_ids, 4)
    layer.update_bias(r, 0.05)
    np.testing.assert_allclose(layer.routing_bias.numpy(), 0.05 * np.sign(load.float().mean().item() - load.numpy()))


def test_claim_C13_routing_collapses_by_training_from_a_near_balanced_start():
    """The chapter's run (seed 0): the collapse is learned, not inherited from the initial router."""
    runs = {b: simulate_routing(balance=b, seed=0) for b in ["none", "aux", "bias"]}
    final = {b: float(run.imbalance[-20:].mean()) for b, run in runs.items()}
    for run in runs.values():
        assert run.load.shape == (200, 8) and bool((run.load.sum(-1) == 256 * 2).all())
        assert math.isclose(float(run.imbalance[-1]), load_imbalance(run.load[-1]), rel_tol=1e-12)
        assert torch.equal(run.load[0], runs["none"].load[0])  # the three runs share their first step
        assert torch.equal(run.topk_ids_history[-1], run.topk_ids)
    free = runs["none"]
    # near balance at step 1: every router probability within 0.03 of 1/8, imbalance of a random assignment
    assert float((free.first_probs - 1 / 8).abs().max()) < 0.03
    assert float(free.imbalance[0]) < 2.0, free.imbalance[0]
    assert final["none"] > 3.0, final  # almost every token has the same expert in its top 2 (4.0 = all of them)
    assert final["aux"] < 1.7 and final["bias"] < 1.7, final
    # the expert that led at step 1 is the one that takes over: the rich get richer
    leader = int(free.load[0].argmax())
    assert int(free.load[-1].argmax()) == leader and int(free.load[-1, leader]) > 200
    # both balanced runs end with a lower task loss than the collapsed one
    assert float(free.main_loss[-1]) > max(float(runs["aux"].main_loss[-1]), float(runs["bias"].main_loss[-1]))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_claim_C13_collapse_is_not_one_lucky_seed(seed):
    """Other seeds: training raises the unbalanced imbalance well above its start and above both remedies."""
    runs = {b: simulate_routing(balance=b, seed=seed) for b in ["none", "aux", "bias"]}
    final = {b: float(run.imbalance[-20:].mean()) for b, run in runs.items()}
    start = float(runs["none"].imbalance[0])
    assert start < 2.0 and final["none"] > start + 0.8 and final["none"] > 2.5, (start, final)
    assert max(final["aux"], final["bias"]) < 1.6 < final["none"], final


def autograd_loss_and_grads(x, target, W_g, r, W, b, K, alpha, balance):
    """The toy MoE's loss through the book's routing functions, differentiated by autograd (float64)."""
    W_g, r, W = (t.clone().requires_grad_() for t in (W_g, r, W))
    probs = torch.softmax(x @ W_g.T + r, -1)
    w, ids = top_k_routing(probs, K, renormalize=K > 1, bias=b if balance == "bias" else None)
    y = torch.einsum("nk,nc,nkcd->nd", w, x, W[ids])
    main = ((y - target) ** 2).mean()
    loss = main + (load_balancing_loss(probs, ids, alpha) if balance == "aux" else 0.0)
    return main, ids, w, torch.autograd.grad(loss, (W_g, r, W))


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("balance", ["none", "aux", "bias"])
def test_simulation_gradients_match_autograd(K, balance):
    """The hand-written gradients of simulate_routing against autograd, at the start and after training."""
    E, N, C = 6, 40, 5
    x, target, W_g, r, W = _toy_task(E, N, C, shared=0.7, noise=1.0, skew=0.5, seed=K)
    g = gen(10 + K)
    for scale in (1.0, 30.0):  # a near-uniform router, then a confident one (as after training)
        W_g_s = W_g * scale + 0.3 * torch.randn(E, C, generator=g, dtype=torch.float64)
        b = 0.05 * torch.randn(E, generator=g, dtype=torch.float64)
        main, _, ids, w, _, grads = _loss_and_grads(x, target, W_g_s, r, W, b, K, 0.7, balance)
        main_ref, ids_ref, w_ref, grads_ref = autograd_loss_and_grads(x, target, W_g_s, r, W, b, K, 0.7, balance)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(main, main_ref.detach(), rtol=1e-12, atol=1e-12)
        for ours, ref in zip(grads, grads_ref, strict=True):
            torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


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
    with pytest.raises(ValueError, match="shared"):
        simulate_routing(shared=1.5)
    with pytest.raises(TypeError, match="seed must be an int"):
        simulate_routing(seed=0.5)
    # runs are cached, yet every call gets its own tensors
    c = simulate_routing(E=4, K=1, N=32, C=4, steps=5, balance="bias", seed=3)
    c.load.zero_()
    assert torch.equal(simulate_routing(E=4, K=1, N=32, C=4, steps=5, balance="bias", seed=3).load, a.load)


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


@pytest.mark.parametrize("seed", range(10))
def test_claim_C13_collapse_relative_to_the_start(seed):
    """The chapter's criterion over ten seeds: the unbalanced imbalance ends >= 1.5 times its start."""
    run = simulate_routing(balance="none", seed=seed)
    start, final = float(run.imbalance[0]), float(run.imbalance[-20:].mean())
    assert start < 2.0 and final > 1.5 * start, (start, final)
    assert int((run.load[-1] < 16).sum()) >= 2  # at least two experts below a quarter of the balanced 64


def test_balance_from_switches_balancing_on_mid_run():
    none = simulate_routing(E=4, K=2, N=32, C=4, steps=30, balance="none", seed=1)
    for balance in ("aux", "bias"):
        always = simulate_routing(E=4, K=2, N=32, C=4, steps=30, balance=balance, seed=1)
        assert torch.equal(simulate_routing(E=4, K=2, N=32, C=4, steps=30, balance=balance, seed=1,
                                            balance_from=0).load, always.load)
        assert torch.equal(simulate_routing(E=4, K=2, N=32, C=4, steps=30, balance=balance, seed=1,
                                            balance_from=30).main_loss, none.main_loss)
        late = simulate_routing(E=4, K=2, N=32, C=4, steps=30, balance=balance, seed=1, balance_from=10)
        assert torch.equal(late.main_loss[:10], none.main_loss[:10])  # before the switch: the unbalanced run
        assert not torch.equal(late.main_loss[10:], none.main_loss[10:])
    with pytest.raises(ValueError, match="balance_from"):
        simulate_routing(steps=5, balance_from=6)
    with pytest.raises(ValueError, match="balance_from"):
        simulate_routing(steps=5, balance_from=1.5)


def test_late_balancing_on_the_chapters_seed():
    """Seed 0, switched on at step 200: the numbers the chapter prints (3.50 -> 1.68 aux, 1.42 bias)."""
    late = {b: simulate_routing(balance=b, seed=0, steps=400, balance_from=200) for b in ("aux", "bias")}
    assert round(float(late["aux"].imbalance[180:200].mean()), 2) == 3.50
    assert round(float(late["aux"].imbalance[-20:].mean()), 2) == 1.68
    assert round(float(late["bias"].imbalance[-20:].mean()), 2) == 1.42
