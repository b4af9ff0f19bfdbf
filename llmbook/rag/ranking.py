r"""Reranking and learning to rank: cross-encoder and monoT5 scores, pointwise, pairwise and listwise losses.

A first-stage retriever returns :math:`N` candidates per query; a reranker gives each
(query, passage) pair a score :math:`s_i` and the list is re-sorted by it.

* **Scores** (25.01, 25.02): :func:`cross_encoder_score` (a linear head on the [CLS] vector),
  :func:`monot5_score` (the log-probability of the token "true").
* **Pointwise** (25.03, :func:`pointwise_loss`): each candidate alone, binary cross-entropy (or MSE).
* **Pairwise** (25.04, 25.05): :func:`pairwise_hinge_loss` (hinge or logistic) and
  :func:`ranknet_loss` over the pairs whose labels differ.
* **Listwise** (25.06, 25.07): :func:`listmle_loss`, the negative Plackett-Luce log-likelihood
  (:func:`plackett_luce_log_prob`) of the label order, and :func:`listnet_loss`, the cross-entropy
  between the top-one distributions of the labels and of the scores.
* **LambdaRank** (25.08, :func:`lambdarank_lambdas`): RankNet's pair gradient times the change of
  NDCG when the pair is swapped; :func:`lambda_gradients` sums them per document and
  :func:`lambdarank_loss` is a surrogate whose autograd gradient they are.

Input conventions: scores ``s`` are ``(B, N)`` (``B`` queries, ``N`` candidates each), relevance
labels ``y`` ``(B, N)`` (graded, larger is more relevant; integer or float), ``mask`` an optional
``(B, N)`` bool tensor, True for a real candidate and False for padding (lists of different lengths
padded to ``N``). Per-list losses average over the list's items or pairs (0 for a list with none) and
``reduction`` (``"mean"``, ``"sum"``, ``"none"``) combines the ``B`` lists. fp16/bf16 scores are
computed in float32 and returned in their dtype. Every normaliser is a log-sum-exp.

>>> s = torch.tensor([[2.0, 0.5, 1.0]]); y = torch.tensor([[2, 0, 1]])
>>> round(float(listmle_loss(s, y)), 4), round(float(ranknet_loss(s, y)), 4)
(0.9384, 0.3296)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_range,
    check_real,
    check_same_last_dim,
    check_same_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["cross_encoder_score", "monot5_score", "pointwise_loss", "pairwise_hinge_loss", "ranknet_loss",
           "plackett_luce_log_prob", "listmle_loss", "listnet_loss", "delta_ndcg", "lambdarank_lambdas",
           "lambda_gradients", "lambdarank_loss"]

REDUCTIONS = ("mean", "sum", "none")
GAINS = ("exp", "linear")


# ----------------------------------------------------------------------------------------------- inputs


def _lists(s, y, mask):
    """``s`` (B, N) in its compute dtype, ``y`` in the same dtype, the bool mask, and ``s``' dtype."""
    s = as_tensor(s, "s")
    check_dim(s, "s", "(B, N)", min_dim=2, max_dim=2)
    check_nonempty(s, "s", dim=0)
    check_nonempty(s, "s", dim=-1)
    check_finite(s, "s")
    dtype = s.dtype
    s = upcast_half(s)
    y = as_tensor(y, "y")
    check_same_shape(s, y, "s", "y")
    check_finite(y, "y")
    y = y.to(s.dtype)
    if mask is None:
        mask = torch.ones(s.shape, dtype=torch.bool, device=s.device)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True for a real candidate), got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        check_same_shape(s, mask, "s", "mask")
    return s, y, mask, dtype


