r"""Deep Q-networks: the double-Q target, the DQN loss and the dueling head.

* **Double Q-learning target** (33.06, :func:`double_q_target`, van Hasselt et al. 2016):
  :math:`Y=r+\gamma\,Q_{\theta^-}(s',\arg\max_aQ_\theta(s',a))`: the online network chooses the action,
  the target network values it, so the noise that made an action look best is not the noise that
  values it (the plain :math:`\max_a Q_{\theta^-}(s',a)` overestimates: :math:`E\max\ge\max E`).
* **DQN loss** (33.07, :func:`dqn_loss`, Mnih et al. 2015): the squared (or Huber) TD error of the
  online network against a target computed by a frozen copy :math:`\theta^-`; no gradient reaches the target.
* **Dueling head** (33.08, :class:`DuelingHead`, Wang et al. 2016):
  :math:`Q(s,a)=V(s)+A(s,a)-\frac1{|\mathcal A|}\sum_{a'}A(s,a')`; subtracting the mean advantage makes
  :math:`V` and :math:`A` identifiable from :math:`Q` (:math:`V=\overline{Q}`, :math:`A=Q-\overline{Q}`).

Conventions: batch-first; ``Q``, ``Q_next_*`` ``(B, A)`` (any leading axes ``(..., A)``), ``a`` ``(...)``
long, ``r`` and ``done`` ``(...)``. fp16/bf16 inputs are computed in float32 and rounded back once.

>>> double_q_target(torch.tensor([0.0]), torch.tensor([[1.0, 2.0]]), torch.tensor([[5.0, 3.0]]), 0.5).tolist()
[1.5]
"""

from __future__ import annotations

import torch
from torch import nn

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_finite,
    check_integer_tensor,
    check_module_input,
    check_positive_int,
    check_range,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.agents.td import _not_done
from llmbook.registry import implements

__all__ = ["double_q_target", "dqn_loss", "DuelingHead", "dueling_q"]


def _next(Q_next, r, name: str) -> torch.Tensor:
    Q_next = as_tensor(Q_next, name)
    if Q_next.dim() < 1 or Q_next.shape[-1] == 0 or Q_next.shape[:-1] != r.shape:
        raise ValueError(f"{name} must be (..., A) with A >= 1 and leading shape of r {tuple(r.shape)}, "
                         f"got {tuple(Q_next.shape)}")
    check_finite(Q_next, name)
    return Q_next


@implements("33.06")
def double_q_target(r, Q_next_online, Q_next_target, gamma: float = 0.99, done=None) -> torch.Tensor:
    r"""The double Q-learning target :math:`Y=r+\gamma(1-d)\,Q_{\theta^-}(s',\arg\max_aQ_\theta(s',a))`.

    ``r`` ``(...)`` reward; ``Q_next_online`` ``(..., A)`` the online network at :math:`s'` (selects the
    action, first maximiser on ties); ``Q_next_target`` ``(..., A)`` the target network at :math:`s'`
    (evaluates it); ``done`` ``(...)`` True where :math:`s'` is terminal. Returns :math:`Y` ``(...)``, detached.

    >>> double_q_target(torch.tensor([1.0]), torch.tensor([[0.0, 9.0]]), torch.tensor([[4.0, 2.0]]), 1.0).tolist()
    [3.0]
    """
    r = as_tensor(r, "r")
    check_finite(r, "r")
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    Qo, Qt = _next(Q_next_online, r, "Q_next_online"), _next(Q_next_target, r, "Q_next_target")
    if Qo.shape != Qt.shape:
        raise ValueError(f"Q_next_online {tuple(Qo.shape)} and Q_next_target {tuple(Qt.shape)} must have one shape")
    dtype = torch.promote_types(r.dtype, Qt.dtype)
    c = upcast_half(torch.zeros((), dtype=dtype)).dtype
    a_star = Qo.detach().argmax(-1, keepdim=True)
    value = Qt.detach().to(c).gather(-1, a_star).squeeze(-1)
    return restore_half(r.detach().to(c) + gamma * _not_done(done, r.shape, c) * value, dtype)


def _huber(x: torch.Tensor, delta: float) -> torch.Tensor:
    ax = x.abs()
    return torch.where(ax <= delta, 0.5 * x * x, delta * (ax - 0.5 * delta))


