"""BLEU (16.01, 16.02) against sacrebleu and ROUGE-N / ROUGE-L (16.03, 16.04) against rouge-score.

Tolerances: sacrebleu's scores are x100; ours are compared after scaling with ``abs = 1e-9`` (both
are float64 sums of the same counts, in a different order); sufficient statistics (lengths,
matches, totals) and tokens are compared exactly. rouge-score: ``abs = 1e-12``.
"""

from __future__ import annotations

import math
import random

import pytest
import sacrebleu
from nltk.stem import porter
from rouge_score import rouge_scorer
from rouge_score import tokenize as rouge_tokenize
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

from llmbook.lm import text_metrics as tm
from tests.try_it import assert_states

WORDS = ["the", "cat", "cats", "sat", "sitting", "on", "mat", "a", "dog", "runs", "running", "ran", "The", "Dog"]
PUNCT = [",", ".", "!", "?", "'s", "3.50", "$", "-", "(", ")", "&amp;", "e.g.", "10,000", "U.S."]


def _sentence(rng: random.Random, lo: int = 0, hi: int = 12, punct: bool = True) -> str:
    toks = rng.choices(WORDS + (PUNCT if punct else []), k=rng.randint(lo, hi))
    return " ".join(toks) if rng.random() < 0.5 else "".join(t if rng.random() < 0.3 else " " + t for t in toks)


def _corpus(seed: int, n_seg: int, n_refs: int, punct: bool = True):
    rng = random.Random(seed)
    hyps = [_sentence(rng, punct=punct) for _ in range(n_seg)]
    refs = [[_sentence(rng, 1, punct=punct) for _ in range(n_refs)] for _ in range(n_seg)]
    return hyps, refs


@pytest.mark.equation("16.01", oracle="sacrebleu.corpus_bleu")
@pytest.mark.parametrize("smooth", ["none", "exp", "floor", "add-k"])
@pytest.mark.parametrize("tokenize", ["13a", "none"])
@pytest.mark.parametrize("seed", range(6))
def test_bleu_matches_sacrebleu(smooth, tokenize, seed):
    hyps, refs = _corpus(seed, n_seg=1 + seed * 3, n_refs=1 + seed % 3)
    ref_streams = [list(r) for r in zip(*refs, strict=True)]
    for lowercase in (False, True):
        ours = tm.bleu(hyps, refs, smooth=smooth, tokenize=tokenize, lowercase=lowercase)
        theirs = sacrebleu.corpus_bleu(hyps, ref_streams, smooth_method=smooth, tokenize=tokenize,
                                       lowercase=lowercase)
        assert 100 * ours.bleu == pytest.approx(theirs.score, abs=1e-9)
        assert (ours.c, ours.r) == (theirs.sys_len, theirs.ref_len)
        if smooth != "add-k":  # sacrebleu adds k to its stored counts in place
            assert list(ours.matches) == theirs.counts and list(ours.totals) == theirs.totals
        assert [100 * p for p in ours.precisions] == pytest.approx(theirs.precisions, abs=1e-9)
        assert ours.bp == pytest.approx(theirs.bp, abs=1e-12)


@pytest.mark.equation("16.01", oracle="sacrebleu.corpus_bleu on segments with mteval's special cases")
def test_bleu_matches_sacrebleu_on_line_ends_and_entities():
    """13a joins "-\n" and drops "<skipped>", but sacrebleu strips each segment's end before tokenising."""
    rng = random.Random(7)
    pool = ["the", "cat", "naïve", "東京", "🙂", "&quot;", "&lt;", "-", "—", "-\n", "\n", "\t", "<skipped>", "U.S.A.",
            "don't", "1,000", "...", " ", ""]
    for _ in range(200):
        hyps, refs = ([("".join(rng.choice(pool) + rng.choice([" ", ""]) for _ in range(rng.randint(0, 8))))
                       for _ in range(3)] for _ in range(2))
        for tokenize in ("13a", "none"):
            ours = tm.bleu(hyps, refs, tokenize=tokenize)
            theirs = sacrebleu.corpus_bleu(hyps, [refs], tokenize=tokenize)
            assert (ours.c, ours.r) == (theirs.sys_len, theirs.ref_len), (hyps, refs)
            assert 100 * ours.bleu == pytest.approx(theirs.score, abs=1e-9)


