r"""A small interpolated n-gram language model over integer tokens.

A helper model, not a catalogue equation: it gives chapter 1 a *real* next-token distribution
(perplexity and bits-per-byte on a real text) without a neural network, and chapter 9 a weak model
beside the trained tiny GPT (the contrastive amateur, the speculative draft, Mirostat's loop).

Orders follow the usual n-gram naming: an order-``n`` model conditions each token on the
``n - 1`` tokens before it (order 1 is a unigram model, order 2 a bigram model), and order 0 is
the uniform distribution :math:`1/V`.

Smoothing is recursive Dirichlet-prior interpolation. With :math:`c` the context of length
:math:`n - 1` and :math:`c'` the same context without its oldest token,

.. math::

    p_n(t \mid c) = \frac{N(c, t) + \beta(c)\, p_{n-1}(t \mid c')}{N(c) + \beta(c)},
    \qquad p_0(t) = \frac{1}{V},

where :math:`N(c, t)` counts ``c`` followed by ``t`` in the training tokens and
:math:`N(c) = \sum_t N(c, t)`. The prior strength is :math:`\beta(c) = \alpha\, V_{\text{eff}}(c)`
with :math:`V_{\text{eff}}(c) = N_{1+}(c\,\cdot)`, the number of *distinct* tokens seen after
``c`` (Witten-Bell style): a context followed by many different tokens leans more on its shorter
context. A context never seen in training (:math:`N(c) = 0`) passes :math:`p_{n-1}` through
unchanged. Each level is a convex mix of counts that sum to :math:`N(c)` and a proper
distribution, so every :math:`p_n(\cdot \mid c)` is a proper distribution over all ``V`` tokens
and gives every token non-zero probability.

Counts are kept sparse (a dict of dicts keyed by context tuples), so large ``V`` costs nothing
until :meth:`NGramLM.next_distribution` builds a dense ``(V,)`` vector.

>>> lm = NGramLM(order=2, vocab_size=3).fit([0, 1, 0, 1, 2])
>>> lm.next_distribution([])  # unigram level: (N(t) + 3 * 1/3) / (5 + 3)
tensor([0.3750, 0.3750, 0.2500], dtype=torch.float64)
>>> lm.next_distribution([0])  # after 0 the data twice showed 1: ([0, 2, 0] + 1 * unigram) / (2 + 1)
tensor([0.1250, 0.7917, 0.0833], dtype=torch.float64)
>>> round(lm.prob([0], 1), 4)
0.7917
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import check_int, check_positive_int, check_range

__all__ = ["byte_tokens", "chunk_tokens", "NGramLM", "chunk_log_probs"]

BYTE_VOCAB = 256


def byte_tokens(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids in ``[0, 256)``: the finest tokenisation, ``V = 256``.

    >>> byte_tokens("hé")
    [104, 195, 169]
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def chunk_tokens(text: str, size: int = 2) -> list[tuple[int, ...]]:
    """A coarser tokenisation: consecutive runs of ``size`` UTF-8 bytes (the last chunk may be shorter).

    Each chunk is a tuple of byte ids; joining the chunks gives back :func:`byte_tokens` of ``text``.

    >>> chunk_tokens("abcde", size=2)
    [(97, 98), (99, 100), (101,)]
    """
    size = check_positive_int(size, "size")
    b = byte_tokens(text)
    return [tuple(b[i:i + size]) for i in range(0, len(b), size)]


def _as_token_list(tokens, vocab_size: int, name: str) -> list[int]:
    """Validate a sequence of integer token ids in ``[0, vocab_size)`` and return it as a list of int."""
    if isinstance(tokens, str):
        raise TypeError(f"{name} must be a sequence of integer token ids, got a str (use byte_tokens(text))")
    if isinstance(tokens, Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.ndim > 1:
            raise TypeError(f"{name} must be a 1-D integer tensor, got dtype {tokens.dtype} "
                            f"shape {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    elif hasattr(tokens, "tolist") and hasattr(tokens, "dtype"):  # numpy arrays and scalars
        if tokens.dtype.kind not in "iu" or getattr(tokens, "ndim", 1) > 1:
            raise TypeError(f"{name} must be a 1-D integer array, got dtype {tokens.dtype}")
        tokens = tokens.tolist()
    elif not isinstance(tokens, Iterable):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(tokens).__name__}")
    out = [check_int(t, name, what="a sequence of integer token ids") for t in tokens]
    if out:
        lo, hi = min(out), max(out)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be token ids in [0, V) = [0, {vocab_size}), got range [{lo}, {hi}]")
    return [int(t) for t in out]


class NGramLM:
    r"""Interpolated n-gram model ``p(t | last order-1 tokens)`` with Dirichlet-prior (Witten-Bell) smoothing.

    Parameters: ``order >= 0`` (0 = uniform, 1 = unigram, 2 = bigram, ...), ``vocab_size`` ``V >= 1``
    (token ids live in ``[0, V)``), ``alpha > 0`` the prior strength (larger = smoother).
    See the module docstring for the formula.

    Shapes: ``next_distribution(context)`` and ``logits(context)`` are float64 ``(V,)``;
    ``score(tokens)`` is float64 ``(T,)``. Contexts are any sequence of token ids; only the last
    ``order - 1`` matter, and a shorter context uses the lower orders only.

    >>> lm = NGramLM(order=0, vocab_size=4)
    >>> lm.next_distribution([])
    tensor([0.2500, 0.2500, 0.2500, 0.2500], dtype=torch.float64)
    """

    def __init__(self, order: int, vocab_size: int, alpha: float = 1.0):
        order = check_int(order, "order", low=0, what="an int >= 0 (0 = uniform, 1 = unigram, 2 = bigram, ...)")
        vocab_size = check_positive_int(vocab_size, "vocab_size")
        check_range(alpha, "alpha", 0.0, low_open=True)
        self.order = order
        self.vocab_size = vocab_size
        self.alpha = float(alpha)
        # _stats[k][context of length k] = (continuation counts {t: N(c, t)}, N(c), beta(c))
        self._stats: list[dict[tuple[int, ...], tuple[dict[int, int], int, float]]] = [{} for _ in range(order)]
        self.fitted = order == 0
        self.n_train_tokens = 0

    def __repr__(self) -> str:
        return f"NGramLM(order={self.order}, vocab_size={self.vocab_size}, alpha={self.alpha})"

    # ------------------------------------------------------------------ training

    def fit(self, tokens: Sequence[int]) -> NGramLM:
        """Count every ``(context, token)`` pair of ``tokens`` for context lengths ``0 .. order-1``.

        Replaces any previous counts; returns ``self`` so that ``NGramLM(...).fit(x)`` chains.
        The first ``k`` tokens have no context of length ``k`` and only feed the shorter ones.
        """
        toks = _as_token_list(tokens, self.vocab_size, "tokens")
        stats: list[dict] = []
        for k in range(self.order):
            # count (k+1)-grams at C speed, then group them by their k-token context
            shifted = [toks[j:len(toks) - k + j] for j in range(k + 1)]  # k + 1 equal-length views
            grams = Counter(zip(*shifted, strict=True)) if len(toks) > k else {}
            by_ctx: dict[tuple[int, ...], dict[int, int]] = {}
            for gram, n in grams.items():
                by_ctx.setdefault(gram[:-1], {})[gram[-1]] = n
            level = {}
            for ctx, cont in by_ctx.items():
                level[ctx] = (cont, sum(cont.values()), self.alpha * len(cont))
            stats.append(level)
        self._stats = stats
        self.fitted = True
        self.n_train_tokens = len(toks)
        return self

    def _check_fitted(self):
        if not self.fitted:
            raise RuntimeError(f"{self!r} has not been fitted: call .fit(tokens) first")

    def _context(self, context) -> tuple[int, ...]:
        ctx = _as_token_list(context, self.vocab_size, "context")
        k = self.order - 1
        return tuple(ctx[len(ctx) - k:]) if k > 0 else ()

    # ------------------------------------------------------------------ queries

    def _prob(self, ctx: tuple[int, ...], token: int) -> float:
        """Recursive interpolation for one token; ``ctx`` already truncated to at most ``order - 1``."""
        p = 1.0 / self.vocab_size
        for k in range(min(self.order, len(ctx) + 1)):
            entry = self._stats[k].get(ctx[len(ctx) - k:] if k else ())
            if entry is not None:
                cont, total, beta = entry
                p = (cont.get(token, 0) + beta * p) / (total + beta)
        return p

    def prob(self, context: Sequence[int], token: int) -> float:
        """``p(token | context)`` as a float in ``(0, 1]``."""
        self._check_fitted()
        (token,) = _as_token_list([token], self.vocab_size, "token")
        return self._prob(self._context(context), token)

    def log_prob(self, context: Sequence[int], token: int) -> float:
        """``log p(token | context)`` in nats."""
        return math.log(self.prob(context, token))

    def next_distribution(self, context: Sequence[int]) -> Float[Tensor, " V"]:
        """The whole next-token distribution ``p(. | context)``: float64 ``(V,)``, positive, sums to one."""
        self._check_fitted()
        ctx = self._context(context)
        V = self.vocab_size
        p = torch.full((V,), 1.0 / V, dtype=torch.float64)
        for k in range(min(self.order, len(ctx) + 1)):
            entry = self._stats[k].get(ctx[len(ctx) - k:] if k else ())
            if entry is not None:
                cont, total, beta = entry
                counts = torch.zeros(V, dtype=torch.float64)
                counts[list(cont.keys())] = torch.tensor(list(cont.values()), dtype=torch.float64)
                p = (counts + beta * p) / (total + beta)
        return p

    def logits(self, context: Sequence[int]) -> Float[Tensor, " V"]:
        """Log-probabilities of the next token, float64 ``(V,)``: logits whose softmax is :meth:`next_distribution`."""
        return self.next_distribution(context).log()

    def score(self, tokens: Sequence[int], context: Sequence[int] = ()) -> Float[Tensor, " T"]:
        """Per-token log-probabilities (nats) of ``tokens``, float64 ``(T,)``.

        Token ``t`` is conditioned on the tokens before it (preceded by ``context``, if given); the
        first tokens therefore see shorter contexts. ``score(x).sum()`` is ``log p(x)`` by the chain rule.
        """
        self._check_fitted()
        toks = _as_token_list(tokens, self.vocab_size, "tokens")
        pre = _as_token_list(context, self.vocab_size, "context")
        k = max(self.order - 1, 0)
        full = pre[len(pre) - k:] + toks if k else toks
        off = len(full) - len(toks)
        out = [0.0] * len(toks)
        for i, t in enumerate(toks):
            j = off + i
            ctx = tuple(full[max(j - k, 0):j]) if k else ()
            out[i] = math.log(self._prob(ctx, t))
        return torch.tensor(out, dtype=torch.float64)


def chunk_log_probs(byte_model: NGramLM, text: str, size: int = 2) -> Float[Tensor, " N"]:
    r"""Log-probability of each ``size``-byte chunk of ``text`` under a byte-level model, float64 ``(N,)``.

    By the chain rule a chunk's probability is the product of its bytes' conditionals, so its
    log-probability is the sum of theirs: the same model, the same total :math:`\log p(\text{text})`,
    just cut into ``N = ceil(n_bytes / size)`` coarser tokens. Per-token perplexity changes with
    ``size``; bits per byte does not.

    >>> lm = NGramLM(order=0, vocab_size=256)
    >>> chunk_log_probs(lm, "abc", size=2) / math.log(1 / 256)  # 2 bytes, then 1
    tensor([2., 1.], dtype=torch.float64)
    """
    if not isinstance(byte_model, NGramLM) or byte_model.vocab_size != BYTE_VOCAB:
        raise TypeError(f"byte_model must be an NGramLM over bytes (vocab_size {BYTE_VOCAB}), got {byte_model!r}")
    size = check_positive_int(size, "size")
    lp = byte_model.score(byte_tokens(text)).tolist()
    return torch.tensor([math.fsum(lp[i:i + size]) for i in range(0, len(lp), size)], dtype=torch.float64)
