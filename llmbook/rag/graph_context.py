r"""Graph context: one message-passing layer, and the book's own entity and passage graphs (chapter 31).

* **Graph context aggregation** (31.06, :func:`aggregate`): a node's new representation mixes its
  own features with a weighted sum of its neighbours',
  :math:`h_v' = \sigma\big(W_{self}h_v + \sum_{u\in N(v)}\alpha_{uv}W_{neigh}h_u\big)`, the layer
  of GraphSAGE (mean weights) and GAT (attention weights, :func:`attention_weights`).
* **The book's index as a graph.** :func:`index_terms` takes the *index* of the book to be the names
  of its equations and sections, whole: single words of the registry's equation names ("rmsnorm",
  "lora") and phrases of two to four words of those names and of the chapter and equation-section
  headings ("cross entropy", "monte carlo", "kv cache"), kept when at least ``min_df`` and at most a
  share ``max_share`` of the passages name them. :func:`entity_runs` normalises text (case, hyphens,
  possessives) and :func:`match_entities` finds the names in a passage, longest first, so the words of
  "cross-entropy" count for that name and not as two fragments. :func:`entity_graph` links two index terms by
  the number of passages in which both occur; :func:`passage_graph` links two passages by the
  index terms they share, each weighted by its idf, so that a shared rare term ("rope") counts more
  than a shared common one ("loss").
* **GraphRAG-style re-ranking** (:func:`graph_rerank`): seed personalised PageRank with a
  retriever's top hits and let the relevance flow over the passage graph, HippoRAG's recipe on a
  passage graph.

Everything here is cheap: the index has a few hundred terms, the corpus a few hundred passages,
and the graphs are dense float64 matrices built in one matrix product.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmbook._checks import as_tensor, check_choice, check_dim, check_finite, check_int, check_range, check_same_dtype
from llmbook._precision import restore_half, upcast_half
from llmbook.rag.graph import personalized_pagerank
from llmbook.registry import catalogue, implements

__all__ = ["aggregate", "attention_weights", "entity_runs", "match_entities", "index_terms", "EntityGraph",
           "entity_graph", "passage_graph", "graph_rerank"]

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "identity": lambda x: x}


def _graph_input(h, A, name_A: str = "A") -> tuple[torch.Tensor, torch.Tensor]:
    h = as_tensor(h, "h")
    check_dim(h, "h", "(..., N, D_in)", min_dim=2)
    check_finite(h, "h")
    A = as_tensor(A, name_A)
    check_dim(A, name_A, "(..., N, N)", min_dim=2)
    N = h.shape[-2]
    if A.shape[-2:] != (N, N):
        raise ValueError(f"{name_A} must be (..., N, N) with N = {N} (the nodes of h), got {tuple(A.shape)}")
    check_finite(A, name_A)
    if A.numel() and A.min().item() < 0:
        raise ValueError(f"{name_A} must hold non-negative edge weights, got minimum {A.min().item():.4g}")
    return h, A


@implements("31.06")
def aggregate(h, A, W_self, W_neigh, alpha=None, *, activation: str = "relu") -> torch.Tensor:
    r"""One message-passing layer: :math:`h_v'=\sigma\big(W_{self}h_v+\sum_{u\in N(v)}\alpha_{uv}W_{neigh}h_u\big)`.

    Symbols: :math:`h_v` = ``h[..., v, :]``, :math:`N(v)` = the nodes :math:`u` with ``A[..., v, u] > 0``
    (row :math:`v` lists the neighbours it receives from), :math:`\alpha_{uv}` = ``alpha[..., v, u]``
    (ignored where there is no edge), :math:`W_{self}` = ``W_self``, :math:`W_{neigh}` = ``W_neigh``
    (``nn.Linear`` layout: ``(D_out, D_in)``), :math:`\sigma` = ``activation`` (``"relu"``, ``"tanh"``
    or ``"identity"``). Without ``alpha`` the weights are the row-normalised edge weights,
    :math:`\alpha_{uv} = A_{vu}/\sum_{u'}A_{vu'}` (GraphSAGE's mean for a 0/1 graph; 0 for an isolated
    node); GAT's attention weights come from :func:`attention_weights`.

    Shapes: ``h`` ``(..., N, D_in)``, ``A`` and ``alpha`` ``(..., N, N)`` broadcastable with ``h``'s
    batch dims. Returns ``(..., N, D_out)``. fp16/bf16 are computed in float32.

    >>> h = torch.tensor([[1.0], [2.0], [4.0]]); A = torch.tensor([[0.0, 1, 1], [1, 0, 0], [1, 0, 0]])
    >>> aggregate(h, A, torch.eye(1), torch.eye(1)).squeeze(-1).tolist()     # own value + neighbours' mean
    [4.0, 3.0, 5.0]
    """
    h, A = _graph_input(h, A)
    check_choice(activation, "activation", tuple(_ACTIVATIONS))
    D_in = h.shape[-1]
    Ws, Wn = as_tensor(W_self, "W_self"), as_tensor(W_neigh, "W_neigh")
    for name, W in (("W_self", Ws), ("W_neigh", Wn)):
        check_dim(W, name, "(D_out, D_in)", min_dim=2, max_dim=2)
        if W.shape[1] != D_in:
            raise ValueError(f"{name} must be (D_out, D_in) with D_in = {D_in} (the last dim of h), "
                             f"got {tuple(W.shape)}")
        check_finite(W, name)
    if Ws.shape != Wn.shape:
        raise ValueError(f"W_self {tuple(Ws.shape)} and W_neigh {tuple(Wn.shape)} must both be (D_out, D_in)")
    check_same_dtype(h, Ws, "h", "W_self")
    check_same_dtype(h, Wn, "h", "W_neigh")
    dtype = h.dtype
    h, A, Ws, Wn = upcast_half(h), upcast_half(A).to(upcast_half(h).dtype), upcast_half(Ws), upcast_half(Wn)
    edge = A > 0
    if alpha is None:
        deg = A.sum(-1, keepdim=True)
        a = A / torch.where(deg > 0, deg, torch.ones_like(deg))
    else:
        a = as_tensor(alpha, "alpha")
        if a.shape != A.shape:
            raise ValueError(f"alpha must have the shape of A, {tuple(A.shape)}, got {tuple(a.shape)}")
        check_finite(a, "alpha")
        a = torch.where(edge, upcast_half(a).to(h.dtype), torch.zeros((), dtype=h.dtype))
    out = h @ Ws.T + a @ (h @ Wn.T)
    return restore_half(_ACTIVATIONS[activation](out), dtype)


def attention_weights(h, A, W, a, *, negative_slope: float = 0.2) -> torch.Tensor:
    r"""GAT's attention weights, :math:`\alpha_{uv}=\mathrm{softmax}_{u\in N(v)}\,e_{vu}`.

    :math:`e_{vu}=\mathrm{LeakyReLU}(a^\top[Wh_v\,\Vert\,Wh_u])` with slope ``negative_slope`` below 0.

    ``W`` ``(D_out, D_in)``, ``a`` ``(2 D_out,)``; the softmax runs over the neighbours of each
    :math:`v` (``A[..., v, u] > 0``), so each row of the result sums to 1, or is all 0 for an isolated
    node. Returns ``alpha`` ``(..., N, N)`` in :func:`aggregate`'s layout (row :math:`v`, column
    :math:`u`).
    """
    h, A = _graph_input(h, A)
    W, a = as_tensor(W, "W"), as_tensor(a, "a")
    check_dim(W, "W", "(D_out, D_in)", min_dim=2, max_dim=2)
    if W.shape[1] != h.shape[-1] or a.shape != (2 * W.shape[0],):
        raise ValueError(f"W must be (D_out, D_in = {h.shape[-1]}) and a (2 D_out,), "
                         f"got {tuple(W.shape)} and {tuple(a.shape)}")
    slope = check_range(negative_slope, "negative_slope", 0.0, math.inf)
    dtype = h.dtype
    z = upcast_half(h) @ upcast_half(W).T
    D_out = W.shape[0]
    a = upcast_half(a).to(z.dtype)
    e = F.leaky_relu((z @ a[:D_out]).unsqueeze(-1) + (z @ a[D_out:]).unsqueeze(-2), slope)
    edge = A > 0
    e = e.masked_fill(~edge, -math.inf)
    alpha = torch.softmax(e, dim=-1).nan_to_num(0.0)  # a row without neighbours: 0 / 0 -> 0
    return restore_half(alpha, dtype)


# ----------------------------------------------------------------------------------------------- the book's graphs


_BREAK = re.compile(r"[^\W_]+|[^\w\s'\u2019\u2010\u2011\u2013-]")  # a word (any script: "λ"), or a run's end
_POSSESSIVE = re.compile(r"['\u2019]s\b")
MAX_WORDS = 4


def entity_runs(text: str) -> list[tuple[str, ...]]:
    """``text`` as runs of words inside which a name can sit: lower-cased, ``'s`` dropped, ``-`` and ``_`` as spaces.

    Hyphens include the en dash of "Bradley–Terry". Other punctuation (``.,;:()$``, the em dash...) and
    stopwords (those of :data:`llmbook.rag.sparse.STOPWORDS`) end a run, so a name never spans two
    clauses. "Cross-entropy", "cross entropy" and "CROSS-ENTROPY" all give the run ``("cross", "entropy")``.

    >>> entity_runs("The KV-cache's size (per token) grows; fine-tuning, Bradley–Terry")
    [('kv', 'cache', 'size'), ('per', 'token'), ('grows',), ('fine', 'tuning'), ('bradley', 'terry')]
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    from llmbook.rag.sparse import STOPWORDS

    runs, run = [], []
    for tok in _BREAK.findall(_POSSESSIVE.sub("", text.lower())):
        if tok[0].isalnum() and tok not in STOPWORDS:
            run.append(tok)
            continue
        if run:
            runs.append(tuple(run))
        run = []
    if run:
        runs.append(tuple(run))
    return runs


