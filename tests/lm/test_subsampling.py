"""word2vec's frequent-word subsampling against gensim and the paper's formula.

* ``formula="word2vec.c"``: gensim's ``Word2Vec`` vocabulary (``sample=t``) stores each word's keep probability as
  ``sample_int = round(p * 2**32)``; ours must agree to ``abs = 1e-8`` (gensim rounds to ``2**-32`` and
  accumulates in its own order).
* ``formula="paper"``: Mikolov et al. (2013), discard probability ``1 - sqrt(t / f)``, written out by hand
  (``abs = 1e-15``).
* ``subsample``: the survivors equal those of a Python loop over the same uniform draws (exact), and the kept
  share of each word lies within 5 binomial standard errors of its keep probability.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from gensim.models import Word2Vec

from llmbook.lm.subsampling import subsample, subsample_keep_prob


def _sentences():
    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    weights = [1 / (i + 1) for i in range(60)]  # Zipf-like: w0 is very frequent
    return [rng.choices(words, weights, k=12) for _ in range(800)]


@pytest.mark.parametrize("t", [1e-3, 3e-2])
def test_word2vec_c_formula_matches_gensim(t):
    sentences = _sentences()
    model = Word2Vec(vector_size=4, min_count=1, sample=t, workers=1, seed=0)
    model.build_vocab(sentences)
    counts = Counter(w for s in sentences for w in s)
    vocab = sorted(counts)
    ours = subsample_keep_prob([counts[w] for w in vocab], t=t, formula="word2vec.c")
    theirs = torch.tensor([model.wv.get_vecattr(w, "sample_int") / 2**32 for w in vocab], dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, atol=1e-8, rtol=0)  # gensim rounds p * 2**32 and sums in its own order
    assert (ours < 1).any() and (t < 1e-2 or (ours == 1).any())  # at t = 0.03 the test sees both regimes


def test_paper_formula_by_hand():
    counts = [500, 300, 150, 49, 1, 0]
    t = 1e-2
    total = sum(counts)
    expected = [min(1.0, math.sqrt(t / (c / total))) if c else 1.0 for c in counts]
    torch.testing.assert_close(subsample_keep_prob(counts, t=t), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-15, rtol=0)


def test_subsample_matches_loop_and_rates():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (20_000,), generator=g)
    p = torch.tensor([0.1, 0.5, 1.0, 0.0, 0.9], dtype=torch.float64)
    kept = subsample(ids, p, generator=torch.Generator().manual_seed(1))
    u = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).tolist()
    assert kept.tolist() == [w for w, ui in zip(ids.tolist(), u, strict=True) if ui < p[w].item()]
    n, k = torch.bincount(ids, minlength=5).double(), torch.bincount(kept, minlength=5).double()
    se = (p * (1 - p) / n).sqrt()
    assert ((k / n - p).abs() <= 5 * se + 1e-12).all()


def test_bad_input():
    with pytest.raises(ValueError, match="counts"):
        subsample_keep_prob([-1, 2])
    with pytest.raises(ValueError, match="t must be"):
        subsample_keep_prob([1, 2], t=0.0)
    with pytest.raises(ValueError, match="formula"):
        subsample_keep_prob([1, 2], formula="glove")
    with pytest.raises(ValueError, match="ids must lie"):
        subsample(torch.tensor([0, 3]), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="probabilities"):
        subsample(torch.tensor([0]), torch.tensor([1.5]))
