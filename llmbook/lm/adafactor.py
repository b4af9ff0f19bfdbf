r"""Adafactor (chapter 8, 08.07): Adam's second moment stored as a row and a column, not a matrix.

For an :math:`n\times m` weight, Adam keeps :math:`v` with :math:`nm` entries. Adafactor keeps only
its row means :math:`r` (:math:`n` numbers) and column means :math:`c` (:math:`m` numbers) and
rebuilds the rank-1 estimate :math:`\hat V = r c^\top/\bar r` when it needs it: for a
:math:`4096\times4096` matrix that is 8192 numbers instead of 16.8 million. T5 and PaLM were
trained with it (T5 with an inverse-square-root schedule, :func:`llmbook.lm.schedules.inverse_sqrt`).

* :func:`adafactor_second_moment` (registered) is the factored update of :math:`r` and :math:`c`
  and the estimate :math:`\hat V`;
* :class:`Adafactor` is the optimiser, with the arguments, state keys and arithmetic of
  ``torch.optim.Adafactor`` (no first moment, :math:`\hat\beta_{2,t}=1-t^{-0.8}`, relative step size
  :math:`\rho_t=\min(\eta, 1/\sqrt t)` scaled by the weight's RMS, update clipping at RMS :math:`d`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_nonempty, check_range, check_same_dtype, check_shape
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.optim import _lr, _nonneg, _RuleOptimizer
from llmbook.registry import implements

__all__ = ["adafactor_second_moment", "Adafactor"]


def _factored(r: Tensor, c: Tensor, g: Tensor, w: float, eps1: float) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel: r, c moved a fraction w = 1 - beta2 towards the row / column means of g^2."""
    r = r.lerp(g.square().mean(-1), w)
    c = c.lerp(g.square().mean(-2), w)
    r_bar = r.mean(-1, keepdim=True).clamp(min=eps1)
    return r, c, (r / r_bar).unsqueeze(-1) * c.unsqueeze(-2)


