r"""Evaluation protocols beyond a reference metric (chapter 16): chrF, multiple choice, judged win rates, contamination.

* :func:`chrf` is Popović's character n-gram F-score (chrF, and chrF++ with word n-grams), computed as
  sacrebleu computes it: statistics summed over the corpus, precision and recall averaged over the orders;
* :func:`option_log_likelihoods` and :func:`multiple_choice` score a multiple-choice question the way
  evaluation harnesses do: the option with the highest (optionally length-normalised) log-likelihood under the
  model is its answer;
* :func:`win_rate` turns pairwise judgements into a win rate with ties, debiased by judging each pair in both
  orders (position swap);
* :func:`paired_bootstrap` is Koehn's paired bootstrap for a *corpus* metric (BLEU, chrF): resample the segments,
  score both systems on the same resample, and read the interval of the difference;
* :func:`ngram_contamination` flags evaluation items that share a word n-gram (13 in GPT-3) with training text.

Registers no equation of the catalogue.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_positive_int, check_real

__all__ = ["chrf", "chrf_from_statistics", "chrf_statistics", "batched_option_log_likelihoods",
           "option_log_likelihoods", "multiple_choice", "win_rate", "word_ngrams", "ngram_contamination",
           "paired_bootstrap"]

_PUNCT = set('!"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~')


def _strs(x, name: str) -> list[str]:
    if isinstance(x, str) or not all(isinstance(s, str) for s in x):
        raise TypeError(f"{name} must be a sequence of str (one per segment)")
    return list(x)


def _char_ngrams(text: str, n: int) -> Counter:
    text = "".join(text.split())  # chrF ignores whitespace
    return Counter(text[i:i + n] for i in range(len(text) - n + 1))


def _words(text: str) -> list[str]:
    """chrF++'s words: split on whitespace, one leading or trailing punctuation mark split off."""
    out = []
    for w in text.split():
        if len(w) > 1 and w[-1] in _PUNCT:
            out += [w[:-1], w[-1]]
        elif len(w) > 1 and w[0] in _PUNCT:
            out += [w[0], w[1:]]
        else:
            out.append(w)
    return out


def _ngrams(items, n: int) -> Counter:
    return Counter(tuple(items[i:i + n]) for i in range(len(items) - n + 1))


def chrf_statistics(hypothesis: str, reference: str, char_order: int = 6, word_order: int = 0) -> list[tuple]:
    """``(hypothesis n-grams, reference n-grams, clipped matches)`` for each order: chars 1..6, then words.

    >>> chrf_statistics("ab", "abc", 2)
    [(2, 3, 2), (1, 2, 1)]
    """
    counters = [(_char_ngrams(hypothesis, n), _char_ngrams(reference, n)) for n in range(1, char_order + 1)]
    hw, rw = _words(hypothesis), _words(reference)
    counters += [(_ngrams(hw, n), _ngrams(rw, n)) for n in range(1, word_order + 1)]
    return [(sum(h.values()) if r else 0, sum(r.values()), sum((h & r).values())) for h, r in counters]


def _f_beta(stats, beta: float) -> float:
    P = [m / h for h, r, m in stats if h > 0 and r > 0]  # the orders with n-grams on both sides
    R = [m / r for h, r, m in stats if h > 0 and r > 0]
    if not P:
        return 0.0
    P_bar, R_bar = sum(P) / len(P), sum(R) / len(R)
    b2 = beta * beta
    return 0.0 if P_bar + R_bar == 0 else (1 + b2) * P_bar * R_bar / (b2 * P_bar + R_bar)


