r"""The arithmetic of LLM agents: choosing a tool, scoring its argument, voting, verifying, remembering, retrying.

An LLM agent is a language model used as a policy: the context is the state, the next text it writes (a
thought, a tool name, an argument string) is the action, and the environment answers with an observation.
Every quantity below is a probability or a score built from the model's sequence log-probabilities.

* **Tool selection** (40.01, :func:`tool_policy`): :math:`\pi(\text{tool}\mid c)=\mathrm{softmax}(f(c))/\tau`
  over the tools' scores, e.g. the tiny GPT's log-probability of each tool name (:func:`string_log_probs`).
* **Argument likelihood** (40.02, :func:`argument_log_likelihood`): :math:`\sum_t\log p(a_t\mid\cdot,a_{<t})`,
  computed by chapter 10's :func:`llmbook.lm.preference.sequence_log_probs` (called, not rewritten).
* **Expected utility** (40.03, :func:`expected_utility`), **ReAct trajectory** (40.04,
  :func:`react_log_prob`), **Tree-of-Thoughts score** (40.05, :func:`tot_path_score`, searched by
  :func:`tot_beam_search`). Voting, verifiers, Reflexion memory, retries and failure prediction (40.06-40.11)
  are in :mod:`llmbook.agents.agent_decisions`.

>>> tool_policy(torch.tensor([[0.0, 0.0]])).tolist()
[[0.5, 0.5]]
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_broadcastable_to,
    check_dim,
    check_finite,
    check_int,
    check_real,
    check_same_shape,
)
from llmbook._precision import compute_dtype
from llmbook.lm.preference import sequence_log_probs
from llmbook.rag.rag_objectives import generator_log_probs
from llmbook.registry import implements

__all__ = ["argument_log_likelihood", "expected_utility", "react_log_prob", "string_log_probs", "tool_policy",
           "tot_beam_search", "tot_path_score"]


def _float(x, name: str, contract: str, *, min_dim: int = 1, allow_neg_inf: bool = False) -> Tensor:
    t = as_tensor(x, name)
    check_dim(t, name, contract, min_dim=min_dim)
    check_finite(t, name, allow_neg_inf=allow_neg_inf)
    return t


def string_log_probs(model, tok, context: str, strings) -> Tensor:
    r""":math:`\log p_\theta(s\mid c)` of each string of ``strings`` after ``context``, float64 shape ``(K,)``.

    The per-character log-probabilities come from chapter 29's :func:`llmbook.rag.rag_objectives.generator_log_probs`
    (one batched forward pass per string); this sums them, which is 40.02 for an argument string and the score
    :math:`f_k(c)` of 40.01 for a tool name. Not registered: a model-facing helper.
    """
    if isinstance(strings, str):
        raise TypeError("strings must be a sequence of strings, not one str")
    return torch.stack([generator_log_probs(model, tok, [context], s)[0].sum() for s in strings])


@implements("40.01")
def tool_policy(f: Tensor, tau: float = 1.0) -> Tensor:
    r"""Tool-selection policy :math:`\pi_\theta(\text{tool}_k\mid c)=\mathrm{softmax}_k(f_k(c)/\tau)`.

    ``f`` ``(B, K)``: a score per candidate tool (the model's log-probability of the tool's name after the
    context; ``-inf`` masks a tool out), ``tau > 0`` a temperature. Returns ``(B, K)`` rows summing to 1.

    >>> [round(x, 4) for x in tool_policy(torch.log(torch.tensor([[3.0, 1.0]])))[0].tolist()]
    [0.75, 0.25]
    """
    tau = check_real(tau, "tau")
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    f = _float(f, "f", "(B, K)", allow_neg_inf=True)
    if f.shape[-1] == 0:
        raise ValueError("f needs at least one tool (K >= 1)")
    if f.numel() and torch.isneginf(f).all(-1).any():
        raise ValueError("every tool of a row is masked (-inf): the policy is undefined")
    return torch.softmax(f.to(compute_dtype(f.dtype)) / tau, dim=-1).to(f.dtype)


@implements("40.02")
def argument_log_likelihood(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    r"""Argument likelihood :math:`\log p_\theta(\text{args}\mid\text{tool},c)=\sum_t\log p_\theta(a_t\mid\cdot)`.

    ``logits`` ``(B, T, V)`` predict ``labels`` ``(B, T)`` (already shifted); the tool name and context positions
    carry ``ignore_index``. Calls chapter 10's :func:`llmbook.lm.preference.sequence_log_probs`. Returns ``(B,)``.

    >>> round(argument_log_likelihood(torch.zeros(1, 2, 4), torch.tensor([[-100, 1]])).item(), 4)
    -1.3863
    """
    logits = as_tensor(logits, "logits")
    check_dim(logits, "logits", "(B, T, V)", min_dim=3, max_dim=3)
    check_finite(logits, "logits")
    return sequence_log_probs(logits, labels, ignore_index=ignore_index)


@implements("40.03")
def expected_utility(p: Tensor, R: Tensor, cost: Tensor, lam: float = 1.0) -> Tensor:
    r"""Expected utility :math:`U(\text{tool})=\mathbb{E}[R\mid\text{tool},c]-\lambda\,\mathrm{Cost}(\text{tool})`.

    ``p`` ``(B, K, M)``: probability of each of ``M`` outcomes for each of ``K`` tools (rows sum to 1); ``R``
    broadcastable to it, the reward of each outcome; ``cost`` broadcastable to ``(B, K)``; ``lam >= 0``.
    Returns ``(B, K)``.

    >>> expected_utility(torch.tensor([[[0.5, 0.5]]]), torch.tensor([0.0, 1.0]), torch.tensor([0.1]), 1.0)
    tensor([[0.4000]])
    """
    lam = check_real(lam, "lam")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    p = _float(p, "p", "(B, K, M)", min_dim=3)
    if p.numel() and (p.min() < 0 or (p.sum(-1) - 1).abs().max() > 1e-3):
        raise ValueError("p must hold outcome probabilities >= 0 summing to 1 over the last axis")
    R, cost = _float(R, "R", "broadcastable to (B, K, M)", min_dim=0), _float(cost, "cost", "(B, K)", min_dim=0)
    check_broadcastable_to(R, p.shape, "R", "p's shape (B, K, M)")
    check_broadcastable_to(cost, p.shape[:-1], "cost", "(B, K)")
    dt = compute_dtype(torch.promote_types(torch.promote_types(p.dtype, R.dtype), cost.dtype))
    U = (p.to(dt) * R.to(dt)).sum(-1) - lam * cost.to(dt)
    return U.to(torch.promote_types(p.dtype, R.dtype))


@implements("40.04")
def react_log_prob(log_pi: Tensor, log_obs: Tensor, mask: Tensor | None = None) -> Tensor:
    r"""ReAct trajectory log-probability :math:`\log p(\tau\mid x)`.

    :math:`\log p(\tau\mid x)=\sum_t[\log p_\theta(\text{thought}_t,\text{action}_t\mid\cdot)+\log p(o_t\mid a_t)]`.

    ``log_pi`` ``(B, T)``: the policy's log-probability of each step's thought and action (a sum of character
    log-probs); ``log_obs`` ``(B, T)``: the environment's log-probability of the observation; ``mask`` ``(B, T)``
    bool marks real steps (padding after the end is ignored). Returns ``(B,)``.

    >>> react_log_prob(torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.0, -0.5]])).tolist()
    [-3.5]
    """
    log_pi = _float(log_pi, "log_pi", "(B, T)", allow_neg_inf=True)
    log_obs = _float(log_obs, "log_obs", "(B, T)", allow_neg_inf=True)
    check_same_shape(log_pi, log_obs, "log_pi", "log_obs")
    if log_pi.numel() and (log_pi.max() > 0 or log_obs.max() > 0):
        raise ValueError("log_pi and log_obs are log-probabilities and must be <= 0")
    s = log_pi.to(compute_dtype(log_pi.dtype)) + log_obs.to(compute_dtype(log_obs.dtype))
    if mask is not None:
        mask = as_tensor(mask, "mask", floating=False)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        check_same_shape(log_pi, mask, "log_pi", "mask")
        s = torch.where(mask, s, torch.zeros_like(s))
    return s.sum(-1).to(torch.promote_types(log_pi.dtype, log_obs.dtype))


@implements("40.05")
def tot_path_score(v: Tensor) -> Tensor:
    r"""Tree-of-Thoughts path score :math:`S(\text{path})=\sum_{t=1}^T v_\theta(\text{thought}_t\mid x,\cdot)`.

    ``v`` ``(B, T)``: the evaluator's value of each thought along ``B`` paths. Returns ``(B,)``.

    >>> tot_path_score(torch.tensor([[0.5, 1.0, -0.25]])).tolist()
    [1.25]
    """
    v = _float(v, "v", "(B, T)")
    return v.to(compute_dtype(v.dtype)).sum(-1).to(v.dtype)


def tot_beam_search(values: list[Tensor], beam: int) -> tuple[tuple[int, ...], float]:
    r"""Breadth-limited Tree-of-Thoughts search over a full tree with branching ``b`` and depth ``T``.

    ``values[t]`` has shape ``(b,) * (t + 1)``: the value of thought ``i_t`` after the prefix ``i_0..i_{t-1}``.
    Keeps the ``beam`` best prefixes by :func:`tot_path_score` at every depth (ToT's BFS); ``beam = b**T``
    is exhaustive. Returns the best path found and its score.
    """
    beam = check_int(beam, "beam", low=1)
    if not values:
        raise ValueError("values needs at least one depth")
    frontier: list[tuple[tuple[int, ...], list[float]]] = [((), [])]
    for t, vt in enumerate(values):
        vt = _float(vt, f"values[{t}]", "(b,) * (t + 1)", min_dim=t + 1)
        cand = [(p + (i,), vs + [float(vt[p + (i,)])]) for p, vs in frontier for i in range(vt.shape[-1])]
        scores = tot_path_score(torch.tensor([vs for _, vs in cand], dtype=torch.float64))
        keep = torch.argsort(scores, descending=True, stable=True)[:beam]
        frontier = [cand[int(k)] for k in keep]
    return frontier[0][0], float(sum(frontier[0][1]))
