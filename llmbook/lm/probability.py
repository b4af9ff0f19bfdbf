r"""Probabilistic foundations (chapter 1): softmax, log-likelihoods, entropies, perplexity.

Shapes use the book's symbols: ``B`` batch, ``T`` positions, ``V`` vocabulary. Distributions live
on the last axis. Everything is in nats unless a name says bits.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_axis,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_positive_int,
    check_probability,
    check_range,
    check_token_ids,
)
from llmbook.registry import implements

__all__ = [
    "softmax",
    "log_softmax",
    "logsumexp",
    "logsumexp_naive",
    "shift_labels",
    "token_log_probs",
    "sequence_log_likelihood",
    "conditional_log_likelihood",
    "nll",
    "cross_entropy_loss",
    "cross_entropy",
    "cross_entropy_decomposition",
    "kl_divergence",
    "reverse_kl_divergence",
    "entropy",
    "length_normalized_score",
    "teacher_forcing_loss",
    "perplexity",
    "bits_per_byte",
]


def _logits(z, name="z", dim: int = -1) -> Tensor:
    z = as_tensor(z, name)
    check_dim(z, name, "(..., V)")
    check_nonempty(z, name, check_axis(z, dim, name))
    check_finite(z, name, allow_neg_inf=True)
    return z


@implements("01.05")
def logsumexp(z: Float[Tensor, "... V"], dim: int = -1) -> Float[Tensor, "..."]:
    r"""Stable log-sum-exp: :math:`\log\sum_i e^{z_i} = m + \log\sum_i e^{z_i - m}`, :math:`m=\max_i z_i`.

    Subtracting the maximum makes the largest exponent :math:`e^0 = 1`, so nothing overflows.
    Entries equal to ``-inf`` (masked) contribute zero; an all-``-inf`` row gives ``-inf``.

    Shape: ``(..., V) -> (...)`` (the reduced ``dim`` is dropped).

    >>> logsumexp(torch.tensor([1000.0, 1000.0])).item() - 1000.0  # log 2
    0.693...
    """
    z = _logits(z, dim=dim)
    m = z.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows: keep -inf, not NaN
    return (m + (z - m).exp().sum(dim=dim, keepdim=True).log()).squeeze(dim)


def logsumexp_naive(z: Float[Tensor, "... V"], dim: int = -1) -> Float[Tensor, "..."]:
    r"""The textbook :math:`\log\sum_i e^{z_i}` with no shift: overflows for logits above ~88 in float32.

    Kept beside :func:`logsumexp` to show what the shift buys.

    >>> logsumexp_naive(torch.tensor([1000.0, 1000.0])).item()
    inf
    """
    z = _logits(z, dim=dim)
    return z.exp().sum(dim=dim).log()


@implements("01.04")
def log_softmax(z: Float[Tensor, "... V"], dim: int = -1) -> Float[Tensor, "... V"]:
    r"""Log-probabilities :math:`\log p_i = z_i - \log\sum_j e^{z_j}`.

    ``z`` are logits (any real numbers, ``-inf`` for masked entries). Shape ``(..., V) -> (..., V)``.

    >>> log_softmax(torch.tensor([0.0, 0.0])).exp()
    tensor([0.5000, 0.5000])
    """
    z = _logits(z, dim=dim)
    m = z.amax(dim=dim, keepdim=True)
    if torch.isinf(m).any():
        raise ValueError("every entry of some row of z is -inf: the softmax of a fully masked row is undefined")
    # shift first, (z - m) - logsumexp(z - m): subtracting the large z and logsumexp(z) directly would
    # lose their shared leading digits (float32 logits of 1e4 would be off by ~1e-3)
    shifted = z - m
    return shifted - logsumexp(shifted, dim=dim).unsqueeze(dim)


@implements("01.03")
def softmax(z: Float[Tensor, "... V"], dim: int = -1) -> Float[Tensor, "... V"]:
    r"""Turn logits into a categorical distribution: :math:`p_i = e^{z_i} / \sum_{j=1}^{V} e^{z_j}`.

    Computed as ``exp(log_softmax(z))`` so large logits cannot overflow. Shape ``(..., V) -> (..., V)``;
    each slice along ``dim`` sums to one.

    >>> softmax(torch.tensor([1.0, 2.0, 3.0]))
    tensor([0.0900, 0.2447, 0.6652])
    """
    return log_softmax(z, dim=dim).exp()


def shift_labels(x: Int[Tensor, "B T"]) -> tuple[Int[Tensor, "B T-1"], Int[Tensor, "B T-1"]]:
    """Split token ids into model inputs ``x[:, :-1]`` and next-token labels ``x[:, 1:]``.

    The label at position t is simply the input at t + 1: language modelling needs no annotation.

    >>> shift_labels(torch.tensor([[5, 6, 7]]))
    (tensor([[5, 6]]), tensor([[6, 7]]))
    """
    x = torch.as_tensor(x)
    if x.dtype.is_floating_point or x.ndim != 2:
        raise ValueError(f"x must be an integer tensor of shape (B, T), got dtype {x.dtype} shape {tuple(x.shape)}")
    if x.shape[1] < 2:
        raise ValueError(f"need at least T = 2 tokens to form a (input, label) pair, got T = {x.shape[1]}")
    return x[:, :-1], x[:, 1:]


def token_log_probs(logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    r"""Per-position :math:`\log p_\theta(x_t \mid x_{<t})`: the log-softmax of ``logits`` at ``targets``.

    ``logits[b, t]`` is the model's prediction for ``targets[b, t]``. Shapes ``(B, T, V), (B, T) -> (B, T)``.
    """
    logits = _logits(logits, "logits")
    targets = check_integer_tensor(targets, "targets", "a tensor of integer token ids")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits (B, T, V) = {tuple(logits.shape)} and targets (B, T) = "
                         f"{tuple(targets.shape)} disagree on (B, T)")
    targets = check_token_ids(targets, logits.shape[-1], "targets")
    return log_softmax(logits).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@implements("01.01", "01.12")
def sequence_log_likelihood(logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"]) -> Float[Tensor, " B"]:
    r"""Log-probability of whole sequences by the chain rule.

    .. math:: \log p_\theta(x_{1:T}) = \sum_{t=1}^{T} \log p_\theta(x_t \mid x_{1:t-1})

    Exponentiating gives the autoregressive factorisation :math:`p_\theta(x_{1:T})=\prod_t p_\theta(x_t\mid x_{<t})`.
    Shapes ``(B, T, V), (B, T) -> (B,)``.

    >>> logits = torch.zeros(1, 3, 4)  # uniform over V = 4
    >>> round(sequence_log_likelihood(logits, torch.tensor([[0, 1, 2]])).item(), 4)  # 3 log(1/4)
    -4.1589
    """
    return token_log_probs(logits, targets).sum(-1)


@implements("01.02")
def conditional_log_likelihood(
    logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"], prompt_length: int
) -> Float[Tensor, " B"]:
    r"""Log-probability of a response given a prompt, :math:`\sum_{t} \log p_\theta(y_t \mid x, y_{<t})`.

    ``targets`` holds the shifted tokens of ``prompt + response``; the first ``prompt_length``
    positions predict prompt tokens (the condition :math:`x`) and are left out of the sum.
    Shapes ``(B, T, V), (B, T) -> (B,)``.
    """
    lp = token_log_probs(logits, targets)
    T = lp.shape[1]
    prompt_length = check_int(prompt_length, "prompt_length", low=0, high=T - 1, what=f"an int in [0, T) = [0, {T})")
    return lp[:, prompt_length:].sum(-1)


@implements("01.06")
def nll(
    logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"], reduction: str = "sum",
    ignore_index: int | None = None,
) -> Tensor:
    r"""Negative log-likelihood :math:`L = -\sum_t \log p_\theta(x_t \mid x_{<t})`.

    ``reduction``: ``"sum"`` (the equation), ``"mean"`` (per counted token, what training reports) or
    ``"none"`` (``(B, T)``). Positions whose target equals ``ignore_index`` (padding) count as zero.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    targets = check_integer_tensor(targets, "targets", "a tensor of integer token ids")  # a bool mask is not ids
    keep = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    safe = torch.where(keep, targets, torch.zeros_like(targets))
    lp = token_log_probs(logits, safe)
    loss = torch.where(keep, -lp, torch.zeros_like(lp))  # not `* keep`: -inf * 0 would be NaN
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    n = keep.sum()
    if n == 0:
        raise ValueError("reduction='mean' with no counted token (every target is ignore_index)")
    return loss.sum() / n


