r"""Gradient clipping and learning-rate schedules (chapter 8).

* :func:`clip_by_global_norm` (08.08) rescales a whole set of gradients so that their joint L2 norm
  is at most :math:`c`; :func:`clip_grad_norm_` applies it in place to the ``.grad`` of a model's
  parameters, as ``torch.nn.utils.clip_grad_norm_`` (GPT-3 and Llama clip at :math:`c = 1`);
* the schedules are plain functions of the step ``t`` that return a learning rate:
  :func:`cosine_decay` (08.09), :func:`linear_warmup` (08.10), their composition
  :func:`warmup_cosine` (the schedule of GPT-3, Llama and the book's tiny GPT) and
  :func:`inverse_sqrt` (08.11, the original Transformer's; T5 uses a relative of it) and
  :func:`warmup_stable_decay` (WSD: warm-up, a long constant phase, a short final decay);
* :func:`lambda_lr` drives a ``torch.optim`` optimiser with any of them through
  ``torch.optim.lr_scheduler.LambdaLR``.

Conventions: ``t`` counts updates from 0 (the first update uses :math:`\eta_0`, as ``LambdaLR`` and
transformers' schedules count), so a warm-up starts at :math:`\eta_0 = 0`; past the end of a decay
(:math:`t > T`) the rate stays at :math:`\eta_{min}`, where ``CosineAnnealingLR`` and transformers'
cosine would climb back up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.optim.lr_scheduler import LambdaLR

from llmbook._checks import as_tensor, check_int, check_positive_int, check_range
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["clip_by_global_norm", "clip_grad_norm_", "cosine_decay", "linear_warmup", "warmup_cosine",
           "inverse_sqrt", "warmup_stable_decay", "lambda_lr"]


# --------------------------------------------------------------------------- 08.08 clipping


def _global_norm(gs: list[Tensor]) -> Tensor:
    """sqrt(sum_i ||g_i||^2) in the compute dtype; each norm is taken on g / max|g| so no square overflows."""
    dt = compute_dtype(gs[0].dtype) if gs else torch.get_default_dtype()
    norms = []
    for g in gs:
        g = upcast_half(g)
        peak = g.abs().amax() if g.numel() else g.new_zeros(())
        scale = torch.where(torch.isfinite(peak) & (peak > 0), peak, torch.ones_like(peak))
        norms.append(torch.linalg.vector_norm(g / scale) * scale)
    if not norms:
        return torch.zeros((), dtype=dt)
    n = torch.stack(norms)
    peak = n.amax()
    scale = torch.where(torch.isfinite(peak) & (peak > 0), peak, torch.ones_like(peak))
    return torch.linalg.vector_norm(n / scale) * scale


@implements("08.08")
def clip_by_global_norm(grads, max_norm: float, eps: float = 1e-6):
    r"""Global gradient clipping: :math:`g \leftarrow g\cdot\min\!\left(1, \frac{c}{\|g\|_2+\epsilon}\right)`.

    :math:`g` is *all* the gradients together, :math:`\|g\|_2=\sqrt{\sum_i\|g_i\|_2^2}` (one norm for
    the whole model, so the direction of the update is kept; clipping each tensor alone would bend
    it). ``grads`` is one tensor or a sequence of tensors (any shapes, one dtype), ``max_norm`` is
    :math:`c>0`, ``eps`` the :math:`10^{-6}` that torch adds to the norm. Returns
    ``(clipped, total_norm)``: the clipped gradients in the input's structure and dtype, and
    :math:`\|g\|_2` before clipping (float32 for fp16 / bf16 input). Norms are computed on rescaled
    tensors, so a float32 gradient of :math:`10^{30}` has a finite norm.

    >>> clipped, norm = clip_by_global_norm([torch.tensor([3.0]), torch.tensor([4.0])], max_norm=1.0, eps=0.0)
    >>> clipped, norm
    ([tensor([0.6000]), tensor([0.8000])], tensor(5.))
    """
    single = isinstance(grads, Tensor) or not isinstance(grads, (list, tuple))
    gs = [as_tensor(grads, "grads")] if single else [as_tensor(g, f"grads[{i}]") for i, g in enumerate(grads)]
    for i, g in enumerate(gs[1:], 1):
        if g.dtype != gs[0].dtype:
            raise TypeError(f"grads[{i}] ({g.dtype}) and grads[0] ({gs[0].dtype}) must share one dtype")
    c = check_range(max_norm, "max_norm", 0.0, low_open=True)
    eps = check_range(eps, "eps", 0.0)
    total = _global_norm(gs)
    coef = torch.clamp(c / (total + eps), max=1.0) if total > 0 else torch.ones_like(total)
    clipped = [restore_half(upcast_half(g) * coef, g.dtype) for g in gs]
    return (clipped[0] if single else clipped), total


def clip_grad_norm_(parameters, max_norm: float, eps: float = 1e-6) -> Tensor:
    r"""Clip the ``.grad`` of ``parameters`` in place by their global norm (08.08); return that norm.

    ``parameters`` is a tensor or an iterable of tensors (``model.parameters()``); those without a
    gradient are skipped, as in ``torch.nn.utils.clip_grad_norm_``, which this matches. The arithmetic
    is :func:`clip_by_global_norm`'s.

    >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_([p], max_norm=1.0), p.grad
    (tensor(5.), tensor([0.6000, 0.8000]))
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(_iter(parameters))
    grads = [p.grad for p in params if p.grad is not None]
    clipped, total = clip_by_global_norm(grads, max_norm, eps)
    with torch.no_grad():
        for g, new in zip(grads, clipped, strict=True):
            g.copy_(new)
    return total


