"""Chapter 8 optimisers (08.01-08.06) against torch.optim and lion-pytorch, and claim C09.

Tolerances, stated once:

* 100 steps on a real model (a TinyGPT, float64), ours against the oracle optimiser, every parameter
  after every step: ``atol = 1e-12``, ``rtol = 1e-10`` (``F64``). The two differ only in the order of
  floating-point operations (torch's ``lerp`` against ``beta m + (1 - beta) g``, ...). Both optimisers
  receive the same gradients, those of the oracle's model: with a forward and backward pass each, the
  last-bit differences of the updates would feed back through the model and grow (to 1.2e-12 by step
  97 for Adam on an AVX-512 machine), a property of the training dynamics and of the CPU, not of the
  optimiser under test;
* one step of an update rule against the oracle's state or parameters: the same ``F64``;
* a state-dict round trip (save at step 50, load into a fresh optimiser, continue): bit-for-bit equal
  to the uninterrupted run (``torch.equal``);
* fp16 / bf16 input of a rule against its float64 evaluation: 4 eps of the low dtype.
"""

from __future__ import annotations

import io
import math

import lion_pytorch
import pytest
import torch
import torch.nn.functional as F

from llmbook.lm import optim
from llmbook.lm.gpt import GPTConfig, TinyGPT

F64 = dict(rtol=1e-10, atol=1e-12)
V = 16
STEPS = 100


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8)
    return TinyGPT(cfg).double()


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(i))


def _loss(model, i: int) -> torch.Tensor:
    b = _batch(i)
    return F.cross_entropy(model(b[:, :-1]).reshape(-1, V), b[:, 1:].reshape(-1))


def _train(model, opt, steps, start=0, after_step=None):
    for i in range(start, start + steps):
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()
        if after_step is not None:
            after_step(i)