@implements("08.07")
def adafactor_second_moment(r, c, g, beta2: float, eps1: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    r"""Adafactor's factored second moment: running row and column means of :math:`g^2`, and their rank-1 product.

    .. math:: r_i \leftarrow \hat\beta_2 r_i + (1-\hat\beta_2)\frac1m\sum_j g_{ij}^2,\quad
              c_j \leftarrow \hat\beta_2 c_j + (1-\hat\beta_2)\frac1n\sum_i g_{ij}^2,\quad
              \hat V_{ij}=\frac{r_i\,c_j}{\bar r},\quad \bar r=\frac1n\sum_i r_i

    With sums instead of means (the paper's :math:`R = V1_m`, :math:`C = 1_n^\top V`) the same
    :math:`\hat V = RC/(1_n^\top R)` comes out. :math:`\hat V` is exact when :math:`g^2` is itself
    rank one (an outer product). ``g`` is :math:`(\ldots, n, m)` with :math:`n, m\ge 1`, ``r`` is
    :math:`(\ldots, n)`, ``c`` :math:`(\ldots, m)` (non-negative; zeros before the first step),
    ``beta2`` is :math:`\hat\beta_2\in[0,1]`, ``eps1`` floors :math:`\bar r` (default: the machine
    epsilon of ``g``'s dtype, as torch) so an all-zero gradient gives :math:`\hat V = 0`, not NaN.
    Returns ``(r, c, V_hat)``, ``V_hat`` of ``g``'s shape.

    >>> g = torch.tensor([[1.0, 2.0], [2.0, 4.0]])  # g^2 is rank one: the estimate is exact
    >>> r, c, V = adafactor_second_moment(torch.zeros(2), torch.zeros(2), g, beta2=0.0)
    >>> V
    tensor([[ 1.,  4.],
            [ 4., 16.]])
    """
    g = as_tensor(g, "g")
    check_dim(g, "g", "(..., n, m)", min_dim=2)
    check_nonempty(g, "g", -1), check_nonempty(g, "g", -2)
    r = check_shape(as_tensor(r, "r"), g.shape[:-1], "r", "(..., n) of g")
    c = check_shape(as_tensor(c, "c"), g.shape[:-2] + g.shape[-1:], "c", "(..., m) of g")
    check_same_dtype(g, r, "g", "r"), check_same_dtype(g, c, "g", "c")
    for name, x in (("r", r), ("c", c)):
        if x.numel() and (x < 0).any():
            raise ValueError(f"{name} (a running mean of g^2) must be non-negative, got a negative entry")
    beta2 = check_range(beta2, "beta2", 0.0, 1.0)
    eps1 = torch.finfo(g.dtype).eps if eps1 is None else check_range(eps1, "eps1", 0.0)
    out = _factored(upcast_half(r), upcast_half(c), upcast_half(g), 1.0 - beta2, eps1)
    return tuple(restore_half(x, g.dtype) for x in out)


class Adafactor(_RuleOptimizer):
    r"""Adafactor with torch's arguments and semantics (``torch.optim.Adafactor``): no :math:`\beta_1`.

    ``lr`` caps the relative step :math:`\rho_t=\min(\eta, t^{-1/2})`; the step is
    :math:`\alpha_t=\max(\epsilon_2, \mathrm{RMS}(\theta))\,\rho_t`, so it scales with the weights.
    ``beta2_decay`` sets :math:`1-\hat\beta_{2,t}=t^{\,\text{beta2\_decay}}` (1 at the first step),
    ``eps = (eps1, eps2)`` (eps1 ``None``: the dtype's epsilon), ``d`` clips the update's RMS,
    ``weight_decay`` multiplies the weights by :math:`1-\eta\lambda`. Tensors of 2 or more dims are
    factored over their last two dims (:func:`adafactor_second_moment`); vectors keep a full
    :math:`v`. State keys as torch: ``step``, ``row_var`` (..., n, 1), ``col_var`` (..., 1, m), ``variance``.

    >>> p = torch.nn.Parameter(torch.ones(2, 2)); p.grad = torch.full((2, 2), 3.0)
    >>> Adafactor([p], lr=0.1).step(); p.data  # RMS(theta) * min(lr, 1) * sign(g)
    tensor([[0.9000, 0.9000],
            [0.9000, 0.9000]])
    """

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8, eps=(None, 1e-3), d: float = 1.0,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))

    def _check_group(self, group):
        _lr(group["lr"]), check_range(group["beta2_decay"], "beta2_decay", high=0.0)
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise TypeError(f"eps must be a pair (eps1, eps2), got {eps!r}")
        if eps[0] is not None:
            _nonneg(eps[0], "eps1")
        _nonneg(eps[1], "eps2"), check_range(group["d"], "d", 1.0), _nonneg(group["weight_decay"], "weight_decay")

    def _update(self, p, theta, g, state, group):
        factored = g.ndim > 1
        if not state:
            state["step"] = 0
            if factored:
                state["row_var"] = p.new_zeros(p.shape[:-1] + (1,))
                state["col_var"] = p.new_zeros(p.shape[:-2] + (1,) + p.shape[-1:])
            else:
                state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t, lr, (eps1, eps2) = state["step"], group["lr"], group["eps"]
        eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
        w = float(t) ** group["beta2_decay"]  # 1 - beta2_t
        alpha = max(eps2, theta.norm(2).item() / theta.numel() ** 0.5) * min(lr, 1 / t**0.5)
        if group["weight_decay"]:
            theta = theta * (1 - lr * group["weight_decay"])
        if factored:
            # the registered rule itself (08.07), so that every check of the optimiser checks it too
            r, c, V = adafactor_second_moment(upcast_half(state["row_var"]).squeeze(-1),
                                              upcast_half(state["col_var"]).squeeze(-2), g, 1.0 - w, eps1)
            self._store(state, "row_var", r.unsqueeze(-1), p), self._store(state, "col_var", c.unsqueeze(-2), p)
        else:
            V = self._store(state, "variance", upcast_half(state["variance"]).lerp(g * g, w), p)
        update = V.clamp(min=eps1 * eps1).rsqrt() * g
        denom = max(1.0, update.norm(2).item() / (update.numel() ** 0.5 * group["d"]))
        p.copy_(theta - (alpha / denom) * update)
