"""MinHash (chapter 20, beside 20.06) against the exact Jaccard similarity of Python sets.

The oracle is ``len(A & B) / len(A | B)`` on the Python sets themselves. The estimate of one seed is a
binomial proportion with ``k`` trials and success probability ``J``; over ``S`` independent seeds the mean
of the ``S * k`` trials has standard error ``sqrt(J (1 - J) / (S k))``. Tolerances, stated once:

* unbiasedness: ``|mean over S seeds - J| <= 4`` standard errors (S = 300, k = 64), for each of several pairs;
* spread: the standard deviation over seeds within ``[0.8, 1.25]`` of the binomial ``sqrt(J (1 - J) / k)``
  (a chi-square with 299 degrees of freedom lies within about 0.86-1.14 of its mean 99.9 % of the time);
* exact cases (equal sets, disjoint sets, empty sets) are exact.
"""

import math

import numpy as np
import pytest

from llmbook.rag.minhash import MERSENNE_31, minhash_jaccard, minhash_signature, shingles

S, K = 300, 64


def pairs():
    """Set pairs of different sizes and overlaps, members strings and ints, and the exact J from Python sets."""
    rng = np.random.default_rng(7)
    words = [f"w{i}" for i in range(400)]
    out = []
    for na, nb, ni in [(30, 30, 10), (100, 60, 50), (8, 8, 6), (200, 150, 12)]:
        pick = rng.permutation(len(words))
        shared = {words[i] for i in pick[:ni]}
        A = shared | {words[i] for i in pick[ni:na]}
        B = shared | {words[i] for i in pick[na:na + nb - ni]}
        out.append((A, B))
    out.append((set(range(0, 40)), set(range(25, 90))))  # integer members
    return [(A, B, len(A & B) / len(A | B)) for A, B in out]


def estimates(A, B, k=K, seeds=range(S)):
    return np.array([minhash_jaccard(*np.split(minhash_signature([A, B], k, seed=s), 2))[0, 0] for s in seeds])


@pytest.mark.parametrize("case", range(5))
def test_minhash_is_unbiased_for_exact_jaccard(case):
    A, B, J = pairs()[case]
    assert 0 < J < 1
    est = estimates(A, B)
    se = math.sqrt(J * (1 - J) / (S * K))
    assert abs(est.mean() - J) <= 4 * se, (est.mean(), J, se)
    ratio = est.std() / math.sqrt(J * (1 - J) / K)
    assert 0.8 <= ratio <= 1.25, ratio


def test_error_shrinks_like_one_over_sqrt_k():
    A, B, J = pairs()[1]
    rms = {k: math.sqrt(np.mean((estimates(A, B, k=k, seeds=range(200)) - J) ** 2)) for k in (16, 256)}
    # 16 times more hash functions: the error falls 4 times (binomial), within the spread of 200 seeds
    assert 3.2 <= rms[16] / rms[256] <= 5.0, rms
    assert abs(rms[256] - math.sqrt(J * (1 - J) / 256)) <= 0.25 * math.sqrt(J * (1 - J) / 256)


def test_exact_cases_and_pairwise_shape():
    A = {"a", "b", "c"}
    sig = minhash_signature([A, set(A), {"x", "y"}, set(), set()], k=32, seed=3)
    assert sig.shape == (5, 32) and sig.dtype == np.int64
    Jhat = minhash_jaccard(sig, sig)
    assert Jhat.shape == (5, 5)
    assert Jhat[0, 1] == 1.0 and Jhat[0, 2] == 0.0  # equal sets; disjoint sets (no hash collision in [0, p))
    assert Jhat[3, 4] == 1.0 and Jhat[0, 3] == 0.0  # two empty sets agree (J = 1, as jaccard_similarity); empty vs not
    assert (sig[3] == MERSENNE_31).all() and (sig[:3] < MERSENNE_31).all()
    np.testing.assert_array_equal(sig, minhash_signature([A, set(A), {"x", "y"}, set(), set()], k=32, seed=3))


def test_signature_is_the_minimum_over_members():
    """The signature of a union is the elementwise minimum of the members' signatures (definition of a min)."""
    A, B = {"p", "q", "r"}, {"s", "t"}
    sig = minhash_signature([A, B, A | B], k=16, seed=11)
    np.testing.assert_array_equal(sig[2], np.minimum(sig[0], sig[1]))


def test_shingles():
    assert shingles("The KV cache, stores keys!", n=2) == {"the kv", "kv cache", "cache stores", "stores keys"}
    assert shingles("one two", n=3) == {"one two"}
    assert shingles("  ", n=3) == set()


@pytest.mark.parametrize("bad, exc", [("abc", TypeError), ([{"a"}, "ab"], TypeError), (5, TypeError)])
def test_bad_sets(bad, exc):
    with pytest.raises(exc, match="set"):
        minhash_signature(bad, 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="k"):
        minhash_signature([{"a"}], 0)
    with pytest.raises(TypeError, match="seed"):
        minhash_signature([{"a"}], 4, seed=1.5)
    with pytest.raises(ValueError, match="same k"):
        minhash_jaccard(np.zeros((1, 4), dtype=np.int64), np.zeros((1, 5), dtype=np.int64))
    with pytest.raises(ValueError, match="2-D integer"):
        minhash_jaccard(np.zeros(4, dtype=np.int64), np.zeros((1, 4), dtype=np.int64))
    with pytest.raises(ValueError, match="n"):
        shingles("a b", n=0)
    with pytest.raises(TypeError, match="str"):
        shingles(["a"])