@pytest.mark.equation("16.01", oracle="sacrebleu.BLEU(max_ngram_order, smooth_value) on real sentences")
def test_bleu_orders_and_smooth_values():
    hyps = ["The cat sat on the mat.", "It costs $3.50, e.g. in the U.S.", "A dog runs."]
    refs = [["The cat is on the mat.", "There is a cat on the mat."], ["It is $3.50 in the U.S.", "Price: 3.50"],
            ["The dog is running.", "A dog ran."]]
    streams = [list(r) for r in zip(*refs, strict=True)]
    for N in (1, 2, 3, 4, 5):
        for smooth, value in (("floor", 0.5), ("add-k", 2.0), ("exp", None)):
            ours = tm.bleu(hyps, refs, N=N, smooth=smooth, smooth_value=value)
            theirs = BLEU(max_ngram_order=N, smooth_method=smooth, smooth_value=value).corpus_score(hyps, streams)
            assert 100 * ours.bleu == pytest.approx(theirs.score, abs=1e-9)
    # one segment given as plain strings
    one = tm.bleu("the cat sat on the mat", "the cat is on the mat", tokenize="none")
    assert 100 * one.bleu == pytest.approx(sacrebleu.corpus_bleu(["the cat sat on the mat"],
                                                                 [["the cat is on the mat"]], tokenize="none").score)


def test_tokenize_13a_matches_sacrebleu():
    rng = random.Random(7)
    lines = [_sentence(rng, 0, 20) for _ in range(300)]
    lines += ["Hello, world! It's $3.50.", "a-b 1-2 x.y 3,000 &quot;q&quot;", "<skipped> line-\nbreak",
              "{[(a)]} ~`@#%^*+=|\\/<>"]
    tok = Tokenizer13a()
    for line in lines:
        assert tm.tokenize_13a(line) == tok(line).split()


@pytest.mark.equation("16.02", oracle="sacrebleu BLEU.compute_bleu(...).bp")
def test_brevity_penalty_matches_sacrebleu():
    for c in range(0, 30):
        for r in range(0, 30):
            theirs = BLEU.compute_bleu([1, 0, 0, 0], [1, 1, 1, 1], sys_len=c, ref_len=r).bp
            assert tm.brevity_penalty(c, r) == pytest.approx(theirs, abs=1e-15)
    assert tm.brevity_penalty(1, 2) == pytest.approx(math.exp(-1.0), abs=1e-15)  # e^{1 - r/c}, c = r/2


def test_modified_precision_clips_by_the_best_reference():
    # the classic example of Papineni et al.: "the the the the the the the" scores 2/7, not 7/7
    hyp = "the the the the the the the".split()
    refs = ["the cat is on the mat".split(), "there is a cat on the mat".split()]
    assert tm.modified_precision(hyp, refs, 1) == (2, 7)


def test_bleu_rejects_bad_input():
    with pytest.raises(ValueError, match="one entry"):
        tm.bleu(["a", "b"], [["a"]])
    with pytest.raises(TypeError, match="str"):
        tm.bleu([3], [["a"]])
    with pytest.raises(ValueError, match="smooth"):
        tm.bleu("a", "a", smooth="laplace")
    with pytest.raises(ValueError, match="at least one"):
        tm.bleu("a", [])
    with pytest.raises(ValueError, match="N must be"):
        tm.bleu("a", "a", N=0)


# --------------------------------------------------------------------------- ROUGE


def _rouge_cases(seed: int, n: int):
    rng = random.Random(seed)
    return [(_sentence(rng), [_sentence(rng, 1) for _ in range(rng.randint(1, 3))]) for _ in range(n)]


def test_tokenize_rouge_matches_rouge_score():
    stem = porter.PorterStemmer()
    for cand, refs in _rouge_cases(1, 200):
        for text in [cand, *refs]:
            assert tm.tokenize_rouge(text) == rouge_tokenize.tokenize(text, None)
            assert tm.tokenize_rouge(text, stem.stem) == rouge_tokenize.tokenize(text, stem)


@pytest.mark.equation("16.03", oracle="rouge_score.rouge_scorer.RougeScorer(['rouge1', 'rouge2', 'rouge3'])")
@pytest.mark.parametrize("use_stemmer", [False, True])
def test_rouge_n_matches_rouge_score_single_reference(use_stemmer):
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rouge3"], use_stemmer=use_stemmer)
    stemmer = porter.PorterStemmer().stem if use_stemmer else None
    for cand, refs in _rouge_cases(2, 300):
        theirs = scorer.score(refs[0], cand)  # target first
        for n in (1, 2, 3):
            ours = tm.rouge_n(cand, refs[0], n=n, stemmer=stemmer)
            t = theirs[f"rouge{n}"]
            assert (ours.precision, ours.recall, ours.fmeasure) == pytest.approx(
                (t.precision, t.recall, t.fmeasure), abs=1e-12)


