"""Chapter 42's memory stream (llmbook/agents/memory_stream.py).

Oracles: hand-built memories whose eviction order is known (first-in-first-out under write-time recency,
least-recently-used under refresh-on-read); the retrieval score recomputed in plain Python (min-max of BM25
and of math.exp decay); invariants of the simulated stream (same events under both rules, the capacity
respected, the truth being the last value written for each person).
"""

from __future__ import annotations

import math

import pytest

from llmbook.agents import memory_stream as ms
from llmbook.rag.rag_generation import Fact
from llmbook.rag.sparse import analyze, bm25_scores


def _mem(spec):
    return [ms.Stored(Fact(n, "city", "Tarsk"), tw, tr, 5) for n, tw, tr in spec]


def test_eviction_is_fifo_by_write_and_lru_by_read():
    spec = [("Ab Cd", 0, 9), ("Ef Gh", 1, 2), ("Ij Kl", 2, 8), ("Mn Op", 3, 3)]
    m = _mem(spec)
    assert ms._evict(m, "write", 10) == 2 and [x.fact.name for x in m] == ["Ij Kl", "Mn Op"]
    m = _mem(spec)
    assert ms._evict(m, "read", 10) == 2 and [x.fact.name for x in m] == ["Ab Cd", "Ij Kl"]
    m = _mem(spec)
    assert ms._evict(m, "read", None) == 0 and len(m) == 4


def test_score_against_plain_python():
    st = ms.simulate("read", n_people=8, n_active=3, steps=20, seed=4)
    q, t = st.tasks[0].question, st.t_end
    got = ms._scores(st.memories, q, t, "read", 0.05, 0.25).tolist()
    rel = bm25_scores([analyze(q)], [analyze(m.fact.index_text) for m in st.memories])[0].tolist()
    rec = [math.exp(-0.05 * (t - m.t_read)) for m in st.memories]

    def mm(x):
        lo, hi = min(x), max(x)
        return [0.5 if hi == lo else (v - lo) / (hi - lo) for v in x]

    want = [a + 0.25 * b for a, b in zip(mm(rel), mm(rec), strict=True)]
    assert got == pytest.approx(want, abs=1e-9)


def test_stream_invariants():
    kw = {"n_people": 20, "n_active": 6, "steps": 80, "seed": 3}
    free = ms.simulate("write", **kw)
    assert free.evicted == 0
    for n, task in zip(free.names, free.tasks, strict=True):   # the truth is the last city written for n
        assert [m.fact.value for m in free.memories if m.fact.name == n][-1] == task.answer
    runs = [ms.simulate(r, capacity=120, **kw) for r in ms.RECENCY]
    assert [t.question for t in runs[0].tasks] == [t.question for t in runs[1].tasks] == \
        [t.question for t in free.tasks]                        # the same events: paired comparisons
    assert runs[0].group == runs[1].group == free.group
    for st in runs:
        assert sum(m.tokens for m in st.memories) <= 120 and st.evicted > 0
    assert [g for g in free.group[:6]] == ["active"] * 6 and set(free.group[6:]) <= {"moved", "quiet"}


def test_recall_fits_the_budget_in_score_order():
    st = ms.simulate("read", n_people=10, n_active=4, steps=40, seed=1)
    count = lambda text: len(text.split())  # noqa: E731
    for budget in (1, 12, 30):
        for q, ctx in enumerate(ms.recall(st, "read", budget, count)):
            assert ctx and (len(ctx) == 1 or sum(count(" " + c) for c in ctx) <= budget)
            s = ms._scores(st.memories, st.tasks[q].question, st.t_end, "read", 0.05, 0.25)
            order = [st.memories[j].fact.sentence for j in sorted(range(len(s)), key=lambda j: -float(s[j]))]
            assert ctx == order[:len(ctx)] or sorted(float(x) for x in s)[-1] == sorted(float(x) for x in s)[-2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="recency"):
        ms.simulate("never")
    with pytest.raises(ValueError, match="n_active"):
        ms.simulate("read", n_people=3, n_active=5)
    with pytest.raises(ValueError, match="p_read \\+ p_move"):
        ms.simulate("read", p_read=0.8, p_move=0.5)
