"""Clipping (08.08) and the learning-rate schedules (08.09-08.11) against torch and transformers.

Tolerances: clipping against ``torch.nn.utils.clip_grad_norm_`` (float64): ``atol = 1e-12``,
``rtol = 1e-10`` (``F64``); schedules against ``torch.optim.lr_scheduler`` / transformers' schedule
functions (the learning rate a real optimiser holds after ``t`` scheduler steps): ``rel_tol = 1e-12``
(``REL``); the off-by-one conventions are checked exactly (``==``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_inverse_sqrt_schedule,
    get_wsd_schedule,
)

from llmbook.lm import schedules as sc

F64 = dict(rtol=1e-10, atol=1e-12)
REL = 1e-12


def _lrs(make_scheduler, n: int, lr: float = 1.0) -> list[float]:
    """The lr a torch optimiser holds before each of n updates, driven by make_scheduler(optimizer)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make_scheduler(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def _close(a, b):
    return math.isclose(a, b, rel_tol=REL, abs_tol=1e-15)


# ----------------------------------------------------------------------------- 08.08 clipping


def _params_with_grads(scale: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (3,), (2, 2, 2)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=torch.float64)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64) * scale
    ps.append(torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))  # no gradient: skipped
    return ps


@pytest.mark.equation("08.08", oracle="torch.nn.utils.clip_grad_norm_")
@pytest.mark.parametrize("scale", [1e-3, 0.2, 1.0, 50.0])
def test_clip_grad_norm_matches_torch(scale):
    ours, ref = _params_with_grads(scale), _params_with_grads(scale)
    n_ours = sc.clip_grad_norm_(ours, max_norm=1.0)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    torch.testing.assert_close(n_ours, n_ref, **F64)
    for a, b in zip(ours, ref, strict=True):
        if b.grad is None:
            assert a.grad is None
        else:
            torch.testing.assert_close(a.grad, b.grad, **F64)
    clipped = math.sqrt(sum(float((p.grad**2).sum()) for p in ours if p.grad is not None))
    assert clipped <= 1.0 + 1e-12 and (n_ref <= 1.0 or clipped > 0.999)


@pytest.mark.equation("08.08", oracle="float64 closed form g * min(1, c / ||g||)")
def test_clip_by_global_norm_keeps_the_direction():
    gs = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([[4.0]], dtype=torch.float64)]
    clipped, total = sc.clip_by_global_norm(gs, 2.5, eps=0.0)
    assert total.item() == 5.0
    torch.testing.assert_close(clipped[0], torch.tensor([1.5, 0.0], dtype=torch.float64), **F64)
    torch.testing.assert_close(clipped[1], torch.tensor([[2.0]], dtype=torch.float64), **F64)
    # below the threshold nothing changes, bit for bit
    small, _ = sc.clip_by_global_norm(gs, 100.0)
    assert all(torch.equal(a, b) for a, b in zip(small, gs, strict=True))


def test_clip_survives_huge_float32_gradients():
    g = torch.full((1000,), 1e30)  # the sum of squares overflows float32; the rescaled norm does not
    clipped, total = sc.clip_by_global_norm(g, 1.0)
    assert math.isclose(total.item(), 1e30 * math.sqrt(1000), rel_tol=1e-5)
    assert math.isclose(float(clipped.double().norm()), 1.0, rel_tol=1e-4)


def test_clip_rejects_bad_input():
    with pytest.raises(ValueError, match="max_norm"):
        sc.clip_by_global_norm(torch.ones(2), 0.0)
    with pytest.raises(TypeError, match="share one dtype"):
        sc.clip_by_global_norm([torch.ones(2), torch.ones(2, dtype=torch.float64)], 1.0)
    with pytest.raises(TypeError, match="parameters"):
        sc.clip_grad_norm_(3, 1.0)


# ----------------------------------------------------------------------------- 08.09 - 08.11 schedules


