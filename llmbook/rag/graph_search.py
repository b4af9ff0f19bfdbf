r"""GraphRAG's two searches, extractively: community summaries, global map-reduce, local entity search (chapter 31).

GraphRAG {Edge et al. 2024} answers two kinds of question from one entity graph:

* **Global search** answers a question about the whole corpus ("which methods make attention cheaper?") from
  *community summaries*. Each community of the entity graph gets a summary (:func:`community_summaries`);
  at query time every summary is read against the question (the *map* step, one partial answer and a score
  per community) and the best partial answers fill the generator's context (the *reduce* step,
  :func:`global_search`). GraphRAG's summaries and partial answers are written by an LLM; the book has no
  generator able to write prose, so here both are **extractive**: a summary is the community's most central
  names and the sentences of the book that weigh most in its names, and a partial answer is the summary's
  sentences that best match the question.
* **Local search** answers a question about a few named things from their neighbourhood: the entities
  the question is linked to seed personalised PageRank on the entity graph, and a passage scores the mass
  its entities receive, :math:`s_n = \sum_t X_{nt}\,p_t` (:func:`local_search`, HippoRAG's passage score).

Contexts are measured in words (a stand-in for tokens) and filled greedily in rank order
(:func:`fill_budget`). :func:`aspect_coverage` scores a context against the aspects a complete answer must
cover, as listed by :func:`load_global_questions`. Registers no equation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmbook._checks import as_tensor, check_dim, check_int, check_range
from llmbook.rag.graph import pagerank, personalized_pagerank

__all__ = ["CommunitySummary", "GlobalAnswer", "GlobalQuestion", "TextUnits", "aspect_coverage",
           "community_summaries", "entity_documents", "fill_budget", "global_search", "load_global_questions",
           "local_search", "split_sentences", "text_units"]

GLOBAL_QUESTIONS = "global_questions.tsv"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z$(\[*\"'])")


def split_sentences(text: str) -> list[str]:
    """``text`` as sentences: cut at blank lines, after every line of a table, and after ``.``, ``!`` or ``?``
    followed by a space and a capital (or ``$``, ``(``).

    A table row (a line holding ``" | "``) is a unit of its own, so a summary can take one row of a table
    without the rest. A decimal point ("0.5") or a full stop before a lower-case word ends no sentence.

    >>> split_sentences("Adam keeps two moments. It costs 0.5 GB per layer!  (Or less.)\\n\\nname | use\\nSGD | all")
    ['Adam keeps two moments.', 'It costs 0.5 GB per layer!', '(Or less.)', 'name | use', 'SGD | all']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    out, prose = [], []
    for line in text.splitlines() + [""]:
        if " | " in line or not line.strip():
            out += [s.strip() for s in _SENTENCE_END.split(" ".join(prose)) if s.strip()]
            prose = []
            if line.strip():
                out.append(line.strip())
        else:
            prose.append(line.strip())
    return out


@dataclass(frozen=True)
class TextUnits:
    """Sentences of a set of passages: their text, source passage, length in words, and the index names they use."""

    #: The sentences.
    texts: tuple[str, ...]
    #: For each sentence, the index (into the passages given) of its passage, (U,) long.
    passage: torch.Tensor
    #: Length in words (whitespace-separated), (U,) long.
    n_words: torch.Tensor
    #: Sentence-by-name incidence, (U, T) float64 0/1 (:func:`llmbook.rag.graph_context.match_entities`).
    X: torch.Tensor


def text_units(texts, terms) -> TextUnits:
    """Every passage text of ``texts`` cut by :func:`split_sentences`, with the names of ``terms`` each sentence uses.

    >>> u = text_units(["LoRA adds a low-rank update. Adam is unchanged."], ("lora", "adam"))
    >>> u.X.tolist(), u.n_words.tolist()
    ([[1.0, 0.0], [0.0, 1.0]], [5, 3])
    """
    from llmbook.rag.graph_context import _incidence

    sents, owner = [], []
    for n, text in enumerate(texts):
        for s in split_sentences(text):
            sents.append(s)
            owner.append(n)
    return TextUnits(tuple(sents), torch.tensor(owner, dtype=torch.long),
                     torch.tensor([len(s.split()) for s in sents], dtype=torch.long), _incidence(sents, tuple(terms)))


def fill_budget(scores, n_words, budget: int) -> list[int]:
    """Greedy context filling: units in descending score (ties: lower index), each taken if it still fits.

    Only units with a positive score are candidates; a unit longer than what is left is skipped and the
    next one tried, so the context holds at most ``budget`` words. ``scores`` and ``n_words`` are ``(U,)``.
    Returns the chosen indices in the order taken (the reading order of the context).

    >>> fill_budget(torch.tensor([0.9, 0.5, 0.7, 0.0]), torch.tensor([6, 3, 5, 1]), 9)
    [0, 1]
    """
    s, w = as_tensor(scores, "scores"), as_tensor(n_words, "n_words")
    check_dim(s, "scores", "(U,)", min_dim=1, max_dim=1)
    if w.shape != s.shape:
        raise ValueError(f"n_words must have the shape of scores, {tuple(s.shape)}, got {tuple(w.shape)}")
    if s.isnan().any():
        raise ValueError("scores must not be NaN")
    budget = check_int(budget, "budget", low=0)
    pos = (s > 0).nonzero().flatten()
    order = pos[torch.sort(-s[pos].double(), stable=True).indices].tolist()  # descending; ties: lower index
    length = w.tolist()
    chosen, used = [], 0
    for i in order:
        if used + length[i] <= budget:
            chosen.append(i)
            used += length[i]
    return chosen


@dataclass(frozen=True)
class CommunitySummary:
    """An extractive community summary (see :func:`community_summaries`)."""

    #: The community's label.
    community: int
    #: Its most central names, term indices, most central first.
    names: tuple[int, ...]
    #: The summary's sentences, unit indices, in the order taken (highest weight first).
    units: tuple[int, ...]
    #: Total length in words.
    n_words: int


def community_summaries(A, communities, X, n_words, *, n_names: int = 5, budget: int = 400,
                        d: float = 0.85) -> list[CommunitySummary]:
    r"""One extractive summary per community: its central names and its weightiest sentences, within ``budget`` words.

    For community :math:`C` with members :math:`M_C`, :math:`\mathrm{PR}_C` is PageRank (damping ``d``) on the
    sub-graph ``A[M_C][:, M_C]``: the centrality *within* the community. The summary names the ``n_names``
    most central members and takes text units (sentences) by their weight in the community,

    .. math:: s_u = \sum_{t \in M_C} \mathrm{PR}_C(t)\, X_{ut},

    through :func:`fill_budget` (positive weight only, greedy, ``budget`` words; weights rounded to 12
    decimals, so that sentences naming the same names tie exactly whatever the CPU's summation order).
    ``A`` ``(T, T)`` is the entity graph, ``communities`` ``(T,)`` integer labels, ``X`` ``(U, T)`` the
    unit-by-name incidence, ``n_words`` ``(U,)``. Returns the summaries in order of label. Deterministic:
    ties go to the lower index.

    >>> A = torch.tensor([[0.0, 2, 1, 0], [2, 0, 1, 0], [1, 1, 0, 1], [0, 0, 1, 0]])
    >>> X = torch.tensor([[1.0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]])
    >>> [(s.names, s.units) for s in community_summaries(A, torch.tensor([0, 0, 1, 1]), X, torch.tensor([4, 4, 4]),
    ...                                                   n_names=1, budget=8)]
    [((0,), (0,)), ((2,), (1, 2))]
    """
    A, c = as_tensor(A, "A").double(), torch.as_tensor(communities)
    check_dim(A, "A", "(T, T)", min_dim=2, max_dim=2)
    T = A.shape[0]
    if A.shape != (T, T) or c.shape != (T,) or c.is_floating_point():
        raise ValueError(f"A must be (T, T) and communities (T,) integer labels, got {tuple(A.shape)} and "
                         f"{tuple(c.shape)} of {c.dtype}")
    X = as_tensor(X, "X").double()
    if X.ndim != 2 or X.shape[1] != T:
        raise ValueError(f"X must be (U, T) with T = {T}, got {tuple(X.shape)}")
    n_names = check_int(n_names, "n_names", low=1)
    check_range(d, "d", 0.0, 1.0, high_open=True)
    out = []
    for label in sorted(set(c.tolist())):
        M = (c == label).nonzero().flatten()
        pr_C = pagerank(A[M][:, M], d)
        rank = sorted(range(len(M)), key=lambda i: (-float(pr_C[i]), int(M[i])))
        w = torch.zeros(T, dtype=torch.float64)
        w[M] = pr_C
        units = fill_budget(torch.round(X @ w, decimals=12), n_words, budget)  # equal names tie on every CPU
        out.append(CommunitySummary(int(label), tuple(int(M[i]) for i in rank[:n_names]), tuple(units),
                                    int(sum(int(n_words[u]) for u in units))))
    return out


@dataclass(frozen=True)
class GlobalAnswer:
    """The context of one global search: the units read, and each community's partial-answer score."""

    #: Units of the context, in reading order (best partial answer first).
    units: tuple[int, ...]
    #: (community, score) of every partial answer with a positive score, best first.
    partials: tuple[tuple[int, float], ...]


def global_search(scores, summaries, n_words, *, map_budget: int = 200, budget: int = 1000) -> list[GlobalAnswer]:
    r"""GraphRAG's global search, map-reduce over community summaries, extractively.

    *Map*: for question :math:`b` and summary :math:`C`, the partial answer is the summary's units that best
    match the question, :func:`fill_budget` over ``scores[b]`` restricted to the summary's units, at most
    ``map_budget`` words; its score is the sum of their scores (GraphRAG has the LLM rate each partial
    answer's helpfulness instead). *Reduce*: the partial answers in descending score (ties: lower label)
    fill the context of ``budget`` words, unit by unit in each answer's order; a unit already in the context
    or longer than what is left is skipped.

    ``scores`` ``(B, U)`` relevance of every unit to every question (e.g. BM25); ``summaries`` from
    :func:`community_summaries`; ``n_words`` ``(U,)``. Returns one :class:`GlobalAnswer` per question.

    >>> S = [CommunitySummary(0, (0,), (0, 1), 8), CommunitySummary(1, (2,), (2,), 4)]
    >>> a = global_search(torch.tensor([[1.0, 0.0, 3.0]]), S, torch.tensor([4, 4, 4]), budget=8)[0]
    >>> a.units, a.partials
    ((2, 0), ((1, 3.0), (0, 1.0)))
    """
    s = as_tensor(scores, "scores").double()
    check_dim(s, "scores", "(B, U)", min_dim=2, max_dim=2)
    w = as_tensor(n_words, "n_words")
    if w.shape != (s.shape[1],):
        raise ValueError(f"n_words must be (U,) with U = {s.shape[1]} (the columns of scores), got {tuple(w.shape)}")
    map_budget, budget = check_int(map_budget, "map_budget", low=0), check_int(budget, "budget", low=0)
    out = []
    for row in s:
        partials = []
        for summary in summaries:
            idx = torch.tensor(summary.units, dtype=torch.long)
            taken = [summary.units[i] for i in fill_budget(row[idx], w[idx], map_budget)] if len(idx) else []
            score = float(sum(float(row[u]) for u in taken))
            if score > 0:
                partials.append((summary.community, score, taken))
        partials.sort(key=lambda p: (-p[1], p[0]))
        context, used = [], 0
        for _, _, taken in partials:
            for u in taken:
                if u not in context and used + int(w[u]) <= budget:
                    context.append(u)
                    used += int(w[u])
        out.append(GlobalAnswer(tuple(context), tuple((c, sc) for c, sc, _ in partials)))
    return out


def entity_documents(doc_terms, X, names=None) -> list[tuple[str, ...]]:
    """Each entity's *description* for linking a question to it: the analysed terms of every passage naming it.

    GraphRAG has an LLM write a description of each entity and links a question to the entities whose
    descriptions it resembles; the extractive stand-in concatenates the passages that name the entity
    (``doc_terms[n]`` for every ``n`` with ``X[n, t] > 0``), preceded by the entity's own name words (``names``,
    optional). Score a question against them with :func:`llmbook.rag.sparse.bm25_scores`.

    >>> entity_documents([("low", "rank"), ("adam",)], torch.tensor([[1.0, 0], [1, 1]]), ["lora", "adam"])
    [('lora', 'low', 'rank', 'adam'), ('adam', 'adam')]
    """
    X = as_tensor(X, "X")
    check_dim(X, "X", "(N, T)", min_dim=2, max_dim=2)
    if X.shape[0] != len(doc_terms) or (names is not None and len(names) != X.shape[1]):
        raise ValueError(f"X (N, T) = {tuple(X.shape)} needs N = len(doc_terms) = {len(doc_terms)} and T names")
    out = []
    for t in range(X.shape[1]):
        words = tuple(names[t].split()) if names is not None else ()
        out.append(words + tuple(w for n in X[:, t].nonzero().flatten().tolist() for w in doc_terms[n]))
    return out


def local_search(entity_scores, A, X, *, k: int = 5, alpha: float = 0.5) -> torch.Tensor:
    r"""GraphRAG's local search, scored as HippoRAG scores passages: :math:`s_{bn} = \sum_t X_{nt}\,p_{bt}`.

    The question is first linked to entities: ``entity_scores`` ``(B, T)`` rates every entity for every
    question (GraphRAG compares the question with each entity's description), and the ``k`` best entities
    with a positive score seed the walk (ties go to the lower index), with restart weights
    :math:`v_{bt} \propto 1/\mathrm{rank}`.
    :math:`p_b` is personalised PageRank (:func:`llmbook.rag.graph.personalized_pagerank`, edge probability
    ``alpha``) on the entity graph ``A`` ``(T, T)``; ``X`` ``(N, T)`` is the passage-by-entity incidence. A
    question linked to no entity retrieves nothing: its row is ``-inf``. Returns ``(B, N)`` float64.

    >>> A = torch.tensor([[0.0, 1, 0], [1, 0, 1], [0, 1, 0]]); X = torch.tensor([[1.0, 0, 0], [0, 0, 1]])
    >>> s = local_search(torch.tensor([[2.0, 0, 0], [0, 0, 0]]), A, X, k=2)
    >>> [[round(x, 4) for x in row] for row in s.tolist()]
    [[0.5833, 0.0833], [-inf, -inf]]
    """
    e, A, X = as_tensor(entity_scores, "entity_scores").double(), as_tensor(A, "A").double(), as_tensor(X, "X").double()
    check_dim(e, "entity_scores", "(B, T)", min_dim=2, max_dim=2)
    T = A.shape[-1]
    if e.shape[1] != T or X.ndim != 2 or X.shape[1] != T:
        raise ValueError(f"entity_scores (B, T) and X (N, T) must have T = {T} columns (the nodes of A), got "
                         f"{tuple(e.shape)} and {tuple(X.shape)}")
    if e.isnan().any():
        raise ValueError("entity_scores must not be NaN")
    k = check_int(k, "k", low=1, high=T)
    top = torch.sort(-e, dim=1, stable=True).indices[:, :k]  # the k best, ties to the lower index
    inv_rank = 1.0 / torch.arange(1, k + 1, dtype=torch.float64)
    w = torch.where(e.gather(1, top) > 0, inv_rank, torch.zeros((), dtype=torch.float64))
    v = torch.zeros_like(e).scatter_(1, top, w)
    linked = v.sum(1, keepdim=True)
    v = torch.where(linked > 0, v / linked.clamp_min(1e-300), torch.full_like(v, 1.0 / T))
    s = torch.round(personalized_pagerank(A, v, alpha) @ X.T, decimals=12)  # passages naming the same entities tie
    return s.masked_fill(linked == 0, float("-inf"))


@dataclass(frozen=True)
class GlobalQuestion:
    """A question about the whole book and the aspects a complete answer covers (alternatives per aspect)."""

    id: str
    text: str
    aspects: tuple[tuple[str, ...], ...]


def load_global_questions(path: str | Path | None = None) -> list[GlobalQuestion]:
    """The global questions of ``llmbook/data/global_questions.tsv``: columns ``id, question, aspects``.

    Aspects are separated by ``"; "``, the alternatives of one aspect by ``" | "`` (see the file's header).

    >>> qs = load_global_questions()
    >>> len(qs) >= 12 and all(len(q.aspects) >= 5 for q in qs)
    True
    """
    source = Path(path) if path is not None else Path(__file__).resolve().parents[1] / "data" / GLOBAL_QUESTIONS
    out = []
    for n, line in enumerate(source.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cols = [c.strip() for c in line.split("\t")]
        if len(cols) != 3:
            raise ValueError(f"{source} line {n}: expected 3 tab-separated columns (id, question, aspects), "
                             f"got {len(cols)}")
        if cols[0] == "id":
            continue
        aspects = tuple(tuple(a.strip() for a in asp.split("|") if a.strip()) for asp in cols[2].split(";"))
        if not cols[1] or not aspects or any(not a for a in aspects):
            raise ValueError(f"{source} line {n}: a question and at least one non-empty aspect are required")
        out.append(GlobalQuestion(cols[0], cols[1], aspects))
    return out


def aspect_coverage(aspects, text: str, sections) -> float:
    """The share of ``aspects`` that a context covers.

    An aspect is covered when one of its alternatives is: a section id (``sec-...``, or ``page#anchor``) is
    covered when it is among ``sections`` (the sections the context's text comes from), a name when
    :func:`llmbook.rag.graph_context.match_entities` finds it in ``text`` (each name on its own, so a longer
    name around it does not hide it).

    >>> aspect_coverage([("sec-04-06", "alibi"), ("sec-03-13",), ("kv cache",)], "The KV-cache grows.", {"sec-04-06"})
    0.6666666666666666
    """
    from llmbook.rag.graph_context import match_entities

    aspects = [tuple(a) for a in aspects]
    if not aspects or any(not a or not all(isinstance(x, str) for x in a) for a in aspects):
        raise ValueError("aspects must be a non-empty list of non-empty tuples of str alternatives")
    sections = set(sections)
    names = {x for a in aspects for x in a if not (x.startswith("sec-") or "#" in x)}
    found = {x for x in names if match_entities(text, {x})}  # one name at a time: "kv cache" inside "kv cache memory"
    return sum(any(x in sections or x in found for x in a) for a in aspects) / len(aspects)
