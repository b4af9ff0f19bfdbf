r"""Chunking: cut documents into retrievable pieces (chapter 27, first half).

A retriever indexes *chunks*, not books; the generator reads a *context* of at most :math:`B` tokens.
The functions here decide how documents are cut; :mod:`llmbook.rag.packing` decides which chunks fill
the context and in which order:

* **Fixed-size chunks** (27.01, :func:`fixed_size_chunks`): windows of :math:`L` tokens every
  :math:`S` tokens, :math:`C_i = x_{iS:iS+L-1}`; :func:`chunk_spans` gives their ``[start, end)``.
* **Sliding-window overlap** (27.02, :func:`window_coverage`): consecutive windows share
  :math:`L-S` tokens, and token :math:`t` lies in exactly
  :math:`c_t = \min(\lfloor t/S\rfloor, n-1) - \max(\lfloor (t-L)/S\rfloor, -1)` windows.
* **Semantic boundaries** (27.03, :func:`semantic_boundaries`): cut between consecutive sentences
  whose embeddings are far apart, :math:`b_i = \mathbf 1[1-\cos(e_i, e_{i+1}) > \tau]`;
  :func:`segments` turns the cuts into sentence ranges.
* The book's corpus: :func:`chunk_passages` re-cuts the passages (or whole sections) into word windows
  and :func:`chunk_scores_to_passages` maps chunk scores back to passages (max over a passage's chunks).

>>> chunk_spans(10, 4, 3).tolist()
[[0, 4], [3, 7], [6, 10]]
>>> window_coverage(6, 4, 2).counts.tolist()
[1, 1, 2, 2, 1, 1]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_real,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.corpus import passage_text
from llmbook.registry import implements

__all__ = ["Chunk", "Coverage", "Boundaries", "chunk_spans", "fixed_size_chunks", "window_coverage",
           "semantic_boundaries", "segments", "chunk_words", "chunk_passages", "chunk_scores_to_passages"]


# ----------------------------------------------------------------------------------------------- 27.01


def _window_args(L, S) -> tuple[int, int]:
    L = check_positive_int(L, "L")
    S = check_positive_int(S, "S")
    if S > L:
        raise ValueError(f"the stride S must satisfy 1 <= S <= L (no gaps between chunks), got S = {S}, L = {L}")
    return L, S


def _n_chunks(T: int, L: int, S: int) -> int:
    """Windows start at 0, S, 2S, ... until one reaches the end: n = 1 + ceil(max(T - L, 0) / S)."""
    return 0 if T == 0 else 1 + -(-max(T - L, 0) // S)


def chunk_spans(T: int, L: int, S: int) -> torch.Tensor:
    """The ``[start, end)`` token spans of :func:`fixed_size_chunks` over ``T`` tokens, shape ``(n, 2)`` long.

    The last window is cut at ``T`` (it may be shorter than ``L``); ``T = 0`` gives no window.

    >>> chunk_spans(5, 4, 2).tolist()
    [[0, 4], [2, 5]]
    """
    T = check_nonnegative_int(T, "T")
    L, S = _window_args(L, S)
    starts = torch.arange(_n_chunks(T, L, S), dtype=torch.long) * S
    return torch.stack([starts, (starts + L).clamp_max(T)], dim=1)


class Chunk(NamedTuple):
    """Windows of :func:`fixed_size_chunks`: ``chunks (n, L)`` (the last right-padded), true ``lengths (n,)``,
    ``starts (n,)``."""

    chunks: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor


@implements("27.01")
def fixed_size_chunks(x, L: int, S: int, pad_value=0) -> Chunk:
    r"""Fixed-size chunking with stride: windows of ``L`` tokens starting every ``S`` tokens.

    .. math::
        C_i = x_{iS:iS+L-1},\qquad i = 0,\dots,n-1,\qquad n = 1+\left\lceil \frac{\max(T-L,0)}{S}\right\rceil

    Symbols: :math:`x` = ``x`` (a 1-D sequence of ``T`` token ids, or any 1-D tensor), :math:`L` = ``L``
    (the chunk length), :math:`S` = ``S`` (the stride, ``1 <= S <= L``; the overlap is ``L - S``). The
    windows cover every token; the last one is cut at the end of the sequence and right-padded with
    ``pad_value`` so the result is a rectangle (``lengths`` holds the true lengths). ``T = 0`` gives
    ``n = 0``. When :math:`(T-L)` is a multiple of :math:`S` no padding occurs and the chunks equal
    ``x.unfold(0, L, S)``.

    Shapes: ``x`` ``(T,)`` -> ``chunks (n, L)`` in ``x``'s dtype, ``lengths (n,)``, ``starts (n,)`` long.

    >>> fixed_size_chunks(torch.arange(7), 4, 2, pad_value=-1).chunks.tolist()
    [[0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, -1]]
    """
    x = as_tensor(x, "x", floating=False)
    if x.dtype == torch.bool or x.is_complex():
        raise TypeError(f"x must be a real tensor of token ids or values, got dtype {x.dtype}")
    check_dim(x, "x", "(T,)", min_dim=1, max_dim=1)
    if x.is_floating_point():
        pad_value = check_real(pad_value, "pad_value")
    else:
        pad_value = check_int(pad_value, "pad_value")
    spans = chunk_spans(x.shape[0], L, S)
    L = int(L)
    n, S = spans.shape[0], int(S)
    if n == 0:
        return Chunk(x.new_zeros((0, L)), spans[:, 0], spans[:, 0])
    padded = torch.full(((n - 1) * S + L,), pad_value, dtype=x.dtype)  # room for the last window
    padded[: x.shape[0]] = x
    return Chunk(padded.unfold(0, L, S).clone(), spans[:, 1] - spans[:, 0], spans[:, 0])


# ----------------------------------------------------------------------------------------------- 27.02


class Coverage(NamedTuple):
    """:func:`window_coverage`: the ``overlap`` L - S, ``counts (T,)`` windows per token, ``n`` windows."""

    overlap: int
    counts: torch.Tensor
    n: int


@implements("27.02")
def window_coverage(T: int, L: int, S: int) -> Coverage:
    r"""The sliding-window overlap and how many windows cover each token, in closed form.

    .. math::
        \mathrm{overlap} = L - S,\qquad
        c_t = \min\!\left(\left\lfloor \tfrac{t}{S}\right\rfloor, n-1\right)
              - \max\!\left(\left\lfloor \tfrac{t-L}{S}\right\rfloor, -1\right)

    Window :math:`i` covers :math:`t` iff :math:`t-L < iS \le t`: the count of multiples of :math:`S` in
    a half-open interval of length :math:`L`, clipped to the windows :math:`0..n-1` that exist. Away from
    the two ends every token is therefore covered :math:`\lfloor L/S\rfloor` or :math:`\lceil L/S\rceil`
    times (exactly :math:`L/S` when :math:`S` divides :math:`L`), :math:`L/S` on average over any
    :math:`S` consecutive tokens; :math:`\sum_t c_t` is the total length of the windows.

    Symbols: ``T`` tokens, window length ``L``, stride ``S`` (``1 <= S <= L``). Returns
    ``Coverage(overlap: int, counts (T,) long, n: int)``.

    >>> window_coverage(10, 4, 2).counts.tolist()
    [1, 1, 2, 2, 2, 2, 2, 2, 1, 1]
    """
    T = check_nonnegative_int(T, "T")
    L, S = _window_args(L, S)
    n = _n_chunks(T, L, S)
    t = torch.arange(T, dtype=torch.long)
    last = torch.div(t, S, rounding_mode="floor").clamp_max(n - 1)
    first_minus_1 = torch.div(t - L, S, rounding_mode="floor").clamp_min(-1)
    return Coverage(L - S, last - first_minus_1, n)


# ----------------------------------------------------------------------------------------------- 27.03


class Boundaries(NamedTuple):
    """:func:`semantic_boundaries`: ``distance (N-1,)`` = 1 - cos of neighbours, ``boundary (N-1,)`` bool."""

    distance: torch.Tensor
    boundary: torch.Tensor


@implements("27.03")
def semantic_boundaries(e, tau: float) -> Boundaries:
    r"""Semantic chunk boundaries: cut after sentence ``i`` when it and sentence ``i+1`` are far apart.

    .. math::
        d_i = 1-\cos(e_i, e_{i+1}),\qquad b_i = \mathbf{1}[d_i > \tau],\qquad i = 0,\dots,N-2

    Symbols: :math:`e_i` = ``e[i]`` (the embedding of sentence ``i``, need not be unit length), :math:`\tau`
    = ``tau`` (a cosine distance in ``[0, 2]``; LangChain's ``SemanticChunker`` takes it as the 95th
    percentile of the :math:`d_i`, e.g. ``torch.quantile(distance, 0.95)``). The cosine of a zero vector is
    taken as 0 (distance 1). Each row is divided by its largest magnitude first, so neither fp16 nor a
    scale of 1e30 overflows; fp16/bf16 are computed in float32.

    Shapes: ``e`` ``(N, D)`` -> ``distance (N-1,)`` in ``e``'s dtype and ``boundary (N-1,)`` bool
    (both empty for ``N <= 1``). :func:`segments` turns ``boundary`` into sentence ranges.

    >>> e = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0]])
    >>> semantic_boundaries(e, 0.5).boundary.tolist()
    [False, True]
    """
    e = as_tensor(e, "e")
    check_dim(e, "e", "(N, D)", min_dim=2, max_dim=2)
    check_finite(e, "e")
    tau = check_range(tau, "tau", 0.0, 2.0)  # a cosine distance lies in [0, 2]
    x = upcast_half(e)
    if x.shape[0] <= 1:
        d = x.new_zeros(0)
    elif x.shape[1] == 0:  # D = 0: every vector is zero, every cosine 0
        d = x.new_ones(x.shape[0] - 1)
    else:
        scale = x.abs().amax(dim=1, keepdim=True)
        x = x / torch.where(scale > 0, scale, torch.ones_like(scale))
        norm = torch.linalg.vector_norm(x, dim=1)
        dot = (x[:-1] * x[1:]).sum(dim=1)
        den = norm[:-1] * norm[1:]
        cos = torch.where(den > 0, dot / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
        d = 1 - cos.clamp(-1, 1)
    return Boundaries(restore_half(d, e.dtype), d > tau)


def segments(boundary) -> list[tuple[int, int]]:
    """Sentence ranges ``[start, end)`` between the cuts of :func:`semantic_boundaries` (N sentences, N-1 flags).

    >>> segments(torch.tensor([False, True, False]))
    [(0, 2), (2, 4)]
    """
    b = as_tensor(boundary, "boundary", floating=False)
    check_dim(b, "boundary", "(N-1,)", min_dim=1, max_dim=1)
    if b.dtype != torch.bool:
        raise TypeError(f"boundary must be a bool tensor, got dtype {b.dtype}")
    cuts = (torch.nonzero(b).flatten() + 1).tolist()
    edges = [0, *cuts, b.shape[0] + 1]
    return list(zip(edges[:-1], edges[1:], strict=True))


# ----------------------------------------------------------------------------------------------- the book's corpus


def chunk_words(words: list[str], L: int, S: int) -> list[list[str]]:
    """Fixed-size windows of ``L`` words every ``S`` words (:func:`chunk_spans` over a word list).

    >>> chunk_words("a b c d e".split(), 3, 2)
    [['a', 'b', 'c'], ['c', 'd', 'e']]
    """
    return [words[a:b] for a, b in chunk_spans(len(words), L, S).tolist()]


def chunk_passages(passages, L: int, S: int, *, by: str = "passage", text=None):
    """Re-cut the book's passages into windows of ``L`` words every ``S`` words.

    ``by="passage"`` chunks each passage on its own; ``by="section"`` first joins the consecutive
    passages of one web section (same ``id`` before ``/``), so a window may straddle two passages.
    ``text(p)`` gives the string of a passage (default :func:`llmbook.rag.corpus.passage_text`).

    Returns ``(texts, owners)``: the chunk strings, and for each chunk the sorted list of the indices of
    the passages its words come from (the input to :func:`chunk_scores_to_passages`).

    >>> from llmbook.rag.corpus import load_corpus
    >>> texts, owners = chunk_passages(load_corpus()[:2], 50, 40)
    >>> owners[0]
    [0]
    """

    text = passage_text if text is None else text
    if by not in ("passage", "section"):
        raise ValueError(f"by must be 'passage' or 'section', got {by!r}")
    _window_args(L, S)
    groups: list[list[int]] = []
    for j, p in enumerate(passages):
        key = p.id.split("/")[0]
        if by == "section" and groups and passages[groups[-1][-1]].id.split("/")[0] == key:
            groups[-1].append(j)
        else:
            groups.append([j])
    texts, owners = [], []
    for g in groups:
        words, who = [], []
        for j in g:
            w = text(passages[j]).split()
            words += w
            who += [j] * len(w)
        for a, b in chunk_spans(len(words), L, S).tolist():
            texts.append(" ".join(words[a:b]))
            owners.append(sorted(set(who[a:b])))
    return texts, owners


def chunk_scores_to_passages(scores, owners, N: int) -> torch.Tensor:
    """Map ``(B, M)`` chunk scores to ``(B, N)`` passage scores: a passage gets the max over its chunks.

    ``owners[m]`` lists the passages chunk ``m`` holds words of (:func:`chunk_passages`). A passage with
    no chunk scores ``-inf`` (not retrieved, chapter 26's convention).

    >>> chunk_scores_to_passages(torch.tensor([[0.2, 0.9, 0.4]]), [[0], [0, 1], [1]], 3).tolist()
    [[0.9, 0.9, -inf]]
    """
    s = as_tensor(scores, "scores")
    check_dim(s, "scores", "(B, M)", min_dim=2, max_dim=2)
    if len(owners) != s.shape[1]:
        raise ValueError(f"owners must list the passages of each of the M = {s.shape[1]} chunks, got {len(owners)}")
    N = check_nonnegative_int(N, "N")
    rows = [m for m, o in enumerate(owners) for _ in o]
    cols = torch.tensor([j for o in owners for j in o], dtype=torch.long)
    out = torch.full((s.shape[0], N), float("-inf"), dtype=s.dtype)
    if rows:
        src = s[:, rows]
        out.scatter_reduce_(1, cols.expand(s.shape[0], -1), src, reduce="amax", include_self=True)
    return out
