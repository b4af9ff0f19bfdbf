"""Tests of llmbook.rag.graph_search: community summaries, global map-reduce, local search, the global questions.

Oracles: ``networkx.pagerank`` (scipy, tol 1e-12) for the centrality inside a community and for the
personalised walk of local search; plain Python loops (sorting by ``(-score, index)`` with Python floats,
greedy filling with Python ints) re-deriving every selection from the docstrings' definitions; hand-worked
small cases for sentence splitting and aspect coverage; the corpus itself for the global questions (sections
exist, names occur, no 6-word quotation, with the labelled questions' own helper). Tolerances: 1e-9 against
networkx's iteration, exact equality for selections and counts.
"""

import networkx as nx
import numpy as np
import pytest
import torch

from llmbook.rag import graph_context as gc
from llmbook.rag import graph_search as gs
from llmbook.rag.corpus import load_corpus, passage_text
from tests.rag.test_corpus import _words


def loop_fill(scores, n_words, budget):
    order = sorted((i for i in range(len(scores)) if scores[i] > 0), key=lambda i: (-scores[i], i))
    chosen, used = [], 0
    for i in order:
        if used + n_words[i] <= budget:
            chosen.append(i)
            used += n_words[i]
    return chosen


def random_graph(seed, T=9, U=30):
    rng = np.random.default_rng(seed)
    A = np.triu((rng.random((T, T)) < 0.5) * rng.integers(1, 5, (T, T)), 1).astype(float)
    A = A + A.T
    comm = rng.integers(0, 3, T)
    X = (rng.random((U, T)) < 0.2).astype(float)
    n_words = rng.integers(1, 30, U)
    return A, comm, X, n_words


def test_split_sentences_by_hand():
    text = "Adam keeps two moments. It costs 0.5 GB, e.g. per layer.\nA new line? Yes.\n\nname | use\nSGD | all\nEnd"
    assert gs.split_sentences(text) == ["Adam keeps two moments.", "It costs 0.5 GB, e.g. per layer.", "A new line?",
                                        "Yes.", "name | use", "SGD | all", "End"]
    assert gs.split_sentences("") == []
    with pytest.raises(TypeError, match="text must be a str"):
        gs.split_sentences(None)


@pytest.mark.parametrize("seed", range(6))
def test_fill_budget_matches_a_loop(seed):
    rng = np.random.default_rng(seed)
    s = np.round(rng.normal(size=40), 1)  # ties and non-positive scores
    w = rng.integers(1, 20, 40)
    for budget in (0, 15, 60, 1000):
        got = gs.fill_budget(torch.tensor(s), torch.tensor(w), budget)
        assert got == loop_fill(s.tolist(), w.tolist(), budget)
        assert sum(w[got]) <= budget


@pytest.mark.parametrize("seed", range(5))
def test_community_summaries_against_networkx_and_loops(seed):
    A, comm, X, n_words = random_graph(seed)
    got = gs.community_summaries(torch.tensor(A), torch.tensor(comm), torch.tensor(X), torch.tensor(n_words),
                                 n_names=2, budget=40, d=0.85)
    labels = sorted(set(comm.tolist()))
    assert [s.community for s in got] == labels
    for s, c in zip(got, labels, strict=True):
        M = [t for t in range(len(comm)) if comm[t] == c]
        G = nx.from_numpy_array(A[np.ix_(M, M)])
        pr = nx.pagerank(G, alpha=0.85, tol=1e-12, max_iter=1000, weight="weight")
        names = sorted(range(len(M)), key=lambda i: (-round(pr[i], 9), M[i]))[:2]
        assert list(s.names) == [M[i] for i in names]
        weight = [sum(pr[i] for i, t in enumerate(M) if X[u, t] > 0) for u in range(len(X))]
        weight = [round(x, 9) for x in weight]  # networkx and the power iteration agree to ~1e-12
        assert list(s.units) == loop_fill(weight, n_words.tolist(), 40)
        assert s.n_words == sum(n_words[u] for u in s.units) <= 40