def cross_entropy_loss(logits: Float[Tensor, "... V"], targets: Int[Tensor, "..."], reduction: str = "mean",
                       ignore_index: int | None = -100) -> Tensor:
    r"""The language-model training loss from logits and target ids, as ``torch.nn.functional.cross_entropy``.

    .. math:: \ell_t = -\log \mathrm{softmax}(z_t)_{y_t} = \log\sum_{v=1}^{V} e^{z_{t,v}} - z_{t,y_t},
              \qquad L = \frac{1}{N}\sum_{t:\, y_t \ne \mathrm{ignore}} \ell_t

    ``logits`` are :math:`z` with the vocabulary on the **last** axis, ``(..., V)`` (e.g. ``(B, T, V)``;
    torch wants ``(N, V, ...)``, so ``F.cross_entropy(logits.transpose(1, 2), targets)`` is the same
    number). ``targets`` are the ids :math:`y`, shape ``(...)``. Positions whose target equals
    ``ignore_index`` (default ``-100``, torch's; ``None`` counts every position) are left out, and
    :math:`N` counts the rest. ``reduction``: ``"mean"`` (default, like torch), ``"sum"`` or ``"none"``
    (the per-position :math:`\ell_t`, zero at ignored positions).

    Per position this is the cross-entropy :math:`H(y, p)` of :func:`cross_entropy` with a one-hot
    :math:`y` and :math:`p = \mathrm{softmax}(z)`; summed over a sequence it is :func:`nll`. Unlike
    :func:`cross_entropy`, which compares two distributions, it takes logits and integer ids (hard
    targets only). One difference from torch: a ``"mean"`` with no counted target raises ``ValueError``
    instead of returning NaN.

    >>> round(cross_entropy_loss(torch.zeros(2, 4), torch.tensor([1, -100])).item(), 4)  # log 4, one counted
    1.3863
    """
    if ignore_index is not None:
        ignore_index = check_int(ignore_index, "ignore_index", what="an int or None")
    return nll(logits, targets, reduction=reduction, ignore_index=ignore_index)


