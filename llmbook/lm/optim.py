r"""Optimisers (chapter 8): SGD, momentum, Adam, AdamW and Lion, as equations and as torch optimisers.

Two layers, one kernel each:

* **the update rules** (registered): :func:`sgd_step` (08.01), :func:`momentum_step` (08.02),
  :func:`adam_moments` (08.03), :func:`adam_update` (08.04), :func:`adamw_update` (08.05) and
  :func:`lion_step` (08.06) take tensors and return new tensors. They check their arguments and
  compute fp16 / bf16 input in float32;
* **the optimisers** :class:`SGD`, :class:`Adam`, :class:`AdamW` and :class:`Lion` are
  ``torch.optim.Optimizer`` subclasses with torch's argument names and state keys
  (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``step``), so ``state_dict()`` round-trips.
  Their ``step`` runs the same private kernels as the rules above (without re-checking every tensor
  on every step) and matches ``torch.optim`` / ``lion-pytorch`` step for step (tests: float64, 100 steps).

Adafactor (08.07) lives in :mod:`llmbook.lm.adafactor`. Not supported here: ``amsgrad``,
``nesterov``, ``dampening``, ``maximize``, sparse gradients, the ``foreach`` / ``fused`` kernels.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.optim import Optimizer

from llmbook._checks import as_tensor, check_positive_int, check_range, check_same_dtype, check_same_shape
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["sgd_step", "momentum_step", "adam_moments", "adam_update", "adamw_update", "lion_step",
           "SGD", "Adam", "AdamW", "Lion"]


# --------------------------------------------------------------------------- argument checks


def _tensors(names: str, *xs) -> list[Tensor]:
    """The tensors ``xs`` (array-likes converted), which must share one shape and one dtype."""
    names = names.split()
    ts = [as_tensor(x, n) for n, x in zip(names, xs, strict=True)]
    for n, t in zip(names[1:], ts[1:], strict=True):
        check_same_shape(ts[0], t, names[0], n)
        check_same_dtype(ts[0], t, names[0], n)
    return ts


def _lr(lr) -> float:
    return check_range(lr, "lr", 0.0)


def _beta(beta, name: str, closed: bool = False) -> float:
    """Adam's betas lie in [0, 1) (the bias correction divides by 1 - beta^t); Lion's in [0, 1]."""
    return check_range(beta, name, 0.0, 1.0, high_open=not closed)


def _betas(betas, closed: bool = False) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return _beta(betas[0], "beta1", closed), _beta(betas[1], "beta2", closed)


def _nonneg(value, name: str) -> float:
    return check_range(value, name, 0.0)


def _check_v(v: Tensor) -> None:
    if v.numel() and (v < 0).any():
        raise ValueError("v (a running mean of g^2) must be non-negative, got a negative entry")


# --------------------------------------------------------------------------- kernels (no checks)


def _momentum(v: Tensor | None, g: Tensor, momentum: float) -> Tensor:
    return g.clone() if v is None else momentum * v + g  # torch starts the buffer at g, not at 0


def _moments(m: Tensor, v: Tensor, g: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    return beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * (g * g)


def _adam_step(m: Tensor, v: Tensor, t: int, lr: float, beta1: float, beta2: float, eps: float) -> Tensor:
    """lr * m_hat / (sqrt(v_hat) + eps), with sqrt(v_hat) = sqrt(v) / sqrt(1 - beta2^t) as in torch."""
    denom = v.sqrt() / math.sqrt(1 - beta2**t) + eps
    return (lr / (1 - beta1**t)) * m / denom


def _lion(theta, m, g, lr, beta1, beta2, weight_decay) -> tuple[Tensor, Tensor]:
    c = beta1 * m + (1 - beta1) * g
    return theta * (1 - lr * weight_decay) - lr * torch.sign(c), beta2 * m + (1 - beta2) * g


# --------------------------------------------------------------------------- 08.01 - 08.06 the rules


@implements("08.01")
def sgd_step(theta, g, lr: float) -> Tensor:
    r"""One step of gradient descent: :math:`\theta_{t+1}=\theta_t-\eta\,\nabla_\theta L(\theta_t)`.

    ``theta`` is :math:`\theta_t`, ``g`` the gradient :math:`\nabla_\theta L(\theta_t)`, ``lr`` is
    :math:`\eta \ge 0`. Any shape; ``theta`` and ``g`` share shape and dtype. Returns :math:`\theta_{t+1}`.

    >>> sgd_step(torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0]), lr=0.1)
    tensor([0.9500, 2.1000])
    """
    theta, g = _tensors("theta g", theta, g)
    lr = _lr(lr)
    return restore_half(upcast_half(theta) - lr * upcast_half(g), theta.dtype)


@implements("08.02")
def momentum_step(theta, g, v, lr: float, momentum: float = 0.9) -> tuple[Tensor, Tensor]:
    r"""Heavy-ball momentum: :math:`v_t=\mu v_{t-1}+g_t,\ \theta_{t+1}=\theta_t-\eta v_t`.

    ``v`` is the buffer :math:`v_{t-1}` (``None`` on the first step: like ``torch.optim.SGD`` the
    buffer then starts at :math:`g_1`, not at :math:`\mu\cdot 0 + g_1`, which is the same number but
    says why there is no warm-up), ``momentum`` is :math:`\mu\in[0,1]`, ``lr`` is :math:`\eta`.
    All tensors share shape and dtype. Returns ``(theta_next, v_t)``.

    >>> theta, v = momentum_step(torch.tensor([1.0]), torch.tensor([1.0]), None, lr=0.1, momentum=0.9)
    >>> theta, v = momentum_step(theta, torch.tensor([1.0]), v, lr=0.1, momentum=0.9)
    >>> theta, v  # v = 0.9 * 1 + 1
    (tensor([0.7100]), tensor([1.9000]))
    """
    theta, g = _tensors("theta g", theta, g)
    if v is not None:
        theta, g, v = _tensors("theta g v", theta, g, v)
    lr, momentum = _lr(lr), check_range(momentum, "momentum", 0.0, 1.0)
    v_t = _momentum(None if v is None else upcast_half(v), upcast_half(g), momentum)
    return restore_half(upcast_half(theta) - lr * v_t, theta.dtype), restore_half(v_t, theta.dtype)


@implements("08.03")
def adam_moments(m, v, g, beta1: float = 0.9, beta2: float = 0.999) -> tuple[Tensor, Tensor]:
    r"""Adam's running moments: :math:`m_t=\beta_1m_{t-1}+(1-\beta_1)g_t,\ v_t=\beta_2v_{t-1}+(1-\beta_2)g_t^2`.

    ``m``, ``v`` are :math:`m_{t-1}, v_{t-1}` (zeros before the first step; :math:`v\ge 0`), ``g`` is
    :math:`g_t`, ``beta1``, ``beta2`` in :math:`[0, 1)`. All tensors share shape and dtype.
    Returns ``(m_t, v_t)``. Both start at zero, hence the bias correction of :func:`adam_update`.

    >>> adam_moments(torch.zeros(2), torch.zeros(2), torch.tensor([2.0, -2.0]))
    (tensor([ 0.2000, -0.2000]), tensor([0.0040, 0.0040]))
    """
    m, v, g = _tensors("m v g", m, v, g)
    beta1, beta2 = _beta(beta1, "beta1"), _beta(beta2, "beta2")
    _check_v(v)
    m_t, v_t = _moments(upcast_half(m), upcast_half(v), upcast_half(g), beta1, beta2)
    return restore_half(m_t, m.dtype), restore_half(v_t, m.dtype)


@implements("08.04")
def adam_update(theta, m, v, t: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8) -> Tensor:
    r"""Adam's bias-corrected step: :math:`\theta_{t+1}=\theta_t-\eta\,\hat m_t/(\sqrt{\hat v_t}+\epsilon)`.

    .. math:: \hat m_t=\frac{m_t}{1-\beta_1^t},\qquad \hat v_t=\frac{v_t}{1-\beta_2^t}

    ``m``, ``v`` are the moments *after* :func:`adam_moments` of step ``t`` (:math:`t\ge 1`), ``lr``
    is :math:`\eta`, ``eps`` is :math:`\epsilon` (added to :math:`\sqrt{\hat v}`, as in torch).
    All tensors share shape and dtype. Returns :math:`\theta_{t+1}`. At :math:`t=1`,
    :math:`\hat m/\sqrt{\hat v}=g/|g|`: the first step is :math:`-\eta\,\mathrm{sign}(g)` whatever the
    gradient's scale (claim C09).

    >>> m, v = adam_moments(torch.zeros(2), torch.zeros(2), torch.tensor([1e-3, -1e3]))
    >>> adam_update(torch.zeros(2), m, v, t=1, lr=0.1)
    tensor([-0.1000,  0.1000])
    """
    theta, m, v = _tensors("theta m v", theta, m, v)
    t, lr, eps = check_positive_int(t, "t"), _lr(lr), _nonneg(eps, "eps")
    beta1, beta2 = _beta(beta1, "beta1"), _beta(beta2, "beta2")
    _check_v(v)
    step = _adam_step(upcast_half(m), upcast_half(v), t, lr, beta1, beta2, eps)
    return restore_half(upcast_half(theta) - step, theta.dtype)


@implements("08.05")
def adamw_update(theta, m, v, t: int, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> Tensor:
    r"""AdamW: Adam's step plus a decay of the *weights*.

    .. math:: \theta_{t+1}=\theta_t-\eta\left(\frac{\hat m_t}{\sqrt{\hat v_t}+\epsilon}+\lambda\theta_t\right)

    ``weight_decay`` is :math:`\lambda\ge 0`; the rest as in :func:`adam_update`. The decay never
    enters :math:`m` or :math:`v`, so it is not rescaled by :math:`1/\sqrt{\hat v}` (Adam with L2,
    ``torch.optim.Adam(weight_decay=...)``, adds :math:`\lambda\theta` to the gradient instead, and
    then a weight with large gradients is barely decayed). Returns :math:`\theta_{t+1}`.

    >>> m, v = adam_moments(torch.zeros(1), torch.zeros(1), torch.tensor([0.0]))
    >>> adamw_update(torch.tensor([2.0]), m, v, t=1, lr=0.1, weight_decay=0.5)  # 2 * (1 - 0.1 * 0.5)
    tensor([1.9000])
    """
    theta, m, v = _tensors("theta m v", theta, m, v)
    t, lr, eps = check_positive_int(t, "t"), _lr(lr), _nonneg(eps, "eps")
    beta1, beta2, weight_decay = _beta(beta1, "beta1"), _beta(beta2, "beta2"), _nonneg(weight_decay, "weight_decay")
    _check_v(v)
    step = _adam_step(upcast_half(m), upcast_half(v), t, lr, beta1, beta2, eps)
    return restore_half(upcast_half(theta) * (1 - lr * weight_decay) - step, theta.dtype)


@implements("08.06")
def lion_step(theta, m, g, lr: float = 1e-4, beta1: float = 0.9, beta2: float = 0.99,
              weight_decay: float = 0.0) -> tuple[Tensor, Tensor]:
    r"""Lion: a step of fixed size along the sign of an interpolated momentum.

    .. math:: c_t=\beta_1m_{t-1}+(1-\beta_1)g_t,\quad
              \theta_{t+1}=\theta_t(1-\eta\lambda)-\eta\,\mathrm{sign}(c_t),\quad
              m_t=\beta_2m_{t-1}+(1-\beta_2)g_t

    The catalogue writes one :math:`\beta_1` for both; Lion (and ``lion-pytorch``) uses
    :math:`\beta_1` for the direction and a slower :math:`\beta_2` for the state. ``m`` is
    :math:`m_{t-1}` (zeros at first), ``weight_decay`` is :math:`\lambda` (decoupled, as AdamW),
    ``beta1``, ``beta2`` in :math:`[0, 1]`. Every coordinate moves by exactly :math:`\eta` (or 0
    where :math:`c=0`). Returns ``(theta_next, m_t)``.

    >>> lion_step(torch.zeros(2), torch.zeros(2), torch.tensor([3.0, -1e-6]), lr=0.1)
    (tensor([-0.1000,  0.1000]), tensor([ 3.0000e-02, -1.0000e-08]))
    """
    theta, m, g = _tensors("theta m g", theta, m, g)
    lr, weight_decay = _lr(lr), _nonneg(weight_decay, "weight_decay")
    beta1, beta2 = _beta(beta1, "beta1", closed=True), _beta(beta2, "beta2", closed=True)
    theta_n, m_t = _lion(upcast_half(theta), upcast_half(m), upcast_half(g), lr, beta1, beta2, weight_decay)
    return restore_half(theta_n, theta.dtype), restore_half(m_t, theta.dtype)


# --------------------------------------------------------------------------- the optimisers


class _RuleOptimizer(Optimizer):
    """Shared ``step``: for every parameter with a gradient, call the subclass's ``_update``.

    The arithmetic runs in float32 for fp16 / bf16 parameters (state is kept in the parameter's
    dtype, as torch does) and in the parameter's own dtype otherwise.
    """

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])  # a group's own lr / betas are checked too

    def _check_group(self, group: dict) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a ``.grad``; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError(f"{type(self).__name__} does not support sparse gradients")
                self._update(p, upcast_half(p), upcast_half(p.grad), self.state[p], group)
        return loss

    @staticmethod
    def _store(state: dict, key: str, value: Tensor, p: Tensor) -> Tensor:
        if key in state:
            state[key].copy_(value)
        else:
            state[key] = value.to(p.dtype).clone(memory_format=torch.preserve_format)
        return value


class SGD(_RuleOptimizer):
    """SGD (08.01) with optional momentum (08.02) and L2 weight decay, as ``torch.optim.SGD``.

    >>> p = torch.nn.Parameter(torch.tensor([1.0])); p.grad = torch.tensor([2.0])
    >>> SGD([p], lr=0.1).step(); p.data
    tensor([0.8000])
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def _check_group(self, group):
        _lr(group["lr"]), check_range(group["momentum"], "momentum", 0.0, 1.0)
        _nonneg(group["weight_decay"], "weight_decay")

    def _update(self, p, theta, g, state, group):
        if group["weight_decay"]:
            g = g + group["weight_decay"] * theta
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            g = self._store(state, "momentum_buffer", _momentum(None if buf is None else upcast_half(buf), g,
                                                                  group["momentum"]), p)
        p.copy_(theta - group["lr"] * g)


