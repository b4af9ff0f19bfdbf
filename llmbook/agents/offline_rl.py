r"""Offline RL and imitation learning (chapter 38): learning and evaluating policies from a fixed log.

A log :math:`D` of transitions was collected by a *behaviour policy* :math:`\mu`; no new interaction is
allowed. The chapter's objects, all batch-first over the ``N`` logged pairs (or ``n`` logged episodes):

* **Behaviour cloning** (38.01, :func:`behavior_cloning_loss`): maximum likelihood of the logged actions,
  :math:`-\frac1N\sum_i\log\pi_\theta(a_i\mid s_i)` from logits ``(N, A)`` and actions ``(N,)``.
* **Ordinary importance sampling** (38.02, :func:`ordinary_importance_sampling`): the unbiased off-policy
  estimate :math:`\frac1n\sum_i\rho_iG_i` with :math:`\rho_i=\prod_t\pi(a_t|s_t)/\mu(a_t|s_t)`.
* **Weighted importance sampling** (38.03, :func:`weighted_importance_sampling`): the self-normalised
  :math:`\sum_i\rho_iG_i/\sum_i\rho_i` (biased, consistent, lower variance).
* **CQL** (38.04, :func:`cql_loss`): the conservative penalty
  :math:`\alpha(\mathbb E_s\log\sum_ae^{Q(s,a)}-\mathbb E_{D}Q(s,a))` plus an optional Bellman error.
* **IQL** (38.05, :func:`iql_value_loss`): the expectile regression of :math:`V(s)` on :math:`Q(s,a)`;
  :func:`expectile` solves the expectile of a sample exactly (bisection on the first-order condition).
* **AWR** (38.06, :func:`awr_loss`): log-likelihood weighted by :math:`\min(e^{A/\beta}, w_{\max})`.

Episode arrays follow :class:`llmbook.agents.envs.Episodes`: ``pi_a`` and ``mu_a`` ``(n, T)`` are the
probabilities of the *logged* actions under the target and the behaviour policy (:func:`logged_probs`
reads them off ``(S, A)`` tables), ``G`` ``(n,)`` the logged returns. fp16 / bf16 inputs are computed in
float32 and rounded back once. :func:`fit_tabular` gives the exact tabular minimisers of BC and of
IQL + AWR on logged transitions (the notebook's FrozenLake comparison).
"""

from __future__ import annotations

import math

import torch

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_integer_tensor,
    check_nonempty,
    check_positive_int,
    check_range,
    check_same_shape,
    check_shape,
    check_unit_interval,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["behavior_cloning_loss", "importance_weights", "ordinary_importance_sampling",
           "weighted_importance_sampling", "cql_loss", "iql_value_loss", "expectile", "awr_loss",
           "logged_probs", "fit_tabular"]

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    return x.mean() if reduction == "mean" else x.sum() if reduction == "sum" else x


def _logits_actions(logits, a, name: str = "logits") -> tuple[torch.Tensor, torch.Tensor]:
    """Check logits ``(N, A)`` (finite, A >= 1, N >= 1) and actions ``(N,)`` in ``[0, A)``."""
    logits = as_tensor(logits, name)
    check_dim(logits, name, "(N, A)", min_dim=2, max_dim=2)
    check_nonempty(logits, name, 0)
    check_nonempty(logits, name, 1)
    check_finite(logits, name)
    a = check_integer_tensor(a, "a", "an integer tensor of actions")
    check_shape(a, (logits.shape[0],), "a", f"one action per row of {name} (N,)")
    if (a < 0).any() or (a >= logits.shape[1]).any():
        raise ValueError(f"a must hold actions in [0, A) = [0, {logits.shape[1]}), got range "
                         f"[{int(a.min())}, {int(a.max())}]")
    return logits, a