@pytest.mark.equation("16.03", oracle="rouge-score per reference, pooled by the references' n-gram counts")
def test_rouge_n_pools_references_as_in_lins_sum():
    # Lin's sum over references = the per-reference recalls of rouge-score weighted by each
    # reference's n-gram count (a different computation of the same quantity)
    scorer = rouge_scorer.RougeScorer(["rouge2"])
    for cand, refs in _rouge_cases(3, 200):
        counts = [max(len(tm.tokenize_rouge(r)) - 1, 0) for r in refs]
        recalls = [scorer.score(r, cand)["rouge2"].recall for r in refs]
        expected = sum(c * r for c, r in zip(counts, recalls, strict=True)) / max(sum(counts), 1)
        assert tm.rouge_n(cand, refs, n=2).recall == pytest.approx(expected, abs=1e-12)


@pytest.mark.equation("16.04", oracle="rouge_score.rouge_scorer.RougeScorer(['rougeL']).score / score_multi")
@pytest.mark.parametrize("use_stemmer", [False, True])
def test_rouge_l_matches_rouge_score(use_stemmer):
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)
    stemmer = porter.PorterStemmer().stem if use_stemmer else None
    for cand, refs in _rouge_cases(4, 300):
        single, multi = scorer.score(refs[0], cand)["rougeL"], scorer.score_multi(refs, cand)["rougeL"]
        for ours, t in ((tm.rouge_l(cand, refs[0], stemmer=stemmer), single),
                        (tm.rouge_l(cand, refs, stemmer=stemmer), multi)):
            assert (ours.precision, ours.recall, ours.fmeasure) == pytest.approx(
                (t.precision, t.recall, t.fmeasure), abs=1e-12)


@pytest.mark.equation("16.04", oracle="brute force: longest common subsequence over all subsequences")
def test_rouge_l_beta_and_lcs_by_brute_force():
    from itertools import combinations

    rng = random.Random(5)
    for _ in range(100):
        a = rng.choices("abcd", k=rng.randint(0, 7))
        b = rng.choices("abcd", k=rng.randint(0, 7))
        subs_a = {tuple(a[i] for i in idx) for k in range(len(a) + 1) for idx in combinations(range(len(a)), k)}
        brute = max((len(s) for k in range(len(b) + 1) for s in combinations(b, k) if tuple(s) in subs_a), default=0)
        assert tm.lcs_length(a, b) == brute
    s = tm.rouge_l("a b c d", "a c e", beta=2.0, tokenize="whitespace")  # LCS = 2: P = 1/2, R = 2/3
    P, R = 0.5, 2 / 3
    assert s.fmeasure == pytest.approx(5 * P * R / (R + 4 * P), abs=1e-15)


def test_rouge_rejects_bad_input():
    with pytest.raises(TypeError, match="candidate"):
        tm.rouge_n(None, "a")
    with pytest.raises(ValueError, match="tokenize"):
        tm.rouge_l("a", "a", tokenize="13a")
    with pytest.raises(TypeError, match="stemmer"):
        tm.rouge_n("a", "a", stemmer="porter")
    with pytest.raises(ValueError, match="beta"):
        tm.rouge_l("a", "a", beta=-1.0)


def test_try_it_solutions_of_chapter_16_bleu():
    hyp, refs = "the the the the the the the", ["the cat is on the mat", "there is a cat on the mat"]
    scores = {}
    for smooth in ("none", "exp", "add-k"):
        s = tm.bleu(hyp, refs, smooth=smooth)
        theirs = sacrebleu.corpus_bleu([hyp], [[refs[0]], [refs[1]]], smooth_method=smooth).score
        assert 100 * s.bleu == pytest.approx(theirs, abs=1e-9)  # oracle: sacrebleu
        scores[smooth] = 100 * s.bleu
        assert s.precisions[0] == pytest.approx(2 / 7) and s.matches[1:] == (0, 0, 0)
    assert_states("16-evaluation.ipynb", [f"$p_1 = 2/7 = {2 / 7:.3f}$", f"BLEU is {scores['none']:.2f}",
                                          f"BLEU is {scores['exp']:.2f}", f"it is {scores['add-k']:.2f}"])