@lru_cache(maxsize=4096)
def _runs(text: str) -> tuple[tuple[str, ...], ...]:
    return tuple(entity_runs(text))


def match_entities(text: str, entities) -> list[str]:
    """The entities named in ``text``, in order, each occurrence matched once, longest name first.

    ``entities`` are names as :func:`entity_runs` writes them, words joined by one space ("kv cache").
    Within each run of ``text``, the scan takes at every position the longest entity (at most
    ``MAX_WORDS`` words) that starts there and continues after it: "paged kv cache" is one match of
    that name, not also one of "kv cache" and of "cache" (leftmost-longest matching).

    >>> match_entities("A paged KV cache; the KV-cache of a cache", {"kv cache", "paged kv cache", "cache"})
    ['paged kv cache', 'kv cache', 'cache']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    entities = set(entities)
    if not all(isinstance(e, str) for e in entities):
        raise TypeError("entities must be an iterable of str names such as 'kv cache'")
    out = []
    for run in _runs(text):
        i = 0
        while i < len(run):
            for n in range(min(MAX_WORDS, len(run) - i), 0, -1):
                name = " ".join(run[i:i + n])
                if name in entities:
                    out.append(name)
                    i += n
                    break
            else:
                i += 1
    return out


_CONNECTIVES = frozenset({"per", "vs", "versus", "via", "using", "without"})  # may sit inside a name, not at its ends
_NAMED_HEADING = re.compile(r"^\d+\. |\(\d+\.\d+\)$")  # "25. Reranking ..." or "... (25.01)"


def _capitalised(texts) -> set[str]:
    """The words (lower-cased) that ``texts`` write with a capital letter in at least half of their occurrences."""
    seen: dict[str, list[int]] = {}
    for text in texts:
        for tok in re.findall(r"[^\W_]+", _POSSESSIVE.sub("", text)):
            n = seen.setdefault(tok.lower(), [0, 0])
            n[0] += 1
            n[1] += tok != tok.lower()
    return {w for w, (n, up) in seen.items() if 2 * up >= n}


def _candidates(names, headings, texts) -> set[str]:
    """The candidate names: whole one-word names, name-like words of equation names, and 2-4-word phrases.

    Only the headings that name something count: chapter titles ("11. Parameter-efficient fine-tuning")
    and equation sections ("Cross-entropy (1.06)"), not "Try it" or "On the book's corpus". A single word
    is a candidate when it is a whole name ("Perplexity") or when it is a word of an equation name that
    the book's ``texts`` mostly write capitalised, as they write names and acronyms ("LoRA", "Mamba",
    "PPO") but not common words ("update", "hidden").
    """
    headings = [h for h in headings if _NAMED_HEADING.search(h.strip())]
    capitalised = _capitalised(texts)
    out = set()
    for text, of_equation in [(t, True) for t in names] + [(t, False) for t in headings]:
        words = [w for w in re.findall(r"[^\W_]+", _POSSESSIVE.sub("", text.lower())) if not w.isdigit()]
        if len(words) == 1 and entity_runs(words[0]):
            out.add(words[0])  # a whole name of one word ("Perplexity (1.10)"), not a stopword
        for run in entity_runs(text):
            for i in range(len(run)):
                for n in range(1, min(MAX_WORDS, len(run) - i) + 1):
                    words = run[i:i + n]
                    if n == 1:
                        if of_equation and len(words[0]) >= 3 and not words[0].isdigit() and words[0] in capitalised:
                            out.add(words[0])
                    elif not any(w.isdigit() for w in words) and not {words[0], words[-1]} & _CONNECTIVES:
                        out.add(" ".join(words))
    return out


@lru_cache(maxsize=8)
def _passage_entities(texts: tuple[str, ...], terms: tuple[str, ...]) -> tuple[frozenset, ...]:
    return tuple(frozenset(match_entities(t, terms)) for t in texts)


@lru_cache(maxsize=4)
def index_terms(min_df: int = 3, max_share: float = 0.05) -> tuple[str, ...]:
    """The book's index: the names of its equations and sections, as whole names, in alphabetical order.

    Candidates are every phrase of two to four consecutive words of the registry's equation names and of
    the chapter and equation-section headings ("cross entropy", "monte carlo", "fine tuning", "kv
    cache"), the one-word names ("perplexity"), and the words of equation names that the book mostly
    writes capitalised, its names and acronyms ("rmsnorm", "lora", "mamba"), all normalised by
    :func:`entity_runs`. Each passage is matched
    by :func:`match_entities` (longest name first, so the words of "cross-entropy" count for that name
    only), and a candidate is kept when at least ``min_df`` passages and at most a share ``max_share`` of
    all passages name it: rarer names link nothing, commoner ones ("attention") link everything.
    Dropping a name frees its words for shorter names, so matching and counting repeat until no
    candidate is dropped.
    """
    from llmbook.rag.corpus import passage_text
    from llmbook.rag.pipeline import book_data

    min_df = check_int(min_df, "min_df", low=1)
    max_share = check_range(max_share, "max_share", 0.0, 1.0, low_open=True)
    passages = book_data().passages
    texts = tuple(passage_text(p) for p in passages)
    terms = _candidates([e.name for e in catalogue().values()], sorted({p.heading for p in passages}), texts)
    while True:
        df: dict[str, int] = {}
        for found in _passage_entities(texts, tuple(sorted(terms))):
            for t in found:
                df[t] = df.get(t, 0) + 1
        kept = {t for t, n in df.items() if min_df <= n <= max_share * len(texts)}
        if kept == terms:
            return tuple(sorted(terms))
        terms = kept


def _incidence(texts, terms) -> torch.Tensor:
    """``(N, T)`` 0/1 float64: whether passage text ``n`` names index term ``t`` (:func:`match_entities`)."""
    col = {t: j for j, t in enumerate(terms)}
    X = torch.zeros(len(texts), len(terms), dtype=torch.float64)
    for n, found in enumerate(_passage_entities(tuple(texts), tuple(terms))):
        for t in found:
            X[n, col[t]] = 1.0
    return X


@dataclass(frozen=True)
class EntityGraph:
    """Index terms as nodes, co-occurrence in passages as edge weights."""

    #: The index terms, one per node.
    terms: tuple[str, ...]
    #: Co-occurrence counts, (T, T) float64 with a zero diagonal.
    A: torch.Tensor
    #: Passage-by-term incidence, (N, T) float64 0/1.
    X: torch.Tensor
    #: Each term's home chapter, the chapter whose passages use it most often, (T,) long.
    chapter: torch.Tensor


def entity_graph(data=None, terms: tuple[str, ...] | None = None, *, exclude: tuple[int, ...] = ()) -> EntityGraph:
    r"""The co-occurrence graph of the index terms: :math:`A = X^\top X` with the diagonal zeroed.

    ``X`` ``(N, T)`` marks which of the ``T`` index terms (default :func:`index_terms`) each of the
    ``N`` passages of ``data`` (default :func:`llmbook.rag.pipeline.book_data`) uses, so
    :math:`A_{st}` is the number of passages that use both :math:`s` and :math:`t`. The passages of
    the chapters in ``exclude`` are left out (chapter 31 leaves out its own passages, whose prose names
    the very examples it prints). A term that then shares no passage with another term would be an
    isolated node, a community of its own: it is dropped, and ``terms`` lists the nodes that remain.
    """
    from llmbook.rag.corpus import passage_text
    from llmbook.rag.pipeline import book_data

    data = book_data() if data is None else data
    terms = index_terms() if terms is None else tuple(terms)
    keep = [n for n, p in enumerate(data.passages) if p.chapter not in set(exclude)]
    X = _incidence([passage_text(data.passages[n]) for n in keep], terms)
    A = X.T @ X
    A.fill_diagonal_(0.0)
    linked = (A.sum(0) > 0).nonzero().flatten().tolist()  # terms with at least one co-occurring term
    terms, X, A = tuple(terms[j] for j in linked), X[:, linked], A[linked][:, linked]
    chapters = torch.tensor([data.passages[n].chapter for n in keep], dtype=torch.long)
    C = int(chapters.max().item()) + 1 if len(chapters) else 1
    per_chapter = F.one_hot(chapters, C).double().T @ X  # (C, T) passages of each chapter using each term
    return EntityGraph(terms, A, X, per_chapter.argmax(0))


def passage_graph(data=None, terms: tuple[str, ...] | None = None) -> torch.Tensor:
    r"""Passages linked by shared index terms: :math:`W = X\,\mathrm{diag}(\mathrm{idf})\,X^\top`, diagonal zeroed.

    :math:`\mathrm{idf}_t = \log(N / \mathrm{df}_t)`: two passages that share a term few passages
    use are linked more strongly than two that share a common one. Returns ``(N, N)`` float64.
    """
    from llmbook.rag.corpus import passage_text
    from llmbook.rag.pipeline import book_data

    data = book_data() if data is None else data
    terms = index_terms() if terms is None else tuple(terms)
    X = _incidence([passage_text(p) for p in data.passages], terms)
    idf = torch.log(X.shape[0] / X.sum(0).clamp_min(1.0))
    W = (X * idf) @ X.T
    W.fill_diagonal_(0.0)
    return W


def graph_rerank(scores, W, *, k: int = 10, alpha: float = 0.5) -> torch.Tensor:
    r"""GraphRAG-style scores: personalised PageRank on ``W`` seeded by each query's top ``k`` hits.

    The restart distribution of query :math:`b` puts weight :math:`1/\mathrm{rank}` on its ``k``
    best-scored passages (rank 1 the best) and 0 elsewhere; the result is
    :func:`llmbook.rag.graph.personalized_pagerank` with ``alpha``, the probability of following an
    edge. A passage the walk never reaches scores 0. ``scores`` ``(B, N)``, ``W`` ``(N, N)``; returns
    ``(B, N)`` float64.
    """
    s = as_tensor(scores, "scores")
    check_dim(s, "scores", "(B, N)", min_dim=2, max_dim=2)
    k = check_int(k, "k", low=1, high=s.shape[1])
    top = s.topk(k, dim=1).indices
    v = torch.zeros(s.shape, dtype=torch.float64)
    v.scatter_(1, top, (1.0 / torch.arange(1, k + 1, dtype=torch.float64)).expand(s.shape[0], k))
    return personalized_pagerank(W, v, alpha)
