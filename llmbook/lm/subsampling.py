r"""word2vec's subsampling of frequent words (chapter 15), with the keep probability of the paper and of the C code.

Mikolov et al. (2013, *Distributed representations of words and phrases*) discard each occurrence of a word
:math:`w` with probability :math:`1 - \sqrt{t / f(w)}`, where :math:`f(w)` is the word's share of the corpus and
:math:`t` a threshold (about :math:`10^{-5}` for billions of words): "the" loses most of its occurrences, a word
rarer than :math:`t` none. Frequent words carry little information per occurrence, and dropping them both
speeds training and widens the effective context window. The released ``word2vec.c`` (and gensim, after it)
uses a slightly different keep probability, :math:`\sqrt{t/f} + t/f`. Registers no equation of the catalogue.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_choice, check_real

__all__ = ["subsample_keep_prob", "subsample"]


def subsample_keep_prob(counts, t: float = 1e-5, formula: str = "paper") -> Tensor:
    r"""Probability of keeping one occurrence of each word: :math:`\min\big(1, \sqrt{t/f(w)}\big)` (``"paper"``).

    ``counts`` ``(V,)``: occurrences of each word; :math:`f(w) = \mathrm{counts}_w / \sum_v \mathrm{counts}_v`.
    ``formula="word2vec.c"`` gives the released code's :math:`\min\big(1, \sqrt{t/f} + t/f\big)`. A word that
    never occurs is kept with probability 1. Returns a float64 tensor ``(V,)``.

    >>> [round(p, 6) for p in subsample_keep_prob([90, 10], t=0.025).tolist()]
    [0.166667, 0.5]
    """
    c = as_tensor(counts, "counts", floating=False)
    if c.dtype == torch.bool or c.is_complex():
        raise TypeError(f"counts must be real numbers, got dtype {c.dtype}")
    c = c.double()
    if c.ndim != 1 or c.numel() == 0 or (c < 0).any() or not torch.isfinite(c).all() or c.sum() <= 0:
        raise ValueError("counts must be a non-empty 1-D tensor of finite non-negative counts with a positive sum")
    t = check_real(t, "t")
    if t <= 0:
        raise ValueError(f"t must be > 0, got {t}")
    check_choice(formula, "formula", ("paper", "word2vec.c"))
    f = c / c.sum()
    r = torch.where(f > 0, t / f.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(f))
    keep = r.sqrt() if formula == "paper" else r.sqrt() + r
    return keep.clamp(max=1.0)


def subsample(ids, keep_prob, generator: torch.Generator | None = None) -> Tensor:
    r"""The token stream ``ids`` ``(N,)`` with each occurrence of word ``w`` kept with probability ``keep_prob[w]``.

    One uniform draw :math:`u_i` per position; position :math:`i` survives when :math:`u_i < \mathrm{keep}(w_i)`.
    The survivors keep their order, so a context window over the result reaches further in the original text.

    >>> subsample(torch.tensor([0, 1, 0, 1]), torch.tensor([0.0, 1.0])).tolist()
    [1, 1]
    """
    ids = as_tensor(ids, "ids", floating=False)
    if ids.ndim != 1 or ids.is_floating_point():
        raise ValueError("ids must be a 1-D integer tensor of word ids")
    p = as_tensor(keep_prob, "keep_prob", floating=False).double()
    if p.ndim != 1 or ((p < 0) | (p > 1)).any():
        raise ValueError("keep_prob must be a 1-D tensor of probabilities in [0, 1], one per word")
    if ids.numel() and (ids.min() < 0 or ids.max() >= p.numel()):
        raise ValueError(f"ids must lie in [0, {p.numel() - 1}] (one keep probability per word)")
    u = torch.rand(ids.shape, generator=generator, dtype=torch.float64)
    return ids[u < p[ids]]