def chrf(hypotheses, references, char_order: int = 6, word_order: int = 0, beta: float = 2.0) -> float:
    r"""Corpus chrF (Popović 2015), chrF++ with ``word_order = 2``: a character n-gram F-score, as a fraction.

    .. math:: \mathrm{chrF}_\beta = \frac{(1+\beta^2)\,\overline{P}\,\overline{R}}{\beta^2\,\overline{P} + \overline{R}}

    where :math:`\overline{P}` and :math:`\overline{R}` average, over the orders :math:`n = 1..` ``char_order``
    (and word orders :math:`1..` ``word_order``), the clipped n-gram precision and recall, each computed from
    matches and counts summed over all segments. Whitespace is removed before character n-grams are taken;
    :math:`\beta = 2` weighs recall twice as much as precision. An order with no n-gram on one side is left out
    of the averages. With several references a segment uses the one with the best segment-level score. This is
    sacrebleu's ``CHRF()`` (its default ``eps_smoothing=False``), which prints the score :math:`\times 100`.

    ``hypotheses``: a list of strings; ``references``: for each hypothesis a string or a list of strings.

    >>> round(chrf(["the cat sat"], ["the cat sat"]), 6)
    1.0
    """
    hyps = _strs(hypotheses, "hypotheses")
    if isinstance(references, str) or len(references) != len(hyps):
        raise ValueError(f"references must give one entry (str or list of str) per hypothesis ({len(hyps)})")
    char_order, beta = check_positive_int(char_order, "char_order"), check_real(beta, "beta")
    if not isinstance(word_order, int) or word_order < 0:
        raise ValueError(f"word_order must be an int >= 0, got {word_order!r}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    segments = []
    for h, refs in zip(hyps, references, strict=True):
        refs = _strs([refs] if isinstance(refs, str) else refs, "references")
        if not refs:
            raise ValueError("every hypothesis needs at least one reference")
        best, best_f = None, -1.0
        for r in refs:
            s = chrf_statistics(h, r, char_order, word_order)
            f = _f_beta(s, beta)
            if f > best_f:
                best, best_f = s, f
        segments.append(best)
    return chrf_from_statistics(segments, beta)


def chrf_from_statistics(segments, beta: float = 2.0) -> float:
    """Corpus chrF from per-segment :func:`chrf_statistics` (of each segment's best reference): the statistics are
    summed over the segments, then :func:`chrf`'s formula is applied. A bootstrap resamples these.

    >>> chrf_from_statistics([chrf_statistics("ab", "abc", 2)]) == chrf(["ab"], ["abc"], char_order=2)
    True
    """
    segments = list(segments)
    if not segments:
        raise ValueError("segments must hold the statistics of at least one segment")
    total = [tuple(sum(col) for col in zip(*order, strict=True)) for order in zip(*segments, strict=True)]
    return _f_beta(total, beta)


# --------------------------------------------------------------------------- multiple choice


def option_log_likelihoods(logits_of, context: Sequence[int], options: Sequence[Sequence[int]]) -> Tensor:
    r"""Summed log-likelihood of each option after ``context``: :math:`\ell_j = \sum_t \log p(y_{j,t}\mid x, y_{j,<t})`.

    ``logits_of`` maps ids ``(J, T)`` to logits ``(J, T, V)`` (a causal LM such as the tiny GPT; the options go
    through it as one right-padded batch); ``context`` is a list of ids, ``options`` a list of non-empty id lists.
    Returns a float64 tensor ``(len(options),)``. :func:`batched_option_log_likelihoods` does many questions at once.

    >>> uniform = lambda ids: torch.zeros(*ids.shape, 4)
    >>> option_log_likelihoods(uniform, [0, 1], [[2], [3, 3]]).tolist() == [math.log(1 / 4), 2 * math.log(1 / 4)]
    True
    """
    return batched_option_log_likelihoods(logits_of, [context], [options])[0]


def batched_option_log_likelihoods(logits_of, contexts, options) -> Tensor:
    """:func:`option_log_likelihoods` for ``Q`` questions in one forward pass: ``contexts[q]`` a list of ids,
    ``options[q]`` its ``J`` options (the same ``J`` for every question). Returns float64 ``(Q, J)``.

    Every (context, option) row is right-padded with token 0 to the longest; a causal model's positions before
    the padding never see it, and each row reads its option's log-probabilities from its own offset.

    >>> uniform = lambda ids: torch.zeros(*ids.shape, 2)
    >>> ell = batched_option_log_likelihoods(uniform, [[0], [1, 1]], [[[1]], [[0, 0]]])
    >>> ell.tolist() == [[-math.log(2)], [-2 * math.log(2)]]
    True
    """
    if len(contexts) == 0 or len(options) != len(contexts):
        raise ValueError(f"contexts and options must be non-empty lists of one length, got {len(contexts)} and "
                         f"{len(options)}")
    J = len(options[0])
    rows, starts, lengths = [], [], []
    for ctx, opts in zip(contexts, options, strict=True):
        if len(ctx) == 0:
            raise ValueError("every context must hold at least one token (the first option token is predicted from it)")
        if len(opts) != J or J == 0 or any(len(y) == 0 for y in opts):
            raise ValueError(f"every question needs the same number J = {J} > 0 of non-empty options")
        for y in opts:
            rows.append(list(ctx) + list(y))
            starts.append(len(ctx))
            lengths.append(len(y))
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long)
    with torch.no_grad():
        logp = torch.log_softmax(logits_of(ids).double(), dim=-1)  # (Q J, T, V)
    L = max(lengths)
    t = torch.tensor(starts)[:, None] + torch.arange(L)[None, :]  # positions of the option tokens
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    t = torch.where(mask, t, torch.zeros_like(t))
    rows_ix = torch.arange(len(rows))[:, None]
    per_token = logp[rows_ix, t - 1, ids[rows_ix, t]]  # log p(token at t | tokens before t)
    return torch.where(mask, per_token, 0.0).sum(1).reshape(len(contexts), J)


