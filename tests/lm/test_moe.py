"""Chapter 14 (ids 14.01-14.07) against transformers' Mixtral and Switch Transformers, plus claims C13 and C18.

Tolerances, stated once:

* float64 against a torch / scipy / brute-force oracle: ``rtol = atol = 1e-12`` (``F64``);
* float32 against transformers modules (which compute the router in float32): ``rtol = atol = 1e-5``
  (``F32``);
* counts, ids, masks and capacities: exact.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import scipy.special
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import MixtralConfig, SwitchTransformersConfig
from transformers.models.mixtral import modeling_mixtral
from transformers.models.switch_transformers import modeling_switch_transformers as switch

from llmbook.lm.moe import (
    capacity_mask,
    expert_capacity,
    expert_load,
    load_balancing_loss,
    moe_flops,
    moe_output,
    moe_param_count,
    router_probs,
    router_z_loss,
    switch_routing,
    top_k_routing,
    update_routing_bias,
)
from llmbook.lm.moe_layer import MoELayer
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_probs(N, E, seed=0, scale=2.0, dtype=torch.float64):
    return torch.softmax(scale * torch.randn(N, E, generator=gen(seed), dtype=dtype), -1)


def dense_reference(x, layer, ids, w, keep=None):
    """Every token through its selected experts, one token and one expert at a time (float64 math)."""
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if keep is not None and not keep[n, k]:
                continue
            e = int(ids[n, k])
            h = layer.W_in[e] @ x[n]
            if layer.activation == "swiglu":
                a, b = h.chunk(2)
                h = a * torch.sigmoid(a) * b
            else:
                h = torch.clamp(h, min=0)
            y[n] += w[n, k] * (layer.W_out[e] @ h)
    return y


def mixtral_block(layer):
    cfg = MixtralConfig(hidden_size=layer.C, intermediate_size=layer.d_ff, num_local_experts=layer.E,
                        num_experts_per_tok=layer.K, router_jitter_noise=0.0, hidden_act="silu")
    cfg._experts_implementation = "eager"  # transformers' reference per-expert loop
    block = modeling_mixtral.MixtralSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(layer.W_g)
        block.experts.gate_up_proj.copy_(layer.W_in)
        block.experts.down_proj.copy_(layer.W_out)
    return block


# ================================================================= 14.01 gating


@pytest.mark.equation("14.01", oracle="torch.nn.functional.softmax(torch.nn.functional.linear); scipy.special.softmax")
@pytest.mark.parametrize("lead", [(5,), (2, 3), ()])
def test_router_probs_matches_softmax_of_linear(lead):
    x = torch.randn(*lead, 6, dtype=torch.float64)
    W_g = torch.randn(4, 6, dtype=torch.float64)
    ours = router_probs(x, W_g)
    torch.testing.assert_close(ours, F.softmax(F.linear(x, W_g), dim=-1), **F64)
    np.testing.assert_allclose(ours.numpy(), scipy.special.softmax((x @ W_g.T).numpy(), axis=-1), **F64)


def test_router_probs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="disagree on C"):
        router_probs(torch.randn(3, 5), torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"W_g must have shape \(E, C\)"):
        router_probs(torch.randn(3, 5), torch.randn(5))
    with pytest.raises(ValueError, match="NaN"):
        top_k_routing(torch.tensor([[float("nan"), 1.0]]), 1)


# ================================================================= 14.02 top-k


@pytest.mark.equation("14.02", oracle="transformers MixtralTopKRouter (scores, indices)")
@pytest.mark.parametrize("E, K", [(8, 2), (4, 1), (6, 3), (5, 5)])
def test_top_k_routing_matches_mixtral_router(E, K):
    C = 12
    cfg = MixtralConfig(hidden_size=C, num_local_experts=E, num_experts_per_tok=K)
    router = modeling_mixtral.MixtralTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, C, generator=gen(E * 10 + K)))
    x = torch.randn(40, C, generator=gen(1))
    logits, scores, indices = router(x)
    w, ids = top_k_routing(router_probs(x, router.weight.detach()), K)
    assert torch.equal(ids, indices)
    torch.testing.assert_close(w, scores, **F32)
    # without renormalisation the weights are the raw probabilities torch.topk returns
    w_raw, ids_raw = top_k_routing(torch.softmax(logits, -1), K, renormalize=False)
    ref = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    assert torch.equal(ids_raw, ref.indices)
    torch.testing.assert_close(w_raw, ref.values, **F32)


@pytest.mark.equation("14.02", oracle="transformers NllbMoeTop2Router (GShard's top-2 gate as in fairseq)")
@pytest.mark.parametrize("E", [3, 4, 8])  # with E = 2 the top two gates already sum to one
def test_renormalised_top_2_is_gshards_gate(E):
    """GShard divides its two largest gates by their sum: renormalize=True, not the raw gates (issue 13)."""
    from transformers import NllbMoeConfig
    from transformers.models.nllb_moe import modeling_nllb_moe

    N, C = 30, 10
    logits = 2.0 * torch.randn(N, C, generator=gen(E), dtype=torch.float64) @ torch.randn(
        C, E, generator=gen(E + 1), dtype=torch.float64)
    router = modeling_nllb_moe.NllbMoeTop2Router(NllbMoeConfig(
        d_model=C, num_experts=E, expert_capacity=N, second_expert_policy="all", batch_prioritized_routing=False,
        normalize_router_prob_before_dropping=True))  # no capacity limit, both experts always kept
    _, gates = router.route_tokens(logits.clone(), input_dtype=torch.float64)  # (N, E), zero off the top 2
    w, ids = top_k_routing(torch.softmax(logits, -1), 2)
    dense = torch.zeros(N, E, dtype=torch.float64).scatter(1, ids, w)
    torch.testing.assert_close(dense, gates, rtol=1e-6, atol=1e-6)  # its softmax runs in float32
    w_raw, _ = top_k_routing(torch.softmax(logits, -1), 2, renormalize=False)
    assert float((torch.zeros(N, E, dtype=torch.float64).scatter(1, ids, w_raw) - gates).abs().max()) > 0.01


@SETTINGS
@given(N=st.integers(1, 20), E=st.integers(1, 9), data=st.data())
def test_renormalised_top_k_weights_sum_to_one_and_pick_the_largest(N, E, data):
    K = data.draw(st.integers(1, E))
    p = random_probs(N, E, seed=N * 31 + E)
    w, ids = top_k_routing(p, K)
    torch.testing.assert_close(w.sum(-1), torch.ones(N, dtype=torch.float64), **F64)
    # every chosen score is >= every score left out
    chosen_min = p.gather(-1, ids).min(-1).values
    left = p.scatter(-1, ids, float("-inf")).max(-1).values
    assert bool((chosen_min >= left).all())


def test_top_k_routing_rejects_bad_k():
    with pytest.raises(ValueError, match=r"K \(3\) cannot exceed the number of experts E \(2\)"):
        top_k_routing(torch.rand(4, 2), 3)
    with pytest.raises(ValueError, match="K must be a positive int"):
        top_k_routing(torch.rand(4, 2), 0)
    with pytest.raises(ValueError, match=r"bias must have shape \(E,\)"):
        top_k_routing(torch.rand(4, 2), 1, bias=torch.zeros(3))


# ================================================================= 14.03 the MoE output


@pytest.mark.equation("14.03", oracle="transformers MixtralSparseMoeBlock (copied weights); per-token dense loop")
@pytest.mark.parametrize("E, K", [(4, 2), (8, 2), (3, 1), (5, 3)])
def test_moe_layer_matches_mixtral_block_and_a_per_token_loop(E, K):
    torch.manual_seed(E + K)
    layer = MoELayer(C=16, d_ff=24, E=E, K=K, generator=gen(E * 7 + K))
    x = torch.randn(2, 9, 16, generator=gen(3))
    y, r = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(y, mixtral_block(layer)(x), **F32)
    layer64 = layer.double()
    x64 = x.double()
    y64, r64 = layer64(x64)
    with torch.no_grad():
        ref = dense_reference(x64.reshape(-1, 16), layer64, r64.topk_ids, r64.topk_weights)
    torch.testing.assert_close(y64.reshape(-1, 16).detach(), ref, **F64)


@pytest.mark.equation("14.03", oracle="per-token loop over explicit expert functions (float64)")
def test_moe_output_with_arbitrary_experts_and_dropped_assignments():
    E, N, K = 4, 11, 2
    mats = torch.randn(E, 5, 3, dtype=torch.float64, generator=gen(2))
    experts = [lambda r, M=M: torch.tanh(r @ M) for M in mats]
    x = torch.randn(N, 5, dtype=torch.float64, generator=gen(3))
    w, ids = top_k_routing(random_probs(N, E, seed=4), K)
    keep = torch.rand(N, K, generator=gen(5)) > 0.3
    ours = moe_output(x, experts, ids, w, keep=keep)
    ref = torch.zeros(N, 3, dtype=torch.float64)
    for n in range(N):
        for k in range(K):
            if keep[n, k]:
                ref[n] += w[n, k] * torch.tanh(x[n] @ mats[ids[n, k]])
    torch.testing.assert_close(ours, ref, **F64)
    none_kept = moe_output(x, experts, ids, w, keep=torch.zeros(N, K, dtype=torch.bool), d_out=3)
    assert none_kept.shape == (N, 3) and not none_kept.any()


def test_moe_output_rejects_bad_input():
    experts = [lambda r: r] * 3
    with pytest.raises(ValueError, match=r"expert ids in \[0, E\) = \[0, 3\)"):
        moe_output(torch.ones(2, 4), experts, torch.tensor([[0], [3]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="must agree"):
        moe_output(torch.ones(2, 4), experts, torch.tensor([[0], [1]]), torch.ones(2, 2))
    with pytest.raises(TypeError, match="integer tensor"):
        moe_output(torch.ones(2, 4), experts, torch.tensor([[0.0], [1.0]]), torch.ones(2, 1))
    layer = MoELayer(8, 8, 4, 2)
    with pytest.raises(ValueError, match=r"x must have shape \(B, T, C\) with C = 8"):
        layer(torch.ones(2, 3, 7))
    with pytest.raises(ValueError, match="at least one token"):
        layer(torch.ones(0, 3, 8))
    with pytest.raises(ValueError, match="activation must be one of"):
        MoELayer(8, 8, 4, 2, activation="tanh")


# ================================================================= 14.04 Switch routing


def switch_config(C, d_ff, E, capacity):
    return SwitchTransformersConfig(d_model=C, d_ff=d_ff, num_experts=E, expert_capacity=capacity,
                                    dense_act_fn="relu", router_bias=False, router_jitter_noise=0.0,
                                    router_dtype="float32", dropout_rate=0.0)


@pytest.mark.equation("14.04", oracle="transformers SwitchTransformersTop1Router and SwitchTransformersSparseMLP")
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 1.5])
def test_switch_routing_and_layer_match_switch_transformers(capacity_factor):
    C, d_ff, E, T = 8, 16, 4, 24
    layer = MoELayer(C, d_ff, E, 1, activation="relu", renormalize=False, capacity_factor=capacity_factor,
                     generator=gen(7))
    with torch.no_grad():
        layer.W_g[0] += 0.5  # a skewed router, so capacity bites
    cap = T if capacity_factor is None else expert_capacity(T, E, 1, capacity_factor)
    mlp = switch.SwitchTransformersSparseMLP(switch_config(C, d_ff, E, cap)).eval()
    with torch.no_grad():
        mlp.router.classifier.weight.copy_(layer.W_g)
        for e in range(E):
            mlp.experts[f"expert_{e}"].wi.weight.copy_(layer.W_in[e])
            mlp.experts[f"expert_{e}"].wo.weight.copy_(layer.W_out[e])
    x = torch.randn(1, T, C, generator=gen(8))
    with torch.no_grad():
        dispatch, top_prob, _ = mlp.router(x)
        y, r = layer(x)
        torch.testing.assert_close(y, mlp(x), **F32)
    w, ids = switch_routing(r.probs)
    assert torch.equal(ids.flatten(), r.probs.argmax(-1))
    torch.testing.assert_close(w, top_prob.reshape(-1, 1), **F32)
    # HF's dispatch mask: one-hot of the expert, zero where capacity dropped the token
    ours = F.one_hot(ids.flatten(), E) * r.keep.long()
    assert torch.equal(ours, dispatch.reshape(-1, E))
    if capacity_factor == 1.0:
        assert not bool(r.keep.all()), "the skewed router should overflow capacity 1.0"


# ================================================================= 14.05 load balancing


@pytest.mark.equation("14.05", oracle="transformers switch_transformers.load_balancing_loss_func")
@pytest.mark.parametrize("K", [1, 2, 3])
def test_load_balancing_loss_matches_switch_transformers(K):
    N, E = 50, 6
    p = random_probs(N, E, seed=K, dtype=torch.float32)
    _, ids = top_k_routing(p, K)
    ref = switch.load_balancing_loss_func(p.unsqueeze(0), ids.unsqueeze(0) if K > 1 else ids.T)
    torch.testing.assert_close(load_balancing_loss(p, ids), ref, **F32)
    # with G groups (batch rows), HF averages the per-group losses
    G = 5
    pg, idg = p.reshape(G, N // G, E), ids.reshape(G, N // G, K)
    ref_g = switch.load_balancing_loss_func(pg, idg if K > 1 else idg.squeeze(-1))
    ours_g = torch.stack([load_balancing_loss(pg[g], idg[g]) for g in range(G)]).mean()
    torch.testing.assert_close(ours_g, ref_g, **F32)
    # alpha scales; a uniform router with a uniform assignment sits at the minimum alpha * K
    torch.testing.assert_close(load_balancing_loss(p, ids, alpha=0.01), 0.01 * ref, **F32)
    uniform = torch.full((E, E), 1 / E)
    cyc = (torch.arange(E).unsqueeze(1) + torch.arange(K)) % E
    assert math.isclose(load_balancing_loss(uniform, cyc).item(), K, rel_tol=1e-6)


@pytest.mark.equation("14.05", oracle="transformers mixtral.load_balancing_loss_func (counts top-k assignments)")
@pytest.mark.parametrize("K", [1, 2])
def test_load_balancing_loss_matches_mixtral_and_pools_layers(K):
    N, E = 40, 8
    z1, z2 = (torch.randn(N, E, generator=gen(s)) for s in (10 + K, 20 + K))
    p1 = torch.softmax(z1, -1)
    ours = load_balancing_loss(p1, top_k_routing(p1, K)[1])
    ref = modeling_mixtral.load_balancing_loss_func((z1,), num_experts=E, top_k=K)
    torch.testing.assert_close(ours, ref, **F32)
    # several layers: Mixtral pools all layers' tokens before the product f * P,
    # which is our loss on the concatenated tokens, not the mean of per-layer losses
    p2 = torch.softmax(z2, -1)
    pooled = torch.cat([p1, p2])
    ref2 = modeling_mixtral.load_balancing_loss_func((z1, z2), num_experts=E, top_k=K)
    torch.testing.assert_close(load_balancing_loss(pooled, top_k_routing(pooled, K)[1]), ref2, **F32)


def test_load_balancing_loss_gradient_flows_only_through_probabilities():
    z = torch.randn(30, 4, dtype=torch.float64, requires_grad=True)
    p = torch.softmax(z, -1)
    _, ids = top_k_routing(p, 2)
    loss = load_balancing_loss(p, ids, alpha=0.5)
    (g,) = torch.autograd.grad(loss, z, retain_graph=True)
    f = torch.bincount(ids.flatten(), minlength=4).double() / 30
    (g_ref,) = torch.autograd.grad(0.5 * 4 * (f * p.mean(0)).sum(), z)  # f as a constant
    torch.testing.assert_close(g, g_ref, **F64)
    with pytest.raises(ValueError, match="alpha must lie in"):
        load_balancing_loss(p, ids, alpha=-1.0)
    with pytest.raises(ValueError, match="share their leading axes"):
        load_balancing_loss(p, ids[:5])


# ================================================================= 14.06 capacity


def brute_force_keep(ids, E, capacity):
    """GShard priority by hand: rank by rank, token by token, each expert fills up to capacity."""
    N, K = ids.shape
    used = [0] * E
    keep = torch.zeros(N, K, dtype=torch.bool)
    for k in range(K):
        for n in range(N):
            e = int(ids[n, k])
            if used[e] < capacity:
                used[e] += 1
                keep[n, k] = True
    return keep


@pytest.mark.equation("14.06", oracle="integer ceiling -(-p*N*K // (q*E)) on the decimal fraction p/q of the factor")
@pytest.mark.parametrize("N, E, K, cf", [(64, 8, 2, 1.25), (50, 10, 1, 1.1), (7, 3, 1, 1.0), (100, 16, 2, 0.5),
                                         (25, 1, 1, 2.2), (1, 64, 8, 1.0)])
def test_expert_capacity_formula(N, E, K, cf):
    frac = Fraction(str(cf))
    assert expert_capacity(N, E, K, cf) == -(-frac.numerator * N * K // (frac.denominator * E))


@pytest.mark.equation("14.06", oracle="transformers SwitchTransformersTop1Router capacity mask (K = 1)")
@pytest.mark.parametrize("capacity", [1, 3, 6, 30])
def test_capacity_mask_matches_switch_router(capacity):
    C, E, T = 8, 4, 30
    router = switch.SwitchTransformersTop1Router(switch_config(C, 16, E, capacity)).eval()
    with torch.no_grad():
        router.classifier.weight.copy_(torch.randn(E, C, generator=gen(capacity)))
        router.classifier.weight[2] += 0.7
    x = torch.randn(1, T, C, generator=gen(100 + capacity))
    with torch.no_grad():
        dispatch, _, logits = router(x)
    ids = logits.reshape(T, E).argmax(-1, keepdim=True)
    keep = capacity_mask(ids, E, capacity)
    assert torch.equal(keep.flatten(), dispatch.reshape(T, E).sum(-1).bool())


@SETTINGS
@given(N=st.integers(1, 30), E=st.integers(1, 6), capacity=st.integers(0, 12), data=st.data())
def test_capacity_mask_keeps_exactly_the_first_assignments_per_expert(N, E, capacity, data):
    K = data.draw(st.integers(1, E))
    _, ids = top_k_routing(random_probs(N, E, seed=N + 17 * E, scale=3.0), K)
    keep = capacity_mask(ids, E, capacity)
    assert torch.equal(keep, brute_force_keep(ids, E, capacity))
    load = expert_load(ids, E)
    assert bool((expert_load(ids, E, keep) <= capacity).all())
    assert int((~keep).sum()) == int(torch.clamp(load - capacity, min=0).sum())


def test_claim_C18_skewed_routing_drops_exactly_the_overflow():
    N, E, K, cf = 96, 8, 2, 1.25
    skew = torch.zeros(E, dtype=torch.float64)
    skew[:2] = 2.5  # experts 0 and 1 are the router's favourites
    p = torch.softmax(torch.randn(N, E, generator=gen(0), dtype=torch.float64) + skew, -1)
    _, ids = top_k_routing(p, K)
    cap = expert_capacity(N, E, K, cf)
    assert cap == math.ceil(1.25 * 96 * 2 / 8) == 30
    load = expert_load(ids, E)
    keep = capacity_mask(ids, E, cap)
    expected_drop = int(torch.clamp(load - cap, min=0).sum())
    assert expected_drop > 0 and int((~keep).sum()) == expected_drop
    # exactly the assignments beyond each expert's capacity, in priority order, are dropped
    assert torch.equal(keep, brute_force_keep(ids, E, cap))
    for e in range(E):
        assert int(expert_load(ids, E, keep)[e]) == min(int(load[e]), cap)


def test_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="capacity_factor must lie in"):
        expert_capacity(10, 2, 1, 0.0)
    with pytest.raises(ValueError, match="N must be a positive int"):
        expert_capacity(0, 2)
    with pytest.raises(ValueError, match="capacity must be a non-negative int"):
        capacity_mask(torch.tensor([[0]]), 2, -1)
    with pytest.raises(ValueError, match=r"topk_ids must have shape \(N, K\)"):
        capacity_mask(torch.tensor([0, 1]), 2, 1)


# ================================================================= 14.07 z-loss


@pytest.mark.equation("14.07", oracle="transformers switch_transformers.router_z_loss_func")
@pytest.mark.parametrize("scale", [0.1, 3.0, 50.0])
def test_router_z_loss_matches_switch_transformers(scale):
    z = scale * torch.randn(3, 17, 8, generator=gen(int(scale * 10)))
    torch.testing.assert_close(router_z_loss(z), switch.router_z_loss_func(z), **F32)
    z64 = z.double()
    ref = (torch.from_numpy(scipy.special.logsumexp(z64.numpy(), axis=-1)) ** 2).mean()
    torch.testing.assert_close(router_z_loss(z64.reshape(-1, 8)), ref, **F64)


def test_router_z_loss_is_shift_sensitive_unlike_the_softmax():
    z = torch.randn(10, 4, dtype=torch.float64)
    assert router_z_loss(z + 5) > router_z_loss(z)
    torch.testing.assert_close(torch.softmax(z + 5, -1), torch.softmax(z, -1), **F64)


# ================================================================= auxiliary-loss-free balancing (DeepSeek)


def test_routing_bias_selects_but_does_not_weight():
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    w, ids = top_k_routing(p, 1, renormalize=False, bias=torch.tensor([0.0, 0.0, 0.4], dtype=torch.float64))
    assert ids.item() == 2 and w.item() == 0.2  # chosen by 0.2 + 0.4, weighted by 0.2
    new = update_routing_bias(torch.zeros(4), torch.tensor([5, 1, 3, 3]), 0.01)
    np.testing.assert_array_equal(new.numpy(), 0.01 * np.sign(3.0 - np.array([5, 1, 3, 3])).astype(np.float32))
    with pytest.raises(ValueError, match="u must lie in"):
        update_routing_bias(torch.zeros(2), torch.tensor([1, 1]), -0.1)


def test_claim_C13_bias_leaves_the_main_gradient_unchanged_the_aux_loss_does_not():
    torch.manual_seed(0)
    layer = MoELayer(8, 12, 6, 2, generator=gen(11)).double()
    x = torch.randn(1, 20, 8, dtype=torch.float64, generator=gen(12))
    target = torch.randn(1, 20, 8, dtype=torch.float64, generator=gen(13))
    bias = torch.linspace(-0.3, 0.3, 6, dtype=torch.float64).requires_grad_()
    with torch.no_grad():
        layer.routing_bias.copy_(bias)
    y, r = layer(x)
    main = ((y - target) ** 2).mean()
    (g_main,) = torch.autograd.grad(main, layer.W_g, retain_graph=True)
    # the same selection fed as fixed ids, with weights from the unbiased probabilities: the same gradient
    probs = torch.softmax(x.reshape(-1, 8) @ layer.W_g.T, -1)
    w = probs.gather(-1, r.topk_ids)
    w = w / w.sum(-1, keepdim=True)
    experts = [lambda rows, e=e: layer.expert(e, rows) for e in range(6)]
    y_fixed = moe_output(x.reshape(-1, 8), experts, r.topk_ids, w).reshape(1, 20, 8)
    (g_fixed,) = torch.autograd.grad(((y_fixed - target) ** 2).mean(), layer.W_g, retain_graph=True)
    torch.testing.assert_close(g_main, g_fixed, **F64)
    # the bias itself is outside the graph (top-k indices carry no gradient)
    assert torch.autograd.grad(main, bias, allow_unused=True, retain_graph=True)[0] is None
    # the bias changes the selection; weighting by the biased scores instead would change the gradient
    assert not torch.equal(r.topk_ids, top_k_routing(probs, 2)[1])
    wb = (probs + bias.detach()).gather(-1, r.topk_ids)
    yb = moe_output(x.reshape(-1, 8), experts, r.topk_ids, wb / wb.sum(-1, keepdim=True)).reshape(1, 20, 8)
    (g_wrong,) = torch.autograd.grad(((yb - target) ** 2).mean(), layer.W_g)
    assert (g_wrong - g_main).abs().max() > 1e-6
    # an auxiliary loss, in contrast, adds its own gradient to the router
    y2, r2 = layer(x)
    total = ((y2 - target) ** 2).mean() + load_balancing_loss(r2.probs, r2.topk_ids, alpha=0.1)
    (g_total,) = torch.autograd.grad(total, layer.W_g)
    assert (g_total - g_main).abs().max() > 1e-6




# ================================================================= claim C13: counts and the simulation


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_claim_C13_parameters_grow_with_E_flops_with_K(activation):
    C, d_ff, N = 32, 48, 24
    x = torch.randn(1, N, C, generator=gen(0))
    params, flops = {}, {}
    for E, K in [(2, 1), (4, 1), (8, 1), (8, 2), (8, 4)]:
        layer = MoELayer(C, d_ff, E, K, activation=activation, generator=gen(E))
        params[E, K] = sum(p.numel() for p in layer.parameters())
        assert params[E, K] == moe_param_count(C, d_ff, E, activation)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            layer(x)
        flops[E, K] = counter.get_total_flops()
        assert flops[E, K] == moe_flops(N, C, d_ff, E, K, activation)
    assert params[8, 1] == params[8, 4]  # K does not add parameters
    m = 3 if activation == "swiglu" else 2
    assert params[8, 1] - params[4, 1] == 4 * (m * C * d_ff + C)  # linear in E
    expert_flops = 2 * N * m * C * d_ff
    assert flops[8, 4] - flops[8, 2] == 2 * expert_flops  # linear in K
    assert flops[8, 1] - flops[2, 1] == 2 * N * 6 * C  # E only through the router


def test_claim_C13_mixtral_layer_parameter_count():
    cfg = MixtralConfig()  # Mixtral 8x7B sizes: C = 4096, d_ff = 14336, E = 8, K = 2
    with torch.device("meta"):
        block = modeling_mixtral.MixtralSparseMoeBlock(cfg)
    n = sum(p.numel() for p in block.parameters())
    assert n == moe_param_count(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts) == 1_409_318_912






# ============================================ top-k routing with a bias, underflowed scores (issue 11)


def _routing64(z, K, bias):
    """Float64 oracle from the logits: g = softmax(z) (no underflow at |z| = 200), select by g + b,
    weights g_S / sum g_S = softmax(z_S)."""
    g = torch.softmax(z, -1)
    ids = torch.topk(g.detach() + bias, K, dim=-1).indices
    return torch.softmax(z.gather(-1, ids), -1), ids


@pytest.mark.parametrize("z, K, bias", [
    ([[200.0, 0.0, 0.0, 0.0]], 2, [-5.0, 0.0, 0.0, 0.0]),   # float32 softmax underflows to [1, 0, 0, 0]
    ([[200.0, 0.0, 0.0, 0.0]], 2, [0.0, 0.0, 0.0, 0.0]),    # one selected expert underflowed
    ([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, -2.0, 1.0]], 2, [0.0, -0.5, 0.7, 0.2]),  # nothing underflows
])
def test_top_k_routing_with_bias_matches_float64_values_and_gradients(z, K, bias):
    z64 = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(bias)
    w_ref, ids_ref = _routing64(z64, K, b.double())
    z32 = z64.detach().float().requires_grad_(True)
    w, ids = top_k_routing(torch.softmax(z32, -1), K, bias=b)
    assert torch.equal(ids, ids_ref)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w.double(), w_ref.detach(), rtol=1e-6, atol=1e-6)
    c = torch.arange(1.0, K + 1)  # a loss that sees the individual weights
    (w * c).sum().backward()
    (w_ref * c.double()).sum().backward()
    assert torch.isfinite(z32.grad).all()
    # where every selected float32 score underflowed to 0 the weights are uniform and constant: the
    # float64 gradient (+-0.25) is not recoverable from probabilities that are exactly 0
    if torch.softmax(z32.detach(), -1).gather(-1, ids).sum(-1).gt(0).all():
        torch.testing.assert_close(z32.grad.double(), z64.grad, rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(z32.grad, torch.zeros_like(z32.grad))


def test_top_k_routing_bias_selecting_a_zero_probability_expert_issue_case():
    w, ids = top_k_routing(torch.tensor([[1.0, 0.0, 0.0]]), 1, bias=torch.tensor([-2.0, 0.0, 0.0]))
    assert ids.tolist() == [[1]]
    assert w.tolist() == [[1.0]]  # K = 1: the renormalised weight is 1, not 0/0


# ================================================================= issue 11: argument pairs and bad scalars


def test_router_probs_rejects_mixed_dtypes():
    with pytest.raises(TypeError, match=r"x \(torch.float32\) and W_g \(torch.float64\) must share one dtype"):
        router_probs(torch.ones(2, 3), torch.zeros(4, 3, dtype=torch.float64))


def test_keep_must_match_topk_ids():
    ids = torch.tensor([[0, 1], [1, 2]])
    w = torch.full((2, 2), 0.5)
    experts = [lambda r: r, lambda r: 2 * r, lambda r: 3 * r]
    x = torch.ones(2, 3)
    for bad, exc, match in [
        (torch.ones(2, dtype=torch.bool), ValueError, r"keep \(2,\) and topk_ids \(2, 2\) must have the same shape"),
        (torch.ones(4, dtype=torch.bool), ValueError, r"keep \(4,\) and topk_ids \(2, 2\) must have the same shape"),
        (torch.ones(2, 2), TypeError, r"keep must be a bool mask .*, got dtype torch.float32"),
    ]:
        with pytest.raises(exc, match=match):
            moe_output(x, experts, ids, w, keep=bad)
        with pytest.raises(exc, match=match):
            expert_load(ids, 3, keep=bad)
    keep = torch.tensor([[True, False], [False, True]])
    # oracle: the kept assignments counted by hand / combined by hand
    assert expert_load(ids, 3, keep=keep).tolist() == [1, 0, 1]
    torch.testing.assert_close(moe_output(x, experts, ids, w, keep=keep), torch.tensor([[0.5] * 3, [1.5] * 3]))


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: expert_capacity(64, 8, 2, math.inf), ValueError, r"capacity_factor must lie in \(0.0, inf\), got inf"),
        (lambda: expert_capacity(64, 8, 2, math.nan), ValueError, r"capacity_factor must be a real number, got nan"),
        (lambda: expert_capacity(64, 8, 2, "1.25"), TypeError, r"capacity_factor must be a real number, got '1.25'"),
        (lambda: expert_capacity(64.0, 8, 2, 1.25), TypeError, r"N must be a positive int, got 64.0 \(float\)"),
        (lambda: top_k_routing(torch.rand(2, 4), True), TypeError, r"K must be a positive int, got True \(bool\)"),
        (lambda: capacity_mask(torch.tensor([[0]]), 2, capacity=1.5), TypeError,
         r"capacity must be a non-negative int, got 1.5 \(float\)"),
        (lambda: moe_output(torch.ones(1, 2), [lambda r: r], torch.tensor([[0]]), torch.ones(1, 1), d_out=0),
         ValueError, r"d_out must be a positive int, got 0"),
    ],
)
def test_scalars_reject_bad_values(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_moe_output_with_no_channels_or_no_choices():
    """Issue 11: C = 0 or K = 0 made reshape(-1, 0) fail; the sum over no choices is 0, over no channels empty."""
    x = torch.randn(6, 4, generator=gen(0))
    experts = [lambda r: 2 * r, lambda r: 3 * r]
    ids, w = torch.zeros(6, 0, dtype=torch.long), torch.zeros(6, 0)
    torch.testing.assert_close(moe_output(x, experts, ids, w), torch.zeros(6, 4), rtol=0, atol=0)  # K = 0
    ids, w = torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1)
    assert moe_output(torch.zeros(6, 0), experts, ids, w).shape == (6, 0)  # C = 0


def test_capacity_beyond_int64_keeps_everything_and_bool_load_is_rejected():
    """Issue 11: capacity_factor = 1e30 gave a capacity beyond int64 (OverflowError); a bool load passed silently."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]])
    capacity = expert_capacity(3, 3, 2, 1e30)
    assert capacity > 2**63
    assert capacity_mask(ids, 3, capacity).all()
    torch.testing.assert_close(capacity_mask(ids, 3, capacity), capacity_mask(ids, 3, 6), rtol=0, atol=0)
    with pytest.raises(TypeError, match="load must be a real floating-point tensor, got dtype torch.bool"):
        update_routing_bias(torch.zeros(3), torch.tensor([True, False, True]), 0.1)


