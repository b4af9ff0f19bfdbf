r"""Search-based and model-pair decoding (chapter 9): beam search, length penalty, contrastive, speculative.

A *model* here is a plain function from a prefix of token ids (a 1-D ``LongTensor``) to the next
token's log-probabilities (or logits) of shape ``(V,)``, so a lookup table, an n-gram model or a
wrapped transformer all fit. The warpers and samplers are in :mod:`llmbook.lm.decoding`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_integer_tensor,
    check_nonempty,
    check_nonnegative_int,
    check_positive_int,
    check_probability,
    check_range,
    is_real,
)
from llmbook.lm.probability import log_softmax, softmax
from llmbook.registry import implements

__all__ = [
    "Hypothesis",
    "length_penalty",
    "beam_search",
    "contrastive_decoding_scores",
    "contrastive_decode_step",
    "speculative_accept_prob",
    "residual_distribution",
    "speculative_sample",
    "speculative_decode",
]

StepFn = Callable[[Tensor], Tensor]


def _prefix(prefix) -> Tensor:
    t = torch.as_tensor(prefix)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.ndim != 1 or t.numel() == 0:
        raise ValueError(f"prefix must be a non-empty 1-D tensor of integer token ids, got dtype {t.dtype} "
                         f"shape {tuple(t.shape)}")
    return t.long()




def _next_scores(fn: StepFn, seq: Tensor, name: str, V: int | None) -> Tensor:
    """Call a model on a prefix and check that it returned ``(V,)`` scores."""
    out = as_tensor(fn(seq), f"{name}(prefix)")
    if out.ndim != 1 or out.numel() == 0 or (V is not None and out.shape[0] != V):
        want = "(V,)" if V is None else f"(V,) = ({V},)"
        raise ValueError(f"{name} must return next-token scores of shape {want}, got {tuple(out.shape)}")
    check_finite(out, f"{name}(prefix)", allow_neg_inf=True)
    return out.double()


# --------------------------------------------------------------------------- beam search


@implements("09.08")
def length_penalty(log_prob, length, alpha: float):
    r"""GNMT length-normalised score (Wu et al., 2016).

    .. math:: s(y) = \frac{\log p(y\mid x)}{\big(\tfrac{5+|y|}{6}\big)^\alpha}

    ``log_prob`` is :math:`\log p(y\mid x) \le 0`, ``length`` is :math:`|y|` (generated tokens,
    an int ``>= 0``), ``alpha`` is :math:`\alpha \ge 0` (``0``: raw log-probability; the paper uses 0.6-0.7).
    Dividing a negative number by a factor that grows with length lifts long hypotheses, which
    raw log-probability (a sum of negative terms) penalises. Numbers in, float out; tensors
    (a floating ``log_prob``, an integer ``length``) broadcast. A factor beyond the float range
    (``alpha = 1e30``) gives the limit ``log_prob / inf = -0.0``.

    >>> length_penalty(-6.0, 7, 1.0)  # (5 + 7) / 6 = 2
    -3.0
    """
    check_range(alpha, "alpha", 0.0, math.inf, high_open=True)
    if isinstance(length, Tensor):
        n = check_integer_tensor(length, "length", "an integer tensor of token counts")
        if n.numel() and n.min() < 0:
            raise ValueError(f"length must be >= 0 (number of generated tokens), got {n.min().item()}")
    else:
        n = check_nonnegative_int(length, "length")
    if isinstance(n, Tensor) or not is_real(log_prob):
        lp = as_tensor(log_prob, "log_prob")
        return lp / ((5 + torch.as_tensor(n).to(lp.dtype)) / 6) ** alpha
    try:
        factor = ((5 + n) / 6) ** alpha
    except OverflowError:  # beyond the float range (say alpha = 1e30): the score is log p / inf = -0.0
        factor = math.inf
    return float(log_prob) / factor


class Hypothesis(NamedTuple):
    """A beam-search result: the full token sequence (prefix included) and its scores."""

    tokens: Tensor  # (len(prefix) + length,)
    log_prob: float  # log p(y | prefix), summed over the generated tokens
    score: float  # length_penalty(log_prob, length, alpha), the final ranking key
    length: int  # number of generated tokens |y| (an eos token counts)


@implements("09.07")
def beam_search(
    step_fn: StepFn, prefix: Int[Tensor, " S"], beam_width: int, max_len: int,
    eos_id: int | None = None, alpha: float = 0.0,
) -> list[Hypothesis]:
    r"""Beam search: keep the ``B`` best extensions of the previous beam by log-probability.

    .. math:: B_t = \mathrm{Top}B_{y_{1:t}}\,[\log p_\theta(y_{1:t}\mid x)],\ y_{1:t} \in B_{t-1}\times\mathcal{V}

    ``step_fn(seq)`` maps a 1-D ``LongTensor`` (prefix + tokens so far) to next-token
    log-probabilities ``(V,)``; ``prefix`` is :math:`x` (at least a BOS token); ``beam_width`` is
    :math:`B`; ``max_len`` the most tokens to generate.

    Each step extends every live hypothesis by every token, and keeps the ``beam_width`` best
    candidates by summed log-probability (ties: earlier beam, then lower token id). A kept
    candidate ending in ``eos_id`` is set aside as finished and stops consuming compute, so the
    live beam shrinks as hypotheses finish; the search ends after ``max_len`` steps or when none is
    live. Finished and still-live hypotheses are finally ranked by :func:`length_penalty` with
    ``alpha`` (Wu et al., 2016). Candidates of log-probability ``-inf`` are never kept.

    With ``beam_width = 1`` this is greedy decoding; with ``beam_width >= V**(max_len - 1)`` nothing
    is pruned before the last step and the result is the exact best sequence.

    Returns every hypothesis, best first.

    >>> table = torch.log(torch.tensor([[0.1, 0.5, 0.4], [0.6, 0.2, 0.2], [0.0, 0.0, 1.0]]))
    >>> step = lambda seq: table[seq[-1]]  # a bigram model; token 2 leads to certainty
    >>> best = beam_search(step, torch.tensor([0]), beam_width=2, max_len=2)[0]
    >>> best.tokens, round(best.log_prob, 4)  # 0.4 * 1.0 beats greedy's 0.5 * 0.6
    (tensor([0, 2, 2]), -0.9163)
    """
    seq0 = _prefix(prefix)
    beam_width, max_len = check_positive_int(beam_width, "beam_width"), check_positive_int(max_len, "max_len")
    check_range(alpha, "alpha", 0.0, math.inf, high_open=True)
    if eos_id is not None:
        eos_id = check_nonnegative_int(eos_id, "eos_id (None or a token id)")
    alive: list[tuple[Tensor, float]] = [(seq0, 0.0)]
    finished: list[tuple[Tensor, float]] = []
    V = None
    for _ in range(max_len):
        rows = []
        for seq, lp in alive:
            nxt = _next_scores(step_fn, seq, "step_fn", V)
            V = nxt.shape[0]
            rows.append(lp + nxt)
        cand = torch.stack(rows).flatten()  # (live * V,), beam-major
        order = torch.sort(cand, descending=True, stable=True).indices[:beam_width]
        new_alive = []
        for i in order.tolist():
            if cand[i] == -math.inf:
                break
            beam, tok = divmod(i, V)
            seq = torch.cat([alive[beam][0], torch.tensor([tok])])
            (finished if tok == eos_id else new_alive).append((seq, cand[i].item()))
        alive = new_alive
        if not alive:
            break
    hyps = []
    for seq, lp in finished + alive:
        n = seq.numel() - seq0.numel()
        hyps.append(Hypothesis(seq, lp, length_penalty(lp, n, alpha), n))
    return sorted(hyps, key=lambda h: -h.score)  # sorted() is stable


# --------------------------------------------------------------------------- contrastive decoding


@implements("09.09")
def contrastive_decoding_scores(
    expert_logits: Float[Tensor, "... V"], amateur_logits: Float[Tensor, "... V"], alpha: float = 1.0,
    plausibility: float = 0.1,
) -> Float[Tensor, "... V"]:
    r"""Contrastive decoding scores, on the plausible set :math:`V_{head}`.

    .. math:: s(x) = \log p_{exp}(x\mid c) - \alpha \log p_{ama}(x\mid c), \quad x \in V_{head}

    Li et al. (2023) introduced the unweighted difference (:math:`\alpha = 1`) with the plausibility
    constraint, for open-ended generation with a smaller language model as the amateur. The weighted
    form is O'Brien & Lewis (2023), who write it in logits as :math:`(1+\lambda) z_{exp} - \lambda z_{ama}`
    (their :math:`\beta`, renamed here because :math:`\beta` is the plausibility threshold below): divided by
    :math:`1+\lambda` it ranks tokens exactly as this score with :math:`\alpha = \lambda/(1+\lambda)`
    (log-softmax differs from the logits by a constant per row).

    The *plausibility constraint* keeps :math:`V_{head} = \{x : p_{exp}(x\mid c) \ge \beta \max_w p_{exp}(w\mid c)\}`
    (``plausibility`` is :math:`\beta \in [0, 1]`, 0.1 in the paper, where it is called
    :math:`\alpha`); every other token scores ``-inf``. Without it, a token both models find absurd
    could win on the difference. ``alpha`` (:math:`\alpha \ge 0`, the catalogue's symbol) weights the
    amateur; ``alpha = 0`` is plain expert log-probability. A plausible token the amateur gives
    probability 0 scores ``+inf``. Shapes ``(..., V), (..., V) -> (..., V)``.

    >>> e, a = torch.log(torch.tensor([0.5, 0.4, 0.1])), torch.log(torch.tensor([0.8, 0.1, 0.1]))
    >>> contrastive_decoding_scores(e, a, alpha=1.0, plausibility=0.5)  # log(0.5/0.8), log(0.4/0.1)
    tensor([-0.4700,  1.3863,    -inf])
    """
    e = as_tensor(expert_logits, "expert_logits")
    a = as_tensor(amateur_logits, "amateur_logits")
    for t, name in ((e, "expert_logits"), (a, "amateur_logits")):
        check_dim(t, name, "(..., V)")
        check_nonempty(t, name)
        check_finite(t, name, allow_neg_inf=True)
    if e.shape != a.shape:
        raise ValueError(f"expert_logits {tuple(e.shape)} and amateur_logits {tuple(a.shape)} must have the same "
                         "shape (..., V): both models must share one vocabulary")
    check_range(alpha, "alpha", 0.0, math.inf, high_open=True)
    check_range(plausibility, "plausibility", 0.0, 1.0)
    lpe, lpa = log_softmax(e), log_softmax(a)
    plausible = torch.isfinite(lpe) & (lpe.exp() >= plausibility * lpe.exp().amax(-1, keepdim=True))
    score = lpe - alpha * lpa if alpha else lpe
    return score.masked_fill(~plausible, float("-inf"))


def contrastive_decode_step(
    expert_logits: Float[Tensor, "... V"], amateur_logits: Float[Tensor, "... V"], alpha: float = 1.0,
    plausibility: float = 0.1,
) -> Int[Tensor, "..."]:
    r"""Contrastive decoding: the best-scoring plausible token.

    .. math:: x_t = \arg\max_{x \in V_{head}} [\log p_{exp}(x\mid c) - \alpha\log p_{ama}(x\mid c)]

    The argmax of :func:`contrastive_decoding_scores` (ties: first index). Shape ``(..., V) -> (...)``.

    >>> e, a = torch.log(torch.tensor([0.5, 0.4, 0.1])), torch.log(torch.tensor([0.8, 0.1, 0.1]))
    >>> contrastive_decode_step(e, a, alpha=1.0, plausibility=0.5)  # greedy on the expert would pick 0
    tensor(1)
    """
    return contrastive_decoding_scores(expert_logits, amateur_logits, alpha, plausibility).argmax(-1)


# --------------------------------------------------------------------------- speculative decoding


def _pq(p, q) -> tuple[Tensor, Tensor]:
    p, q = as_tensor(p, "p"), as_tensor(q, "q")
    check_dim(p, "p", "(..., V)")
    check_nonempty(p, "p")
    if p.shape != q.shape:
        raise ValueError(f"target p {tuple(p.shape)} and draft q {tuple(q.shape)} must have the same shape (..., V)")
    check_probability(p, "p (target distribution)")
    check_probability(q, "q (draft distribution)")
    return p, q


@implements("09.10")
def speculative_accept_prob(p: Float[Tensor, "... V"], q: Float[Tensor, "... V"], x: Int[Tensor, "..."]) -> Tensor:
    r"""Acceptance probability of a drafted token: :math:`a = \min\big(1, p(x)/q(x)\big)`.

    ``p`` is the target model's next-token distribution, ``q`` the draft model's, ``x`` the token(s)
    the draft proposed. Tokens the draft under-rates are always accepted. ``x`` broadcasts against
    the leading dims of ``p`` and ``q``, so one ``(V,)`` pair can be scored at every token at once
    (``x = torch.arange(V)``). A token the draft never proposes (:math:`q(x) = 0`) gets ``1`` by
    the convention :math:`\min(1, p/0) = 1`; it carries no weight in the output law
    :math:`q(x)\,a(x)`. Shapes ``(..., V), (..., V), (...) -> (...)`` (broadcast).

    >>> speculative_accept_prob(torch.tensor([0.2, 0.8]), torch.tensor([0.5, 0.5]), torch.tensor(0))
    tensor(0.4000)
    >>> speculative_accept_prob(torch.tensor([0.2, 0.8]), torch.tensor([0.5, 0.5]), torch.arange(2))
    tensor([0.4000, 1.0000])
    """
    p, q = _pq(p, q)
    x = torch.as_tensor(x)
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"x must hold integer token ids, got dtype {x.dtype}")
    try:
        lead = torch.broadcast_shapes(p.shape[:-1], x.shape)
    except RuntimeError as err:
        raise ValueError(f"x {tuple(x.shape)} must broadcast against the leading dims of p and q "
                         f"{tuple(p.shape[:-1])}") from err
    V = p.shape[-1]
    if x.numel() and (x.min() < 0 or x.max() >= V):
        raise ValueError(f"x must be token ids in [0, V) = [0, {V}), got range [{x.min().item()}, {x.max().item()}]")
    idx = x.long().expand(lead).unsqueeze(-1)
    px, qx = p.expand(*lead, V).gather(-1, idx).squeeze(-1), q.expand(*lead, V).gather(-1, idx).squeeze(-1)
    return torch.where(qx > 0, torch.clamp(px / torch.where(qx > 0, qx, 1.0), max=1.0), 1.0)


def residual_distribution(p: Float[Tensor, "... V"], q: Float[Tensor, "... V"]) -> Float[Tensor, "... V"]:
    r"""The distribution to resample from after a rejection: :math:`\mathrm{norm}(\max(0, p - q))`.

    It holds exactly the mass the draft under-covers. When ``p == q`` it is undefined but never
    used (every draft is accepted); ``p`` is returned then. Shape ``(..., V) -> (..., V)``.

    >>> residual_distribution(torch.tensor([0.2, 0.8]), torch.tensor([0.5, 0.5]))
    tensor([0., 1.])
    """
    p, q = _pq(p, q)
    r = torch.clamp(p - q, min=0.0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, torch.ones_like(s)), p)


def speculative_sample(
    p: Float[Tensor, "... V"], q: Float[Tensor, "... V"], generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "..."], Tensor]:
    r"""One speculative-sampling token (Leviathan et al., 2023; Chen et al., 2023), exactly distributed as ``p``.

    Draw :math:`x \sim q`; accept it with probability :math:`\min(1, p(x)/q(x))`
    (:func:`speculative_accept_prob`); otherwise draw from :func:`residual_distribution`. The output
    law is :math:`q(x)\min(1, p(x)/q(x)) + (1-\beta)\,\mathrm{norm}(\max(0,p-q))(x) = p(x)`, with
    :math:`\beta = \sum_x \min(p(x), q(x))` the acceptance rate. Returns ``(tokens, accepted)``,
    shapes ``(...)``; rows are independent.

    >>> speculative_sample(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]))  # always rejected
    (tensor(1), tensor(False))
    """
    p, q = _pq(p, q)
    V, lead = p.shape[-1], p.shape[:-1]
    x = torch.multinomial(q.reshape(-1, V), 1, generator=generator)  # (N, 1)
    u = torch.rand(x.shape, generator=generator, dtype=p.dtype)
    p2, q2 = p.reshape(-1, V), q.reshape(-1, V)
    accepted = u * q2.gather(-1, x) < p2.gather(-1, x)  # u < p/q without dividing
    y = torch.multinomial(residual_distribution(p2, q2), 1, generator=generator)
    return torch.where(accepted, x, y).reshape(lead), accepted.reshape(lead)


class SpeculativeResult(NamedTuple):
    tokens: Tensor  # prefix + generated tokens
    n_drafted: int  # draft tokens proposed
    n_accepted: int  # draft tokens accepted


def speculative_decode(
    target_fn: StepFn, draft_fn: StepFn, prefix: Int[Tensor, " S"], n_draft: int, max_new_tokens: int,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    r"""Speculative decoding: the draft proposes ``n_draft`` tokens, the target verifies them, output ~ target.

    Each round (Leviathan et al., 2023, Algorithm 1) drafts :math:`\gamma` tokens
    :math:`x_i \sim q(\cdot\mid x_{<i})`, scores the :math:`\gamma + 1` prefixes with the target
    (one parallel pass in a real system), accepts drafts left to right with probability
    :math:`\min(1, p/q)`, and at the first rejection resamples from the residual and ends the
    round; if all are accepted it adds one token from the target. So a round yields 1 to
    :math:`\gamma+1` tokens, each sequence has exactly the target model's law.

    ``target_fn`` / ``draft_fn`` map a 1-D ``LongTensor`` prefix to next-token logits or
    log-probabilities ``(V,)`` (softmax is applied). :math:`\gamma` is ``n_draft``, shortened near
    ``max_new_tokens`` so the output is never longer.

    >>> target = lambda seq: torch.log(torch.tensor([0.0, 1.0]))  # always token 1
    >>> speculative_decode(target, target, torch.tensor([0]), n_draft=3, max_new_tokens=5)
    SpeculativeResult(tokens=tensor([0, 1, 1, 1, 1, 1]), n_drafted=3, n_accepted=3)
    """
    seq = _prefix(prefix)
    n_draft = check_positive_int(n_draft, "n_draft")
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
    V = None
    n_drafted = n_accepted = 0
    goal = seq.numel() + max_new_tokens

    def dist(fn, s, name):
        nonlocal V
        out = softmax(_next_scores(fn, s, name, V))
        V = out.shape[0]
        return out

    def draw(probs):
        return torch.multinomial(probs, 1, generator=generator)

    while seq.numel() < goal:
        gamma = min(n_draft, goal - seq.numel() - 1)
        drafts, qs = [], []
        for _ in range(gamma):
            q = dist(draft_fn, torch.cat([seq, *drafts]), "draft_fn")
            qs.append(q)
            drafts.append(draw(q))
        n_drafted += gamma
        for i in range(gamma + 1):
            p = dist(target_fn, torch.cat([seq, *drafts[:i]]), "target_fn")
            if i == gamma:  # every draft accepted: one bonus token from the target
                seq = torch.cat([seq, *drafts, draw(p)])
                break
            x = drafts[i]
            if torch.rand((), generator=generator, dtype=p.dtype) * qs[i][x] < p[x]:
                n_accepted += 1
                continue
            seq = torch.cat([seq, *drafts[:i], draw(residual_distribution(p, qs[i]))])
            break
    return SpeculativeResult(seq, n_drafted, n_accepted)
