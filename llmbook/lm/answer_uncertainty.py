r"""Answer-level uncertainty of a language model (chapter 19): semantic entropy, self-consistency and P(True).

Token probabilities say how sure a model is of the next token, not of an answer: "Paris", " Paris" and
"It is Paris." are different strings with one meaning. Three answer-level measures:

* **Semantic entropy** (Kuhn, Gal and Farquhar, 2023). Sample :math:`M` answers, cluster them by meaning
  (:func:`semantic_clusters`; the paper uses bidirectional entailment under an NLI model, short factual answers
  can use equality after normalisation), and take the entropy over the clusters,

  .. math:: SE(x) = -\sum_{C} p(C \mid x) \log p(C \mid x), \qquad p(C \mid x) = \sum_{s \in C} p(s \mid x),

  with :math:`p(s \mid x)` the sequence probability of each distinct answer, renormalised over the clusters
  found, or, without probabilities, the fraction of the samples in each cluster (the *discrete* estimator).
  High when the samples disagree in meaning, zero when they all say the same thing however worded
  (:func:`semantic_entropy`).
* **Self-consistency** (Wang et al., 2023). Answer with the majority of the sampled answers; the share of
  samples that agree with it, :math:`\max_C |C| / M`, is a confidence (:func:`self_consistency`).
* **P(True)** (Kadavath et al., 2022). Show the model a question and a proposed answer, ask whether it is
  true, and read the probability of "True" against "False": :math:`P(\mathrm{True}) = e^{\ell_T} /
  (e^{\ell_T} + e^{\ell_F})` from the two log-probabilities (:func:`p_true`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from llmbook._checks import as_tensor, check_finite

__all__ = ["normalize_answer", "semantic_clusters", "semantic_entropy", "self_consistency", "p_true"]


def normalize_answer(s: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed: ``" Velm."`` and ``"velm"`` become ``"velm"``."""
    if not isinstance(s, str):
        raise TypeError(f"an answer must be a str, got {type(s).__name__}")
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def _f64(x, name: str) -> torch.Tensor:
    """``x`` as float64 (python floats and lists too, which ``as_tensor`` would make float32)."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be a number, numbers or a tensor, got {type(x).__name__}") from e
    return as_tensor(x, name).double()


def _answers(answers) -> list[str]:
    if isinstance(answers, str) or not isinstance(answers, Sequence):
        raise TypeError(f"answers must be a sequence of strings (the sampled answers), got {type(answers).__name__}")
    if len(answers) == 0:
        raise ValueError("answers is empty: sample at least one answer")
    for a in answers:
        if not isinstance(a, str):
            raise TypeError(f"every answer must be a str, got {type(a).__name__}")
    return list(answers)


def semantic_clusters(answers: Sequence[str], equivalent: Callable[[str, str], bool] | None = None) -> list[int]:
    r"""Cluster ids of ``answers``, in order of first appearance: answer :math:`i` joins the first cluster whose first
    member is ``equivalent`` to it, else opens a new one (the greedy algorithm of Kuhn et al., 2023).

    ``equivalent(a, b)`` should be symmetric (the paper: each answer entails the other); the default compares
    :func:`normalize_answer` forms. Returns ``(M,)`` ints in ``0 .. n_clusters - 1``.

    >>> semantic_clusters(["Velm", "Kesh", " velm.", "Velm"])
    [0, 1, 0, 0]
    """
    answers = _answers(answers)
    eq = equivalent if equivalent is not None else (lambda a, b: normalize_answer(a) == normalize_answer(b))
    reps: list[str] = []
    ids = []
    for a in answers:
        j = next((j for j, r in enumerate(reps) if eq(r, a)), None)
        if j is None:
            reps.append(a)
            j = len(reps) - 1
        ids.append(j)
    return ids


def semantic_entropy(answers: Sequence[str], log_probs=None,
                     equivalent: Callable[[str, str], bool] | None = None) -> float:
    r"""Semantic entropy :math:`-\sum_C p(C \mid x) \log p(C \mid x)` over meaning clusters of sampled answers (nats).

    ``answers``: the :math:`M` sampled answers. ``log_probs`` ``(M,)``: each answer's sequence log-probability
    :math:`\log p(s \mid x)`; then :math:`p(C \mid x)` is the sum of :math:`p(s \mid x)` over the *distinct*
    answers in :math:`C` (a string sampled twice is one outcome, counted once), renormalised over the clusters.
    Without ``log_probs``, :math:`p(C \mid x) = |C| / M` (the discrete estimator). ``equivalent`` as in
    :func:`semantic_clusters`. 0 when every sample means the same; :math:`\log M` at most.

    >>> round(semantic_entropy(["Velm", "velm", "Kesh", "Velm."]), 4)   # clusters of 3 and 1: H(3/4, 1/4)
    0.5623
    """
    answers = _answers(answers)
    ids = semantic_clusters(answers, equivalent)
    K = max(ids) + 1
    if log_probs is None:
        p = torch.bincount(torch.tensor(ids), minlength=K).double() / len(answers)
    else:
        lp = _f64(log_probs, "log_probs")
        if lp.shape != (len(answers),):
            raise ValueError(f"log_probs must have shape (M,) = ({len(answers)},), one per answer, "
                             f"got {tuple(lp.shape)}")
        check_finite(lp, "log_probs")
        if (lp > 1e-9).any():
            raise ValueError("log_probs must be log-probabilities (<= 0)")
        seen, mass = set(), [[] for _ in range(K)]
        for a, j, v in zip(answers, ids, lp.tolist(), strict=True):
            if a not in seen:
                seen.add(a)
                mass[j].append(v)
        logC = torch.stack([torch.logsumexp(torch.tensor(m, dtype=torch.float64), 0) for m in mass])
        p = torch.softmax(logC, 0)
    p = p[p > 0]
    return float(-(p * p.log()).sum()) + 0.0  # + 0.0: one cluster gives 0.0, not -0.0


def self_consistency(answers: Sequence[str], equivalent: Callable[[str, str], bool] | None = None
                     ) -> tuple[str, float]:
    r"""The majority answer of the samples and its agreement :math:`\max_C |C| / M` (Wang et al., 2023).

    Returns the first-seen member of the largest cluster (ties: the cluster seen first) and the fraction of
    the :math:`M` samples in it, a confidence in :math:`[1/M, 1]`.

    >>> self_consistency(["30", "74", "30", " 30", "81"])
    ('30', 0.6)
    """
    answers = _answers(answers)
    ids = semantic_clusters(answers, equivalent)
    counts = torch.bincount(torch.tensor(ids))
    j = int(counts.argmax())  # argmax returns the first maximum: the cluster seen first
    return answers[ids.index(j)], counts[j].item() / len(answers)


def p_true(logp_true, logp_false):
    r"""P(True) of Kadavath et al. (2022): :math:`e^{\ell_T} / (e^{\ell_T} + e^{\ell_F}) = \sigma(\ell_T - \ell_F)`.

    ``logp_true``, ``logp_false``: the model's log-probabilities of answering "True" and "False" to "Is the
    proposed answer true?", scalars or tensors of one shape. Only their difference matters, so the rest of the
    vocabulary is ignored. Returns a float for scalars, else a float64 tensor.

    >>> round(p_true(-1.0, -2.0), 4)   # sigma(1)
    0.7311
    """
    scalar = not isinstance(logp_true, torch.Tensor) and not isinstance(logp_false, torch.Tensor)
    lt, lf = _f64(logp_true, "logp_true"), _f64(logp_false, "logp_false")
    if lt.shape != lf.shape:
        raise ValueError(f"logp_true {tuple(lt.shape)} and logp_false {tuple(lf.shape)} must have one shape")
    check_finite(lt, "logp_true"), check_finite(lf, "logp_false")
    out = torch.sigmoid(lt - lf)
    return float(out) if scalar and out.ndim == 0 else out