PAIRS = {
    "SGD": (lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "SGD-momentum": (lambda p: optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
    "Adam": (lambda p: optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6),
             lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6)),
    "Adam-L2": (lambda p: optim.Adam(p, lr=1e-2, weight_decay=0.1),
                lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
    "AdamW": (lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "Lion": (lambda p: optim.Lion(p, lr=1e-3, weight_decay=0.1),
             lambda p: lion_pytorch.Lion(p, lr=1e-3, weight_decay=0.1)),
}


def _match_oracle_for_100_steps(name):
    ours_make, ref_make = PAIRS[name]
    m_ours, m_ref = _model(), _model()
    o_ours, o_ref = ours_make(m_ours.parameters()), ref_make(m_ref.parameters())
    start = [p.detach().clone() for p in m_ours.parameters()]

    def compare(i):
        for a, b in zip(m_ours.parameters(), m_ref.parameters(), strict=True):
            torch.testing.assert_close(a, b, **F64, msg=lambda s: f"{name}, step {i}: {s}")

    for i in range(STEPS):
        o_ref.zero_grad()
        _loss(m_ref, i).backward()
        o_ours.zero_grad()
        for a, b in zip(m_ours.parameters(), m_ref.parameters(), strict=True):
            a.grad = b.grad.clone()  # the same gradient for both rules (see the module docstring)
        o_ours.step()
        o_ref.step()
        compare(i)
    moved = max((p - s).abs().max().item() for p, s in zip(m_ours.parameters(), start, strict=True))
    assert moved > 1e-2, f"{name}: the weights barely moved ({moved:.2g}); the comparison would be vacuous"
    return o_ours, o_ref


@pytest.mark.equation("08.01", "08.02", oracle="torch.optim.SGD (100 float64 steps on a TinyGPT)")
@pytest.mark.parametrize("name", ["SGD", "SGD-momentum"])
def test_sgd_matches_torch_for_100_steps(name):
    o_ours, o_ref = _match_oracle_for_100_steps(name)
    if name == "SGD-momentum":
        for p_o, p_r in zip(o_ours.param_groups[0]["params"], o_ref.param_groups[0]["params"], strict=True):
            torch.testing.assert_close(o_ours.state[p_o]["momentum_buffer"], o_ref.state[p_r]["momentum_buffer"], **F64)


@pytest.mark.equation("08.03", "08.04", oracle="torch.optim.Adam (100 float64 steps on a TinyGPT)")
@pytest.mark.parametrize("name", ["Adam", "Adam-L2"])
def test_adam_matches_torch_for_100_steps(name):
    o_ours, o_ref = _match_oracle_for_100_steps(name)
    for p_o, p_r in zip(o_ours.param_groups[0]["params"], o_ref.param_groups[0]["params"], strict=True):
        s_o, s_r = o_ours.state[p_o], o_ref.state[p_r]
        assert s_o["step"] == int(s_r["step"]) == STEPS
        torch.testing.assert_close(s_o["exp_avg"], s_r["exp_avg"], **F64)
        torch.testing.assert_close(s_o["exp_avg_sq"], s_r["exp_avg_sq"], **F64)


@pytest.mark.equation("08.05", oracle="torch.optim.AdamW (100 float64 steps on a TinyGPT)")
def test_adamw_matches_torch_for_100_steps():
    _match_oracle_for_100_steps("AdamW")


@pytest.mark.equation("08.06", oracle="lion_pytorch.Lion (100 float64 steps on a TinyGPT)")
def test_lion_matches_lion_pytorch_for_100_steps():
    o_ours, o_ref = _match_oracle_for_100_steps("Lion")
    p_o, p_r = o_ours.param_groups[0]["params"][0], o_ref.param_groups[0]["params"][0]
    torch.testing.assert_close(o_ours.state[p_o]["exp_avg"], o_ref.state[p_r]["exp_avg"], **F64)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_state_dict_round_trip_continues_bit_for_bit(name):
    make = PAIRS[name][0]
    m_full = _model()
    o_full = make(m_full.parameters())
    _train(m_full, o_full, STEPS)

    m_a = _model()
    o_a = make(m_a.parameters())
    _train(m_a, o_a, STEPS // 2)
    buf = io.BytesIO()
    torch.save({"model": m_a.state_dict(), "optim": o_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m_b = _model(seed=1)  # different initial weights: everything must come from the checkpoint
    m_b.load_state_dict(ckpt["model"])
    o_b = make(m_b.parameters())
    o_b.load_state_dict(ckpt["optim"])
    _train(m_b, o_b, STEPS - STEPS // 2, start=STEPS // 2)
    for a, b in zip(m_full.parameters(), m_b.parameters(), strict=True):
        assert torch.equal(a, b), f"{name}: resuming from the state dict diverged"


# ----------------------------------------------------------------------------- the rules, one step


def _one_torch_step(opt_cls, theta, g, **kw):
    p = torch.nn.Parameter(theta.clone())
    opt = opt_cls([p], **kw)
    p.grad = g.clone()
    opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.equation("08.01", oracle="torch.optim.SGD")
def test_sgd_step_matches_torch():
    theta, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    ref, _ = _one_torch_step(torch.optim.SGD, theta, g, lr=0.3)
    torch.testing.assert_close(optim.sgd_step(theta, g, 0.3), ref, **F64)


@pytest.mark.equation("08.02", oracle="torch.optim.SGD(momentum=0.9), three steps")
def test_momentum_step_matches_torch_and_starts_the_buffer_at_g():
    theta = torch.randn(5, dtype=torch.float64)
    gs = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    v = None
    for i, g in enumerate(gs):
        p.grad = g.clone()
        opt.step()
        theta, v = optim.momentum_step(theta, g, v, lr=0.1, momentum=0.9)
        torch.testing.assert_close(theta, p.detach(), **F64)
        torch.testing.assert_close(v, opt.state[p]["momentum_buffer"], **F64)
        if i == 0:
            torch.testing.assert_close(v, gs[0], **F64)  # not (1 - mu) g, not mu * 0 + g done lazily


@pytest.mark.equation("08.03", oracle="torch.optim.Adam state exp_avg / exp_avg_sq")
def test_adam_moments_match_torch_state():
    theta = torch.randn(4, 3, dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.Adam([p], lr=0.01, betas=(0.7, 0.95))
    m = v = torch.zeros_like(theta)
    for _ in range(3):
        g = torch.randn(4, 3, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        m, v = optim.adam_moments(m, v, g, 0.7, 0.95)
        torch.testing.assert_close(m, opt.state[p]["exp_avg"], **F64)
        torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"], **F64)


@pytest.mark.equation("08.04", oracle="torch.optim.Adam, three steps")
def test_adam_update_matches_torch():
    theta = torch.randn(6, dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.Adam([p], lr=0.05, betas=(0.9, 0.99), eps=1e-3)
    m = v = torch.zeros_like(theta)
    for t in (1, 2, 3):
        g = torch.randn(6, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        m, v = optim.adam_moments(m, v, g, 0.9, 0.99)
        theta = optim.adam_update(theta, m, v, t, lr=0.05, beta1=0.9, beta2=0.99, eps=1e-3)
        torch.testing.assert_close(theta, p.detach(), **F64)


@pytest.mark.equation("08.05", oracle="torch.optim.AdamW, three steps")
def test_adamw_update_matches_torch():
    theta = torch.randn(6, dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = torch.optim.AdamW([p], lr=0.05, weight_decay=0.3)
    m = v = torch.zeros_like(theta)
    for t in (1, 2, 3):
        g = torch.randn(6, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        m, v = optim.adam_moments(m, v, g)
        theta = optim.adamw_update(theta, m, v, t, lr=0.05, weight_decay=0.3)
        torch.testing.assert_close(theta, p.detach(), **F64)


@pytest.mark.equation("08.06", oracle="lion_pytorch.Lion, three steps")
def test_lion_step_matches_lion_pytorch():
    theta = torch.randn(6, dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = lion_pytorch.Lion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.5)
    m = torch.zeros_like(theta)
    for _ in range(3):
        g = torch.randn(6, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        theta, m = optim.lion_step(theta, m, g, lr=0.01, weight_decay=0.5)
        torch.testing.assert_close(theta, p.detach(), **F64)
        torch.testing.assert_close(m, opt.state[p]["exp_avg"], **F64)
    moves = (optim.lion_step(theta, m, torch.randn(6, dtype=torch.float64), lr=0.01)[0] - theta).abs()
    torch.testing.assert_close(moves, torch.full_like(moves, 0.01), **F64)  # every coordinate moves by lr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rules_agree_with_float64(dtype):
    g = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(dtype) * 300  # g^2 > fp16's range / 100
    m, v = optim.adam_moments(torch.zeros(64, dtype=dtype), torch.zeros(64, dtype=dtype), g)
    z64 = torch.zeros(64, dtype=torch.float64)
    m64, v64 = optim.adam_moments(z64, z64, g.double())
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(m.double(), m64.to(dtype).double(), rtol=4 * eps, atol=0)
    torch.testing.assert_close(v.double(), v64.to(dtype).double(), rtol=4 * eps, atol=0)


def test_classes_train_half_precision_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).bfloat16()
    opt = optim.AdamW(lin.parameters(), lr=1e-2)
    x = torch.randn(4, 8).bfloat16()
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = lin(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert opt.state[lin.weight]["exp_avg"].dtype == torch.bfloat16
    assert losses[-1] < 0.5 * losses[0]


# ----------------------------------------------------------------------------- claim C09


def adam_first_steps(scale: float, lr: float = 1e-3):
    """(ours, torch.optim.Adam) first updates for a gradient of a given scale (the C09 data)."""
    g = torch.tensor([0.3, -1.7, 0.05, 2.4], dtype=torch.float64) * scale
    theta = torch.zeros(4, dtype=torch.float64)
    m, v = optim.adam_moments(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), g)
    ours = optim.adam_update(theta, m, v, t=1, lr=lr) - theta
    ref = _one_torch_step(torch.optim.Adam, theta, g, lr=lr)[0] - theta
    return g, ours, ref


def adamw_vs_l2(steps: int = 2000, lr: float = 1e-2, weight_decay: float = 0.1):
    """Final weights of AdamW and Adam+L2 (ours and torch's) on L = 1/2 sum a_i (theta_i - 1)^2, a = (100, 0.01)."""
    a = torch.tensor([100.0, 0.01], dtype=torch.float64)
    out = {}
    for name, cls in (("AdamW", optim.AdamW), ("torch AdamW", torch.optim.AdamW),
                      ("Adam+L2", optim.Adam), ("torch Adam+L2", torch.optim.Adam)):
        theta = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt = cls([theta], lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * a * (theta - 1) ** 2).sum().backward()
            opt.step()
        out[name] = theta.detach().clone()
    return a, out


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_claim_c09_first_adam_step_is_lr_times_sign(scale):
    g, ours, ref = adam_first_steps(scale)
    torch.testing.assert_close(ours, -1e-3 * torch.sign(g), rtol=1e-3, atol=0)  # eps / |g| <= 1e-8 / 5e-5 = 2e-4
    torch.testing.assert_close(ours, ref, **F64)


def test_claim_c09_scale_free_until_g_nears_eps():
    g, ours, _ = adam_first_steps(1e-8)  # |g| ~ eps: the step shrinks to lr |g| / (|g| + eps)
    expected = -1e-3 * g / (g.abs() + 1e-8)
    torch.testing.assert_close(ours, expected, **F64)
    assert ours.abs().max() < 0.75e-3


def test_claim_c09_adamw_differs_from_adam_with_l2():
    a, w = adamw_vs_l2()
    torch.testing.assert_close(w["AdamW"], w["torch AdamW"], **F64)
    torch.testing.assert_close(w["Adam+L2"], w["torch Adam+L2"], **F64)
    # L2 through Adam converges to the minimiser of L + lambda/2 |theta|^2: a / (a + lambda) per coordinate,
    # so the flat coordinate (a = 0.01) is crushed to 0.09 while the steep one keeps 0.999
    torch.testing.assert_close(w["Adam+L2"], a / (a + 0.1), rtol=1e-3, atol=1e-3)
    # AdamW's decay is not divided by sqrt(v): both coordinates are pulled alike, and the flat one stays large
    assert w["AdamW"][1] > 0.5 and (w["AdamW"] - w["Adam+L2"]).abs().max() > 0.4


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, err", [
    (lambda p: optim.SGD(p, lr=-1.0), ValueError),
    (lambda p: optim.SGD(p, lr=0.1, momentum=1.5), ValueError),
    (lambda p: optim.Adam(p, lr=float("nan")), ValueError),
    (lambda p: optim.Adam(p, betas=(0.9, 1.0)), ValueError),
    (lambda p: optim.Adam(p, betas=0.9), TypeError),
    (lambda p: optim.AdamW(p, eps=-1e-8), ValueError),
    (lambda p: optim.AdamW(p, weight_decay="0.1"), TypeError),
    (lambda p: optim.Lion(p, betas=(0.9, 1.1)), ValueError),
    (lambda p: optim.Lion(p, lr=True), TypeError),
])
def test_optimizers_reject_bad_hyperparameters(make, err):
    with pytest.raises(err):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_param_groups_are_checked_too():
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="lr"):
        optim.AdamW([{"params": [p]}, {"params": [q], "lr": -1.0}])


def test_sparse_gradients_are_rejected():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        optim.Adam([p]).step()


def test_rules_reject_bad_tensors():
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        optim.sgd_step(z, torch.zeros(4), 0.1)
    with pytest.raises(TypeError, match="share one dtype"):
        optim.adam_moments(z, z, z.double())
    with pytest.raises(ValueError, match="non-negative"):
        optim.adam_update(z, z, -torch.ones(3), t=1)
    with pytest.raises(ValueError, match="t must be a positive int"):
        optim.adam_update(z, z, z, t=0)
    with pytest.raises(TypeError):
        optim.lion_step(z, z, torch.ones(3, dtype=torch.bool))


def test_closure_is_evaluated_with_grad():
    p = torch.nn.Parameter(torch.tensor([2.0]))
    opt = optim.SGD([p], lr=0.5)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert math.isclose(opt.step(closure).item(), 4.0)
    assert math.isclose(p.item(), 0.0)


# ----------------------------------------------------------------------------- Try-it numbers of chapter 8


def test_try_it_momentum_settles_to_ten_times_the_gradient_after_44_steps():
    """Chapter 8, Try it 1: constant g, mu = 0.9: the buffer tends to g / (1 - mu) = 10 g; within 1 % at t = 44."""
    g = torch.ones(1, dtype=torch.float64)
    theta, v, first = torch.zeros(1, dtype=torch.float64), None, None
    for t in range(1, 200):
        theta, v = optim.momentum_step(theta, g, v, lr=0.1, momentum=0.9)
        if first is None and v.item() >= 0.99 * 10:
            first = t
    assert first == 44 and math.isclose(v.item(), 10.0, rel_tol=1e-8)


def test_try_it_adam_first_step_is_half_of_lr_at_g_equal_eps():
    """Chapter 8, Try it 3: |g| = eps = 1e-8 makes the first Adam step exactly lr / 2 (torch.optim.Adam agrees)."""
    g = torch.tensor([1e-8, -1e-8], dtype=torch.float64)
    m, v = optim.adam_moments(torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), g)
    step = optim.adam_update(torch.zeros(2, dtype=torch.float64), m, v, t=1, lr=1e-3)
    torch.testing.assert_close(step, torch.tensor([-5e-4, 5e-4], dtype=torch.float64), rtol=1e-12, atol=0)
    ref = _one_torch_step(torch.optim.Adam, torch.zeros(2, dtype=torch.float64), g, lr=1e-3)[0]
    torch.testing.assert_close(step, ref, **F64)