# ================================================================= the chapter's Try-it solutions



def test_try_it_solutions_of_chapter_14():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm.moe_layer import simulate_routing

    stated = []
    # 1. the explorer without balancing at step 200: the capacity factor that drops nothing, and its cost
    free = simulate_routing(balance="none")
    busiest = int(free.load[-1].max())
    c = Fraction(busiest * 8, 256 * 2)  # ceil(c N K / E) = busiest
    assert (busiest, c) == (224, Fraction(7, 2))
    assert expert_capacity(256, 8, 2, float(c)) == busiest
    assert bool(capacity_mask(free.topk_ids, 8, busiest).all())
    assert not bool(capacity_mask(free.topk_ids, 8, expert_capacity(256, 8, 2, 3.45)).all())
    slots = 8 * busiest
    assert (slots, slots - 512, round(100 * (slots - 512) / slots)) == (1792, 1280, 71)
    stated += ["224", "$c = 3.5$", "1792", "1280", "71 %"]
    # 2. the auxiliary loss at three strengths
    none_imb = float(free.imbalance[-20:].mean())
    stated += [f"{none_imb:.2f}", f"{free.main_loss[-1].item():.3f}"]
    results = {}
    for a in (0.01, 0.3, 3.0):
        sim = simulate_routing(balance="aux", alpha=a)
        results[a] = (float(sim.imbalance[-20:].mean()), float(sim.main_loss[-1]))
        stated += [f"{results[a][0]:.2f}", f"{results[a][1]:.3f}"]
    assert results[0.01][0] > 3.0 and max(results[0.3][0], results[3.0][0]) < 1.7  # too weak, then balanced
    assert results[0.01][1] > free.main_loss[-1].item() > max(results[0.3][1], results[3.0][1])
    # 3. nothing shared: a much weaker collapse
    alone = simulate_routing(balance="none", shared=0.0)
    start, end = float(alone.imbalance[0]), float(alone.imbalance[-20:].mean())
    assert start < end < 2.5 < none_imb
    stated += [f"{start:.2f}", f"{end:.2f}"]
    # 4. a fine-grained MoE against Mixtral's layer
    fine, mixtral = moe_param_count(4096, 1792, 64), moe_param_count(4096, 14336, 8)
    assert fine - mixtral == 56 * 4096 == 229376
    flops_fine, flops_mixtral = moe_flops(1, 4096, 1792, 64, 8), moe_flops(1, 4096, 1792 * 8, 8, 2)
    assert flops_fine - 2 * 64 * 4096 == (flops_mixtral - 2 * 8 * 4096) // 2  # half the expert compute
    assert moe_flops(1, 4096, 1792, 64, 16) - 2 * 64 * 4096 == flops_mixtral - 2 * 8 * 4096  # K = 16 matches
    assert (math.comb(64, 8), math.comb(8, 2)) == (4426165368, 28)
    stated += [f"{fine:,}", f"{mixtral:,}", "229{,}376", f"{flops_fine:,}", f"{flops_mixtral:,}",
               "4{,}426{,}165{,}368", "= 28"]
    assert_states("14-moe.ipynb", stated)