@implements("38.01")
def behavior_cloning_loss(logits, a, *, reduction: str = "mean") -> torch.Tensor:
    r"""Behaviour cloning :math:`\mathcal L_{BC}=-\mathbb E_{(s,a)\sim D}\log\pi_\theta(a\mid s)`.

    :math:`\pi_\theta(\cdot\mid s_i)=\mathrm{softmax}(\text{logits}_i)`. Symbols: ``logits`` ``(N, A)`` the
    policy's scores at the logged states :math:`s_i`, ``a`` ``(N,)`` the logged actions. ``reduction``
    ``"mean"`` (the expectation over :math:`D`), ``"sum"`` or ``"none"`` (``(N,)``). It is the cross-entropy
    of classification; its minimiser over a table of logits is the empirical :math:`\hat\mu(a\mid s)`.

    >>> round(behavior_cloning_loss(torch.zeros(3, 4), torch.tensor([0, 1, 3])).item(), 4)  # log 4
    1.3863
    """
    check_choice(reduction, "reduction", _REDUCTIONS)
    logits, a = _logits_actions(logits, a)
    dtype = logits.dtype
    logp = torch.log_softmax(upcast_half(logits), -1).gather(-1, a[:, None]).squeeze(-1)
    return restore_half(_reduce(-logp, reduction), dtype)


def logged_probs(pi, s, a) -> torch.Tensor:
    r"""Probabilities :math:`\pi(a_t\mid s_t)` of logged actions: ``pi`` ``(S, A)``, ``s``, ``a`` ``(...)``.

    >>> logged_probs(torch.tensor([[0.25, 0.75]]), torch.tensor([[0, 0]]), torch.tensor([[1, 0]])).tolist()
    [[0.75, 0.25]]
    """
    pi = as_tensor(pi, "pi")
    check_dim(pi, "pi", "(S, A)", min_dim=2, max_dim=2)
    s, a = check_integer_tensor(s, "s"), check_integer_tensor(a, "a")
    check_same_shape(s, a, "s", "a")
    if s.numel() and ((s < 0).any() or (s >= pi.shape[0]).any() or (a < 0).any() or (a >= pi.shape[1]).any()):
        raise ValueError(f"s and a must index pi of shape {tuple(pi.shape)}")
    return pi[s, a]