@pytest.mark.equation("08.09", oracle="torch.optim.lr_scheduler.CosineAnnealingLR")
@pytest.mark.parametrize("eta_min", [0.0, 0.1])
def test_cosine_decay_matches_cosine_annealing_lr(eta_min):
    T = 50
    ref = _lrs(lambda o: CosineAnnealingLR(o, T_max=T, eta_min=eta_min), T + 1, lr=2.0)
    ours = [sc.cosine_decay(t, T, 2.0, eta_min) for t in range(T + 1)]
    assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(ours, ref, strict=True))
    # past T torch climbs back up (a periodic cosine); ours stays at eta_min
    after = _lrs(lambda o: CosineAnnealingLR(o, T_max=T, eta_min=eta_min), T + 10, lr=2.0)[-1]
    assert after > eta_min + 1e-3 and sc.cosine_decay(T + 9, T, 2.0, eta_min) == eta_min


@pytest.mark.equation("08.10", oracle="transformers.get_constant_schedule_with_warmup")
def test_linear_warmup_matches_transformers():
    ref = _lrs(lambda o: get_constant_schedule_with_warmup(o, num_warmup_steps=10), 20, lr=3e-4)
    ours = [sc.linear_warmup(t, 10, 3e-4) for t in range(20)]
    assert all(_close(a, b) for a, b in zip(ours, ref, strict=True))
    assert ours[0] == 0.0 and ours[10] == 3e-4  # the convention: eta_0 = 0, the peak at t = T_warm
    assert sc.linear_warmup(0, 0, 3e-4) == 3e-4  # no warm-up


@pytest.mark.equation("08.09", "08.10", oracle="transformers.get_cosine_schedule_with_warmup / _with_min_lr")
def test_warmup_cosine_matches_transformers():
    T_warm, T = 10, 100
    ref = _lrs(lambda o: get_cosine_schedule_with_warmup(o, T_warm, T), T + 1, lr=6e-4)
    ours = [sc.warmup_cosine(t, T_warm, T, 6e-4) for t in range(T + 1)]
    assert all(_close(a, b) for a, b in zip(ours, ref, strict=True))
    ref_min = _lrs(lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, T_warm, T, min_lr_rate=0.1), T + 1, lr=6e-4)
    ours_min = [sc.warmup_cosine(t, T_warm, T, 6e-4, 6e-5) for t in range(T + 1)]
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(ours_min, ref_min, strict=True))


@pytest.mark.equation("08.11", oracle="transformers.get_inverse_sqrt_schedule times (d_model T_warm)^-1/2")
def test_inverse_sqrt_matches_transformers():
    d_model, T_warm = 512, 40
    peak = (d_model * T_warm) ** -0.5
    ref = _lrs(lambda o: get_inverse_sqrt_schedule(o, num_warmup_steps=T_warm), 400, lr=peak)
    ours = [sc.inverse_sqrt(t, d_model, T_warm) for t in range(400)]
    assert all(_close(a, b) for a, b in zip(ours, ref, strict=True))
    assert max(ours) == ours[T_warm] and _close(ours[T_warm], peak)
    assert _close(ours[4 * T_warm], peak / 2)  # 1/sqrt(t): four times later, half the rate


@pytest.mark.equation("08.11", oracle="float64 closed form of Vaswani et al. (2017), eq. 3")
def test_inverse_sqrt_is_the_transformer_schedule():
    for step in (1, 100, 3999, 4000, 4001, 10**5):
        expected = 512**-0.5 * min(step**-0.5, step * 4000**-1.5)
        assert _close(sc.inverse_sqrt(step, 512, 4000), expected)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
