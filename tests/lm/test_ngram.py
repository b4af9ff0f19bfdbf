"""The interpolated n-gram helper model (not a catalogue equation, so no ``equation`` markers).

Oracles: hand-computed smoothed counts with ``collections.Counter`` (float64, exact to 1e-15),
``math.fsum`` of ``prob()`` per position, and the proper-distribution axioms (sum = 1 to 1e-12).
"""

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch

from llmbook.data import corpus
from llmbook.lm.ngram import NGramLM, byte_tokens, chunk_log_probs, chunk_tokens

TINY = "abracadabra, a cab."


@pytest.fixture(scope="module")
def split():
    """Bytes of the frozen corpus: all but the last 20k for training, the last 20k held out."""
    b = byte_tokens(corpus())
    return b[:-20_000], b[-20_000:]


def test_byte_and_chunk_tokens_round_trip():
    text = "héllo, wörld"
    b = byte_tokens(text)
    assert b == list(text.encode("utf-8")) and all(0 <= t < 256 for t in b)
    for size in (1, 2, 3, 5):
        chunks = chunk_tokens(text, size)
        assert [t for c in chunks for t in c] == b
        assert all(len(c) == size for c in chunks[:-1]) and 1 <= len(chunks[-1]) <= size
        assert len(chunks) == math.ceil(len(b) / size)


@pytest.mark.parametrize("order", [0, 1, 2, 3, 5])
def test_distributions_are_proper(order):
    lm = NGramLM(order, 256, alpha=0.7).fit(byte_tokens(TINY * 3))
    for ctx in ([], byte_tokens("a"), byte_tokens("abr"), byte_tokens("zzzz"), byte_tokens(TINY)):
        p = lm.next_distribution(ctx)
        assert p.dtype == torch.float64 and p.shape == (256,)
        assert (p > 0).all()
        assert abs(p.sum().item() - 1.0) < 1e-12
        torch.testing.assert_close(torch.softmax(lm.logits(ctx), -1), p, rtol=1e-13, atol=0)
        # the dense vector agrees with the scalar query
        for t in (ord("a"), ord("c"), 0, 255):
            assert lm.prob(ctx, t) == pytest.approx(p[t].item(), rel=1e-13)
            assert lm.log_prob(ctx, t) == pytest.approx(math.log(p[t].item()), rel=1e-13)


def test_order_zero_is_uniform():
    for V in (2, 7, 256):
        lm = NGramLM(0, V).fit([0, 1, 1, 1])
        torch.testing.assert_close(lm.next_distribution([1, 0]), torch.full((V,), 1 / V, dtype=torch.float64))
        assert lm.score([1, 1, 0]).tolist() == pytest.approx([-math.log(V)] * 3, rel=1e-15)
    # order 0 needs no fit
    assert NGramLM(0, 4).prob([], 3) == 0.25


@pytest.mark.parametrize("alpha", [0.1, 1.0, 3.0])
def test_unigram_and_bigram_equal_hand_counts(alpha):
    """Order 1 and 2 against the smoothing formula written out with ``collections.Counter``."""
    toks = byte_tokens(TINY)
    V = 256
    uni = Counter(toks)
    n, distinct = len(toks), len(uni)
    p1 = [(uni[t] + alpha * distinct * (1 / V)) / (n + alpha * distinct) for t in range(V)]

    lm1 = NGramLM(1, V, alpha).fit(toks)
    np.testing.assert_allclose(lm1.next_distribution([]).numpy(), p1, rtol=1e-14, atol=0)
    np.testing.assert_allclose(lm1.next_distribution(byte_tokens("ab")).numpy(), p1, rtol=1e-14, atol=0)

    big = Counter(itertools.pairwise(toks))
    lm2 = NGramLM(2, V, alpha).fit(toks)
    for c in sorted(set(toks)) + [ord("z")]:  # "z" never occurs: the bigram level passes p1 through
        after = {t: k for (a, t), k in big.items() if a == c}
        N, d = sum(after.values()), len(after)
        expect = p1 if N == 0 else [(after.get(t, 0) + alpha * d * p1[t]) / (N + alpha * d) for t in range(V)]
        np.testing.assert_allclose(lm2.next_distribution([c]).numpy(), expect, rtol=1e-14, atol=0)


def test_score_matches_per_position_prob():
    toks = byte_tokens(TINY * 2)
    lm = NGramLM(3, 256).fit(toks)
    held = byte_tokens("a cabra abra")
    s = lm.score(held)
    assert s.dtype == torch.float64 and s.shape == (len(held),)
    expect = [math.log(lm.prob(held[:i], t)) for i, t in enumerate(held)]  # shorter contexts at the start
    np.testing.assert_allclose(s.numpy(), expect, rtol=1e-14, atol=0)
    # the whole-sequence log-probability is the sum (chain rule)
    assert s.sum().item() == pytest.approx(math.fsum(expect), rel=1e-12)
    # a given prefix context is used for the first tokens
    pre = byte_tokens("xy")
    expect = [math.log(lm.prob(pre + held[:i], t)) for i, t in enumerate(held)]
    np.testing.assert_allclose(lm.score(held, context=pre).numpy(), expect, rtol=1e-14, atol=0)
    assert lm.score([]).shape == (0,)


