"""LoRA, rsLoRA, QLoRA and DoRA (chapter 11) against ``peft`` 0.21, ``bitsandbytes`` and float64 closed forms."""

import copy
import math

import pytest
import torch
from torch import nn

from llmbook.lm import lora as lo

peft = pytest.importorskip("peft")

TOL64 = dict(atol=1e-12, rtol=0)  # float64 against float64: only summation order differs


class Toy(nn.Module):
    """Two linears named like attention projections, one with a bias."""

    def __init__(self, d_in=16, d_out=12):
        super().__init__()
        self.q_proj = nn.Linear(d_in, d_out, bias=True)
        self.v_proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        return self.q_proj(x) + 2 * self.v_proj(x)


def _toy(seed=0):
    torch.manual_seed(seed)
    return Toy().double()


def _peft_lora(base, **cfg):
    """A ``peft`` LoRA model of ``base`` (deep-copied) with random, non-zero A and B (float64)."""
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **cfg)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**cfg)).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            layer = getattr(model.base_model.model, name)
            layer.lora_A["default"].weight.copy_(torch.randn(layer.lora_A["default"].weight.shape, generator=g))
            layer.lora_B["default"].weight.copy_(torch.randn(layer.lora_B["default"].weight.shape, generator=g))
            if cfg.get("use_dora"):
                m = layer.lora_magnitude_vector["default"].weight
                m.copy_(m * (1 + 0.3 * torch.rand(m.shape, generator=g, dtype=m.dtype)))
    return model


def _copy_into_ours(ours, theirs, kind):
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            o, t = getattr(ours, name), getattr(theirs.base_model.model, name)
            o.lora_A.copy_(t.lora_A["default"].weight)
            o.lora_B.copy_(t.lora_B["default"].weight)
            if kind == "dora":
                o.magnitude.copy_(t.lora_magnitude_vector["default"].weight)


@pytest.mark.equation("11.01", oracle="peft.LoraConfig (plain and use_rslora=True): forward and merged weights")
@pytest.mark.parametrize("rslora", [False, True])
def test_lora_matches_peft(rslora):
    base = _toy()
    theirs = _peft_lora(base, use_rslora=rslora)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    layer = theirs.base_model.model.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    y = lo.lora_linear(x, base.q_proj.weight, A, B, alpha=8, bias=base.q_proj.bias, rslora=rslora)
    torch.testing.assert_close(y, layer(x), **TOL64)
    assert layer.scaling["default"] == lo.lora_scaling(8, 4, rslora) == (8 / 2 if rslora else 8 / 4)
    ours = copy.deepcopy(base)
    names = lo.add_lora(ours, r=4, alpha=8, rslora=rslora)
    assert names == ["q_proj", "v_proj"]
    _copy_into_ours(ours, theirs, "lora")
    torch.testing.assert_close(ours(x), theirs(x), **TOL64)
    # merged weights: ours in place against peft's merge_and_unload
    merged = theirs.merge_and_unload()
    for name in ("q_proj", "v_proj"):
        getattr(ours, name).merge()
        torch.testing.assert_close(getattr(ours, name).base.weight, getattr(merged, name).weight, **TOL64)
    torch.testing.assert_close(ours(x), merged(x), **TOL64)


@pytest.mark.equation("11.01", oracle="float64 closed form W + (alpha/r) B A and the unmerged forward")
def test_merge_unmerge_is_exact_up_to_one_rounding():
    torch.manual_seed(0)
    base = nn.Linear(32, 24)
    W0 = base.weight.detach().clone()
    layer = lo.LoRALinear(base, r=4, alpha=16)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(7, 32)
    y_adapter = layer(x)
    delta = (16 / 4) * (layer.lora_B.double() @ layer.lora_A.double())
    layer.merge()
    assert layer.merged
    torch.testing.assert_close(layer.base.weight.double(), W0.double() + delta, atol=1e-5, rtol=0)  # fp32 rounding
    torch.testing.assert_close(layer(x), y_adapter, atol=1e-5, rtol=1e-5)
    layer.unmerge()
    # W + dW - dW differs from W by at most one rounding of W + dW: half an ulp of |W| + |dW|
    ulp = torch.finfo(torch.float32).eps * (W0.abs() + delta.abs().float())
    assert ((layer.base.weight - W0).abs() <= ulp).all()
    layer.merge()
    layer.merge()  # idempotent
    layer.unmerge()
    assert ((layer.base.weight - W0).abs() <= ulp).all()


