r"""Combining and judging an LLM agent's attempts: voting, verifiers, Reflexion memory, retries, failure prediction.

The second half of chapter 40 (the first is :mod:`llmbook.agents.llm_agents`).

* **Self-consistency** (40.06, :func:`majority_vote`; exact accuracy :func:`majority_vote_accuracy`) and
  **weighted voting** (40.07, :func:`weighted_vote`) over sampled answers.
* **Verifier-guided decoding** (40.08, :func:`verifier_guided_choice`).
* **Reflexion memory** (40.09, :func:`reflexion_update`) as a set union over a finite set of reflections.
* **Retry value** (40.10, :func:`retry_decision`) and **failure probability** (40.11,
  :func:`failure_probability`, fitted by :func:`fit_failure_model`).

>>> majority_vote(torch.tensor([[1, 1, 0]])).tolist()
[1]
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_int, check_real, check_same_shape
from llmbook._precision import compute_dtype
from llmbook.agents.llm_agents import _float
from llmbook.registry import implements

__all__ = ["failure_probability", "fit_failure_model", "majority_vote", "majority_vote_accuracy", "reflexion_update",
           "retry_decision", "verifier_guided_choice", "weighted_vote"]


def _labels(y, name: str) -> Tensor:
    t = as_tensor(y, name, floating=False)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor of answer ids, got {t.dtype}")
    check_dim(t, name, "(B, N)", min_dim=2, max_dim=2)
    if t.numel() and t.min() < 0:
        raise ValueError(f"{name} must hold answer ids >= 0, got {t.min().item()}")
    return t.long()


def _vote(y: Tensor, w: Tensor, num_classes: int | None) -> Tensor:
    """The id with the largest total weight in each row of ``y`` (ties: the smallest id), ``(B,)`` long.

    The weights are summed per *distinct* id (``torch.unique`` sorts them), so the work does not grow with
    the size of the ids: an answer id of 10**12 costs what an id of 3 does.
    """
    if num_classes is not None:
        num_classes = check_int(num_classes, "num_classes", low=1)
        if y.numel() and y.max() >= num_classes:
            raise ValueError(f"answer ids must be < num_classes = {num_classes}, got {y.max().item()}")
    if y.numel() == 0:
        return torch.zeros(y.shape[0], dtype=torch.long)
    ids, slot = torch.unique(y, sorted=True, return_inverse=True)  # ids ascending: the first maximum is the smallest
    totals = torch.zeros(y.shape[0], len(ids), dtype=w.dtype).scatter_add_(1, slot, w)
    return ids[totals.argmax(-1)]


@implements("40.06")
def majority_vote(y: Tensor, num_classes: int | None = None) -> Tensor:
    r"""Self-consistency vote :math:`\hat y=\arg\max_y\sum_{i=1}^N\mathbf 1[y_i=y]` over ``N`` sampled answers.

    ``y`` ``(B, N)`` integer answer ids; a tie goes to the smallest id. Returns ``(B,)`` long.

    >>> majority_vote(torch.tensor([[2, 0, 2, 1]])).tolist()
    [2]
    """
    y = _labels(y, "y")
    if y.shape[1] == 0:
        raise ValueError("y needs at least one sampled answer (N >= 1)")
    return _vote(y, torch.ones(y.shape, dtype=torch.float64), num_classes)


@implements("40.07")
def weighted_vote(y: Tensor, w: Tensor, num_classes: int | None = None) -> Tensor:
    r"""Weighted self-consistency :math:`\hat y=\arg\max_y\sum_i w_i\mathbf 1[y_i=y]`.

    ``y`` ``(B, N)`` answer ids, ``w`` ``(B, N)`` weights (e.g. each sample's probability or a verifier score);
    ties go to the smallest id. Returns ``(B,)`` long.

    >>> weighted_vote(torch.tensor([[0, 0, 1]]), torch.tensor([[0.2, 0.2, 0.9]])).tolist()
    [1]
    """
    y = _labels(y, "y")
    w = _float(w, "w", "(B, N)", min_dim=2)
    check_same_shape(y, w, "y", "w")
    if y.shape[1] == 0:
        raise ValueError("y needs at least one sampled answer (N >= 1)")
    return _vote(y, w.to(torch.float64), num_classes)


def majority_vote_accuracy(probs, N: int) -> float:
    r"""Exact :math:`P(\text{majority of }N\text{ samples is answer }0)`; each sample is answer ``k`` w.p. ``probs[k]``.

    Sums the multinomial over every count vector; a tie between answer 0 and others counts as a fair draw
    (answer 0 wins with probability 1/#tied). Answer 0 is the correct one.
    """
    N = check_int(N, "N", low=1)
    p = [float(x) for x in probs]
    if any(x < 0 for x in p) or abs(sum(p) - 1) > 1e-9:
        raise ValueError("probs must be >= 0 and sum to 1")
    K, acc = len(p), 0.0
    for c in itertools.product(range(N + 1), repeat=K - 1):
        if sum(c) > N:
            continue
        n = (N - sum(c),) + c
        top = max(n)
        if n[0] == top:
            coef = math.factorial(N) / math.prod(math.factorial(k) for k in n)
            acc += coef * math.prod(pk ** k for pk, k in zip(p, n, strict=True)) / sum(k == top for k in n)
    return acc


@implements("40.08")
def verifier_guided_choice(log_p: Tensor, v: Tensor, lam: float = 1.0) -> Tensor:
    r"""Verifier-guided decoding :math:`y^*=\arg\max_{y\in\mathcal Y}[\log p_\theta(y\mid x)+\lambda v_\phi(x,y)]`.

    ``log_p`` ``(B, K)`` the model's log-probability of each candidate (``-inf`` allowed), ``v`` ``(B, K)`` the
    verifier's score, ``lam >= 0``. Returns the chosen index ``(B,)`` (ties: the first).

    >>> verifier_guided_choice(torch.tensor([[-1.0, -3.0]]), torch.tensor([[0.0, 1.0]]), 5.0).tolist()
    [1]
    """
    lam = check_real(lam, "lam")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    log_p = _float(log_p, "log_p", "(B, K)", allow_neg_inf=True)
    v = _float(v, "v", "(B, K)")
    check_same_shape(log_p, v, "log_p", "v")
    if log_p.shape[-1] == 0:
        raise ValueError("there must be at least one candidate (K >= 1)")
    dt = compute_dtype(torch.promote_types(log_p.dtype, v.dtype))
    return (log_p.to(dt) + lam * v.to(dt)).argmax(-1)


@implements("40.09")
def reflexion_update(M: Tensor, rho: Tensor) -> Tensor:
    r"""Reflexion memory update :math:`M_{t+1}=M_t\cup\{\rho_t\}` over a finite set of possible reflections.

    ``M`` ``(B, R)`` bool: which of ``R`` reflections each agent's memory holds; ``rho`` ``(B,)`` the id of the
    new reflection :math:`\rho_t=f_\theta(\text{trajectory}_t,\text{feedback}_t)`, or ``-1`` for none. Returns
    the new ``(B, R)`` bool memory (a set union: adding twice changes nothing).

    >>> reflexion_update(torch.tensor([[True, False, False]]), torch.tensor([2])).tolist()
    [[True, False, True]]
    """
    M = as_tensor(M, "M", floating=False)
    if M.dtype != torch.bool:
        raise TypeError(f"M must be a bool tensor, got {M.dtype}")
    check_dim(M, "M", "(B, R)", min_dim=2, max_dim=2)
    rho = as_tensor(rho, "rho", floating=False)
    if rho.dtype.is_floating_point or rho.dtype == torch.bool:
        raise TypeError(f"rho must be an integer tensor of reflection ids, got {rho.dtype}")
    check_dim(rho, "rho", "(B,)", min_dim=1, max_dim=1)
    if rho.shape[0] != M.shape[0]:
        raise ValueError(f"rho has {rho.shape[0]} rows but M has B = {M.shape[0]}")
    if rho.numel() and (rho.min() < -1 or rho.max() >= M.shape[1]):
        raise ValueError(f"rho must be -1 or an id in [0, R) = [0, {M.shape[1]})")
    new = torch.zeros_like(M)
    rows = (rho >= 0).nonzero()[:, 0]
    new[rows, rho[rows].long()] = True
    return M | new


@implements("40.10")
def retry_decision(p_success: Tensor, V: float, C_retry: float) -> Tensor:
    r"""Retry value :math:`\mathrm{Retry}=\mathbf 1[P(\text{success}\mid\text{retry})\,V-C_{\text{retry}}>0]`.

    ``p_success`` ``(B,)`` in ``[0, 1]``, ``V >= 0`` the value of success, ``C_retry >= 0`` the cost of one more
    try. Returns ``(B,)`` bool.

    >>> retry_decision(torch.tensor([0.05, 0.5]), 1.0, 0.1).tolist()
    [False, True]
    """
    V, C = check_real(V, "V"), check_real(C_retry, "C_retry")
    if V < 0 or C < 0:
        raise ValueError(f"V and C_retry must be >= 0, got {V} and {C}")
    p = _float(p_success, "p_success", "(B,)", min_dim=0)
    if p.numel() and (p.min() < 0 or p.max() > 1):
        raise ValueError("p_success must lie in [0, 1]")
    return p.to(compute_dtype(p.dtype)) * V - C > 0


@implements("40.11")
def failure_probability(phi: Tensor, w: Tensor, b: float = 0.0) -> Tensor:
    r"""Failure probability :math:`P(\text{fail}\mid c,\text{tool})=\sigma(w^\top\phi(c,\text{tool})+b)`.

    ``phi`` ``(B, D)`` features of (context, tool), ``w`` ``(D,)``, ``b`` a bias. Returns ``(B,)`` in ``(0, 1)``.

    >>> failure_probability(torch.tensor([[1.0, 2.0]]), torch.tensor([0.5, -0.25])).tolist()
    [0.5]
    """
    phi = _float(phi, "phi", "(B, D)", min_dim=2)
    w = _float(w, "w", "(D,)")
    b = check_real(b, "b")
    check_dim(w, "w", "(D,)", max_dim=1)
    if w.shape[0] != phi.shape[-1]:
        raise ValueError(f"w has {w.shape[0]} entries but phi has D = {phi.shape[-1]}")
    dt = compute_dtype(torch.promote_types(phi.dtype, w.dtype))
    return torch.sigmoid(phi.to(dt) @ w.to(dt) + b).to(torch.promote_types(phi.dtype, w.dtype))


def fit_failure_model(phi: Tensor, y: Tensor, l2: float = 1.0, steps: int = 200) -> tuple[Tensor, float]:
    r"""Fit :math:`w, b` of :func:`failure_probability` by L-BFGS: mean log-loss plus :math:`\frac{l2}{2n}\|w\|^2`.

    The penalty matches scikit-learn's ``LogisticRegression(C=1/l2)`` (whose objective is the summed log-loss
    plus :math:`\frac{1}{2C}\|w\|^2`, bias unpenalised), so the two fits agree. Returns ``(w, b)`` in float64.
    """
    phi = _float(phi, "phi", "(n, D)", min_dim=2).double()
    y = as_tensor(y, "y").double()
    l2 = check_real(l2, "l2")
    w = torch.zeros(phi.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1, max_iter=check_int(steps, "steps", low=1), tolerance_grad=1e-12,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")
    n = phi.shape[0]

    def closure():
        opt.zero_grad()
        z = phi @ w[:-1] + w[-1]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z, y) + l2 / (2 * n) * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w = w.detach()
    return w[:-1], float(w[-1])