@pytest.mark.parametrize("T_warm, T, frac", [(20, 300, 0.2), (0, 100, 0.1), (5, 50, 1 - 5 / 50)])
def test_warmup_stable_decay_matches_transformers_get_wsd_schedule(shape, T_warm, T, frac):
    """Oracle: transformers.get_wsd_schedule (eta_min = 0), the rate a real optimiser holds at each step."""
    eta_max, T_dec = 3e-3, round(frac * T)
    ref = _lrs(lambda o: get_wsd_schedule(o, num_warmup_steps=T_warm, num_decay_steps=T_dec,
                                          num_training_steps=T, decay_type=shape), T + 5, eta_max)
    ours = [sc.warmup_stable_decay(t, T_warm, T, eta_max, decay_fraction=frac, shape=shape) for t in range(T + 5)]
    for t, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert math.isclose(a, b, rel_tol=REL, abs_tol=1e-18), (t, a, b)


def test_warmup_stable_decay_with_a_floor_and_bad_input():
    """eta_min: transformers' min_lr_ratio maps [0, 1] onto [eta_min/eta_max, 1] in the decay phase."""
    ref = _lrs(lambda o: get_wsd_schedule(o, 10, 40, num_training_steps=200, min_lr_ratio=0.1,
                                          decay_type="cosine"), 200, 1.0)
    ours = [sc.warmup_stable_decay(t, 10, 200, 1.0, 0.1, decay_fraction=0.2, shape="cosine") for t in range(200)]
    # transformers also lifts the warm-up to min_lr_ratio; ours starts at 0
    for a, b in zip(ours[10:], ref[10:], strict=True):
        assert math.isclose(a, b, rel_tol=REL)
    assert sc.warmup_stable_decay(500, 10, 200, 1.0, 0.1) == 0.1
    with pytest.raises(ValueError, match="shape"):
        sc.warmup_stable_decay(0, 1, 10, 1.0, shape="step")
    with pytest.raises(ValueError, match="T_warm"):
        sc.warmup_stable_decay(0, 9, 10, 1.0, decay_fraction=0.5)
    with pytest.raises(ValueError, match="decay_fraction"):
        sc.warmup_stable_decay(0, 1, 10, 1.0, decay_fraction=1.5)


def test_lambda_lr_drives_a_real_optimizer_with_our_schedule():
    kw = dict(T_warm=5, T=30, eta_max=1e-3, eta_min=1e-4)
    got = _lrs(lambda o: sc.lambda_lr(o, sc.warmup_cosine, **kw), 35, lr=1e-3)
    assert all(math.isclose(a, sc.warmup_cosine(t, **kw), rel_tol=1e-15, abs_tol=1e-18) for t, a in enumerate(got))


@pytest.mark.parametrize("call, err", [
    (lambda: sc.cosine_decay(-1, 10, 1.0), ValueError),
    (lambda: sc.cosine_decay(1, 0, 1.0), ValueError),
    (lambda: sc.cosine_decay(1, 10, 1.0, eta_min=2.0), ValueError),
    (lambda: sc.linear_warmup(1, 2.5, 1.0), TypeError),
    (lambda: sc.warmup_cosine(1, 20, 10, 1.0), ValueError),
    (lambda: sc.inverse_sqrt(1, 0, 10), ValueError),
    (lambda: sc.inverse_sqrt(float("nan"), 8, 10), ValueError),
    (lambda: sc.lambda_lr("opt", sc.linear_warmup), TypeError),
    (lambda: sc.lambda_lr(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), sc.linear_warmup, T=3),
     TypeError),
])
def test_schedules_reject_bad_input(call, err):
    with pytest.raises(err):
        call()


# ----------------------------------------------------------------------------- Try-it numbers of chapter 8


def test_try_it_gpt3_schedule_numbers():
    """Chapter 8, Try it 2: GPT-3 175B's schedule in steps.

    Warm-up over 375M tokens, cosine decay to 10 % over 260B tokens, 3.2M tokens a batch.
    """
    T_warm, T = round(375e6 / 3.2e6), round(260e9 / 3.2e6)
    assert (T_warm, T) == (117, 81250)
    lr = [sc.warmup_cosine(t, T_warm, T, 6e-5, 6e-6) for t in (T_warm, T // 2, T)]
    assert [round(x * 1e6, 2) for x in lr] == [60.0, 33.06, 6.0]