def multiple_choice(log_likelihoods, lengths=None) -> Tensor:
    r"""The chosen option per question: :math:`\arg\max_j \ell_j` or, with lengths, :math:`\arg\max_j \ell_j / |y_j|`.

    ``log_likelihoods`` ``(Q, J)``: question ``q``'s option ``j`` summed log-likelihood :math:`\ell_j`;
    ``lengths`` ``(Q, J)`` (characters or bytes, as lm-evaluation-harness's ``acc_norm``) normalises each by the
    option's length, so long options are not penalised merely for having more tokens. Returns ids ``(Q,)``; ties go
    to the first option.

    >>> multiple_choice([[-3.0, -4.0]], [[1, 4]]).tolist(), multiple_choice([[-3.0, -4.0]]).tolist()
    ([1], [0])
    """
    ell = as_tensor(log_likelihoods, "log_likelihoods").double()
    check_dim(ell, "log_likelihoods", "(Q, J)", min_dim=2, max_dim=2)
    if torch.isnan(ell).any():
        raise ValueError("log_likelihoods must not be NaN")
    if lengths is not None:
        L = as_tensor(lengths, "lengths").double()
        if L.shape != ell.shape or (L <= 0).any():
            raise ValueError(f"lengths must be positive with the shape of log_likelihoods {tuple(ell.shape)}")
        ell = ell / L
    return ell.argmax(dim=1)


# --------------------------------------------------------------------------- pairwise judging


def win_rate(first, swapped) -> dict:
    r"""Win rate of system A over B from judgements in both orders: :math:`\mathrm{WR} = (W + T/2)/n`.

    ``first[i]`` is the judge's verdict with A shown first, ``swapped[i]`` with B shown first; each is ``"A"``,
    ``"B"`` or ``"tie"`` and names the *system* preferred (not the position). A pair counts as a win for A only
    if both orders prefer A (a loss only if both prefer B); anything else, including a judge that always
    picks the same position, is a tie. Returns ``{"win", "tie", "loss", "win_rate", "consistent"}``, the
    last being the share of pairs whose two verdicts agree.

    >>> win_rate(["A", "A", "A"], ["A", "B", "tie"])["win_rate"]
    0.6666666666666666
    """
    if isinstance(first, str) or isinstance(swapped, str) or len(first) != len(swapped) or len(first) == 0:
        raise ValueError("first and swapped must be non-empty sequences of verdicts of one length")
    for v in (*first, *swapped):
        if v not in ("A", "B", "tie"):
            raise ValueError(f"a verdict must be 'A', 'B' or 'tie', got {v!r}")
    W = sum(a == b == "A" for a, b in zip(first, swapped, strict=True))
    L = sum(a == b == "B" for a, b in zip(first, swapped, strict=True))
    n = len(first)
    T = n - W - L
    return {"win": W, "tie": T, "loss": L, "win_rate": (W + T / 2) / n,
            "consistent": sum(a == b for a, b in zip(first, swapped, strict=True)) / n}