def _reduce(per_list: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    check_choice(reduction, "reduction", REDUCTIONS)
    out = per_list.mean() if reduction == "mean" else per_list.sum() if reduction == "sum" else per_list
    return restore_half(out, dtype)


def _pair_mean(terms: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Mean of ``terms`` (B, N, N) over the True entries of ``pairs`` per list (0 for none)."""
    total = torch.where(pairs, terms, torch.zeros((), dtype=terms.dtype)).sum((-2, -1))
    return total / pairs.sum((-2, -1)).clamp(min=1)


def _ordered_pairs(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool: True where ``y_i > y_j`` and both are real candidates."""
    return (y[:, :, None] > y[:, None, :]) & mask[:, :, None] & mask[:, None, :]


# ----------------------------------------------------------------------------------------------- 25.01, 25.02


@implements("25.01")
def cross_encoder_score(h_cls, w, b: float = 0.0) -> torch.Tensor:
    r"""Cross-encoder relevance score :math:`s(q,d)=w^\top h_{[CLS]}(q,d) + b`.

    ``h_cls`` ``(..., d)`` is the encoder's vector for the joint input "[CLS] q [SEP] d [SEP]" (for
    BERT the pooled [CLS] output), ``w`` ``(d,)`` the linear head, ``b`` its bias (a real number).
    Returns ``(...)``: one score per (query, passage) pair. This is the ``num_labels=1`` head of
    ``BertForSequenceClassification`` that Nogueira and Cho fine-tuned on MS MARCO.

    >>> cross_encoder_score(torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([0.5, 1.0]), b=0.25)
    tensor([ 2.7500, -0.7500])
    """
    h_cls = as_tensor(h_cls, "h_cls")
    w = as_tensor(w, "w")
    check_dim(h_cls, "h_cls", "(..., d)")
    check_dim(w, "w", "(d,)", max_dim=1)
    check_same_last_dim(h_cls, w, "h_cls", "w", "d")
    b = check_real(b, "b")
    dtype = torch.promote_types(h_cls.dtype, w.dtype)
    out = upcast_half(h_cls.to(dtype)) @ upcast_half(w.to(dtype)) + b
    return restore_half(out, dtype)


@implements("25.02")
def monot5_score(logits, true_id: int, false_id: int, *, restrict: bool = True) -> torch.Tensor:
    r"""monoT5 relevance :math:`s(q,d)=\log p_\theta(\text{true}\mid q,d)` from the first decoder step's logits.

    ``logits`` ``(..., V)`` are the sequence-to-sequence model's logits for the first output token after
    the input "Query: q Document: d Relevant:"; ``true_id`` and ``false_id`` the ids of the tokens
    "true" and "false". With ``restrict`` (monoT5's choice) the softmax runs over those two logits only,
    :math:`s = \log\sigma(z_{\text{true}} - z_{\text{false}})`; otherwise over the whole vocabulary.
    Returns ``(...)``, a log-probability (at most 0).

    >>> round(float(monot5_score(torch.tensor([0.0, 2.0, 1.0]), true_id=1, false_id=2)), 4)
    -0.3133
    """
    z = as_tensor(logits, "logits")
    check_dim(z, "logits", "(..., V)")
    check_nonempty(z, "logits")
    check_finite(z, "logits")
    V = z.shape[-1]
    t = check_int(true_id, "true_id", low=0, high=V - 1)
    f = check_int(false_id, "false_id", low=0, high=V - 1)
    if t == f:
        raise ValueError(f"true_id and false_id must name two different tokens, got {t} for both")
    if not isinstance(restrict, bool):
        raise TypeError(f"restrict must be a bool, got {restrict!r}")
    dtype = z.dtype
    z = upcast_half(z)
    out = F.logsigmoid(z[..., t] - z[..., f]) if restrict else z[..., t] - torch.logsumexp(z, -1)
    return restore_half(out, dtype)


# ----------------------------------------------------------------------------------------------- 25.03-25.05


@implements("25.03")
def pointwise_loss(s, y, mask=None, *, kind: str = "bce", reduction: str = "mean") -> torch.Tensor:
    r"""Pointwise loss: each candidate judged alone, :math:`\mathcal{L}=-(y\log\sigma(s)+(1-y)\log(1-\sigma(s)))`.

    ``kind="bce"`` (the equation; ``y`` in [0, 1], a binary or soft relevance), computed stably as
    :math:`\mathrm{softplus}(s) - y s`; ``kind="mse"`` regresses the graded label, :math:`(s-y)^2`.
    ``s``, ``y``, ``mask`` ``(B, N)``; the per-list mean over real candidates, then ``reduction``.

    >>> round(float(pointwise_loss(torch.tensor([[0.0, 2.0]]), torch.tensor([[1.0, 1.0]]))), 4)
    0.4100
    """
    s, y, mask, dtype = _lists(s, y, mask)
    check_choice(kind, "kind", ("bce", "mse"))
    if kind == "bce":
        if ((y < 0) | (y > 1)).any():
            raise ValueError(f"y must lie in [0, 1] for kind='bce', got range "
                             f"[{y.min().item():.4g}, {y.max().item():.4g}]")
        terms = F.softplus(s) - y * s
    else:
        terms = (s - y) ** 2
    per_list = torch.where(mask, terms, torch.zeros((), dtype=s.dtype)).sum(-1) / mask.sum(-1).clamp(min=1)
    return _reduce(per_list, reduction, dtype)


@implements("25.04")
def pairwise_hinge_loss(s, y, mask=None, *, margin: float = 1.0, kind: str = "hinge",
                        reduction: str = "mean") -> torch.Tensor:
    r"""Pairwise loss over the pairs :math:`y_i > y_j`: :math:`\mathcal{L}=\max(0,m-s(q,d^+)+s(q,d^-))`.

    Every pair of real candidates whose labels differ gives a :math:`(d^+, d^-)` pair. ``kind="hinge"``
    (the equation, ``margin`` :math:`m \ge 0`) or ``kind="logistic"``,
    :math:`\log(1+e^{-(s^+ - s^-)})` (RankNet without ties; ``margin`` unused). Per-list mean over
    its pairs (0 without any), then ``reduction``.

    >>> float(pairwise_hinge_loss(torch.tensor([[1.0, 0.5, 0.0]]), torch.tensor([[1, 0, 0]])))
    0.25
    """
    s, y, mask, dtype = _lists(s, y, mask)
    m = check_range(margin, "margin", 0.0)
    check_choice(kind, "kind", ("hinge", "logistic"))
    d = s[:, :, None] - s[:, None, :]  # s_i - s_j
    terms = F.relu(m - d) if kind == "hinge" else F.softplus(-d)
    return _reduce(_pair_mean(terms, _ordered_pairs(y, mask)), reduction, dtype)


@implements("25.05")
def ranknet_loss(s, y, mask=None, *, sigma: float = 1.0, ties: bool = False, reduction: str = "mean") -> torch.Tensor:
    r"""RankNet: cross-entropy of :math:`P_{ij}=\sigma(\sigma_s(s_i-s_j))` against :math:`\bar P_{ij}`.

    .. math:: \mathcal{L}=-\bar{P}_{ij}\log P_{ij}-(1-\bar{P}_{ij})\log(1-P_{ij})

    over the unordered pairs :math:`i<j` of real candidates, with :math:`\bar P_{ij}` = 1, 0 or 1/2 as
    :math:`y_i` is greater than, less than or equal to :math:`y_j`. Tied pairs are left out unless
    ``ties`` (Burges et al. kept them with target 1/2). ``sigma`` :math:`\sigma_s > 0` scales the score
    difference. Computed as :math:`\mathrm{softplus}(z) - \bar P z`, :math:`z = \sigma_s(s_i - s_j)`.
    Per-list mean over its pairs, then ``reduction``.

    >>> round(float(ranknet_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]))), 4)
    0.3133
    """
    s, y, mask, dtype = _lists(s, y, mask)
    sig = check_range(sigma, "sigma", 0.0, low_open=True)
    if not isinstance(ties, bool):
        raise TypeError(f"ties must be a bool, got {ties!r}")
    N = s.shape[-1]
    z = sig * (s[:, :, None] - s[:, None, :])
    P_bar = (1 + torch.sign(y[:, :, None] - y[:, None, :])) / 2
    upper = torch.ones(N, N, dtype=torch.bool, device=s.device).triu(1)
    pairs = upper & mask[:, :, None] & mask[:, None, :]
    if not ties:
        pairs = pairs & (P_bar != 0.5)
    return _reduce(_pair_mean(F.softplus(z) - P_bar * z, pairs), reduction, dtype)


# ----------------------------------------------------------------------------------------------- 25.06, 25.07


def _masked_fill_low(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``s`` with the padded entries at the dtype's lowest value: exp() of it is 0, and no -inf - (-inf)."""
    return torch.where(keep, s, torch.full((), torch.finfo(s.dtype).min, dtype=s.dtype))


def _pl_log_prob(s: torch.Tensor, pi: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    s_pi = s.gather(-1, pi)
    keep = mask.gather(-1, pi)
    s_pi = _masked_fill_low(s_pi, keep)
    # log sum_{j >= i} exp(s_{pi_j}): a log-cumsum-exp run from the end of the list
    tail = torch.logcumsumexp(s_pi.flip(-1), -1).flip(-1)
    return torch.where(keep, s_pi - tail, torch.zeros((), dtype=s.dtype)).sum(-1)


def plackett_luce_log_prob(s, pi, mask=None) -> torch.Tensor:
    r"""Log-probability of the ranking ``pi`` under the Plackett-Luce model with log-weights ``s``.

    .. math:: \log P(\pi\mid s)=\sum_{i=1}^{n}\Big(s_{\pi_i}-\log\sum_{j=i}^{n}e^{s_{\pi_j}}\Big)

    Items are drawn one after another without replacement, each with probability proportional to
    :math:`e^{s}` among those left. ``s`` ``(B, N)``, ``pi`` ``(B, N)`` integer, each row a
    permutation of ``0..N-1`` (best first); padded items (``mask`` False) are skipped wherever they
    stand. Returns ``(B,)``. Over all :math:`N!` permutations the probabilities sum to 1.

    >>> round(float(plackett_luce_log_prob(torch.zeros(1, 3), torch.tensor([[2, 0, 1]])).exp()), 4)
    0.1667
    """
    s, _, mask, dtype = _lists(s, torch.zeros_like(as_tensor(s, "s")), mask)
    pi = check_integer_tensor(pi, "pi", "an integer tensor of permutations")
    check_same_shape(s, pi, "s", "pi")
    N = s.shape[-1]
    if not torch.equal(pi.sort(-1).values, torch.arange(N, device=pi.device).expand_as(pi)):
        raise ValueError(f"every row of pi must be a permutation of 0..{N - 1}")
    return restore_half(_pl_log_prob(s, pi.long(), mask), dtype)


def _label_order(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Indices sorting each list by label, best first; ties keep their input order; padding last."""
    key = torch.where(mask, y, torch.full((), -math.inf, dtype=y.dtype))
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


@implements("25.06")
def listmle_loss(s, y, mask=None, *, reduction: str = "mean") -> torch.Tensor:
    r"""ListMLE: the negative Plackett-Luce log-likelihood of the order given by the labels.

    .. math:: \mathcal{L}=-\sum_{i=1}^{n}\log\frac{e^{s_{\pi_i}}}{\sum_{j=i}^{n}e^{s_{\pi_j}}}

    :math:`\pi` sorts the real candidates by ``y``, best first; tied labels keep their input order
    (one of the orders consistent with the labels; Xia et al. assume a total order). The denominators
    are a reversed ``torch.logcumsumexp``. ``s``, ``y``, ``mask`` ``(B, N)``; per-list sum, then
    ``reduction``.

    >>> round(float(listmle_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[1, 0]]))), 4)  # log 2
    0.6931
    """
    s, y, mask, dtype = _lists(s, y, mask)
    return _reduce(-_pl_log_prob(s, _label_order(y, mask), mask), reduction, dtype)


@implements("25.07")
def listnet_loss(s, y, mask=None, *, reduction: str = "mean") -> torch.Tensor:
    r"""ListNet (top-one): cross-entropy between the top-one distributions of the labels and the scores.

    .. math:: \mathcal{L}=-\sum_i P_y(i)\log P_s(i),\quad P_s(i)=\frac{e^{s_i}}{\sum_j e^{s_j}}

    and likewise :math:`P_y = \mathrm{softmax}(y)` (Cao et al.'s :math:`\varphi = \exp`), both over the
    real candidates only. Equals :math:`\mathrm{KL}(P_y\,\|\,P_s) + H(P_y)`. ``(B, N)`` inputs; per-list
    value, then ``reduction``.

    >>> round(float(listnet_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]))), 4)  # log 2
    0.6931
    """
    s, y, mask, dtype = _lists(s, y, mask)
    P_y = torch.softmax(_masked_fill_low(y, mask), -1)
    log_P_s = torch.log_softmax(_masked_fill_low(s, mask), -1)
    per_list = -torch.where(mask, P_y * log_P_s, torch.zeros((), dtype=s.dtype)).sum(-1)
    return _reduce(per_list, reduction, dtype)


# ----------------------------------------------------------------------------------------------- 25.08


def _gains(y: torch.Tensor, mask: torch.Tensor, gain: str) -> torch.Tensor:
    check_choice(gain, "gain", GAINS)
    if (y[mask] < 0).any():
        raise ValueError(f"y must be non-negative relevance grades for a DCG gain, got minimum "
                         f"{y[mask].min().item():.4g}")
    G = torch.exp2(y) - 1 if gain == "exp" else y
    G = torch.where(mask, G, torch.zeros((), dtype=y.dtype))
    if not torch.isfinite(G).all():
        raise ValueError(f"the gain 2^y - 1 overflows {y.dtype} (largest y {y.max().item():.4g}); use smaller grades "
                         f"or gain='linear'")
    return G


def _discounts_at_ranks(order: torch.Tensor, mask_sorted: torch.Tensor, k: int | None) -> torch.Tensor:
    """(B, N): the discount 1/log2(1 + rank) of each item placed by ``order`` (0 beyond k or padded)."""
    N = order.shape[-1]
    rank = torch.arange(1, N + 1, dtype=torch.float64, device=order.device)
    disc = 1.0 / torch.log2(1.0 + rank)
    if k is not None:
        disc = torch.where(rank <= k, disc, torch.zeros((), dtype=disc.dtype))
    disc = torch.where(mask_sorted, disc, torch.zeros((), dtype=disc.dtype))
    return torch.zeros_like(disc).scatter(-1, order, disc)  # back to the items' own positions


def _score_order(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    key = torch.where(mask, s, torch.full((), -math.inf, dtype=s.dtype))
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def _dcg(s, y, mask=None, k: int | None = None, gain: str = "exp") -> torch.Tensor:
    r"""(B,) DCG@k of the lists ranked by ``s``: :math:`\sum_{r\le k} G_{(r)}/\log_2(1+r)` (ties: input order)."""
    s, y, mask, _ = _lists(s, y, mask)
    k = None if k is None else check_int(k, "k", low=1)
    G = _gains(y.double(), mask, gain)
    order = _score_order(s, mask)
    D = _discounts_at_ranks(order, mask.gather(-1, order), k)
    return (G * D).sum(-1)


def _ndcg(s, y, mask=None, k: int | None = None, gain: str = "exp") -> torch.Tensor:
    """(B,) NDCG@k = DCG@k / ideal DCG@k (0 for a list without a relevant item)."""
    ideal = _dcg(as_tensor(y, "y").to(torch.float64), y, mask, k, gain)
    return _dcg(s, y, mask, k, gain) / torch.where(ideal > 0, ideal, torch.ones_like(ideal)) * (ideal > 0)


def delta_ndcg(s, y, mask=None, *, k: int | None = None, gain: str = "exp") -> torch.Tensor:
    r""":math:`|\Delta \mathrm{NDCG}_{ij}|`: how much NDCG@k changes when items i and j swap places.

    With the list ranked by ``s`` (ties in input order), gains :math:`G` (``"exp"``: :math:`2^y-1`;
    ``"linear"``: :math:`y`, scikit-learn's) and discounts :math:`D_i = 1/\log_2(1+\mathrm{rank}_i)`
    (0 beyond ``k``), a swap changes DCG by :math:`(G_i-G_j)(D_j-D_i)`; divided by the ideal DCG@k.
    Returns ``(B, N, N)`` float64, symmetric, 0 on padded rows/columns and for lists with no gain.

    >>> round(delta_ndcg(torch.tensor([[1.0, 0.0]]), torch.tensor([[0, 1]]), gain="linear")[0, 0, 1].item(), 4)
    0.3691
    """
    s, y, mask, _ = _lists(s, y, mask)
    k = None if k is None else check_int(k, "k", low=1)
    G = _gains(y.double(), mask, gain)
    D = _discounts_at_ranks(_score_order(s, mask), mask.gather(-1, _score_order(s, mask)), k)
    ideal_order = _label_order(y.double(), mask)
    ideal = (G * _discounts_at_ranks(ideal_order, mask.gather(-1, ideal_order), k)).sum(-1)
    dG = G[:, :, None] - G[:, None, :]
    dD = D[:, :, None] - D[:, None, :]
    inv = torch.where(ideal > 0, 1.0 / torch.where(ideal > 0, ideal, torch.ones_like(ideal)), torch.zeros_like(ideal))
    return (dG * dD).abs() * inv[:, None, None]


@implements("25.08")
def lambdarank_lambdas(s, y, mask=None, *, sigma: float = 1.0, k: int | None = None, gain: str = "exp") -> torch.Tensor:
    r"""LambdaRank's pair weights: RankNet's gradient scaled by the NDCG change of the swap.

    .. math:: \lambda_{ij}=\frac{-\sigma}{1+e^{\sigma(s_i-s_j)}}|\Delta NDCG_{ij}|

    for the pairs :math:`y_i > y_j` of real candidates (0 elsewhere). :math:`-\sigma/(1+e^{\sigma(s_i-s_j)})`
    is :math:`\partial/\partial s_i` of RankNet's pair loss :math:`\log(1+e^{-\sigma(s_i-s_j)})`, so
    :math:`\lambda_{ij}` is the push on :math:`s_i` (with :math:`-\lambda_{ij}` on :math:`s_j`); the
    :math:`|\Delta NDCG|` factor (:func:`delta_ndcg`, options ``k`` and ``gain``) concentrates it on
    pairs whose swap moves the top of the list. ``(B, N)`` inputs, ``(B, N, N)`` output.

    >>> round(lambdarank_lambdas(torch.tensor([[0.0, 0.0]]), torch.tensor([[0, 1]]), gain="linear")[0, 1, 0].item(), 4)
    -0.1845
    """
    s, y, mask, dtype = _lists(s, y, mask)
    sig = check_range(sigma, "sigma", 0.0, low_open=True)
    dN = delta_ndcg(s, y, mask, k=k, gain=gain).to(s.dtype)
    rho = torch.sigmoid(-sig * (s[:, :, None] - s[:, None, :]))  # 1 / (1 + e^{sigma (s_i - s_j)})
    lam = torch.where(_ordered_pairs(y, mask), -sig * rho * dN, torch.zeros((), dtype=s.dtype))
    return restore_half(lam, dtype)


def lambda_gradients(s, y, mask=None, *, sigma: float = 1.0, k: int | None = None, gain: str = "exp") -> torch.Tensor:
    r"""Per-document lambdas :math:`\lambda_i=\sum_{j}\lambda_{ij}-\sum_{j}\lambda_{ji}`, ``(B, N)``.

    The gradient of :func:`lambdarank_loss` (``reduction="sum"``) with respect to ``s``; gradient
    descent moves :math:`s_i` by :math:`-\eta\lambda_i`, up for a relevant document placed too low.

    >>> lambda_gradients(torch.tensor([[0.0, 0.0]]), torch.tensor([[0, 1]]), gain="linear")
    tensor([[ 0.1845, -0.1845]])
    """
    lam = lambdarank_lambdas(s, y, mask, sigma=sigma, k=k, gain=gain)
    return lam.sum(-1) - lam.sum(-2)


def lambdarank_loss(s, y, mask=None, *, sigma: float = 1.0, k: int | None = None, gain: str = "exp",
                    reduction: str = "mean") -> torch.Tensor:
    r"""A loss whose gradient is LambdaRank's: :math:`\sum_{y_i>y_j}|\Delta NDCG_{ij}|\log(1+e^{-\sigma(s_i-s_j)})`.

    The :math:`|\Delta NDCG|` weights are held constant (computed without gradient), as LambdaRank
    defines only the gradient. Per-list sum over pairs, then ``reduction``.

    >>> round(float(lambdarank_loss(torch.tensor([[0.0, 0.0]]), torch.tensor([[0, 1]]), gain="linear")), 4)
    0.2558
    """
    s, y, mask, dtype = _lists(s, y, mask)
    sig = check_range(sigma, "sigma", 0.0, low_open=True)
    with torch.no_grad():
        dN = delta_ndcg(s, y, mask, k=k, gain=gain).to(s.dtype)
    terms = F.softplus(-sig * (s[:, :, None] - s[:, None, :])) * dN
    per_list = torch.where(_ordered_pairs(y, mask), terms, torch.zeros((), dtype=s.dtype)).sum((-2, -1))
    return _reduce(per_list, reduction, dtype)