def _iter(parameters) -> Iterable[Tensor]:
    if not isinstance(parameters, Iterable):
        raise TypeError(f"parameters must be a tensor or an iterable of tensors, got {type(parameters).__name__}")
    for i, p in enumerate(parameters):
        if not isinstance(p, Tensor):
            raise TypeError(f"parameters[{i}] must be a tensor, got {type(p).__name__}")
        yield p


# --------------------------------------------------------------------------- schedules


def _t(t) -> float:
    return check_range(t, "t", 0.0)


def _etas(eta_max, eta_min) -> tuple[float, float]:
    eta_max = check_range(eta_max, "eta_max", 0.0)
    return eta_max, check_range(eta_min, "eta_min", 0.0, eta_max)


@implements("08.09")
def cosine_decay(t: float, T: int, eta_max: float, eta_min: float = 0.0) -> float:
    r"""Cosine decay from :math:`\eta_{max}` at :math:`t=0` to :math:`\eta_{min}` at :math:`t=T`.

    .. math:: \eta_t=\eta_{min}+\tfrac12(\eta_{max}-\eta_{min})\left(1+\cos\frac{\pi t}{T}\right),
              \quad 0\le t\le T;\qquad \eta_t=\eta_{min},\quad t>T

    ``t`` is the step (a real :math:`\ge 0`), ``T`` the length of the decay (an int :math:`\ge 1`),
    :math:`0\le\eta_{min}\le\eta_{max}`. Equals ``CosineAnnealingLR(T_max=T, eta_min=...)`` for
    :math:`t\le T` (torch's then climbs back up: it is half a period of a cosine).

    >>> cosine_decay(0, 100, 1.0), cosine_decay(50, 100, 1.0), cosine_decay(100, 100, 1.0, 0.1)
    (1.0, 0.5, 0.1)
    """
    t, T = _t(t), check_positive_int(T, "T")
    eta_max, eta_min = _etas(eta_max, eta_min)
    if t >= T:
        return eta_min
    return eta_min + 0.5 * (eta_max - eta_min) * (1.0 + math.cos(math.pi * t / T))