def _episodes(pi_a, mu_a, G, mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    pi_a, mu_a, G = as_tensor(pi_a, "pi_a"), as_tensor(mu_a, "mu_a"), as_tensor(G, "G")
    check_dim(pi_a, "pi_a", "(n, T)", min_dim=2, max_dim=2)
    check_same_shape(pi_a, mu_a, "pi_a", "mu_a")
    check_nonempty(pi_a, "pi_a", 0)
    check_shape(G, (pi_a.shape[0],), "G", "one return per logged episode (n,)")
    check_finite(G, "G")
    for x, name in ((pi_a, "pi_a"), (mu_a, "mu_a")):
        if not torch.isfinite(x).all() or (x < 0).any() or (x > 1).any():
            raise ValueError(f"{name} must hold probabilities in [0, 1]")
    if (mu_a == 0).any():
        raise ValueError("mu_a must be > 0: a logged action has positive probability under the behaviour policy "
                         "(coverage: pi(a|s) > 0 needs mu(a|s) > 0)")
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
        check_same_shape(mask, pi_a, "mask", "pi_a")
    dtype = G.dtype
    ct = torch.promote_types(upcast_half(pi_a).dtype, upcast_half(mu_a).dtype)
    ct = torch.promote_types(ct, upcast_half(G).dtype)
    log_ratio = torch.log(pi_a.to(ct)) - torch.log(mu_a.to(ct))
    if mask is not None:
        log_ratio = torch.where(mask, log_ratio, torch.zeros((), dtype=ct))
    return log_ratio.sum(-1), G.to(ct), dtype


def importance_weights(pi_a, mu_a, mask=None) -> torch.Tensor:
    r"""Per-episode ratios :math:`\rho_i=\prod_t\pi(a_t|s_t)/\mu(a_t|s_t)` ``(n,)``, summed in log space.

    ``mask`` ``(n, T)`` bool: steps that count (False steps, e.g. idling in an absorbing terminal state,
    contribute a ratio of 1).

    >>> importance_weights(torch.tensor([[0.5, 1.0]]), torch.tensor([[0.25, 0.5]])).tolist()
    [4.0]
    """
    log_rho, G, _ = _episodes(pi_a, mu_a, torch.zeros(torch.as_tensor(pi_a).shape[:1]), mask)
    return log_rho.exp()


@implements("38.02")
def ordinary_importance_sampling(pi_a, mu_a, G, mask=None) -> torch.Tensor:
    r"""Ordinary importance sampling :math:`\hat V_{IS}=\frac1n\sum_i\rho_iG_i`.

    :math:`\rho_i=\prod_t\pi(a_t|s_t)/\mu(a_t|s_t)` is the episode's importance ratio.

    Unbiased: :math:`\mathbb E_{\tau\sim\mu}[\rho(\tau)G(\tau)]=V^\pi` whenever :math:`\pi(a|s)>0\Rightarrow
    \mu(a|s)>0` (Precup, Sutton and Singh, 2000). Symbols: ``pi_a``, ``mu_a`` ``(n, T)`` probabilities of the
    logged actions under :math:`\pi` and :math:`\mu` (``mu_a > 0``), ``G`` ``(n,)`` the logged returns,
    ``mask`` optional ``(n, T)`` bool of the steps that count. Returns a 0-d tensor in ``G``'s dtype.

    >>> ordinary_importance_sampling(torch.tensor([[0.5], [0.5]]), torch.tensor([[0.25], [0.75]]),
    ...                              torch.tensor([1.0, 3.0])).item()  # (2 * 1 + 2/3 * 3) / 2
    2.0
    """
    log_rho, G, dtype = _episodes(pi_a, mu_a, G, mask)
    return restore_half((log_rho.exp() * G).mean(), dtype)


@implements("38.03")
def weighted_importance_sampling(pi_a, mu_a, G, mask=None) -> torch.Tensor:
    r"""Weighted (self-normalised) importance sampling :math:`\hat V_{WIS}=\sum_i\rho_iG_i/\sum_i\rho_i`.

    The weights :math:`\rho_i/\sum_j\rho_j` are a softmax of :math:`\log\rho_i` (no overflow for long
    episodes). Biased (with one episode it returns that episode's :math:`G`), consistent, and bounded by
    the range of the returns, so its variance is far lower than :func:`ordinary_importance_sampling`'s.
    Arguments as there. Convention: if every :math:`\rho_i=0` (no logged episode is possible under
    :math:`\pi`) the estimate is 0.

    >>> weighted_importance_sampling(torch.tensor([[0.5], [0.5]]), torch.tensor([[0.25], [0.75]]),
    ...                              torch.tensor([1.0, 3.0])).item()  # (2 * 1 + 2/3 * 3) / (2 + 2/3)
    1.5
    """
    log_rho, G, dtype = _episodes(pi_a, mu_a, G, mask)
    if torch.isneginf(log_rho).all():
        return restore_half(torch.zeros((), dtype=G.dtype), dtype)
    return restore_half((torch.softmax(log_rho, 0) * G).sum(), dtype)


@implements("38.04")
def cql_loss(Q, a, *, alpha: float = 1.0, target=None) -> torch.Tensor:
    r"""Conservative Q-learning: :math:`\alpha(\mathbb E_s\log\sum_ae^{Q(s,a)}-\mathbb E_DQ(s,a))+\mathcal L_{Bell}`.

    The penalty's gradient in :math:`Q(s,\cdot)` is :math:`\alpha(\mathrm{softmax}\,Q(s,\cdot)-\mathbb 1_{a})`
    per logged pair: every action is pushed down in proportion to its softmax weight and the logged action
    pushed up, so actions never seen in the log only go down (Kumar et al., 2020, the CQL(H) variant).
    Symbols: ``Q`` ``(N, A)`` action values at the logged states, ``a`` ``(N,)`` logged actions, ``alpha``
    :math:`\alpha\ge0`, ``target`` optional ``(N,)`` Bellman targets :math:`y` (computed by the caller, e.g.
    :math:`r+\gamma\max_{a'}Q'(s',a')`, treated as constants), adding :math:`\frac12\mathbb E(Q(s,a)-y)^2`.
    Without ``target`` the penalty alone is returned. 0-d result.

    >>> round(cql_loss(torch.zeros(2, 4), torch.tensor([0, 3])).item(), 4)  # log 4 - 0
    1.3863
    """
    alpha = check_range(alpha, "alpha", 0.0)
    Q, a = _logits_actions(Q, a, "Q")
    dtype = Q.dtype
    Qc = upcast_half(Q)
    Q_data = Qc.gather(-1, a[:, None]).squeeze(-1)
    loss = alpha * (torch.logsumexp(Qc, -1) - Q_data).mean()
    if target is not None:
        y = as_tensor(target, "target")
        check_shape(y, (Q.shape[0],), "target", "one Bellman target per logged pair (N,)")
        check_finite(y, "target")
        loss = loss + 0.5 * ((Q_data - upcast_half(y).to(Qc.dtype).detach()) ** 2).mean()
    return restore_half(loss, dtype)


def _tau(tau) -> float:
    return check_unit_interval(tau, "tau")


@implements("38.05")
def iql_value_loss(Q, V, *, tau: float = 0.7, reduction: str = "mean") -> torch.Tensor:
    r"""IQL's value loss :math:`\mathcal L_V=\mathbb E_{(s,a)\sim D}[L_2^\tau(Q(s,a)-V(s))]`.

    :math:`L_2^\tau(u)=|\tau-\mathbf 1[u<0]|u^2` is the expectile loss.

    An asymmetric squared error: with :math:`\tau>0.5` positive residuals (actions better than
    :math:`V`) cost more, so the minimiser :math:`V(s)` is the :math:`\tau`-expectile of :math:`Q(s,a)` over
    the logged actions, which tends to their maximum as :math:`\tau\to1`, without ever querying an action
    outside the log (Kostrikov, Nair and Levine, 2022). :math:`\tau=0.5` is half the squared error.
    Symbols: ``Q`` ``(...)`` target values :math:`Q(s,a)` of the logged pairs (the caller detaches them),
    ``V`` the same shape, ``tau`` in [0, 1]. ``reduction`` ``"mean"``, ``"sum"`` or ``"none"``.

    >>> [round(x, 6) for x in iql_value_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]), tau=0.9,
    ...                                       reduction="none").tolist()]
    [0.9, 0.1]
    """
    check_choice(reduction, "reduction", _REDUCTIONS)
    tau = _tau(tau)
    Q, V = as_tensor(Q, "Q"), as_tensor(V, "V")
    check_same_shape(Q, V, "Q", "V")
    check_finite(Q, "Q")
    check_finite(V, "V")
    if reduction == "mean" and Q.numel() == 0:
        raise ValueError(f"the mean over no logged pairs is undefined: Q and V are empty, shape {tuple(Q.shape)}")
    dtype = torch.promote_types(Q.dtype, V.dtype)
    ct = torch.promote_types(upcast_half(Q).dtype, upcast_half(V).dtype)
    u = Q.to(ct) - V.to(ct)
    w = torch.where(u < 0, torch.tensor(1.0 - tau, dtype=ct), torch.tensor(tau, dtype=ct))
    return restore_half(_reduce(w * u * u, reduction), dtype)


def expectile(x, tau: float, weights=None) -> torch.Tensor:
    r"""The :math:`\tau`-expectile of samples ``x`` ``(..., N)``: the minimiser of :math:`\sum_iw_iL_2^\tau(x_i-m)`.

    The first-order condition :math:`\tau\sum_iw_i(x_i-m)_+=(1-\tau)\sum_iw_i(m-x_i)_+` is piecewise linear
    in :math:`m`: with the samples sorted, on the segment :math:`[x_{(k)},x_{(k+1)}]` it gives
    :math:`m_k=\frac{(1-\tau)\sum_{i\le k}w_ix_i+\tau\sum_{i>k}w_ix_i}{(1-\tau)\sum_{i\le k}w_i+\tau\sum_{i>k}w_i}`,
    and the root is the :math:`m_k` that lies in its segment (exact, float64, row by row over the leading
    axes). ``weights`` ``(..., N)`` non-negative (default 1; each row needs a positive total). :math:`\tau=0.5`
    gives the weighted mean, :math:`\tau=1` (``0``) the largest (smallest) sample of positive weight.
    Returns ``(...)`` float64.

    >>> expectile(torch.tensor([0.0, 1.0, 5.0]), 0.5).item()
    2.0
    """
    tau = _tau(tau)
    x = as_tensor(x, "x").double()
    check_nonempty(x, "x", -1)
    check_finite(x, "x")
    w = torch.ones_like(x) if weights is None else as_tensor(weights, "weights").double()
    check_same_shape(w, x, "weights", "x")
    if not torch.isfinite(w).all() or (w < 0).any() or (w.sum(-1) <= 0).any():
        raise ValueError("weights must be finite, >= 0, with a positive total in every row")
    inf = torch.tensor(math.inf, dtype=torch.float64)
    if tau in (0.0, 1.0):
        return torch.where(w > 0, x, -inf).amax(-1) if tau == 1.0 else torch.where(w > 0, x, inf).amin(-1)
    xs, order = x.sort(-1)
    ws = w.gather(-1, order)
    W_le, S_le = ws.cumsum(-1), (ws * xs).cumsum(-1)
    W_gt, S_gt = W_le[..., -1:] - W_le, S_le[..., -1:] - S_le
    m = ((1 - tau) * S_le + tau * S_gt) / ((1 - tau) * W_le + tau * W_gt)
    upper = torch.cat([xs[..., 1:], inf.expand(xs.shape[:-1] + (1,))], -1)
    violation = (xs - m).clamp(min=0) + (m - upper).clamp(min=0)
    return m.gather(-1, violation.argmin(-1, keepdim=True)).squeeze(-1)


@implements("38.06")
def awr_loss(logits, a, A, *, beta: float = 1.0, w_max: float = 20.0) -> torch.Tensor:
    r"""Advantage-weighted regression :math:`\mathcal L_{AWR}=-\mathbb E_{(s,a)\sim D}[w\,\log\pi_\theta(a\mid s)]`.

    :math:`w=\min(e^{A(s,a)/\beta},w_{\max})` is the clipped exponentiated advantage.

    Behaviour cloning with each logged action weighted by its exponentiated advantage: the minimiser over
    a table of logits is :math:`\pi(a|s)\propto\hat\mu(a|s)\,w(s,a)`, the solution of the KL-constrained
    improvement step (Peng et al., 2019). The weights are clipped at ``w_max`` (Peng et al. use 20) and
    treated as constants (no gradient through ``A``); the exponent is clamped at :math:`\log w_{\max}` before
    ``exp`` so no weight overflows. Symbols: ``logits`` ``(N, A)``, ``a`` ``(N,)``, ``A`` ``(N,)`` advantages
    :math:`A(s_i,a_i)`, ``beta`` :math:`\beta>0` a *temperature* (AWR's convention), ``w_max`` > 0. 0-d result.
    IQL's paper writes the same weights as :math:`e^{\beta_{IQL}A}` with an inverse temperature: to reproduce
    its :math:`\beta_{IQL}` pass ``beta = 1 / beta_IQL``.

    >>> round(awr_loss(torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([0.0, 1.0])).item(), 4)  # (1+e)/2 log 2
    1.2886
    """
    beta = check_range(beta, "beta", 0.0, low_open=True)
    w_max = check_range(w_max, "w_max", 0.0, low_open=True)
    logits, a = _logits_actions(logits, a)
    A = as_tensor(A, "A")
    check_shape(A, (logits.shape[0],), "A", "one advantage per logged pair (N,)")
    check_finite(A, "A")
    dtype = logits.dtype
    lc = upcast_half(logits)
    w = torch.exp((upcast_half(A).to(lc.dtype).detach() / beta).clamp(max=math.log(w_max)))
    logp = torch.log_softmax(lc, -1).gather(-1, a[:, None]).squeeze(-1)
    return restore_half(-(w * logp).mean(), dtype)


def fit_tabular(method: str, s, a, r, s_next, done, S: int, A: int, gamma: float, *, tau: float = 0.7,
                beta: float = 0.1, w_max: float = 20.0, iters: int = 5000, tol: float = 1e-14) -> dict:
    r"""The exact minimisers of BC, IQL and AWR for *tabular* policies on logged transitions (each ``(N,)``).

    With a free logit per :math:`(s,a)` each loss has a closed-form minimiser, so no gradient descent is
    needed (the tests check that the gradients of the registered losses vanish there):

    * ``"bc"``: :math:`\pi(a|s)=\hat\mu(a|s)=n(s,a)/n(s)` (uniform at unlogged states);
    * ``"iql"``: the in-sample fixed point :math:`Q(s,a)=\hat r(s,a)+\gamma\sum_{s'}\hat P(s'|s,a)(1-d)V(s')`,
      :math:`V(s)=` the :math:`\tau`-expectile of :math:`Q(s,\cdot)` weighted by :math:`n(s,a)` (only logged
      actions enter), swept until V moves by at most ``tol`` (or ``iters`` sweeps); then AWR's
      :math:`\pi(a|s)\propto n(s,a)\min(e^{(Q(s,a)-V(s))/\beta},w_{\max})`. ``beta`` is AWR's temperature,
      the inverse of the :math:`\beta` in IQL's paper (whose weights are :math:`e^{\beta A}`).

    Returns ``{"pi": (S, A), "Q": (S, A) or None, "V": (S,) or None, "n": (S, A) counts}`` in float64.
    """
    check_choice(method, "method", ("bc", "iql"))
    s, a, s_next = s.long(), a.long(), s_next.long()
    r, alive = r.double(), 1.0 - done.double()
    n = torch.zeros(S, A, dtype=torch.float64).index_put_((s, a), torch.ones_like(r), accumulate=True)
    seen = n.sum(-1) > 0
    uniform = torch.full((S, A), 1.0 / A, dtype=torch.float64)
    if method == "bc":
        return {"pi": torch.where(seen[:, None], n / n.sum(-1, keepdim=True).clamp(min=1), uniform), "Q": None,
                "V": None, "n": n}
    r_hat = torch.zeros(S, A, dtype=torch.float64).index_put_((s, a), r, accumulate=True) / n.clamp(min=1)
    P_hat = torch.zeros(S, A, S, dtype=torch.float64).index_put_((s, a, s_next), alive, accumulate=True)
    P_hat = P_hat / n.clamp(min=1)[..., None]
    V = torch.zeros(S, dtype=torch.float64)
    w = torch.where(seen[:, None], n, torch.ones_like(n))
    for _ in range(check_positive_int(iters, "iters")):
        Q = r_hat + gamma * P_hat @ V
        V_new = torch.where(seen, expectile(torch.where(n > 0, Q, 0.0), tau, w), 0.0)
        converged = (V_new - V).abs().max().item() <= tol
        V = V_new
        if converged:
            break
    Q = r_hat + gamma * P_hat @ V
    weight = n * torch.exp(((Q - V[:, None]) / beta).clamp(max=math.log(w_max)))
    pi = torch.where(seen[:, None], weight / weight.sum(-1, keepdim=True).clamp(min=1e-300), uniform)
    return {"pi": pi, "Q": Q, "V": V, "n": n}