class Adam(_RuleOptimizer):
    """Adam (08.03 moments, 08.04 update) with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    >>> p = torch.nn.Parameter(torch.tensor([1.0])); p.grad = torch.tensor([1e-4])
    >>> Adam([p], lr=0.1).step(); p.data  # the first step is lr * sign(g)
    tensor([0.9000])
    """

    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _check_group(self, group):
        _lr(group["lr"]), _betas(group["betas"]), _nonneg(group["eps"], "eps")
        _nonneg(group["weight_decay"], "weight_decay")

    def _update(self, p, theta, g, state, group):
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        if wd and not self.decoupled:
            g = g + wd * theta  # L2: the decay goes through m and v
        m, v = _moments(upcast_half(state["exp_avg"]), upcast_half(state["exp_avg_sq"]), g, beta1, beta2)
        self._store(state, "exp_avg", m, p), self._store(state, "exp_avg_sq", v, p)
        # the registered rules themselves (08.04, 08.05), so that every check of the optimiser checks them too
        if self.decoupled:
            p.copy_(adamw_update(theta, m, v, state["step"], lr, beta1, beta2, group["eps"], wd))
        else:
            p.copy_(adam_update(theta, m, v, state["step"], lr, beta1, beta2, group["eps"]))


class AdamW(Adam):
    """AdamW (08.05): Adam with decoupled weight decay, as ``torch.optim.AdamW`` (default ``weight_decay=1e-2``).

    >>> p = torch.nn.Parameter(torch.tensor([1.0])); p.grad = torch.tensor([0.0])
    >>> AdamW([p], lr=0.1, weight_decay=0.5).step(); p.data
    tensor([0.9500])
    """

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


class Lion(_RuleOptimizer):
    """Lion (08.06) with decoupled weight decay, as ``lion_pytorch.Lion``.

    >>> p = torch.nn.Parameter(torch.tensor([1.0])); p.grad = torch.tensor([-5.0])
    >>> Lion([p], lr=0.1).step(); p.data
    tensor([1.1000])
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _check_group(self, group):
        _lr(group["lr"]), _betas(group["betas"], closed=True), _nonneg(group["weight_decay"], "weight_decay")

    def _update(self, p, theta, g, state, group):
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        theta_n, m = _lion(theta, upcast_half(state["exp_avg"]), g, group["lr"], beta1, beta2, group["weight_decay"])
        self._store(state, "exp_avg", m, p)
        p.copy_(theta_n)
