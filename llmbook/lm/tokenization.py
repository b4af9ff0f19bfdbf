r"""WordPiece scores and the Unigram language model of subword tokenisation (Viterbi, forward-backward, EM).

Two alternatives to BPE's frequency rule (:mod:`llmbook.lm.bpe`):

* **WordPiece** (Schuster & Nakajima, 2012; BERT) merges the pair that gains the most likelihood,
  scored as :math:`\mathrm{score}(a, b) = \frac{\mathrm{count}(ab)}{\mathrm{count}(a)\,\mathrm{count}(b)}`
  (:func:`wordpiece_scores`, :func:`train_wordpiece`), and encodes a word greedily, longest vocabulary
  entry first (:func:`wordpiece_encode`). Pieces inside a word carry the prefix ``##``.
* **Unigram LM** (Kudo, 2018; SentencePiece's default: T5, ALBERT, XLNet) gives each piece a probability and a
  segmentation the product of its pieces' probabilities, :math:`P(x) = \prod_{t \in seg(x)} p(t)`
  (:func:`unigram_log_prob`). A word is encoded by its most probable segmentation,
  :math:`seg^*(x) = \operatorname{argmax}_{s \in S(x)} \sum_{t \in s} \log p(t)`, found by dynamic
  programming over the lattice of pieces (:func:`viterbi_segment`). Training (:func:`train_unigram`)
  starts from many frequent substrings, re-estimates :math:`p` by EM with expected counts from the
  forward-backward algorithm (:func:`unigram_expected_counts`) and prunes the pieces whose removal
  costs the least likelihood.

Words are Python ``str``; a vocabulary of log-probabilities is a ``dict[str, float]``.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from llmbook._checks import check_int, check_positive_int, check_range
from llmbook.registry import implements

__all__ = ["train_unigram", "train_wordpiece", "unigram_expected_counts", "unigram_log_prob",
           "unigram_marginal_log_prob", "viterbi_segment", "wordpiece_encode", "wordpiece_scores"]

NEG_INF = -math.inf


def _check_word_counts(word_counts) -> dict[str, int]:
    if not isinstance(word_counts, Mapping):
        raise TypeError("word_counts must be a mapping word -> count (e.g. a Counter), got "
                        f"{type(word_counts).__name__}")
    out = {}
    for w, c in word_counts.items():
        if not isinstance(w, str) or not w:
            raise ValueError(f"word_counts keys must be non-empty str, got {w!r}")
        out[w] = check_int(c, f"word_counts[{w!r}]", low=1)
    return out


def _initial_split(word: str) -> list[str]:
    return [word[0]] + ["##" + ch for ch in word[1:]]


def _join(a: str, b: str) -> str:
    return a + (b[2:] if b.startswith("##") else b)


@implements("15.02")
def wordpiece_scores(word_counts: Mapping[str, int],
                     splits: Mapping[str, Sequence[str]] | None = None) -> dict[tuple[str, str], float]:
    r"""WordPiece's merge score of every pair: :math:`\frac{\mathrm{count}(ab)}{\mathrm{count}(a)\,\mathrm{count}(b)}`.

    ``word_counts`` maps each word of the (pre-tokenised) corpus to its count; ``splits`` gives the current
    segmentation of each word (default: its characters, ``##`` on all but the first). Returns the score of
    every adjacent pair as a dict keyed by ``(a, b)``. The counts are weighted by word frequency;
    ``count(ab)`` is the number of adjacent occurrences of the pair. A pair of rare units scores high even if
    it is rare itself.

    >>> s = wordpiece_scores({"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5})  # the HF course example
    >>> max(s, key=s.get), s[("##g", "##s")], round(s[("##u", "##g")], 5)
    (('##g', '##s'), 0.05, 0.02778)
    """
    word_counts = _check_word_counts(word_counts)
    units: Counter = Counter()
    pairs: Counter = Counter()
    for w, f in word_counts.items():
        seg = list(splits[w]) if splits is not None else _initial_split(w)
        for u in seg:
            units[u] += f
        for pair in zip(seg, seg[1:], strict=False):
            pairs[pair] += f
    return {p: c / (units[p[0]] * units[p[1]]) for p, c in pairs.items()}


def train_wordpiece(word_counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """Learn a WordPiece vocabulary: start from the characters, merge the best-scoring pair until ``vocab_size``.

    Ties in the score go to the pair seen first (word order, then position), as in the HF course's
    reference code. Returns the vocabulary in the order it was built (characters first, then merges).

    >>> train_wordpiece({"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5}, 10)[7:]  # 7 characters, 3 merges
    ['##gs', 'hu', 'hugs']
    """
    word_counts = _check_word_counts(word_counts)
    vocab_size = check_positive_int(vocab_size, "vocab_size")
    splits = {w: _initial_split(w) for w in word_counts}
    vocab = list(dict.fromkeys(u for w in word_counts for u in splits[w]))
    while len(vocab) < vocab_size:
        scores = wordpiece_scores(word_counts, splits)
        if not scores:
            break
        a, b = max(scores, key=scores.get)  # the first maximum in insertion order
        new = _join(a, b)
        for w, seg in splits.items():
            i, out = 0, []
            while i < len(seg):
                if i + 1 < len(seg) and seg[i] == a and seg[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            splits[w] = out
        vocab.append(new)
    return vocab


def wordpiece_encode(word: str, vocab, unk: str = "[UNK]", max_chars: int = 100) -> list[str]:
    """BERT's encoder: the longest vocabulary entry that starts the word, then ``##`` entries, else ``[unk]``.

    >>> wordpiece_encode("unaffable", {"un", "##aff", "##able", "u"})
    ['un', '##aff', '##able']
    """
    if not isinstance(word, str):
        raise TypeError(f"word must be a str, got {type(word).__name__}")
    max_chars = check_positive_int(max_chars, "max_chars")
    if len(word) > max_chars:
        return [unk]
    out, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return [unk]  # some position has no piece: the whole word is unknown
        out.append(piece)
        start = end
    return out


def _check_log_p(log_p) -> tuple[dict[str, float], int]:
    if not isinstance(log_p, Mapping) or not log_p:
        raise TypeError(f"log_p must be a non-empty mapping piece -> log-probability, got {type(log_p).__name__}")
    for t, lp in log_p.items():
        if not isinstance(t, str) or not t:
            raise ValueError(f"log_p keys must be non-empty str, got {t!r}")
        check_range(lp, f"log_p[{t!r}]", -math.inf, 0.0, finite=False)
    return log_p, max(len(t) for t in log_p)


@implements("15.03")
def unigram_log_prob(pieces: Sequence[str], log_p: Mapping[str, float]) -> float:
    r"""Log-probability of one segmentation under a unigram LM: :math:`\log P(x) = \sum_{t \in seg(x)} \log p(t)`.

    ``pieces`` is the segmentation (a sequence of vocabulary entries), ``log_p`` maps each piece to
    :math:`\log p(t)` (natural log). The probability of the *string* sums this over all its
    segmentations: :func:`unigram_marginal_log_prob`.

    >>> unigram_log_prob(["ab", "c"], {"a": math.log(0.3), "ab": math.log(0.2), "c": math.log(0.5)}) == math.log(0.1)
    True
    """
    log_p, _ = _check_log_p(log_p)
    if isinstance(pieces, str):
        raise TypeError("pieces must be a sequence of pieces, got a single str; wrap it in a list")
    missing = [t for t in pieces if t not in log_p]
    if missing:
        raise ValueError(f"pieces {missing[:3]} are not in the vocabulary log_p")
    return math.fsum(log_p[t] for t in pieces)


def _lattice(x: str, log_p, max_len):
    """(start, end, log p) for every vocabulary piece x[start:end]."""
    return [(s, e, log_p[x[s:e]]) for e in range(1, len(x) + 1) for s in range(max(0, e - max_len), e)
            if x[s:e] in log_p]


def _logaddexp(a: float, b: float) -> float:
    if a == NEG_INF:
        return b
    if b == NEG_INF:
        return a
    m = max(a, b)
    return m + math.log1p(math.exp(-abs(a - b)))


@implements("15.04")
def viterbi_segment(x: str, log_p: Mapping[str, float]) -> tuple[list[str], float]:
    r"""The most probable segmentation :math:`seg^*(x)=\operatorname{argmax}_{s \in S(x)} \sum_{t \in s} \log p(t)`.

    Dynamic programming over end positions: ``best[e]`` is the best score of ``x[:e]``, the maximum of
    ``best[s] + log p(x[s:e])`` over the pieces ending at ``e``; a back-pointer recovers the pieces.
    :math:`O(|x| \cdot L)` for pieces of at most ``L`` characters. Among equal scores the piece that
    starts earliest wins (as in SentencePiece and HF ``tokenizers``).

    Returns ``(pieces, score)``, or raises ``ValueError`` when no segmentation exists (a character that no
    piece covers).

    >>> viterbi_segment("abc", {"a": -1.0, "b": -2.0, "c": -1.5, "ab": -2.5, "bc": -2.2})
    (['a', 'bc'], -3.2)
    """
    if not isinstance(x, str):
        raise TypeError(f"x must be a str, got {type(x).__name__}")
    log_p, max_len = _check_log_p(log_p)
    result = _viterbi(x, log_p, max_len)
    if result is None:
        best = _viterbi_scores(x, log_p, max_len)[0]
        e = next(e for e in range(1, len(x) + 1) if best[e] == NEG_INF)
        raise ValueError(f"x has no segmentation into pieces of log_p: nothing covers {x[:e]!r} (character {e - 1})")
    return result


def _viterbi_scores(x: str, log_p, max_len: int):
    n = len(x)
    best, back = [0.0] + [NEG_INF] * n, [0] * (n + 1)
    for e in range(1, n + 1):
        for s in range(max(0, e - max_len), e):
            lp = log_p.get(x[s:e])
            if lp is not None and best[s] + lp > best[e]:
                best[e], back[e] = best[s] + lp, s
    return best, back


def _viterbi(x: str, log_p, max_len: int):
    best, back = _viterbi_scores(x, log_p, max_len)
    if best[len(x)] == NEG_INF:
        return None
    pieces, e = [], len(x)
    while e > 0:
        pieces.append(x[back[e]:e])
        e = back[e]
    return pieces[::-1], best[len(x)]


def unigram_marginal_log_prob(x: str, log_p: Mapping[str, float]) -> float:
    r"""The forward algorithm: :math:`\log \sum_{s \in S(x)} \prod_{t \in s} p(t)` (``-inf`` if no segmentation).

    >>> lp = {"a": math.log(0.3), "b": math.log(0.2), "ab": math.log(0.1)}
    >>> round(math.exp(unigram_marginal_log_prob("ab", lp)), 12)  # 0.3 * 0.2 + 0.1
    0.16
    """
    return unigram_expected_counts(x, log_p)[1]


def unigram_expected_counts(x: str, log_p: Mapping[str, float]) -> tuple[dict[str, float], float]:
    r"""Forward-backward: expected piece counts :math:`E_{s \sim P(s \mid x)}[\#t \in s]` and :math:`\log P(x)`.

    ``alpha[e]`` sums the probability of the segmentations of ``x[:e]``, ``beta[s]`` those of ``x[s:]``; a
    piece spanning ``(s, e)`` occurs with posterior probability ``exp(alpha[s] + log p + beta[e] - log P(x))``.
    """
    if not isinstance(x, str):
        raise TypeError(f"x must be a str, got {type(x).__name__}")
    return _forward_backward(x, *_check_log_p(log_p))


def _forward_backward(x: str, log_p, max_len: int):
    n, edges = len(x), _lattice(x, log_p, max_len)
    alpha, beta = [0.0] + [NEG_INF] * n, [NEG_INF] * n + [0.0]
    for s, e, lp in edges:  # edges are sorted by end: alpha[s] is final when used
        alpha[e] = _logaddexp(alpha[e], alpha[s] + lp)
    for s, e, lp in sorted(edges, key=lambda t: -t[0]):
        beta[s] = _logaddexp(beta[s], lp + beta[e])
    log_z = alpha[n]
    counts: dict[str, float] = defaultdict(float)
    if log_z > NEG_INF:
        for s, e, lp in edges:
            if alpha[s] > NEG_INF and beta[e] > NEG_INF:
                counts[x[s:e]] += math.exp(alpha[s] + lp + beta[e] - log_z)
    return dict(counts), log_z


def train_unigram(word_counts: Mapping[str, int], vocab_size: int, *, max_len: int = 16, seed_size: int | None = None,
                  n_em: int = 2, shrink: float = 0.75) -> dict[str, float]:
    """Learn a Unigram-LM vocabulary of ``vocab_size`` pieces (log-probabilities), as SentencePiece does.

    1. Seed: every single character, plus the ``seed_size`` (default ``10 * vocab_size``) most frequent
       substrings of up to ``max_len`` characters.
    2. EM, ``n_em`` rounds: expected counts by forward-backward over every word (weighted by its count),
       then :math:`p(t) \\propto` expected count.
    3. Prune: a piece's loss is how much the corpus log-likelihood drops if its Viterbi occurrences are
       re-segmented without it; keep the best ``shrink`` fraction (all single characters always stay);
       repeat 2-3 until ``vocab_size`` pieces remain, then a final EM.
    """
    word_counts = _check_word_counts(word_counts)
    vocab_size = check_positive_int(vocab_size, "vocab_size")
    max_len = check_positive_int(max_len, "max_len")
    n_em = check_positive_int(n_em, "n_em")
    check_range(shrink, "shrink", 0.0, 1.0, low_open=True, high_open=True)
    seed_size = 10 * vocab_size if seed_size is None else check_positive_int(seed_size, "seed_size")
    chars, subs = Counter(), Counter()
    for w, f in word_counts.items():
        for s in range(len(w)):
            chars[w[s]] += f
            for e in range(s + 2, min(len(w), s + max_len) + 1):
                subs[w[s:e]] += f
    pieces = dict(chars)
    pieces.update(dict(subs.most_common(seed_size)))
    total = sum(pieces.values())
    log_p = {t: math.log(c / total) for t, c in pieces.items()}

    def em(log_p):
        for _ in range(n_em):
            expected: dict[str, float] = defaultdict(float)
            for w, f in word_counts.items():
                for t, c in _forward_backward(w, log_p, max_len)[0].items():
                    expected[t] += f * c
            kept = {t: c for t, c in expected.items() if c > 0 or len(t) == 1}
            z = math.fsum(kept.values())
            log_p = {t: math.log(c / z) if c > 0 else math.log(1e-12) for t, c in kept.items()}
        return log_p

    log_p = em(log_p)
    while len(log_p) > vocab_size:
        viterbi_freq: Counter = Counter()
        for w, f in word_counts.items():
            for t in _viterbi(w, log_p, max_len)[0]:
                viterbi_freq[t] += f
        loss = {}
        for t, lp in list(log_p.items()):
            if len(t) > 1:  # the likelihood lost if t's occurrences fall back to their best split without t
                del log_p[t]
                loss[t] = viterbi_freq[t] * (lp - _viterbi(t, log_p, max_len)[1])
                log_p[t] = lp
        n_drop = min(len(log_p) - vocab_size, max(1, int(len(loss) * (1 - shrink))))
        for t in sorted(loss, key=lambda t: (loss[t], t))[:n_drop]:
            del log_p[t]
        log_p = em(log_p)
    return log_p

