r"""Reference-based n-gram metrics (chapter 16): BLEU and ROUGE.

* :func:`bleu` (16.01) is corpus BLEU: clipped ("modified") n-gram precisions :math:`p_n`
  (:func:`modified_precision`) combined by a geometric mean and multiplied by the
  :func:`brevity_penalty` (16.02). It follows sacrebleu: its ``13a`` tokeniser
  (:func:`tokenize_13a`), the closest reference length, and its smoothing methods;
* :func:`rouge_n` (16.03) and :func:`rouge_l` (16.04) follow rouge-score: lowercase, every
  non-alphanumeric character is a separator (:func:`tokenize_rouge`), optional stemming of words of
  more than 3 characters with a stemmer the caller passes;
* METEOR, exact match and token F1 live in :mod:`llmbook.lm.unigram_metrics`.

All scores are fractions in :math:`[0, 1]` (sacrebleu and torchmetrics print them :math:`\times 100`).
Texts are Python strings; a corpus is a list of them.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from llmbook._checks import check_choice, check_int, check_positive_int, check_range
from llmbook.registry import implements

__all__ = ["BLEUScore", "PRF", "tokenize_13a", "tokenize_rouge", "ngram_counts", "modified_precision",
           "brevity_penalty", "bleu", "rouge_n", "lcs_length", "rouge_l"]


# --------------------------------------------------------------------------- texts and n-grams


def _text(x, name: str) -> str:
    if not isinstance(x, str):
        raise TypeError(f"{name} must be a str, got {type(x).__name__}")
    return x


def _texts(x, name: str, *, nonempty: bool = True) -> list[str]:
    """A str or a list/tuple of str, as a list."""
    if isinstance(x, str):
        return [x]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of str, got {type(x).__name__}")
    if nonempty and not x:
        raise ValueError(f"{name} must hold at least one text, got an empty {type(x).__name__}")
    return [_text(t, f"{name}[{i}]") for i, t in enumerate(x)]


def _stemmer(stemmer):
    if stemmer is not None and not callable(stemmer):
        raise TypeError(f"stemmer must be None or a callable str -> str, got {type(stemmer).__name__}")
    return stemmer


_13A = [(re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "), (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
        (re.compile(r"([\.,])([^0-9])"), r" \1 \2"), (re.compile(r"([0-9])(-)"), r"\1 \2 ")]


def tokenize_13a(line: str) -> list[str]:
    """mteval-v13a's tokenisation (sacrebleu's default): punctuation and symbols become tokens.

    >>> tokenize_13a("Hello, world! It costs $3.50.")
    ['Hello', ',', 'world', '!', 'It', 'costs', '$', '3.50', '.']
    """
    line = _text(line, "line").replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    line = f" {line} "
    for pattern, repl in _13A:
        line = pattern.sub(repl, line)
    return line.split()


def tokenize_rouge(text: str, stemmer: Callable[[str], str] | None = None) -> list[str]:
    """rouge-score's tokenisation: lowercase, non-alphanumerics separate, words of > 3 characters stemmed.

    >>> tokenize_rouge("The cat's hat, 2x!")
    ['the', 'cat', 's', 'hat', '2x']
    """
    tokens = re.sub(r"[^a-z0-9]+", " ", _text(text, "text").lower()).split()
    stemmer = _stemmer(stemmer)
    if stemmer is not None:
        tokens = [stemmer(t) if len(t) > 3 else t for t in tokens]
    return [t for t in tokens if re.fullmatch(r"[a-z0-9]+", t)]


def ngram_counts(tokens: list[str], n: int) -> Counter:
    """The multiset of the n-grams of a token list (tuples of ``n`` tokens).

    >>> ngram_counts("a b a b".split(), 2)
    Counter({('a', 'b'): 2, ('b', 'a'): 1})
    """
    n = check_positive_int(n, "n")
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


# --------------------------------------------------------------------------- BLEU


def modified_precision(hypothesis: list[str], references: list[list[str]], n: int) -> tuple[int, int]:
    r"""Clipped n-gram matches and hypothesis n-grams of one segment: :math:`p_n`'s numerator and denominator.

    Each hypothesis n-gram counts at most as often as it occurs in any *single* reference:
    :math:`\sum_g \min(\mathrm{count}_{hyp}(g), \max_S \mathrm{count}_S(g))`, so "the the the" does not
    score against "the cat". Token lists in, ``(matches, total)`` out.

    >>> modified_precision("the the the".split(), ["the cat".split()], 1)
    (1, 3)
    """
    hyp = ngram_counts(hypothesis, n)
    max_ref: Counter = Counter()
    for ref in references:
        for g, k in ngram_counts(ref, n).items():
            max_ref[g] = max(max_ref[g], k)
    return sum(min(k, max_ref[g]) for g, k in hyp.items()), sum(hyp.values())


@implements("16.02")
def brevity_penalty(c: int, r: int) -> float:
    r"""BLEU's brevity penalty: :math:`BP = 1` if :math:`c > r`, else :math:`e^{1 - r/c}`.

    ``c`` is the hypothesis length and ``r`` the effective reference length (token counts, ints, summed
    over the corpus). Precision alone rewards saying little; :math:`BP` charges short output instead.
    :math:`c = 0 < r` gives :math:`BP = 0` (the limit), and :math:`c = r` gives 1.

    >>> round(brevity_penalty(9, 10), 4), brevity_penalty(12, 10)
    (0.8948, 1.0)
    """
    c, r = check_int(c, "c", low=0, what="a token count (a non-negative int)"), check_int(
        r, "r", low=0, what="a token count (a non-negative int)")
    if c >= r:
        return 1.0
    return math.exp(1.0 - r / c) if c > 0 else 0.0


@dataclass(frozen=True)
class BLEUScore:
    """Corpus BLEU and its sufficient statistics: ``bleu`` in [0, 1], ``precisions`` the :math:`p_n`."""

    bleu: float
    precisions: tuple[float, ...]
    bp: float
    c: int
    r: int
    matches: tuple[int, ...]
    totals: tuple[int, ...]


def _bleu_refs(hypotheses, references) -> tuple[list[str], list[list[str]]]:
    if isinstance(hypotheses, str):
        return [hypotheses], [_texts(references, "references")]
    hyps = _texts(hypotheses, "hypotheses")
    if not isinstance(references, (list, tuple)) or len(references) != len(hyps):
        raise ValueError(f"references must hold one entry (a str or a list of str) per hypothesis: "
                         f"{len(hyps)} hypotheses, got {type(references).__name__} of length "
                         f"{len(references) if isinstance(references, (list, tuple)) else '-'}")
    return hyps, [_texts(r, f"references[{i}]") for i, r in enumerate(references)]


@implements("16.01")
def bleu(hypotheses, references, N: int = 4, smooth: str = "exp", smooth_value: float | None = None,
         tokenize: str = "13a", lowercase: bool = False) -> BLEUScore:
    r"""Corpus BLEU: :math:`\mathrm{BLEU} = BP\cdot\exp\big(\sum_{n=1}^{N} w_n \log p_n\big)`, :math:`w_n = 1/N`.

    ``hypotheses``: a str or a list of str (the corpus); ``references``: for each hypothesis a str or
    a list of str (any number). :math:`p_n` pools :func:`modified_precision` over the corpus (matches
    summed, then divided), :math:`c` is the total hypothesis length and :math:`r` the sum of the
    reference lengths closest to each hypothesis's (the shorter on a tie), as sacrebleu.
    ``smooth`` handles :math:`p_n = 0` (which would zero the geometric mean): ``"none"``, ``"floor"``
    (:math:`p_n = \epsilon/\mathrm{total}_n`, :math:`\epsilon` = ``smooth_value``, default 0.1),
    ``"add-k"`` (add :math:`k` = ``smooth_value``, default 1, to matches and totals for :math:`n\ge2`),
    ``"exp"`` (sacrebleu's default, mteval's: the :math:`i`-th zero becomes :math:`1/(2^i\,\mathrm{total}_n)`).
    ``tokenize``: ``"13a"`` (sacrebleu's default) or ``"none"`` (split on whitespace); as in sacrebleu, each
    segment is lowercased (``lowercase=True``) and stripped of trailing whitespace before it is tokenised.

    >>> s = bleu(["the cat sat on the mat"], [["the cat sat on a mat"]])
    >>> round(s.bleu, 4), s.precisions[0], s.bp
    (0.5373, 0.8333333333333334, 1.0)
    """
    hyps, refs = _bleu_refs(hypotheses, references)
    N = check_positive_int(N, "N")
    check_choice(smooth, "smooth", ("none", "floor", "add-k", "exp"))
    k = check_range({"floor": 0.1, "add-k": 1.0}.get(smooth, 0.0) if smooth_value is None else smooth_value,
                    "smooth_value", 0.0)
    if not isinstance(lowercase, bool):
        raise TypeError(f"lowercase must be a bool, got {type(lowercase).__name__}")
    check_choice(tokenize, "tokenize", ("13a", "none"))
    tok = tokenize_13a if tokenize == "13a" else str.split
    matches, totals, c, r = [0] * N, [0] * N, 0, 0
    for hyp, rs in zip(hyps, refs, strict=True):
        h = tok((hyp.lower() if lowercase else hyp).rstrip())  # sacrebleu strips each segment's end first
        ts = [tok((x.lower() if lowercase else x).rstrip()) for x in rs]  # (so a final "-\n" stays a "-")
        c += len(h)
        r += min((abs(len(t) - len(h)), len(t)) for t in ts)[1]
        for n in range(1, N + 1):
            m, t = modified_precision(h, ts, n)
            matches[n - 1] += m
            totals[n - 1] += t
    bp = brevity_penalty(c, r)
    p = [0.0] * N
    if any(matches):
        halvings = 0
        for n in range(N):
            m, t = matches[n], totals[n]
            if smooth == "add-k" and n > 0:
                m, t = m + k, t + k
            if t == 0:
                break  # no hypothesis n-grams of this order: p_n stays 0 (sacrebleu)
            if m > 0:
                p[n] = m / t
            elif smooth == "exp":
                halvings += 1
                p[n] = 1.0 / (2**halvings * t)
            elif smooth == "floor":
                p[n] = k / t
    score = bp * math.exp(sum(math.log(x) for x in p) / N) if all(x > 0 for x in p) else 0.0
    return BLEUScore(score, tuple(p), bp, c, r, tuple(matches), tuple(totals))


# --------------------------------------------------------------------------- ROUGE


@dataclass(frozen=True)
class PRF:
    """Precision, recall and their F-measure."""

    precision: float
    recall: float
    fmeasure: float


def _f(P: float, R: float, beta: float = 1.0) -> float:
    return (1 + beta**2) * P * R / (R + beta**2 * P) if P > 0 and R > 0 else 0.0


@implements("16.03")
def rouge_n(candidate: str, references, n: int = 2, tokenize: str = "rouge",
            stemmer: Callable[[str], str] | None = None) -> PRF:
    r"""ROUGE-N recall over references :math:`S`: matched n-grams over the references' n-grams.

    .. math:: \mathrm{ROUGE\text{-}N}=\frac{\sum_{S}\sum_{g\in S}\min(\mathrm{count}_{cand}(g),\mathrm{count}_S(g))}
              {\sum_{S}\sum_{g\in S}\mathrm{count}_S(g)}

    The recall twin of BLEU's precision (summaries are judged by what they cover). ``references``: a
    str or a list of str, pooled as in the sum; precision divides the same matches by
    :math:`|Ref|` times the candidate's n-gram count; ``fmeasure`` is their harmonic mean. One
    reference gives rouge-score's ``rougeN`` exactly. ``tokenize``: ``"rouge"`` (:func:`tokenize_rouge`,
    with ``stemmer``) or ``"whitespace"``.

    >>> rouge_n("the cat sat on the mat", "the cat lay on the mat", n=2)
    PRF(precision=0.6, recall=0.6, fmeasure=0.6)
    """
    refs = _texts(references, "references")
    n = check_positive_int(n, "n")
    check_choice(tokenize, "tokenize", ("rouge", "whitespace"))
    stemmer = _stemmer(stemmer)

    def tok(x):
        return tokenize_rouge(x, stemmer) if tokenize == "rouge" else x.split()

    cand = ngram_counts(tok(_text(candidate, "candidate")), n)
    hits = ref_total = 0
    for ref in refs:
        counts = ngram_counts(tok(ref), n)
        hits += sum(min(k, cand[g]) for g, k in counts.items())
        ref_total += sum(counts.values())
    P = hits / max(len(refs) * sum(cand.values()), 1)
    R = hits / max(ref_total, 1)
    return PRF(P, R, _f(P, R))


def lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence of two sequences (dynamic programming, ``O(len(a) * len(b))``).

    >>> lcs_length("the cat sat on the mat".split(), "the cat lay on a mat".split())
    4
    """
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@implements("16.04")
def rouge_l(candidate: str, references, beta: float = 1.0, tokenize: str = "rouge",
            stemmer: Callable[[str], str] | None = None) -> PRF:
    r"""ROUGE-L: :math:`F_{LCS}=\frac{(1+\beta^2)R_{LCS}P_{LCS}}{R_{LCS}+\beta^2P_{LCS}}`.

    :math:`R_{LCS} = \mathrm{LCS}/|ref|`, :math:`P_{LCS} = \mathrm{LCS}/|cand|`: the longest common
    subsequence rewards words in the right order without asking them to be adjacent. ``beta``
    weighs recall (:math:`\beta = 1`, rouge-score's choice, is the harmonic mean; Lin's paper takes
    :math:`\beta` large, i.e. recall). Several references: the one with the best :math:`F` (as
    rouge-score's ``score_multi``). Tokenisation as :func:`rouge_n`.

    >>> rouge_l("the cat sat on the mat", "the cat lay on a mat").fmeasure
    0.6666666666666666
    """
    refs = _texts(references, "references")
    beta = check_range(beta, "beta", 0.0)
    check_choice(tokenize, "tokenize", ("rouge", "whitespace"))
    stemmer = _stemmer(stemmer)

    def tok(x):
        return tokenize_rouge(x, stemmer) if tokenize == "rouge" else x.split()

    cand = tok(_text(candidate, "candidate"))
    best = None
    for ref in refs:
        r = tok(ref)
        lcs = lcs_length(r, cand) if r and cand else 0
        P, R = lcs / max(len(cand), 1), lcs / max(len(r), 1)
        score = PRF(P, R, _f(P, R, beta))
        best = score if best is None or score.fmeasure > best.fmeasure else best
    return best