@implements("08.10")
def linear_warmup(t: float, T_warm: int, eta_max: float) -> float:
    r"""Linear warm-up: :math:`\eta_t=\eta_{max}\,t/T_{warm}` for :math:`t\le T_{warm}`, then :math:`\eta_{max}`.

    ``T_warm`` is an int :math:`\ge 0` (0: no warm-up). At :math:`t=0` the rate is 0, as in
    transformers' ``get_constant_schedule_with_warmup`` (nanoGPT uses :math:`(t+1)/(T_{warm}+1)`
    so that its first update is not wasted). Adam's :math:`v` is still a noisy estimate for the first
    hundreds of steps; warm-up keeps those steps small.

    >>> linear_warmup(0, 10, 1e-3), linear_warmup(5, 10, 1e-3), linear_warmup(50, 10, 1e-3)
    (0.0, 0.0005, 0.001)
    """
    t, T_warm = _t(t), check_int(T_warm, "T_warm", low=0)
    eta_max = check_range(eta_max, "eta_max", 0.0)
    return eta_max if t >= T_warm else eta_max * t / T_warm


def warmup_cosine(t: float, T_warm: int, T: int, eta_max: float, eta_min: float = 0.0) -> float:
    r"""Linear warm-up over ``T_warm`` steps, then cosine decay to ``eta_min`` at step ``T``.

    :func:`linear_warmup` (08.10) for :math:`t<T_{warm}`, then :func:`cosine_decay` (08.09) of
    :math:`t-T_{warm}` over :math:`T-T_{warm}` steps; :math:`0\le T_{warm}\le T`. The schedule of
    GPT-3 (375M warm-up tokens, decay to 10 %), Llama 2 (2000 steps, decay to 10 %) and the book's
    tiny GPT; with ``eta_min = 0`` it is transformers' ``get_cosine_schedule_with_warmup``.

    >>> [round(warmup_cosine(t, 2, 6, 1.0, 0.1), 4) for t in range(8)]
    [0.0, 0.5, 1.0, 0.8682, 0.55, 0.2318, 0.1, 0.1]
    """
    t, T_warm, T = _t(t), check_int(T_warm, "T_warm", low=0), check_positive_int(T, "T")
    if T_warm > T:
        raise ValueError(f"T_warm must be <= T, got T_warm = {T_warm} > T = {T}")
    eta_max, eta_min = _etas(eta_max, eta_min)
    if t < T_warm:
        return linear_warmup(t, T_warm, eta_max)
    if t >= T:
        return eta_min
    return cosine_decay(t - T_warm, T - T_warm, eta_max, eta_min)


@implements("08.11")
def inverse_sqrt(t: float, d_model: int, T_warm: int) -> float:
    r"""The Transformer's schedule: :math:`\eta_t=d_{model}^{-1/2}\min(t^{-1/2},\ t\,T_{warm}^{-3/2})`.

    Linear growth up to :math:`t=T_{warm}`, where both branches meet at the peak
    :math:`(d_{model}T_{warm})^{-1/2}`, then decay as :math:`1/\sqrt t`, with no end: training can
    stop at any step. ``t`` is a real :math:`\ge 0` (:math:`\eta_0=0`), ``d_model`` and ``T_warm``
    ints :math:`\ge 1`. Equals :math:`(d_{model}T_{warm})^{-1/2}` times transformers'
    ``get_inverse_sqrt_schedule(num_warmup_steps=T_warm)``. (Vaswani et al.: :math:`d = 512`,
    :math:`T_{warm}=4000`, peak :math:`7\cdot10^{-4}`.)

    >>> round(inverse_sqrt(4000, 512, 4000), 7), inverse_sqrt(0, 512, 4000)
    (0.0006988, 0.0)
    """
    t, d_model, T_warm = _t(t), check_positive_int(d_model, "d_model"), check_positive_int(T_warm, "T_warm")
    if t == 0:
        return 0.0
    return d_model**-0.5 * min(t**-0.5, t * T_warm**-1.5)


DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def warmup_stable_decay(t: float, T_warm: int, T: int, eta_max: float, eta_min: float = 0.0,
                        decay_fraction: float = 0.2, shape: str = "linear") -> float:
    r"""Warmup-stable-decay (WSD): warm up, hold :math:`\eta_{max}`, and decay only over the last steps.

    .. math:: \eta_t = \begin{cases} \eta_{max}\,t/T_{warm} & t < T_{warm}\\
              \eta_{max} & T_{warm} \le t < T - T_{dec}\\
              \eta_{min} + (\eta_{max}-\eta_{min})\,f\big((t - T + T_{dec})/T_{dec}\big) & T - T_{dec} \le t < T\\
              \eta_{min} & t \ge T \end{cases}

    with :math:`T_{dec} = \mathrm{round}(` ``decay_fraction`` :math:`\cdot\,T)` decay steps and :math:`f(s)`
    ``1 - s`` (``shape="linear"``), :math:`\tfrac12(1+\cos\pi s)` (``"cosine"``) or :math:`1-\sqrt s`
    (``"1-sqrt"``). Unlike :func:`cosine_decay` the rate does not depend on :math:`T` until the decay
    starts, so one long constant-rate run can be branched into decays at several lengths (MiniCPM; Hägele
    et al. 2024). With ``eta_min = 0`` it is transformers' ``get_wsd_schedule(num_warmup_steps=T_warm,
    num_decay_steps=T_dec, num_training_steps=T, decay_type=shape)`` times :math:`\eta_{max}`. Requires
    :math:`0 \le T_{warm} \le T - T_{dec}`, ``decay_fraction`` in :math:`[0, 1]`.

    >>> [round(warmup_stable_decay(t, 2, 10, 1.0, decay_fraction=0.4), 2) for t in range(11)]
    [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    t, T_warm, T = _t(t), check_int(T_warm, "T_warm", low=0), check_positive_int(T, "T")
    eta_max, eta_min = _etas(eta_max, eta_min)
    decay_fraction = check_range(decay_fraction, "decay_fraction", 0.0, 1.0)
    if shape not in DECAY_SHAPES:
        raise ValueError(f"shape must be one of {DECAY_SHAPES}, got {shape!r}")
    T_dec = round(decay_fraction * T)
    if T_warm > T - T_dec:
        raise ValueError(f"T_warm must be <= T - T_dec = {T} - {T_dec}, got T_warm = {T_warm}")
    if t < T_warm:
        return linear_warmup(t, T_warm, eta_max)
    if t >= T:
        return eta_min
    if t < T - T_dec:
        return eta_max
    s = (t - (T - T_dec)) / T_dec
    f = {"linear": 1.0 - s, "cosine": 0.5 * (1.0 + math.cos(math.pi * s)), "1-sqrt": 1.0 - math.sqrt(s)}[shape]
    return eta_min + (eta_max - eta_min) * f


def lambda_lr(optimizer: torch.optim.Optimizer, schedule: Callable[..., float], **kwargs) -> LambdaLR:
    """A ``LambdaLR`` that sets every group's learning rate to ``schedule(t, **kwargs)``.

    ``LambdaLR`` multiplies each group's initial ``lr`` by a factor, so the factor is
    ``schedule(t, **kwargs) / initial lr`` (equal to the schedule up to one rounding); the initial lrs
    must be positive. Call ``scheduler.step()`` after each ``optimizer.step()``, as with any torch scheduler.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = lambda_lr(opt, linear_warmup, T_warm=4, eta_max=0.1)
    >>> lr_0 = opt.param_groups[0]["lr"]
    >>> opt.step(); sched.step()
    >>> lr_0, round(opt.param_groups[0]["lr"], 6)
    (0.0, 0.025)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(schedule):
        raise TypeError(f"schedule must be callable, got {type(schedule).__name__}")
    schedule(0, **kwargs)  # bad keyword arguments fail here, not at the first step
    lambdas = []
    for i, group in enumerate(optimizer.param_groups):
        base = group.get("initial_lr", group["lr"])
        check_range(base, f"the initial lr of param group {i}", 0.0, low_open=True)
        lambdas.append(lambda t, base=base: schedule(t, **kwargs) / base)
    return LambdaLR(optimizer, lambdas)
