r"""Reward modelling for agents (chapter 41): rankings, margins, and process vs outcome supervision.

* **Rankings** (41.01, :func:`plackett_luce_probability`): the Plackett-Luce probability of a whole ranking of
  :math:`K` responses; it is ``exp`` of :func:`llmbook.rag.ranking.plackett_luce_log_prob` (chapter 25), the
  same distribution that ListMLE fits to a reranker. :func:`ranking_pairs` turns a ranking into its
  :math:`\binom{K}{2}` (winner, loser) pairs, InstructGPT's way of training a Bradley-Terry reward model
  (:func:`llmbook.lm.preference.reward_model_loss`, chapter 10) on rankings.
* **Margins** (41.02, :func:`pairwise_margin_loss`): the hinge on the reward difference, chapter 25's
  :func:`~llmbook.rag.ranking.pairwise_hinge_loss` applied to one (chosen, rejected) pair per row.
* **Process and outcome** (41.03, 41.04): :func:`process_reward_loss` supervises every step of a reasoning trace
  (a step mask leaves out padding and unlabelled steps), :func:`outcome_reward_loss` only the final answer.
  :func:`aggregate_step_scores` turns step scores into one trace score (``"prod"``, ``"min"``, ``"last"``).
* **A real example**: :func:`sum_traces` samples reasoning traces for multi-step sums from a policy that slips
  now and then; exact integer arithmetic labels every step and every final answer, and :func:`step_features`
  is what a small reward model sees of a step: a noisy digit-by-digit checker.

Shapes are batch-first: ``(B,)`` pairs or traces, ``(B, T)`` steps. Losses take *logits* (computed with
``softplus``, never ``log(sigmoid)``), labels in [0, 1] (soft labels allowed), and ``reduction`` ``"mean"``
(over traces or pairs), ``"sum"`` or ``"none"``. fp16 / bf16 inputs are computed in float32 and rounded once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_positive_int,
    check_range,
    check_same_shape,
    check_unit_interval,
)
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm.losses import reduce_loss
from llmbook.rag import ranking as rk
from llmbook.registry import implements

__all__ = ["plackett_luce_probability", "ranking_pairs", "pairwise_margin_loss", "process_reward_loss",
           "outcome_reward_loss", "aggregate_step_scores", "SumTraces", "sum_traces", "step_features"]

AGGREGATIONS = ("prod", "min", "last")


def _promote(names, tensors, contract, ndim):
    """Checked finite floating ``ndim``-d tensors of one shape, in their common compute dtype, and the output dtype."""
    ts = [as_tensor(t, n) for n, t in zip(names, tensors, strict=True)]
    out = ts[0].dtype
    for n, t in zip(names, ts, strict=True):
        check_dim(t, n, contract, min_dim=ndim, max_dim=ndim)
        check_finite(t, n)
        check_same_shape(ts[0], t, names[0], n)
        out = torch.promote_types(out, t.dtype)
    return [t.to(compute_dtype(out)) for t in ts], out


def _labels(y, like: Tensor, name: str = "y") -> Tensor:
    y = as_tensor(y, name)
    check_same_shape(like, y, "logits", name)
    check_finite(y, name)
    if ((y < 0) | (y > 1)).any():
        raise ValueError(f"{name} must hold labels in [0, 1] (1 = correct), got range "
                         f"[{y.min().item():.4g}, {y.max().item():.4g}]")
    return y.to(like.dtype)


def _mask(mask, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True for a labelled step), got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    check_same_shape(like, mask, "logits", "mask")
    return mask


# ----------------------------------------------------------------------------------------------- 41.01


@implements("41.01")
def plackett_luce_probability(s, pi, mask=None) -> Tensor:
    r"""Plackett-Luce probability of the ranking ``pi`` (best first) of items with scores ``s``.

    .. math:: P(\pi)=\prod_{i=1}^{n}\frac{e^{s_{\pi_i}}}{\sum_{j=i}^{n}e^{s_{\pi_j}}}

    The best item is drawn with probability proportional to :math:`e^{s}`, the second from the items left,
    and so on. ``s`` ``(B, K)``: the rewards :math:`r(x, y_k)` of the :math:`K` responses to a prompt;
    ``pi`` ``(B, K)`` integer, each row a permutation of ``0..K-1``; ``mask`` optional ``(B, K)`` bool
    (False for padding). Returns ``(B,)``, summing to 1 over all :math:`K!` rankings. This is ``exp`` of
    chapter 25's :func:`llmbook.rag.ranking.plackett_luce_log_prob` (computed there with a reversed
    ``logcumsumexp``); with :math:`K = 2` it is the Bradley-Terry probability :math:`\sigma(s_w - s_l)`.

    >>> round(float(plackett_luce_probability(torch.tensor([[1.0, 0.0]]), torch.tensor([[0, 1]]))), 4)
    0.7311
    """
    s = as_tensor(s, "s")
    dtype = s.dtype
    return restore_half(rk.plackett_luce_log_prob(upcast_half(s), pi, mask).exp(), dtype)


def ranking_pairs(pi) -> tuple[Tensor, Tensor]:
    r"""The :math:`\binom{K}{2}` (winner, loser) index pairs of rankings ``pi`` ``(B, K)`` (best first).

    InstructGPT's labellers ranked :math:`K = 4` to 9 responses per prompt and every pair of them became a
    Bradley-Terry comparison. Returns ``(w, l)``, each ``(B, K(K-1)/2)``: ``w[b, k]`` is ranked above ``l[b, k]``.

    >>> ranking_pairs(torch.tensor([[2, 0, 1]]))
    (tensor([[2, 2, 0]]), tensor([[0, 1, 1]]))
    """
    pi = check_integer_tensor(pi, "pi", "an integer tensor of rankings").long()
    check_dim(pi, "pi", "(B, K)", min_dim=2, max_dim=2)
    K = pi.shape[-1]
    if not torch.equal(pi.sort(-1).values, torch.arange(K).expand_as(pi)):
        raise ValueError(f"every row of pi must be a permutation of 0..{K - 1}")
    ij = torch.tensor(list(itertools.combinations(range(K), 2)), dtype=torch.long).view(-1, 2)
    return pi[:, ij[:, 0]], pi[:, ij[:, 1]]


# ----------------------------------------------------------------------------------------------- 41.02


@implements("41.02")
def pairwise_margin_loss(r_w, r_l, margin: float = 1.0, reduction: str = "mean") -> Tensor:
    r"""Margin (hinge) loss on the reward difference of a chosen and a rejected response.

    .. math:: \mathcal{L}=\max\big(0,\ m-r(x,y_w)+r(x,y_l)\big)

    ``r_w``, ``r_l`` ``(B,)``: rewards of the chosen and rejected responses; ``margin`` :math:`m \ge 0`.
    Zero once the chosen response wins by :math:`m`: unlike the Bradley-Terry loss of chapter 10
    (:func:`llmbook.lm.preference.reward_model_loss`, :math:`-\log\sigma(r_w - r_l - m)`, never zero) it stops
    pushing pairs that are already separated. Computed by chapter 25's
    :func:`llmbook.rag.ranking.pairwise_hinge_loss` on the two-item list :math:`(r_w, r_l)`.

    >>> pairwise_margin_loss(torch.tensor([2.0, 0.5]), torch.tensor([0.0, 0.0]), reduction="none")
    tensor([0.0000, 0.5000])
    """
    (r_w, r_l), out = _promote(("r_w", "r_l"), (r_w, r_l), "(B,)", 1)
    check_nonempty(r_w, "r_w", dim=0)
    m = check_range(margin, "margin", 0.0)
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    y = torch.tensor([1.0, 0.0], dtype=r_w.dtype).expand(r_w.shape[0], 2)
    loss = rk.pairwise_hinge_loss(torch.stack([r_w, r_l], -1), y, margin=m, kind="hinge", reduction=reduction)
    return restore_half(loss, out)


# ----------------------------------------------------------------------------------------------- 41.03, 41.04


@implements("41.03")
def process_reward_loss(logits, y, mask=None, reduction: str = "mean") -> Tensor:
    r"""Process reward model (PRM) loss: binary cross-entropy on every labelled step of a trace.

    .. math:: \mathcal{L}_{PRM}=-\sum_t\big[y_t\log p_t+(1-y_t)\log(1-p_t)\big],\qquad p_t=\sigma(z_t)

    ``logits`` ``(B, T)``: the reward model's score :math:`z_t` for step :math:`t` of each of ``B`` traces;
    ``y`` ``(B, T)``: step labels in [0, 1] (1 = the step is correct; soft labels, e.g. the share of
    roll-outs from the step that reach the right answer, are allowed); ``mask`` ``(B, T)`` bool, False for
    padding and unlabelled steps (PRM800K labels a trace up to its first wrong step). Per trace the sum over
    its masked steps, then ``reduction`` over traces. Each term is :math:`\mathrm{softplus}(z) - y z`.
    With every :math:`y_t` set to the trace's final-answer label this is the token-level verifier loss of
    Cobbe et al. (an outcome label spread over the steps).

    >>> round(float(process_reward_loss(torch.zeros(1, 3), torch.ones(1, 3))), 4)  # 3 log 2
    2.0794
    """
    (z,), out = _promote(("logits",), (logits,), "(B, T)", 2)
    y = _labels(y, z)
    keep = _mask(mask, z)
    terms = torch.where(keep, F.softplus(z) - y * z, torch.zeros((), dtype=z.dtype))
    return restore_half(reduce_loss(terms.sum(-1), None, reduction, "trace"), out)


@implements("41.04")
def outcome_reward_loss(logits, y, reduction: str = "mean") -> Tensor:
    r"""Outcome reward model (ORM) loss: binary cross-entropy on the final answer's correctness.

    .. math:: \mathcal{L}_{ORM}=-\big(y\log p+(1-y)\log(1-p)\big),\qquad p=\sigma(z)

    ``logits`` ``(B,)``: one score :math:`z` per trace (Cobbe et al.'s verifier reads the whole solution);
    ``y`` ``(B,)``: 1 when the final answer is right, checkable without any step label. A trace whose
    errors cancel is labelled 1 all the same. Computed as :math:`\mathrm{softplus}(z) - y z`.

    >>> round(float(outcome_reward_loss(torch.tensor([0.0]), torch.tensor([1.0]))), 4)
    0.6931
    """
    (z,), out = _promote(("logits",), (logits,), "(B,)", 1)
    y = _labels(y, z)
    return restore_half(reduce_loss(F.softplus(z) - y * z, None, reduction, "trace"), out)


def aggregate_step_scores(logits, mask=None, how: str = "prod") -> Tensor:
    r"""One score per trace from its step logits ``(B, T)``: a probability that the trace is sound.

    ``"prod"``: :math:`\prod_t p_t`, the probability that every step is correct if the steps were
    independent (Lightman et al.'s choice for best-of-N), computed as ``exp(sum(logsigmoid))``; ``"min"``:
    :math:`\min_t p_t`, the weakest step; ``"last"``: :math:`p` of the last masked step. Only steps with
    ``mask`` True count; every row needs one. Returns ``(B,)`` in [0, 1].

    >>> aggregate_step_scores(torch.tensor([[0.0, 0.0]]), how="prod")
    tensor([0.2500])
    """
    (z,), out = _promote(("logits",), (logits,), "(B, T)", 2)
    keep = _mask(mask, z)
    check_choice(how, "how", AGGREGATIONS)
    if z.shape[-1] == 0 or not keep.any(-1).all():
        raise ValueError("every trace needs at least one masked (True) step to aggregate")
    if how == "prod":
        score = torch.where(keep, F.logsigmoid(z), torch.zeros((), dtype=z.dtype)).sum(-1).exp()
    elif how == "min":
        score = torch.sigmoid(torch.where(keep, z, torch.full((), torch.inf, dtype=z.dtype)).min(-1).values)
    else:
        T = z.shape[-1]
        last = T - 1 - keep.flip(-1).long().argmax(-1)
        score = torch.sigmoid(z.gather(-1, last[:, None])[:, 0])
    return restore_half(score, out)


# ----------------------------------------------------------------------------------------------- traces


@dataclass
class SumTraces:
    """Sampled reasoning traces for sums of ``n_terms`` numbers: ``P`` problems, ``N`` samples each.

    Step ``t`` of a trace writes ``a + b = c``: ``a`` the running total so far (the trace's own, right or
    wrong), ``b`` the next term, ``c`` the new total. All ``(P, N, S)`` int64 with ``S = n_terms - 1``
    steps; ``step_ok`` ``(P, N, S)`` bool is exact arithmetic (``c == a + b``), ``outcome`` ``(P, N)`` bool
    whether the final total equals the true sum, ``terms`` ``(P, n_terms)``.
    """

    terms: Tensor
    a: Tensor
    b: Tensor
    c: Tensor
    step_ok: Tensor
    outcome: Tensor

    def text(self, p: int, n: int) -> str:
        """The trace as the policy would print it, e.g. ``'17+25=42, 42+8=50'``."""
        return ", ".join(f"{a}+{b}={c}" for a, b, c in zip(self.a[p, n].tolist(), self.b[p, n].tolist(),
                                                          self.c[p, n].tolist(), strict=True))


def sum_traces(n_problems: int, n_samples: int, n_terms: int = 5, p_error: float = 0.1,
               generator: torch.Generator | None = None) -> SumTraces:
    r"""Sample traces for ``n_problems`` sums of ``n_terms`` two-digit numbers, ``n_samples`` per problem.

    The policy adds the terms one by one; at each step, with probability ``p_error``, it slips: the new total
    is off by :math:`\pm 1` (a units slip) or :math:`\pm 10` (a lost or extra carry), each a quarter of the
    slips. Later steps build on the wrong total, so one slip spoils the answer unless another cancels it.

    >>> tr = sum_traces(1, 1, n_terms=3, p_error=0.0, generator=torch.Generator().manual_seed(0))
    >>> bool(tr.outcome.all()), tr.c.shape
    (True, torch.Size([1, 1, 2]))
    """
    P, N = check_positive_int(n_problems, "n_problems"), check_positive_int(n_samples, "n_samples")
    n_terms = check_int(n_terms, "n_terms", low=2)
    p_error = check_unit_interval(p_error, "p_error")
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    terms = torch.randint(10, 100, (P, n_terms), generator=g)
    slips = torch.tensor([-10, -1, 1, 10])
    err = torch.where(torch.rand(P, N, n_terms - 1, generator=g) < p_error,
                      slips[torch.randint(0, 4, (P, N, n_terms - 1), generator=g)], 0)
    a, b, c = (torch.empty(P, N, n_terms - 1, dtype=torch.long) for _ in range(3))
    total = terms[:, :1].expand(P, N)
    for t in range(n_terms - 1):
        a[..., t], b[..., t] = total, terms[:, t + 1, None].expand(P, N)
        c[..., t] = total = total + b[..., t] + err[..., t]
    return SumTraces(terms, a, b, c, c == a + b, c[..., -1] == terms.sum(-1, keepdim=True))


def step_features(a, b, c, noise: float = 0.1, generator: torch.Generator | None = None) -> Tensor:
    r"""What a cheap, unreliable checker reports of the step ``a + b = c``: ``(..., 3)`` float.

    Column ``k`` is +1 when digit ``k`` of ``c`` (units, tens, hundreds) equals that digit of ``a + b`` and
    -1 otherwise, each reading flipped with probability ``noise`` (a sloppy checker, a small model). A units
    slip fails the units check, a carry slip the tens check; no single reading is trusted.

    >>> step_features(torch.tensor([17]), torch.tensor([25]), torch.tensor([32]), noise=0.0)
    tensor([[ 1., -1.,  1.]])
    """
    noise = check_unit_interval(noise, "noise")
    nums = [check_integer_tensor(v, n).long() for n, v in (("a", a), ("b", b), ("c", c))]
    for n, v in zip("abc", nums, strict=True):
        check_same_shape(nums[0], v, "a", n)
        if v.numel() and v.min() < 0:
            raise ValueError(f"{n} must hold non-negative integers, got {v.min().item()}")
    base = torch.tensor([1, 10, 100])
    same = ((nums[0] + nums[1])[..., None] // base) % 10 == (nums[2][..., None] // base) % 10
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    flip = torch.rand(same.shape, generator=g) < noise
    return torch.where(same ^ flip, 1.0, -1.0).to(torch.get_default_dtype())
