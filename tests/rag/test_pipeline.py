"""The pipeline's book data: labels agree with the passage-level qrels, scores evaluate like chapter 26 says."""

import pytest
import torch

from llmbook.rag import pipeline
from llmbook.rag.corpus import load_corpus, load_queries, qrels


def test_labels_matrix_holds_every_judgement_once():
    d = pipeline.book_data()
    judged = qrels(list(d.queries), list(d.passages))
    assert int((d.labels > 0).sum()) == sum(len(v) for v in judged.values())
    assert float(d.labels.sum()) == sum(sum(v.values()) for v in judged.values())
    q = d.queries[0]
    ids = {d.passages[j].id for j in torch.nonzero(d.labels[0]).flatten().tolist()}
    assert ids == set(judged[q.id])


def test_a_perfect_run_scores_one_and_a_reversed_run_less():
    d = pipeline.book_data()
    perfect = pipeline.evaluate_scores(d.labels.clone())
    assert perfect["ndcg@10"] == pytest.approx(1.0) and perfect["mrr"] == pytest.approx(1.0)
    worst = pipeline.evaluate_scores(-d.labels)
    assert worst["ndcg@10"] < 0.05


def test_dense_scores_are_cosines_of_the_cached_embeddings():
    d = pipeline.book_data()
    s = pipeline.dense_scores(d)
    torch.testing.assert_close(s[2, 5], torch.nn.functional.cosine_similarity(
        d.query_emb[2:3].double(), d.doc_emb[5:6].double())[0], rtol=0, atol=1e-6)
    assert s.shape == (len(load_queries()), len(load_corpus()))


def test_evaluate_scores_checks_the_shape():
    with pytest.raises(ValueError, match="same"):
        pipeline.evaluate_scores(torch.zeros(2, 3))
