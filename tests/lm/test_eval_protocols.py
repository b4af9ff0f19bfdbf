"""chrF, multiple-choice scoring, judged win rates and n-gram contamination against independent references.

* chrF / chrF++: sacrebleu's ``CHRF()`` and ``CHRF(word_order=2)`` (scores / 100, ``abs = 1e-12``), on random
  sentences with one or two references, and Popović's formula by hand on a two-word example.
* option log-likelihoods: a token-by-token loop that re-runs the model on every prefix and takes
  ``torch.nn.functional.cross_entropy`` of the next token (``abs = 1e-10``), on a small random GPT.
* multiple choice: a Python loop over options (exact ids).
* win rate: enumeration of every pair of verdicts by hand-written rules (exact).
* contamination: a brute-force search of each n-gram as a space-joined substring of the training words (exact).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from sacrebleu.metrics import CHRF

from llmbook.lm import eval_protocols as ep

WORDS = "the cat sat on a mat dog ran far away , . ! big small red".split()


def _sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.mark.parametrize("word_order", [0, 2])
@pytest.mark.parametrize("n_refs", [1, 2])
def test_chrf_matches_sacrebleu(word_order, n_refs):
    rng = random.Random(word_order * 10 + n_refs)
    hyps = [_sentence(rng, rng.randint(1, 12)) for _ in range(30)]
    refs = [[_sentence(rng, rng.randint(1, 12)) for _ in range(n_refs)] for _ in hyps]
    ours = ep.chrf(hyps, refs, word_order=word_order)
    theirs = CHRF(word_order=word_order).corpus_score(hyps, [list(r) for r in zip(*refs, strict=True)]).score / 100
    assert ours == pytest.approx(theirs, abs=1e-12)
    for h, r in zip(hyps[:10], refs[:10], strict=True):  # sentence level too
        assert ep.chrf([h], [r], word_order=word_order) == pytest.approx(
            CHRF(word_order=word_order).sentence_score(h, r).score / 100, abs=1e-12)


def test_chrf_by_hand():
    # "ab" vs "abc", orders 1..2: P = (2/2 + 1/1)/2 = 1, R = (2/3 + 1/2)/2 = 7/12; beta = 2
    P, R = 1.0, 7 / 12
    assert ep.chrf(["ab"], ["abc"], char_order=2) == pytest.approx(5 * P * R / (4 * P + R), abs=1e-15)
    with pytest.raises(ValueError, match="references"):
        ep.chrf(["a"], ["a", "b"])
    with pytest.raises(TypeError, match="hypotheses"):
        ep.chrf("a", ["a"])
    with pytest.raises(ValueError, match="beta"):
        ep.chrf(["a"], ["a"], beta=0.0)


class _TinyLM(torch.nn.Module):
    """A causal LM: embedding, one causal self-attention layer, unembedding."""

    def __init__(self, V=11, d=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.E = torch.nn.Parameter(torch.randn(V, d, generator=g))
        self.W = torch.nn.Parameter(torch.randn(d, V, generator=g))

    def forward(self, ids):
        x = self.E[ids]
        T = ids.shape[1]
        att = (x @ x.transpose(1, 2)).masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        return (att @ x) @ self.W


def test_option_log_likelihoods_match_prefix_loop():
    model = _TinyLM()
    context, options = [1, 2, 3], [[4], [5, 6], [7, 8, 9, 10]]
    ours = ep.option_log_likelihoods(model, context, options)
    ref = []
    for y in options:
        total, prefix = 0.0, list(context)
        for t in y:
            with torch.no_grad():
                logits = model(torch.tensor([prefix]))[0, -1].double()
            total -= float(F.cross_entropy(logits[None], torch.tensor([t])))
            prefix.append(t)
        ref.append(total)
    torch.testing.assert_close(ours, torch.tensor(ref, dtype=torch.float64), atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="context"):
        ep.option_log_likelihoods(model, [], options)
    with pytest.raises(ValueError, match="option"):
        ep.option_log_likelihoods(model, context, [[]])


def test_batched_option_log_likelihoods_match_prefix_loop():
    model = _TinyLM()
    contexts = [[1, 2, 3], [4], [5, 6]]
    options = [[[4], [5, 6]], [[7, 8, 9], [1]], [[2, 2], [3, 10, 10, 1]]]
    ours = ep.batched_option_log_likelihoods(model, contexts, options)
    for q, (ctx, opts) in enumerate(zip(contexts, options, strict=True)):
        for j, y in enumerate(opts):
            total, prefix = 0.0, list(ctx)
            for t in y:
                with torch.no_grad():
                    logits = model(torch.tensor([prefix]))[0, -1].double()
                total -= float(F.cross_entropy(logits[None], torch.tensor([t])))
                prefix.append(t)
            assert ours[q, j].item() == pytest.approx(total, abs=1e-10)
    with pytest.raises(ValueError, match="same number"):
        ep.batched_option_log_likelihoods(model, [[1], [2]], [[[1]], [[1], [2]]])


def test_chrf_from_statistics_sums_segments():
    hyps, refs = ["the cat", "a dog ran", "big red"], ["the cats", "dog ran far", "small red"]
    stats = [ep.chrf_statistics(h, r) for h, r in zip(hyps, refs, strict=True)]
    assert ep.chrf_from_statistics(stats) == pytest.approx(CHRF().corpus_score(hyps, [refs]).score / 100, abs=1e-12)


def test_multiple_choice_matches_loop():
    g = torch.Generator().manual_seed(1)
    ell = -torch.rand(50, 4, generator=g, dtype=torch.float64) * 20
    L = torch.randint(1, 30, (50, 4), generator=g)
    for lengths in (None, L):
        ours = ep.multiple_choice(ell, lengths).tolist()
        for q in range(50):
            s = [ell[q, j].item() / (1 if lengths is None else L[q, j].item()) for j in range(4)]
            assert ours[q] == max(range(4), key=lambda j: (s[j], -j))
    with pytest.raises(ValueError, match="shape"):
        ep.multiple_choice(ell[0])
    with pytest.raises(ValueError, match="lengths"):
        ep.multiple_choice(ell, torch.zeros(50, 4))


def test_win_rate_enumerates_every_pair_of_verdicts():
    verdicts = ["A", "B", "tie"]
    first = [a for a in verdicts for _ in verdicts]
    swapped = [b for _ in verdicts for b in verdicts]
    r = ep.win_rate(first, swapped)
    # by hand: (A, A) a win, (B, B) a loss, the other 7 combinations ties
    assert (r["win"], r["loss"], r["tie"]) == (1, 1, 7)
    assert r["win_rate"] == pytest.approx((1 + 7 / 2) / 9, abs=1e-15)
    assert r["consistent"] == pytest.approx(3 / 9, abs=1e-15)
    # a judge that always picks the first position names A first, then B: every pair is a tie, win rate 1/2
    assert ep.win_rate(["A"] * 5, ["B"] * 5)["win_rate"] == 0.5
    with pytest.raises(ValueError, match="verdict"):
        ep.win_rate(["A"], ["first"])
    with pytest.raises(ValueError, match="one length"):
        ep.win_rate(["A"], [])


def test_contamination_matches_substring_search():
    rng = random.Random(3)
    train = " ".join(rng.choice(WORDS[:6]) for _ in range(400))
    train_words = " " + " ".join(w for w in train.split() if w.isalnum()) + " "
    items = [" ".join(rng.choice(WORDS[:8]) for _ in range(rng.randint(1, 12))) for _ in range(40)]
    for n in (1, 3, 5):
        ours = ep.ngram_contamination(items, train, n)
        for x, o in zip(items, ours, strict=True):
            w = [t for t in x.split() if t.isalnum()]
            grams = {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}
            if not grams:
                assert math.isnan(o)
            else:
                assert o == sum(f" {g} " in train_words for g in grams) / len(grams)
    with pytest.raises(TypeError, match="items"):
        ep.ngram_contamination("abc", train)


def test_paired_bootstrap_matches_reconstruction_and_normal_theory():
    """Same resampled indices reconstructed with numpy (exact); for a mean metric the interval is also close to
    the normal-theory one, diff +- 1.96 * sd(d) / sqrt(n) (within 15 %, 4000 resamples of 200 segments)."""
    import numpy as np

    rng = np.random.default_rng(5)
    sa, sb = rng.random(200), rng.random(200) * 0.9
    mean_metric = lambda h, r: float(np.mean(h))  # noqa: E731 - a corpus metric that is a plain mean
    c = ep.paired_bootstrap(mean_metric, sa, sb, [None] * 200, n_boot=4000, seed=3)
    idx = np.random.default_rng(3).integers(0, 200, size=(4000, 200))
    d = sa[idx].mean(1) - sb[idx].mean(1)
    lo, hi = np.quantile(d, [0.025, 0.975])
    assert (c.low, c.high) == pytest.approx((lo, hi), abs=1e-12)
    assert c.share_a == pytest.approx((d > 0).mean(), abs=1e-12)
    se = np.std(sa - sb, ddof=1) / np.sqrt(200)
    assert c.diff == pytest.approx(np.mean(sa - sb), abs=1e-12)
    assert c.high - c.low == pytest.approx(2 * 1.959964 * se, rel=0.15)
    with pytest.raises(ValueError, match="paired"):
        ep.paired_bootstrap(mean_metric, [1.0], [1.0], [None])