def test_lora_starts_at_the_base_model_and_trains_only_A_and_B():
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    layer = lo.LoRALinear(base, r=2, alpha=4)
    x = torch.randn(4, 8)
    torch.testing.assert_close(layer(x), base(x), atol=1e-6, rtol=0)
    layer(x).sum().backward()
    assert base.weight.grad is None and layer.lora_A.grad is not None
    assert lo.count_trainable(layer) == 2 * 8 + 6 * 2


# --------------------------------------------------------------------------- QLoRA


@pytest.mark.equation("11.02", oracle="bitsandbytes.functional.quantize_4bit/dequantize_4bit (NF4) + peft LoRA "
                                      "on the dequantised weight")
def test_qlora_matches_bitsandbytes_nf4_and_peft():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    base = Toy().float()
    W = base.q_proj.weight.detach()
    # bitsandbytes 0.50's CPU dequantisation mixes up block scales when a row is shorter than a block
    # (12 x 16 here), so the weight goes in flattened: the blocks are the same row-major runs of 64
    q, state = bnbf.quantize_4bit(W.flatten().contiguous(), blocksize=64, quant_type="nf4")
    W_bnb = bnbf.dequantize_4bit(q, state).reshape(W.shape)
    q_layer = lo.QLoRALinear(base.q_proj, r=4, alpha=8)  # quantises with chapter 12's llmbook.lm.nf4
    packed = q.flatten()
    assert torch.equal(torch.stack([packed >> 4, packed & 15], 1).flatten(), q_layer.codes.flatten())  # 2 a byte
    torch.testing.assert_close(q_layer.absmax, state.absmax.float(), atol=0, rtol=0)
    # the layer: dequantised base + LoRA, against peft LoRA on a Linear holding bitsandbytes' dequantised weight
    deq = copy.deepcopy(base).double()
    with torch.no_grad():
        deq.q_proj.weight.copy_(W_bnb)
    theirs = _peft_lora(deq)
    layer = theirs.base_model.model.q_proj
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, 16, dtype=torch.float64)
    y = lo.qlora_linear(x, q_layer.codes, q_layer.absmax, A, B, alpha=8, block_size=64, bias=base.q_proj.bias.double())
    torch.testing.assert_close(y, layer(x), atol=1e-6, rtol=0)  # the NF4 levels are float32 on both sides
    q_layer = q_layer.double()
    with torch.no_grad():
        q_layer.lora_A.copy_(A)
        q_layer.lora_B.copy_(B)
    torch.testing.assert_close(q_layer(x), layer(x), atol=1e-6, rtol=0)
    assert {n for n, p in q_layer.named_parameters() if p.requires_grad} == {"lora_A", "lora_B"}
    assert q_layer.codes.dtype == torch.uint8 and not q_layer.absmax.requires_grad


def test_qlora_trains_only_the_lora_factors():
    torch.manual_seed(0)
    layer = lo.QLoRALinear(nn.Linear(64, 8), r=2, alpha=4)
    codes = layer.codes.clone()
    opt = torch.optim.SGD([p for p in layer.parameters() if p.requires_grad], lr=0.1)
    with torch.no_grad():
        layer.lora_B.normal_()
    layer(torch.randn(5, 64)).pow(2).sum().backward()
    opt.step()
    assert torch.equal(layer.codes, codes) and layer.lora_A.grad is not None


# --------------------------------------------------------------------------- DoRA


@pytest.mark.equation("11.03", oracle="peft.LoraConfig(use_dora=True): forward, merged weights and gradients "
                                      "(the detached norm)")
