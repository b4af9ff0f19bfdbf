"""The test collection (llmbook.rag.collection): judged@k against a plain loop, the split, the pool's coverage,
and ask's default as the dev winner."""

from collections import Counter

import pytest
import torch

from llmbook.rag import collection as col
from llmbook.rag import pipeline as pl


def _judged_at_k_loop(scores, judged, k):
    """The definition, one query at a time in Python: rank by score (ties in column order), skip -inf."""
    out = []
    for s, j in zip(scores.tolist(), judged.tolist(), strict=True):
        ranked = sorted((i for i in range(len(s)) if s[i] != float("-inf")), key=lambda i: (-s[i], i))[:k]
        out.append(sum(j[i] for i in ranked) / len(ranked) if ranked else 0.0)
    return out


def test_judged_at_k_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (40, 25), generator=g).double()  # many ties
    scores[torch.rand(40, 25, generator=g) < 0.3] = float("-inf")
    scores[0] = float("-inf")  # a query that retrieved nothing
    judged = torch.rand(40, 25, generator=g) < 0.5
    for k in (1, 5, 10, 30):
        assert col.judged_at_k(scores, judged, k).tolist() == pytest.approx(_judged_at_k_loop(scores, judged, k),
                                                                           abs=1e-15)
    with pytest.raises(TypeError, match="judged must be a bool tensor"):
        col.judged_at_k(scores, judged.double())


def test_split_halves_each_kind_and_part():
    qs = pl.book_data().queries
    dev, test = pl.split_rows("dev"), pl.split_rows("test")
    assert set(dev.tolist()).isdisjoint(test.tolist()) and len(dev) + len(test) == len(qs)
    strata = Counter((q.kind, int(q.id[1:]) <= 56, q.split) for q in qs)
    for kind in ("plain", "paraphrase", "exact"):
        for part in (True, False):
            assert abs(strata[(kind, part, "dev")] - strata[(kind, part, "test")]) <= 1, strata
    with pytest.raises(ValueError, match="split must be 'dev' or 'test'"):
        pl.split_rows("train")


def test_the_pool_was_judged():
    """Every query's top 20 under each pooled run lies in judged sections (prose edits that bring a new section
    into a pool make this fail until it is judged), and every query has a section that answers it."""
    data = pl.book_data()
    J = col.judged_matrix(list(data.queries), list(data.passages))
    for name, s in col.pooled_runs(data).items():
        share = col.judged_at_k(s, J, 20)
        assert share.min() >= 0.95 and share.mean() >= 0.99, (name, share.min().item(), share.mean().item())
    assert all(2 in q.relevance.values() for q in data.queries)


def test_ask_uses_the_dev_winner():
    winner, values = col.dev_winner()
    print("dev NDCG@10:", {m: round(v, 3) for m, v in values.items()})
    assert pl.DEFAULT_METHOD == winner
    # the split matters: the dev values are computed on dev rows only
    full = {m: pl.evaluate_scores(pl.method_scores(m))["ndcg@10"] for m in pl.METHODS}
    assert any(abs(full[m] - values[m]) > 1e-9 for m in pl.METHODS)
