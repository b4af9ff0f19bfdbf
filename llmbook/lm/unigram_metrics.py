r"""Unigram-matching metrics (chapter 16): METEOR, and SQuAD's exact match and token F1.

* :func:`meteor` (16.05) aligns unigrams in two stages as nltk does (exact, then stemmed if a stemmer
  is given; no WordNet synonyms) and penalises fragmented alignments;
* :func:`exact_match` (16.07) and :func:`token_f1` (16.08) are SQuAD's answer metrics after
  :func:`normalize_answer` (lowercase, no punctuation, no articles).

Scores are fractions in :math:`[0, 1]`; texts are Python strings. The n-gram metrics (BLEU, ROUGE)
are in :mod:`llmbook.lm.text_metrics`.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable

from llmbook._checks import check_range
from llmbook.lm.text_metrics import _f, _stemmer, _text, _texts
from llmbook.registry import implements

__all__ = ["meteor", "normalize_answer", "exact_match", "token_f1"]


# --------------------------------------------------------------------------- METEOR


def _align(hyp: list[str], ref: list[str]) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """nltk's greedy stage: hypothesis words right to left, each to the rightmost free equal reference word."""
    positions: dict[str, list[int]] = {}
    for j in ref:
        positions.setdefault(j[1], []).append(j[0])
    pairs = []
    for i, w in reversed(hyp):
        if positions.get(w):
            pairs.append((i, positions[w].pop()))
    used_h, used_r = {i for i, _ in pairs}, {j for _, j in pairs}
    return pairs, [x for x in hyp if x[0] not in used_h], [x for x in ref if x[0] not in used_r]


@implements("16.05")
def meteor(hypothesis: str, references, alpha: float = 0.9, beta: float = 3.0, gamma: float = 0.5,
           stemmer: Callable[[str], str] | None = None, lowercase: bool = True) -> float:
    r"""METEOR: :math:`F_{mean}(1-\mathrm{Penalty})`, the best over the references.

    Unigrams are aligned (exact matches first, then, with ``stemmer``, equal stems; WordNet synonyms,
    the third stage of the original, are not used); :math:`m` matches give :math:`P = m/|hyp|`,
    :math:`R = m/|ref|`, :math:`F_{mean} = \frac{PR}{\alpha P + (1-\alpha) R}` (recall-heavy) and
    :math:`\mathrm{Penalty} = \gamma\,(ch/m)^\beta` for the :math:`ch` chunks of adjacent matches in
    the same order, so a scrambled hypothesis loses up to :math:`\gamma`. Words are whitespace tokens,
    lowercased; the alignment is nltk's (defaults :math:`\alpha=0.9,\beta=3,\gamma=0.5`).

    >>> round(meteor("the cat sat on the mat", "on the mat sat the cat"), 4)
    0.5
    """
    refs = _texts(references, "references")
    alpha = check_range(alpha, "alpha", 0.0, 1.0)
    beta = check_range(beta, "beta", 0.0)
    gamma = check_range(gamma, "gamma", 0.0, 1.0)
    stemmer = _stemmer(stemmer)

    def words(x):
        return list(enumerate(x.lower().split() if lowercase else x.split()))

    hyp = words(_text(hypothesis, "hypothesis"))
    best = 0.0
    for ref_text in refs:
        ref = words(ref_text)
        pairs, h_left, r_left = _align(hyp, ref)
        if stemmer is not None:
            more, _, _ = _align([(i, stemmer(w)) for i, w in h_left], [(j, stemmer(w)) for j, w in r_left])
            pairs += more
        m = len(pairs)
        if m == 0:
            continue
        pairs.sort()
        chunks = 1 + sum(1 for a, b in zip(pairs, pairs[1:], strict=False) if (b[0] - a[0], b[1] - a[1]) != (1, 1))
        P, R = m / len(hyp), m / len(ref)
        F_mean = P * R / (alpha * P + (1 - alpha) * R)
        best = max(best, F_mean * (1 - gamma * (chunks / m) ** beta))
    return best


# --------------------------------------------------------------------------- SQuAD


def normalize_answer(s: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation, drop the articles a/an/the, squeeze spaces.

    >>> normalize_answer("The  Eiffel-Tower!")
    'eiffeltower'
    """
    s = "".join(ch for ch in _text(s, "s").lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


@implements("16.07")
def exact_match(prediction: str, ground_truths) -> float:
    r"""Exact match: :math:`EM = \mathbb{1}[\mathrm{normalize}(\hat y) = \mathrm{normalize}(y)]`, max over answers.

    ``ground_truths``: a str or a list of accepted answers (SQuAD lists several). Returns 1.0 or 0.0.

    >>> exact_match("the Eiffel Tower.", ["Eiffel Tower", "la tour Eiffel"])
    1.0
    """
    y_hat = normalize_answer(_text(prediction, "prediction"))
    return float(any(y_hat == normalize_answer(y) for y in _texts(ground_truths, "ground_truths")))


@implements("16.08")
def token_f1(prediction: str, ground_truths) -> float:
    r"""Token F1: :math:`F_1 = \frac{2PR}{P+R}` over the bags of normalised words, max over answers.

    :math:`P` = shared words / predicted words, :math:`R` = shared words / answer words (a bag:
    a repeated word is shared at most as often as it occurs in both). Partial credit where exact match
    gives none; an empty normalised side scores 1 if both are empty, else 0 (SQuAD).

    >>> token_f1("in Paris, France", "Paris")
    0.5
    """
    pred = normalize_answer(_text(prediction, "prediction")).split()
    best = 0.0
    for y in _texts(ground_truths, "ground_truths"):
        gold = normalize_answer(y).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        same = sum((Counter(pred) & Counter(gold)).values())
        if same:
            best = max(best, _f(same / len(pred), same / len(gold)))
    return best
