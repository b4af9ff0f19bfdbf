"""Tests of llmbook.rag.world_reports: the summariser's data, the entity graph, the reports and the contexts."""

from collections import Counter

import networkx as nx
import pytest

from llmbook.lm.assistant import Assistant
from llmbook.lm.training import _data_dir
from llmbook.rag import world_reports as wr
from llmbook.rag.hyde_writer import collection
from llmbook.rag.rag_generation import knowledge_base
from tests.lm.test_assistant import check_trains_a_copy, tiny_assistant_model


def _truth(facts):
    out = {}
    for f in facts:
        out.setdefault(f.name, {})[f.field] = f.value
    return out


def test_summary_examples_state_the_values_of_their_notes():
    for prompt, target in wr.summary_examples(50, seed=3):
        notes = prompt.split("Notes:")[1].split("<|end|>")[0]
        said = wr.statements(notes)
        (name, values), = said.items()  # one person per example, three facts
        ordered = sorted(values, key=_field_order)  # city (capitalised), age (digits), job (lower case)
        assert target == wr.person_line(name, dict(zip(("city", "age", "job"), ordered, strict=True))) + "<|end|>"


def _field_order(v):
    return 1 if v.isdigit() else 2 if v.islower() else 0


def test_statements_recover_every_fact_from_sentences_and_from_lines():
    facts = knowledge_base(20, seed=4)
    truth = {n: set(p.values()) for n, p in _truth(facts).items()}
    assert wr.statements(" ".join(f.sentence for f in facts)) == truth
    assert wr.statements(" ".join(wr.person_line(n, p) for n, p in _truth(facts).items())) == truth
    assert wr.statements("Pim Dovik lives in pallow. Pim Dovik: Velm, 34") == {}  # malformed: nothing stated


def test_entity_graph_and_questions_against_counts_of_the_facts():
    facts = knowledge_base(30, seed=5)
    nodes, A = wr.entity_graph(facts)
    people = _truth(facts)
    deg = dict(zip(nodes, A.sum(1).tolist(), strict=True))
    residents = Counter(p["city"] for p in people.values())
    workers = Counter(p["job"] for p in people.values())
    assert all(deg[n] == 2 for n in people)
    assert all(deg[c] == k for c, k in residents.items()) and all(deg[j] == k for j, k in workers.items())
    qs = wr.global_questions(facts)
    assert len(qs) == len(residents) + len(workers)
    for q in qs:
        value = q.text.split(" in ")[-1][:-6] if q.text.startswith("Which") else q.text.split(" as a ")[1][:-6]
        expected = {n for n, p in people.items() if value in (p["city"], p["job"])}
        assert {a[0] for a in q.aspects} == expected, q.text


def test_reports_follow_networkx_pagerank_inside_each_louvain_community():
    facts = knowledge_base(30, seed=6)
    nodes, A = wr.entity_graph(facts)
    labels = wr.communities(A, seed=0)
    G = nx.from_numpy_array(A.numpy())
    ref = sorted(nx.community.louvain_communities(G, weight="weight", seed=0), key=min)
    assert [set((labels == k).nonzero().flatten().tolist()) for k in range(len(ref))] == ref
    lines = {n: wr.person_line(n, p) for n, p in _truth(facts).items()}
    summaries, texts = wr.reports(nodes, A, labels, lines)
    assert sorted(texts) == sorted(lines.values())  # every person once
    for s in summaries:
        members = sorted(ref[s.community])
        pr = nx.pagerank(G.subgraph(members), alpha=0.85, tol=1e-12, max_iter=1000, weight="weight")
        people = sorted((m for m in members if nodes[m] in lines), key=lambda m: (-round(pr[m], 9), m))
        assert [texts[u] for u in s.units] == [lines[nodes[m]] for m in people]


def test_contexts_respect_the_budget_and_only_joined_texts_cover_the_questions():
    facts, _ = collection(71_003, people=20, questions=3)
    lines = {n: wr.person_line(n, p) for n, p in _truth(facts).items()}
    qs = wr.global_questions(facts)
    for budget in (10, 40):
        for name, ctx in wr.world_contexts(facts, lines, qs, budget).items():
            assert all(len(t.split()) <= budget for t in ctx), name
    big = wr.world_contexts(facts, lines, qs, 10_000)
    assert all(wr.coverage(q, t) == 0 for q, t in zip(qs, big["plain, facts"], strict=True))  # no fact joins two
    for name in ("two-hop, facts", "global, blocks", "global, lines", "plain, lines"):
        assert all(wr.coverage(q, t) == 1 for q, t in zip(qs, big[name], strict=True)), name
    with pytest.raises(ValueError, match="budget"):
        wr.world_contexts(facts, lines, qs, 0)


def test_train_summariser_learns_and_leaves_the_assistant_alone():
    examples = wr.summary_examples(40, seed=1)
    model, tok = tiny_assistant_model([p + y for p, y in examples])
    a = Assistant(model.eval(), tok)
    check_trains_a_copy(wr.train_summariser, a, examples, steps=80, B=8, lr=1e-2)
    with pytest.raises(ValueError, match="at least one"):
        wr.train_summariser(a, [], steps=1)


@pytest.mark.skipif(not (_data_dir() / wr.SUMMARISER).is_file(), reason="no committed summariser")
def test_committed_summariser_writes_exact_lines():
    facts = knowledge_base(12, seed=13)
    truth = _truth(facts)
    lines = wr.write_lines(wr.load_summariser(), facts)
    exact = sum(line == wr.person_line(n, truth[n]) for n, line in lines.items())
    assert exact >= 11, lines  # could fail: a summariser that garbles a name or a value