@implements("33.07")
def dqn_loss(Q, a, r, Q_next_target, gamma: float = 0.99, done=None, *, Q_next_online=None, loss: str = "mse",
             delta: float = 1.0) -> torch.Tensor:
    r"""The DQN loss :math:`\mathcal L(\theta)=\frac1B\sum_i\ell\big(Y_i-Q_\theta(s_i,a_i)\big)`, the target
    :math:`Y=r+\gamma(1-d)\max_{a'}Q_{\theta^-}(s',a')` held fixed.

    ``Q`` ``(..., A)`` the online network at :math:`s` (gradients flow through it); ``a`` ``(...)`` the
    actions taken; ``r``, ``done`` ``(...)``; ``Q_next_target`` ``(..., A)`` the target network at :math:`s'`
    (detached here: no gradient reaches :math:`\theta^-`). With ``Q_next_online`` (the online network at
    :math:`s'`) the target is the double-Q target (:func:`double_q_target`). ``loss``: ``"mse"``,
    :math:`\ell(x)=x^2` (the equation), or ``"huber"``, :math:`\ell(x)=x^2/2` for :math:`|x|\le\delta`, else
    :math:`\delta(|x|-\delta/2)` (DQN's "error clipping"; ``F.huber_loss``). Returns a scalar, the batch mean.

    >>> Q = torch.tensor([[1.0, 2.0]], requires_grad=True)
    >>> L = dqn_loss(Q, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([[3.0, 0.0]]), 0.5)
    >>> L.item(), torch.autograd.grad(L, Q)[0].tolist()
    (2.25, [[-3.0, 0.0]])
    """
    Q = as_tensor(Q, "Q")
    check_choice(loss, "loss", ("mse", "huber"))
    delta = check_range(delta, "delta", 0.0, low_open=True)
    r = as_tensor(r, "r")
    if Q.dim() < 1 or Q.shape[-1] == 0 or Q.shape[:-1] != r.shape:
        raise ValueError(f"Q must be (..., A) with A >= 1 and leading shape of r {tuple(r.shape)}, "
                         f"got {tuple(Q.shape)}")
    check_finite(Q, "Q")
    a = check_integer_tensor(a, "a")
    if a.shape != r.shape or (a.numel() and (a.min().item() < 0 or a.max().item() >= Q.shape[-1])):
        raise ValueError(f"a must be {tuple(r.shape)} actions in [0, {Q.shape[-1]}), got shape {tuple(a.shape)}")
    if Q_next_online is None:
        Qt = _next(Q_next_target, r, "Q_next_target")
        Y = double_q_target(r, Qt, Qt, gamma, done)  # selecting and valuing with one network: the plain max
    else:
        Y = double_q_target(r, Q_next_online, Q_next_target, gamma, done)
    if r.numel() == 0:
        raise ValueError("dqn_loss needs at least one transition (the mean of an empty batch is undefined)")
    Qc = upcast_half(Q)
    x = Y.to(Qc.dtype) - Qc.gather(-1, a.long().unsqueeze(-1)).squeeze(-1)
    per = x * x if loss == "mse" else _huber(x, delta)
    return restore_half(per.mean(), Q.dtype)


def dueling_q(V, A) -> torch.Tensor:
    r"""The dueling aggregation :math:`Q=V+A-\overline{A}`: ``V`` ``(...)`` or ``(..., 1)``, ``A`` ``(..., n)``."""
    V, A = as_tensor(V, "V"), as_tensor(A, "A")
    if V.shape != A.shape[:-1] and V.shape != (*A.shape[:-1], 1):
        raise ValueError(f"V must be (...) or (..., 1) for A (..., n) = {tuple(A.shape)}, got {tuple(V.shape)}")
    if V.shape == A.shape[:-1]:
        V = V.unsqueeze(-1)
    Ac = upcast_half(A)
    return restore_half(upcast_half(V) + Ac - Ac.mean(-1, keepdim=True), A.dtype)


@implements("33.08")
class DuelingHead(nn.Module):
    r"""The dueling head :math:`Q(s,a)=V(s)+A(s,a)-\frac{1}{|\mathcal A|}\sum_{a'}A(s,a')`.

    Two linear streams on a feature vector ``x`` ``(..., d_in)``: ``value`` (to 1) and ``advantage`` (to
    ``n_actions``). ``forward(x)`` returns ``Q`` ``(..., n_actions)``; ``parts(x)`` returns the identified
    ``(V (...), A (..., n_actions))`` with :math:`\sum_aA(s,a)=0`, so that ``V + A == Q``. Without the mean,
    :math:`(V+c, A-c)` would give the same :math:`Q` for every :math:`c`.

    >>> head = DuelingHead(3, 4)
    >>> Q = head(torch.randn(2, 3))
    >>> V, A = head.parts(torch.randn(2, 3))
    >>> tuple(Q.shape), bool(A.sum(-1).abs().max() < 1e-6)
    ((2, 4), True)
    """

    def __init__(self, d_in: int, n_actions: int):
        super().__init__()
        self.d_in, self.n_actions = check_positive_int(d_in, "d_in"), check_positive_int(n_actions, "n_actions")
        self.value = nn.Linear(self.d_in, 1)
        self.advantage = nn.Linear(self.d_in, self.n_actions)

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = check_module_input(self, x, d=self.d_in, symbol="d_in", contract="(..., d_in)")
        V, A = self.value(x), self.advantage(x)
        Ac = upcast_half(A)
        return V.squeeze(-1), restore_half(Ac - Ac.mean(-1, keepdim=True), A.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_module_input(self, x, d=self.d_in, symbol="d_in", contract="(..., d_in)")
        return dueling_q(self.value(x), self.advantage(x))