def _distributions(p, q, names=("p", "q")):
    p, q = as_tensor(p, names[0]), as_tensor(q, names[1])
    check_dim(p, names[0], "(..., V)")
    check_nonempty(p, names[0])
    if p.shape != q.shape:
        raise ValueError(f"{names[0]} {tuple(p.shape)} and {names[1]} {tuple(q.shape)} "
                         "must have the same shape (..., V)")
    check_probability(p, names[0])
    check_probability(q, names[1])
    return p, q


@implements("01.11")
def entropy(p: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    r"""Shannon entropy :math:`H(P) = -\sum_x P(x)\log P(x)` in nats, with :math:`0 \log 0 = 0`.

    >>> round(entropy(torch.full((8,), 1 / 8)).item(), 4)  # log 8
    2.0794
    """
    p, _ = _distributions(p, p)
    return -torch.special.xlogy(p, p).sum(-1)


@implements("01.07")
def cross_entropy(y: Float[Tensor, "... V"], p: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    r"""Cross-entropy :math:`H(y, p) = -\sum_i y_i \log p_i` of a model ``p`` against targets ``y``.

    ``y`` may be one-hot (then this is the NLL of the labelled token) or any distribution.
    Infinite when ``p`` puts zero mass where ``y`` has some. Two distributions in, one number per row
    out; for the training loss from logits and target ids (what ``F.cross_entropy`` computes) use
    :func:`cross_entropy_loss`.
    """
    y, p = _distributions(y, p, ("y", "p"))
    return -torch.special.xlogy(y, p).sum(-1)


@implements("01.09")
def kl_divergence(p: Float[Tensor, "... V"], q: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    r"""Forward KL :math:`D_{KL}(P\|Q) = \sum_x P(x) \log (P(x)/Q(x))`.

    The expected extra nats of coding samples of ``P`` with a code built for ``Q``.

    Zero iff ``p == q``; infinite where ``q`` is zero and ``p`` is not (mass-covering).
    """
    p, q = _distributions(p, q)
    return (torch.special.xlogy(p, p) - torch.special.xlogy(p, q)).sum(-1)


@implements("01.10")
def reverse_kl_divergence(p: Float[Tensor, "... V"], q: Float[Tensor, "... V"]) -> Float[Tensor, "..."]:
    r"""Reverse KL :math:`D_{KL}(Q\|P) = \sum_x Q(x)\log(Q(x)/P(x))`, with ``p`` the data and ``q`` the model.

    Minimising it over ``q`` is mode-seeking: ``q`` is punished for mass where ``p`` has little.
    """
    return kl_divergence(q, p)


@implements("01.08")
def cross_entropy_decomposition(p: Float[Tensor, "... V"], q: Float[Tensor, "... V"]) -> tuple[Tensor, Tensor]:
    r"""Split :math:`H(P, Q) = H(P) + D_{KL}(P\|Q)` into its two terms, returned as ``(H(P), KL)``.

    :math:`H(P)` is the floor no model can beat; the KL is what the model loses by being wrong.
    """
    return entropy(p), kl_divergence(p, q)


@implements("01.13")
def length_normalized_score(log_probs: Float[Tensor, "B T"], alpha: float = 1.0,
                            mask: Tensor | None = None) -> Float[Tensor, " B"]:
    r"""Length-normalised score :math:`S = T^{-\alpha}\sum_{t=1}^{T}\log p_\theta(x_t\mid x_{<t})`.

    ``alpha = 0`` is the raw sum (favours short outputs), ``alpha = 1`` the mean log-probability.
    ``mask`` (``(B, T)``, true for real tokens) lets sequences of different lengths share a batch.
    """
    log_probs = as_tensor(log_probs, "log_probs")
    check_dim(log_probs, "log_probs", "(B, T)", min_dim=2, max_dim=2)
    check_finite(log_probs, "log_probs", allow_neg_inf=True)
    check_range(alpha, "alpha", 0.0)
    mask = torch.ones_like(log_probs, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if mask.shape != log_probs.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of log_probs (B, T) = {tuple(log_probs.shape)}")
    T = mask.sum(-1)
    if (T == 0).any():
        raise ValueError("every sequence needs at least one unmasked token")
    kept = torch.where(mask, log_probs, torch.zeros_like(log_probs))  # -inf at padding must not give NaN
    return kept.sum(-1) / T.to(log_probs.dtype) ** alpha


@implements("01.14")
def teacher_forcing_loss(model, x: Int[Tensor, "B S"], y_star: Int[Tensor, "B T"]) -> Tensor:
    r"""Teacher forcing :math:`L_{TF} = -\sum_t \log p_\theta(y^\star_t \mid y^\star_{<t}, x)`.

    The model always conditions on the *reference* prefix :math:`y^\star_{<t}`, never on its own
    samples, so one forward pass over ``concat(x, y_star)`` scores every position at once.
    ``model`` maps token ids ``(B, L)`` to logits ``(B, L, V)``; it is called once on the
    ``L = S + T - 1`` tokens that precede a prediction. Returns the summed loss over the batch (a scalar).
    """
    x = check_integer_tensor(x, "x", "a tensor of integer token ids")
    y_star = check_integer_tensor(y_star, "y_star", "a tensor of integer token ids")
    if x.ndim != 2 or y_star.ndim != 2 or x.shape[0] != y_star.shape[0]:
        raise ValueError(f"x (B, S) = {tuple(x.shape)} and y_star (B, T) = {tuple(y_star.shape)} "
                         "must be 2-D with equal B")
    if x.shape[1] < 1:
        raise ValueError("x needs at least one token (a start-of-sequence token) to predict y_star[:, 0]")
    tokens = torch.cat([x, y_star], dim=1)
    logits = model(tokens[:, :-1])
    S = x.shape[1]
    return -conditional_log_likelihood(logits, tokens[:, 1:], S - 1).sum()


@implements("01.15")
def perplexity(logits: Float[Tensor, "B T V"], targets: Int[Tensor, "B T"],
               ignore_index: int | None = None) -> Tensor:
    r"""Perplexity :math:`\exp\big(-\tfrac{1}{T}\sum_t \log p_\theta(x_t\mid x_{<t})\big)`, over all counted tokens.

    The effective number of equally likely choices per token; a uniform model over ``V`` gives ``V``.

    >>> round(perplexity(torch.zeros(1, 5, 50), torch.zeros(1, 5, dtype=torch.long)).item(), 4)
    50.0
    """
    return nll(logits, targets, reduction="mean", ignore_index=ignore_index).exp()


@implements("01.16")
def bits_per_byte(total_nll_nats, n_bytes: int) -> float:
    r"""Bits per byte :math:`BPB = -\frac{1}{B \ln 2}\sum_t \log p_\theta(x_t\mid x_{<t})`.

    ``total_nll_nats`` is the summed negative log-likelihood (nats) of a text under any
    tokenisation (a number ``>= 0``, ``inf`` included, or a one-element tensor such as the output of
    :func:`nll`); ``n_bytes`` is that text's length in UTF-8 bytes (:math:`B`). Dividing by bytes
    instead of tokens makes models with different tokenisers comparable.

    >>> bits_per_byte(1000 * math.log(256), 1000)  # a uniform byte model
    8.0
    """
    if isinstance(total_nll_nats, Tensor) and total_nll_nats.numel() == 1:  # e.g. nll(...) itself
        total_nll_nats = total_nll_nats.item()
    total = check_range(total_nll_nats, "total_nll_nats", 0.0, finite=False)  # inf: a byte of probability 0
    n_bytes = check_positive_int(n_bytes, "n_bytes")
    return total / (n_bytes * math.log(2))