def test_inputs_accept_tensors_and_numpy():
    toks = byte_tokens(TINY)
    a = NGramLM(2, 256).fit(toks)
    b = NGramLM(2, 256).fit(torch.tensor(toks))
    c = NGramLM(2, 256).fit(np.array(toks, dtype=np.int64))
    for m in (b, c):
        torch.testing.assert_close(m.next_distribution(np.array([97])), a.next_distribution([97]))
        torch.testing.assert_close(m.score(torch.tensor(toks)), a.score(toks))


def test_higher_order_lowers_held_out_perplexity(split):
    train, test = split
    ppl = {}
    for order in range(0, 5):
        lm = NGramLM(order, 256).fit(train)
        ppl[order] = math.exp(-lm.score(test).mean().item())
    assert ppl[0] == pytest.approx(256, rel=1e-12)
    assert ppl[0] > ppl[1] > ppl[2] > ppl[3] > ppl[4], ppl
    assert ppl[4] < 8  # a real model of English-like text, far below uniform


def test_chunk_log_probs_sum_bytes(split):
    train, _ = split
    lm = NGramLM(3, 256).fit(train)
    text = "The assert statement, ünïcode too."
    lp = lm.score(byte_tokens(text))
    for size in (1, 2, 4, 7):
        ch = chunk_log_probs(lm, text, size)
        assert ch.shape == (len(chunk_tokens(text, size)),)
        assert ch.sum().item() == pytest.approx(lp.sum().item(), rel=1e-12)
        assert ch[0].item() == pytest.approx(math.fsum(lp[:size].tolist()), rel=1e-14)
    assert chunk_log_probs(lm, "", 2).shape == (0,)


def test_fit_and_score_are_fast(split):
    """Order 5 on ~180k bytes trains and scores 20k bytes in well under the brief's few seconds."""
    import time

    train, test = split
    t0 = time.perf_counter()
    lm = NGramLM(5, 256).fit(train)
    t1 = time.perf_counter()
    lm.score(test)
    t2 = time.perf_counter()
    assert t1 - t0 < 5 and t2 - t1 < 5, (t1 - t0, t2 - t1)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: NGramLM(-1, 10), ValueError, "order must be an int >= 0 .*, got -1"),
        (lambda: NGramLM(2.0, 10), TypeError, "order must be an int"),
        (lambda: NGramLM(2, 0), ValueError, "vocab_size must be a positive int, got 0"),
        (lambda: NGramLM(True, 10), TypeError, r"order must be an int >= 0 .*, got True \(bool\)"),
        (lambda: NGramLM(2, 10, alpha=0.0), ValueError, "alpha must lie in"),
        (lambda: NGramLM(2, 10, alpha=-1.0), ValueError, "alpha must lie in"),
        (lambda: NGramLM(2, 10, alpha=float("nan")), ValueError, "alpha must be a real number, got nan"),
        (lambda: NGramLM(2, 10, alpha=float("inf")), ValueError, r"alpha must lie in \(0.0, inf\), got inf"),
        (lambda: NGramLM(2, 10, alpha="0.5"), TypeError, "alpha must be a real number, got '0.5'"),
        (lambda: chunk_tokens("abc", 2.5), TypeError, r"size must be a positive int, got 2.5 \(float\)"),
        (lambda: NGramLM(2, 10).fit([1, 2, 10]), ValueError, r"tokens must be token ids in \[0, V\) = \[0, 10\)"),
        (lambda: NGramLM(2, 10).fit([1, -1]), ValueError, r"token ids in \[0, V\)"),
        (lambda: NGramLM(2, 10).fit([1, 2.5]), TypeError, "integer token ids"),
        (lambda: NGramLM(2, 10).fit("abc"), TypeError, "use byte_tokens"),
        (lambda: NGramLM(2, 10).fit(torch.tensor([1.0, 2.0])), TypeError, "integer tensor"),
        (lambda: NGramLM(2, 10).fit([1, 2]).score([3, 11]), ValueError, r"\[0, 10\)"),
        (lambda: NGramLM(2, 10).fit([1, 2]).prob([1], 10), ValueError, "token must be token ids"),
        (lambda: NGramLM(2, 10).fit([1, 2]).next_distribution([12]), ValueError, "context must be token ids"),
        (lambda: NGramLM(2, 10).prob([1], 2), RuntimeError, "has not been fitted"),
        (lambda: chunk_tokens("abc", 0), ValueError, "size must be a positive int"),
        (lambda: byte_tokens(b"abc"), TypeError, "text must be a str"),
        (lambda: chunk_log_probs(NGramLM(0, 10), "abc", 2), TypeError, "NGramLM over bytes"),
    ],
)
def test_bad_input(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