def test_dora_matches_peft_forward_merge_and_gradients():
    base = _toy()
    theirs = _peft_lora(base, use_dora=True)
    ours = copy.deepcopy(base)
    lo.add_lora(ours, r=4, alpha=8, kind="dora")
    _copy_into_ours(ours, theirs, "dora")
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    y_ours, y_theirs = ours(x), theirs(x)
    torch.testing.assert_close(y_ours, y_theirs, **TOL64)
    (y_ours ** 2).sum().backward()
    (y_theirs ** 2).sum().backward()
    for name in ("q_proj", "v_proj"):
        o, t = getattr(ours, name), getattr(theirs.base_model.model, name)
        torch.testing.assert_close(o.lora_A.grad, t.lora_A["default"].weight.grad, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(o.lora_B.grad, t.lora_B["default"].weight.grad, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(o.magnitude.grad, t.lora_magnitude_vector["default"].weight.grad,
                                   atol=1e-9, rtol=1e-9)
    with torch.no_grad():
        theirs.merge_adapter()
        for name in ("q_proj", "v_proj"):
            layer = getattr(ours, name)
            layer.merge()
            torch.testing.assert_close(layer.base.weight, getattr(theirs.base_model.model, name).base_layer.weight,
                                       **TOL64)
            assert layer._weight_norm.shape == (layer.base.out_features,)  # all that is kept: one norm per row
    merged = theirs.merge_and_unload()
    with torch.no_grad():
        for name in ("q_proj", "v_proj"):
            torch.testing.assert_close(getattr(ours, name).base.weight, getattr(merged, name).weight, **TOL64)


def test_dora_unmerge_from_the_norm_vector_matches_peft():
    """peft's unmerge (``W'`` divided by ``m / ||W + ΔW||`` per row, minus ΔW) restores ``W`` without a copy."""
    base = _toy()
    theirs = _peft_lora(base, use_dora=True)
    ours = copy.deepcopy(base)
    lo.add_lora(ours, r=4, alpha=8, kind="dora")
    _copy_into_ours(ours, theirs, "dora")
    with torch.no_grad():
        theirs.merge_adapter()
        theirs.unmerge_adapter()
        for name in ("q_proj", "v_proj"):
            layer = getattr(ours, name)
            W0 = layer.base.weight.clone()
            layer.merge()
            assert not torch.allclose(layer.base.weight, W0)  # the merged weight differs from W
            layer.unmerge()
            torch.testing.assert_close(layer.base.weight, W0, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(layer.base.weight, getattr(theirs.base_model.model, name).base_layer.weight,
                                       atol=1e-12, rtol=1e-12)
            assert not hasattr(layer, "_W0")


def test_dora_norm_is_detached_and_rows_have_norm_m():
    g = torch.Generator().manual_seed(0)
    W, A, B = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((5, 7), (2, 7), (5, 2)))
    m = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    eye = torch.eye(7, dtype=torch.float64)
    W_prime = lo.dora_linear(eye, W, A, B, m, alpha=2.0).T  # rows of x = I give W'^T
    torch.testing.assert_close(torch.linalg.vector_norm(W_prime, dim=1), m, **TOL64)
    m = m.requires_grad_()
    lo.dora_linear(eye, W, A, B, m, alpha=2.0).sum().backward()
    V = W + B @ A
    # with the norm detached, d/dm of sum(x W'^T) = row sums of V / ||V||
    torch.testing.assert_close(m.grad, (V / torch.linalg.vector_norm(V, dim=1, keepdim=True)).sum(1), **TOL64)


# --------------------------------------------------------------------------- errors


def test_bad_input_raises_clear_errors():
    x, W, A, B = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="d_in = 4"):
        lo.lora_linear(torch.zeros(2, 5), W, A, B, 1.0)
    with pytest.raises(ValueError, match=r"B must have shape \(3, 2\)"):
        lo.lora_linear(x, W, A, torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match="rank r >= 1"):
        lo.lora_linear(x, W, torch.zeros(0, 4), torch.zeros(3, 0), 1.0)
    with pytest.raises(TypeError, match="share one dtype"):
        lo.lora_linear(x.double(), W, A, B, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        lo.lora_linear(x, W, A, B, math.nan)
    with pytest.raises(ValueError, match=r"m must have shape \(3,\)"):
        lo.dora_linear(x, W, A, B, torch.ones(4), 1.0)
    with pytest.raises(TypeError, match="nn.Linear"):
        lo.LoRALinear(nn.Conv1d(2, 2, 1), 2, 2.0)
    with pytest.raises(ValueError, match="no nn.Linear named"):
        lo.add_lora(Toy(), 2, 2.0, targets=["qproj"])
    with pytest.raises(ValueError, match="kind must be one of"):
        lo.add_lora(Toy(), 2, 2.0, kind="lorax")
