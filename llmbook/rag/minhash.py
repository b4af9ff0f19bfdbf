r"""MinHash: estimating the Jaccard similarity of sets from short signatures (chapter 20, beside 20.06).

Broder's observation: hash every member of a set with a random hash function :math:`h` and keep the
smallest value. For two sets :math:`A` and :math:`B`, the member of :math:`A\cup B` with the smallest
hash lies in :math:`A\cap B` with probability :math:`|A\cap B|/|A\cup B|`, and exactly then the two
minima are equal:

.. math:: \Pr\big[\min_{a\in A} h(a) = \min_{b\in B} h(b)\big] = J(A, B).

With :math:`k` independent hash functions :math:`h_1,\dots,h_k`, a set's *signature* is the vector of
its :math:`k` minima, and the fraction of equal coordinates

.. math:: \hat J(A,B) = \frac1k\sum_{i=1}^{k}\mathbf 1\big[\min_{a\in A} h_i(a) = \min_{b\in B} h_i(b)\big]

is an unbiased estimate of :math:`J` with variance :math:`J(1-J)/k` (a binomial proportion), so its
error shrinks like :math:`1/\sqrt k` whatever the sizes of the sets. A signature of :math:`k` integers
replaces a set of any size, which is how near-duplicate detection scales to web crawls and to the
deduplication of pre-training corpora.

The hash functions are the universal family :math:`h_i(x) = (a_i x + b_i) \bmod p` with the Mersenne
prime :math:`p = 2^{31}-1` and :math:`a_i \in [1, p)`, :math:`b_i \in [0, p)` drawn from a seeded
generator; a member (a string, an integer, any ``repr``-able value) is first mapped to :math:`[0, p)` by a
stable BLAKE2b digest, so signatures do not depend on ``PYTHONHASHSEED``. Registers no catalogue equation.

>>> sig = minhash_signature([{"a", "b", "c"}, {"b", "c", "d"}], k=512, seed=0)
>>> sig.shape, round(float(minhash_jaccard(sig[:1], sig[1:])[0, 0]), 1)
((2, 512), 0.5)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import numpy as np

from llmbook._checks import check_positive_int

__all__ = ["MERSENNE_31", "minhash_jaccard", "minhash_signature", "shingles"]

MERSENNE_31 = (1 << 31) - 1  # the prime p of the hash family; a*x + b < 2^63 fits int64


def shingles(text: str, n: int = 3) -> set[str]:
    """The set of word ``n``-shingles of ``text``: runs of ``n`` consecutive lower-cased words (``[a-z0-9]+``).

    A text with fewer than ``n`` words gives one shingle (all its words); an empty text the empty set.

    >>> sorted(shingles("The KV cache stores keys", n=2))
    ['cache stores', 'kv cache', 'stores keys', 'the kv']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    n = check_positive_int(n, "n")
    words = re.findall(r"[a-z0-9]+", text.lower())
    if not words:
        return set()
    return {" ".join(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def _member_ids(members: Iterable) -> np.ndarray:
    """Map each member to an integer in [0, p) by a stable 8-byte BLAKE2b digest (independent of hash seeds)."""
    out = [int.from_bytes(hashlib.blake2b(repr(m).encode(), digest_size=8).digest(), "little") % MERSENNE_31
           for m in members]
    return np.unique(np.asarray(out, dtype=np.int64))


def minhash_signature(sets, k: int = 128, *, seed: int = 0) -> np.ndarray:
    r"""MinHash signatures :math:`s_i(A) = \min_{a\in A} h_i(a)`, :math:`i = 1..k`, of each set in ``sets``.

    ``sets``: a sequence of ``N`` sets (any iterables of hashable members, e.g. :func:`shingles`); ``k``: the
    number of hash functions; ``seed``: draws the :math:`(a_i, b_i)` of the family
    :math:`h_i(x) = (a_i x + b_i) \bmod p`. Returns an ``int64`` array ``(N, k)``. An empty set's
    signature is :math:`p` in every coordinate (larger than any hash), so two empty sets agree
    everywhere (:math:`\hat J = 1`, as :func:`llmbook.rag.similarity.jaccard_similarity` gives them) and an
    empty and a non-empty set nowhere. The same ``seed`` must be used for signatures that are compared.

    >>> minhash_signature([{1, 2}, set()], k=3, seed=1).shape
    (2, 3)
    """
    if isinstance(sets, (str, bytes)) or not isinstance(sets, Iterable):
        raise TypeError(f"sets must be a sequence of sets (iterables of members), got {type(sets).__name__}")
    sets = list(sets)
    for i, s in enumerate(sets):
        if isinstance(s, (str, bytes)) or not isinstance(s, Iterable):
            raise TypeError(f"sets[{i}] must be a set (an iterable of members, not a string), got {type(s).__name__}; "
                            f"use shingles(text) to turn a text into a set")
    k = check_positive_int(k, "k")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    rng = np.random.default_rng(seed)
    a = rng.integers(1, MERSENNE_31, size=k, dtype=np.int64)
    b = rng.integers(0, MERSENNE_31, size=k, dtype=np.int64)
    sig = np.full((len(sets), k), MERSENNE_31, dtype=np.int64)
    for i, s in enumerate(sets):
        x = _member_ids(s)
        if x.size:
            sig[i] = ((x[:, None] * a[None, :] + b[None, :]) % MERSENNE_31).min(axis=0)  # (|A|, k) -> (k,)
    return sig


def minhash_jaccard(sig_x, sig_y) -> np.ndarray:
    r"""Pairwise MinHash estimate :math:`\hat J = \frac1k\sum_i \mathbf 1[s_i(A) = s_i(B)]` from signatures.

    ``sig_x`` ``(N, k)`` and ``sig_y`` ``(M, k)`` integer signatures from :func:`minhash_signature` with the
    same ``k`` and seed; returns float64 ``(N, M)``, entry ``[i, j]`` estimating :math:`J` of set ``i`` of the
    first and set ``j`` of the second (chapter 20's pairwise convention).

    >>> minhash_jaccard(np.array([[1, 2, 3, 4]]), np.array([[1, 2, 0, 4], [5, 6, 7, 8]]))
    array([[0.75, 0.  ]])
    """
    sx, sy = np.asarray(sig_x), np.asarray(sig_y)
    for s, name in ((sx, "sig_x"), (sy, "sig_y")):
        if s.ndim != 2 or not np.issubdtype(s.dtype, np.integer):
            raise ValueError(f"{name} must be a 2-D integer array of signatures (sets, k), got shape {s.shape} and "
                             f"dtype {s.dtype}")
    if sx.shape[1] != sy.shape[1] or sx.shape[1] == 0:
        raise ValueError(f"sig_x and sig_y must have the same k >= 1 hash functions, got {sx.shape[1]} and "
                         f"{sy.shape[1]}")
    return (sx[:, None, :] == sy[None, :, :]).mean(axis=-1)
