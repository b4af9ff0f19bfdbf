"""AdaLoRA (chapter 11, id 11.04) against ``peft``'s ``AdaLoraLayer``/``SVDLinear`` and ``RankAllocator``."""

import copy

import pytest
import torch
from torch import nn

from llmbook.lm import adalora as ad

peft = pytest.importorskip("peft")
from peft.tuners.adalora.layer import RankAllocator  # noqa: E402

NAMES = ("q_proj", "v_proj")


class Toy(nn.Module):
    def __init__(self, d_in=16, d_out=12):
        super().__init__()
        self.q_proj = nn.Linear(d_in, d_out, bias=True)
        self.v_proj = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        return torch.tanh(self.q_proj(x)) * self.v_proj(x)


def _pair(r=4, target_r=2):
    torch.manual_seed(0)
    base = Toy().double()
    cfg = peft.AdaLoraConfig(init_r=r, target_r=target_r, lora_alpha=8, target_modules=list(NAMES), total_step=100,
                             tinit=10, tfinal=20, deltaT=1, beta1=0.85, beta2=0.85)
    theirs = peft.get_peft_model(copy.deepcopy(base), cfg).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in NAMES:
            layer = getattr(theirs.base_model.model, name)
            for part in (layer.lora_A, layer.lora_B, layer.lora_E):
                part["default"].copy_(torch.randn(part["default"].shape, generator=g, dtype=torch.float64))
            layer.ranknum["default"].fill_(r - 1e-5)  # peft divides by ranknum + 1e-5: make that r (to 1 ulp)
    ours = copy.deepcopy(base)
    layers = ad.add_adalora(ours, r=r, alpha=8, targets=NAMES)
    with torch.no_grad():
        for name in NAMES:
            t = getattr(theirs.base_model.model, name)
            layers[name].lora_P.copy_(t.lora_B["default"])
            layers[name].lora_Lambda.copy_(t.lora_E["default"][:, 0])
            layers[name].lora_Q.copy_(t.lora_A["default"])
    return ours, layers, theirs, cfg


@pytest.mark.equation("11.04", oracle="peft AdaLoraConfig / SVDLinear forward (its ranknum + 1e-5 set to r)")
def test_adalora_svd_form_matches_peft():
    ours, layers, theirs, _ = _pair()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-12, rtol=0)
    q = layers["q_proj"]
    dW = (8 / 4) * q.lora_P @ torch.diag(q.lora_Lambda) @ q.lora_Q  # sum_i s_i u_i v_i^T
    sum_form = sum((8 / 4) * q.lora_Lambda[i] * torch.outer(q.lora_P[:, i], q.lora_Q[i]) for i in range(4))
    torch.testing.assert_close(dW, sum_form, atol=1e-12, rtol=0)
    torch.testing.assert_close(ad.adalora_linear(x, q.base.weight, q.lora_P, q.lora_Lambda, q.lora_Q, 8.0),
                               x @ (q.base.weight + dW).T, atol=1e-12, rtol=0)


@pytest.mark.equation("11.04", oracle="peft.tuners.adalora.layer.RankAllocator (update_ipt, mask_to_budget)")
def test_rank_allocation_matches_peft():
    ours, layers, theirs, cfg = _pair()
    allocator, reference = ad.AdaLoRAAllocator(0.85, 0.85), RankAllocator(theirs, cfg, "default")
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(4, 16, generator=g, dtype=torch.float64)
        for model in (ours, theirs):
            model.zero_grad()
            (model(x) ** 2).sum().backward()
        allocator.update(layers)
        reference.update_ipt(theirs)
    ranks = allocator.mask_to_budget(layers, budget=3)
    pattern = reference.mask_to_budget(theirs, budget=3)
    assert sum(ranks.values()) == 3
    for name in NAMES:
        keep = pattern[f"base_model.model.{name}.lora_E.default"]
        assert [bool(v) for v in (layers[name].lora_Lambda != 0).tolist()] == keep
        torch.testing.assert_close(layers[name].lora_Lambda,
                                   getattr(theirs.base_model.model, name).lora_E["default"][:, 0], atol=0, rtol=0)


@pytest.mark.equation("11.04", oracle="peft RankAllocator.budget_schedule (cubic schedule)")
def test_budget_schedule_matches_peft():
    _, _, theirs, cfg = _pair()
    reference = RankAllocator(theirs, cfg, "default")
    for step in range(0, 101):
        expected, _ = reference.budget_schedule(step)
        assert ad.adalora_budget(step, 8, 4, 10, 20, 100) == expected, step


def test_orth_penalty_and_errors():
    layer = ad.AdaLoRALinear(nn.Linear(6, 5).double(), r=3, alpha=2.0)
    with torch.no_grad():
        layer.lora_P.copy_(torch.linalg.qr(torch.randn(5, 3, dtype=torch.float64))[0])
        layer.lora_Q.copy_(torch.linalg.qr(torch.randn(6, 3, dtype=torch.float64))[0].T)
    assert layer.orth_penalty().item() < 1e-24  # orthonormal P and Q cost nothing
    with torch.no_grad():
        layer.lora_P.mul_(2.0)  # P^T P = 4 I: 3 diagonal entries of (4 - 1)^2
    assert abs(layer.orth_penalty().item() - 27.0) < 1e-9
    with pytest.raises(ValueError, match="share the rank r"):
        ad.adalora_linear(torch.zeros(1, 6), torch.zeros(5, 6), torch.zeros(5, 3), torch.zeros(2), torch.zeros(3, 6),
                          1.0)
    with pytest.raises(ValueError, match="no gradient"):
        ad.AdaLoRAAllocator().update({"x": layer})
    with pytest.raises(ValueError, match="total_step"):
        ad.adalora_budget(3, 8, 4, 10, 20, 25)