# --------------------------------------------------------------------------- contamination


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The set of word n-grams of ``text`` after GPT-3's normalisation (lower case, words of ``[a-z0-9]``).

    >>> sorted(word_ngrams("The cat, the CAT!", 2))
    [('cat', 'the'), ('the', 'cat')]
    """
    n = check_positive_int(n, "n")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    w = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def ngram_contamination(items, training_text: str, n: int = 13) -> list[float]:
    r"""Per evaluation item, the share of its word n-grams found in the training text (GPT-3: :math:`n = 13`).

    .. math:: o(x) = \frac{|G_n(x) \cap G_n(D)|}{|G_n(x)|}

    with :math:`G_n` the set of normalised word n-grams (:func:`word_ngrams`). GPT-3 called an item *dirty* when
    :math:`o(x) > 0`, one shared 13-gram. An item shorter than :math:`n` words has no n-gram and gets ``nan``.

    >>> ngram_contamination(["a b c d", "x y"], "z a b c", n=3)
    [0.5, nan]
    """
    items = _strs(items, "items")
    D = word_ngrams(training_text, n)
    out = []
    for x in items:
        G = word_ngrams(x, n)
        out.append(len(G & D) / len(G) if G else math.nan)
    return out


# --------------------------------------------------------------------------- paired bootstrap


@dataclass(frozen=True)
class BootstrapComparison:
    """``diff`` = metric(A) - metric(B) on all segments; ``[low, high]`` its percentile interval; ``share_a`` the
    share of resamples where A scored higher; ``n`` segments, ``n_boot`` resamples."""

    diff: float
    low: float
    high: float
    share_a: float
    n: int
    n_boot: int
    confidence: float = 0.95

    def __str__(self) -> str:
        verdict = "A higher" if self.low > 0 else "B higher" if self.high < 0 else "no difference shown"
        return (f"{self.diff:+.4f} [{self.low:+.4f}, {self.high:+.4f}] ({self.confidence:.0%} paired bootstrap, "
                f"{self.n} segments), A higher in {self.share_a:.0%} of resamples: {verdict}")


def paired_bootstrap(metric, a, b, references, *, n_boot: int = 1000, confidence: float = 0.95,
                     seed: int = 0) -> BootstrapComparison:
    r"""Koehn's (2004) paired bootstrap of a corpus metric: the interval of :math:`\Delta = m(A) - m(B)`.

    Draw :math:`S` = ``n_boot`` resamples of the :math:`n` segment indices with replacement (one
    ``numpy.random.default_rng(seed).integers(0, n, (S, n))`` call); on each, score both systems with
    ``metric(hypotheses, references)`` on the *same* segments, and take :math:`\Delta^{(s)}`. The interval is the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the :math:`\Delta^{(s)}`. Pairing removes
    the variation between segments that both systems share, which is most of it. ``a``, ``b``, ``references``:
    lists of one length (a reference entry may be a list, as the metric expects).

    >>> mean = lambda h, r: sum(x == y for x, y in zip(h, r)) / len(h)
    >>> c = paired_bootstrap(mean, ["x", "y", "z", "w"], ["x", "q", "q", "q"], ["x", "y", "z", "w"], n_boot=200)
    >>> c.diff, c.low > 0
    (0.75, True)
    """
    a, b, refs = list(a), list(b), list(references)
    n = len(a)
    if n < 2 or len(b) != n or len(refs) != n:
        raise ValueError(f"a, b and references must be lists of one length >= 2 (paired), got {n}, {len(b)}, "
                         f"{len(refs)}")
    n_boot = check_positive_int(n_boot, "n_boot")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    deltas = np.array([metric([a[i] for i in row], [refs[i] for i in row])
                       - metric([b[i] for i in row], [refs[i] for i in row]) for row in idx], dtype=np.float64)
    lo, hi = np.quantile(deltas, [(1 - confidence) / 2, (1 + confidence) / 2])
    return BootstrapComparison(float(metric(a, refs) - metric(b, refs)), float(lo), float(hi),
                               float((deltas > 0).mean()), n, n_boot, confidence)