@pytest.mark.parametrize("seed", range(5))
def test_global_search_matches_a_map_reduce_loop(seed):
    A, comm, X, n_words = random_graph(seed)
    summaries = gs.community_summaries(torch.tensor(A), torch.tensor(comm), torch.tensor(X),
                                       torch.tensor(n_words), budget=60)
    rng = np.random.default_rng(100 + seed)
    scores = np.round(np.maximum(rng.normal(size=(4, len(X))), 0), 1)
    got = gs.global_search(torch.tensor(scores), summaries, torch.tensor(n_words), map_budget=25, budget=50)
    for row, answer in zip(scores.tolist(), got, strict=True):
        partials = []
        for s in summaries:  # map: the summary's best units within 25 words, scored by their sum
            sub = list(s.units)
            taken = [sub[i] for i in loop_fill([row[u] for u in sub], [int(n_words[u]) for u in sub], 25)]
            if sum(row[u] for u in taken) > 0:
                partials.append((sum(row[u] for u in taken), s.community, taken))
        partials.sort(key=lambda p: (-p[0], p[1]))
        context, used = [], 0
        for _, _, taken in partials:  # reduce: best partial answers first, 50 words
            for u in taken:
                if u not in context and used + n_words[u] <= 50:
                    context.append(u)
                    used += n_words[u]
        assert list(answer.units) == context
        assert [c for c, _ in answer.partials] == [c for _, c, _ in partials]
        np.testing.assert_allclose([x for _, x in answer.partials], [x for x, _, _ in partials], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_local_search_against_networkx(seed):
    A, _, X, _ = random_graph(seed)
    A[0, 1] = A[1, 0] = 1.0  # no isolated node 0
    rng = np.random.default_rng(seed)
    E = np.maximum(np.round(rng.normal(size=(3, len(A))), 0), 0)  # ties among the entity scores
    E[0, 0] = E[1, 1] = 2.0  # at least one entity linked
    E[2] = 0.0  # linked to nothing
    k, alpha = 3, 0.4
    got = gs.local_search(torch.tensor(E), torch.tensor(A), torch.tensor(X), k=k, alpha=alpha)
    G = nx.from_numpy_array(A)
    for b in range(2):
        top = sorted(range(len(A)), key=lambda t: -E[b, t])[:k]
        v = {t: 1.0 / (r + 1) for r, t in enumerate(top) if E[b, t] > 0}
        p = nx.pagerank(G, alpha=alpha, personalization=v, tol=1e-12, max_iter=1000, weight="weight")
        ref = [sum(p[t] for t in range(len(A)) if X[n, t] > 0) for n in range(len(X))]
        np.testing.assert_allclose(got[b].numpy(), ref, rtol=0, atol=1e-9)
    assert torch.isneginf(got[2]).all()


def test_entity_documents_and_coverage_by_hand():
    docs = gs.entity_documents([("a", "b"), ("c",), ("d",)], torch.tensor([[1.0, 0], [1, 1], [0, 0]]), ["x y", "z"])
    assert docs == [("x", "y", "a", "b", "c"), ("z", "c")]
    aspects = [("sec-1", "rope"), ("kv cache",), ("kv cache memory",), ("sec-2",), ("page#anchor",)]
    text = "The KV-cache memory grows; RoPE rotates."
    assert gs.aspect_coverage(aspects, text, {"sec-9"}) == 3 / 5  # rope, kv cache memory and kv cache inside it
    assert gs.aspect_coverage(aspects, "", {"sec-2", "page#anchor"}) == 2 / 5
    assert gs.aspect_coverage(aspects, text, {"sec-2", "page#anchor"}) == 1.0


def test_clear_errors():
    with pytest.raises(ValueError, match="n_words must have the shape"):
        gs.fill_budget(torch.ones(3), torch.ones(2, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="NaN"):
        gs.fill_budget(torch.tensor([float("nan")]), torch.ones(1, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="budget"):
        gs.fill_budget(torch.ones(1), torch.ones(1, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="integer labels"):
        gs.community_summaries(torch.zeros(2, 2), torch.tensor([0.0, 1.0]), torch.zeros(1, 2), torch.ones(1))
    with pytest.raises(ValueError, match="X must be"):
        gs.community_summaries(torch.zeros(2, 2), torch.tensor([0, 1]), torch.zeros(1, 3), torch.ones(1))
    with pytest.raises(ValueError, match="columns"):
        gs.local_search(torch.zeros(1, 3), torch.zeros(2, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="n_words must be"):
        gs.global_search(torch.zeros(1, 3), [], torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="aspects"):
        gs.aspect_coverage([], "text", set())
    with pytest.raises(ValueError, match="expected 3 tab-separated"):
        bad = __import__("pathlib").Path(__import__("tempfile").mkdtemp()) / "q.tsv"
        bad.write_text("g1\tq\n", encoding="utf-8")
        gs.load_global_questions(bad)


# ---- the global questions ------------------------------------------------------------------------------


def test_global_questions_are_well_formed_and_grounded():
    qs = gs.load_global_questions()
    passages = load_corpus()
    assert len(qs) >= 12 and len({q.id for q in qs}) == len(qs)
    sections = {p.section for p in passages if p.section}
    others = [passage_text(p) for p in passages if p.chapter != 31]  # chapter 31 itself discusses the questions
    for q in qs:
        assert len(q.aspects) >= 5, q.id
        chapters = set()
        for aspect in q.aspects:
            for alt in aspect:
                if alt.startswith("sec-"):
                    assert alt in sections, (q.id, alt)
                    chapters |= {p.chapter for p in passages if p.section == alt}
                else:
                    assert any(gc.match_entities(t, {alt}) for t in others), (q.id, alt)
        assert 31 not in chapters, q.id


def substring_coverage(aspects, text, sections):
    """Aspect coverage with names found as word sequences inside the runs of entity_runs (joined by ' | ')."""
    padded = " " + " | ".join(" ".join(run) for run in gc.entity_runs(text)) + " "
    return sum(any(x in sections or f" {x} " in padded for x in a) for a in aspects) / len(aspects)


def test_no_single_passage_answers_a_global_question():
    """A global question needs several passages: no passage covers all of its aspects (the best covers 0.7)."""
    passages = [p for p in load_corpus() if p.chapter != 31]
    for q in gs.load_global_questions():
        cover = [substring_coverage(q.aspects, passage_text(p), {p.section}) for p in passages]
        best = int(np.argmax(cover))
        assert cover[best] <= 0.7, (q.id, cover[best])
        for n in (best, 0, len(passages) - 1):  # the library agrees with the substring oracle
            p = passages[n]
            assert gs.aspect_coverage(q.aspects, passage_text(p), {p.section}) == cover[n], (q.id, p.id)


def test_no_global_question_is_quoted_by_the_corpus():
    """The labelled questions' rule (tests/rag/test_corpus.py): no 6 consecutive words of a question in a passage."""
    def grams(ws, n=6):
        return {tuple(ws[i:i + n]) for i in range(len(ws) - n + 1)}

    corpus = set().union(*(grams(_words(f"{p.heading} {p.text}")) for p in load_corpus()))
    quoted = [(q.id, g) for q in gs.load_global_questions() for g in grams(_words(q.text)) if g in corpus]
    assert not quoted, quoted
    # the check finds a quotation when there is one
    p = load_corpus()[7]
    assert grams(_words(f"{p.heading} {p.text}")[2:9]) & corpus
