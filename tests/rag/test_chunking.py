"""Tests of llmbook.rag.chunking: fixed-size windows, coverage, semantic cuts, the book's chunks.

Oracles: ``torch.Tensor.unfold`` and ``numpy.lib.stride_tricks.sliding_window_view`` for the windows; a
brute-force count over the materialised windows for the coverage; ``sklearn.metrics.pairwise.cosine_distances``
and ``scipy.spatial.distance.cosine`` for the semantic distances; a per-chunk numpy maximum for the map back
to passages. The packing functions of chapter 27 are tested in tests/rag/test_packing.py.
"""

import math

import numpy as np
import pytest
import torch

from llmbook.rag import chunking as ck
from tests.try_it import assert_states

NB = "27-chunking.ipynb"


# ----------------------------------------------------------------------------------------------- 27.01


@pytest.mark.equation("27.01", oracle="torch.Tensor.unfold and numpy sliding_window_view[::S] on the padded sequence")
@pytest.mark.parametrize("T", [0, 1, 5, 16, 17, 37])
@pytest.mark.parametrize("L,S", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (8, 5), (10, 10)])
def test_fixed_size_chunks_match_unfold(T, L, S):
    x = torch.arange(100, 100 + T)
    got = ck.fixed_size_chunks(x, L, S, pad_value=-1)
    if T == 0:
        assert got.chunks.shape == (0, L)
        return
    n = 1 + math.ceil(max(T - L, 0) / S)
    assert got.chunks.shape == (n, L)
    # the last window must reach the end, the one before must not
    assert (n - 1) * S + L >= T and ((n - 2) * S + L < T if n > 1 else True)
    padded = torch.cat([x, torch.full(((n - 1) * S + L - T,), -1)])
    assert torch.equal(got.chunks, padded.unfold(0, L, S))
    np.testing.assert_array_equal(got.chunks.numpy(), np.lib.stride_tricks.sliding_window_view(padded.numpy(), L)[::S])
    for c, length, start in zip(got.chunks, got.lengths, got.starts, strict=True):
        assert torch.equal(c[:length], x[start:start + length])
        assert (c[length:] == -1).all()


def test_fixed_size_chunks_float_and_errors():
    x = torch.randn(9, dtype=torch.float64)
    out = ck.fixed_size_chunks(x, 4, 4)
    assert out.chunks.dtype == torch.float64 and out.lengths.tolist() == [4, 4, 1]
    with pytest.raises(ValueError, match="S <= L"):
        ck.fixed_size_chunks(x, 3, 4)
    with pytest.raises(ValueError, match="shape"):
        ck.fixed_size_chunks(torch.zeros(2, 3), 2, 1)
    with pytest.raises(TypeError):
        ck.fixed_size_chunks(x, 2.0, 1)


# ----------------------------------------------------------------------------------------------- 27.02


@pytest.mark.equation("27.02", oracle="brute-force count of the windows of chunk_spans holding each token")
@pytest.mark.parametrize("T", [0, 1, 3, 20, 41])
@pytest.mark.parametrize("L,S", [(1, 1), (5, 1), (5, 2), (6, 3), (7, 7), (10, 4)])
def test_window_coverage_counts(T, L, S):
    cov = ck.window_coverage(T, L, S)
    assert cov.overlap == L - S
    brute = np.zeros(T, dtype=int)
    for a, b in ck.chunk_spans(T, L, S).tolist():
        brute[a:b] += 1
    np.testing.assert_array_equal(cov.counts.numpy(), brute)
    assert cov.counts.sum().item() == ck.fixed_size_chunks(torch.arange(T), L, S).lengths.sum().item()
    # the identity: tokens away from both ends are covered floor(L/S) or ceil(L/S) times
    interior = brute[max(L - S, 0): (cov.n - 1) * S] if cov.n > 1 else brute[:0]
    assert set(interior.tolist()) <= {L // S, -(-L // S)}
    if L % S == 0:
        assert (interior == L // S).all()


def test_window_coverage_average_is_L_over_S():
    cov = ck.window_coverage(200, 10, 3)
    mid = cov.counts[9:9 + 3 * 50].double()  # 50 full periods of S tokens in the interior
    assert mid.mean().item() == pytest.approx(10 / 3, abs=1e-12)


# ----------------------------------------------------------------------------------------------- 27.03


@pytest.mark.equation("27.03", oracle="sklearn.metrics.pairwise.cosine_distances and scipy.spatial.distance.cosine")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_semantic_boundaries_match_sklearn(seed, dtype):
    from scipy.spatial.distance import cosine
    from sklearn.metrics.pairwise import cosine_distances

    rng = np.random.default_rng(seed)
    E = rng.normal(size=(15, 8)) * rng.uniform(0.1, 10, size=(15, 1))
    out = ck.semantic_boundaries(torch.tensor(E, dtype=dtype), 0.8)
    ref = np.diag(cosine_distances(E[:-1], E[1:]))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(out.distance.numpy(), ref, rtol=0, atol=tol)
    np.testing.assert_allclose(out.distance.numpy(), [cosine(E[i], E[i + 1]) for i in range(14)], rtol=0, atol=tol)
    if dtype == torch.float64:
        np.testing.assert_array_equal(out.boundary.numpy(), ref > 0.8)


def test_semantic_boundaries_edges_and_segments():
    assert ck.semantic_boundaries(torch.ones(1, 3), 0.5).distance.shape == (0,)
    e = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1e30, 1e29]])
    out = ck.semantic_boundaries(e, 0.5)
    assert out.distance[:2].tolist() == [1.0, 1.0]  # a zero vector has cosine 0 with anything
    assert out.distance[2].item() == pytest.approx(1 - 10 / math.sqrt(101), abs=1e-6)
    assert ck.segments(out.boundary) == [(0, 1), (1, 2), (2, 4)]
    assert ck.segments(torch.zeros(0, dtype=torch.bool)) == [(0, 1)]
    with pytest.raises(TypeError):
        ck.segments(torch.tensor([1, 0]))


# ----------------------------------------------------------------------------------------------- the book's corpus


def test_chunk_passages_and_map_back():
    from llmbook.rag.corpus import load_corpus
    from llmbook.rag.encoder import passage_text

    P = load_corpus()[:30]
    texts, owners = ck.chunk_passages(P, 40, 30)
    # every word of every passage is in some chunk of that passage, in order
    for j, p in enumerate(P):
        own = [t for t, o in zip(texts, owners, strict=True) if o == [j]]
        words = passage_text(p).split()
        assert own[0].split()[:5] == words[:5] and own[-1].split()[-3:] == words[-3:]
    texts_s, owners_s = ck.chunk_passages(P, 40, 30, by="section")
    assert any(len(o) > 1 for o in owners_s)
    scores = torch.tensor(np.random.default_rng(0).normal(size=(3, len(texts_s))))
    got = ck.chunk_scores_to_passages(scores, owners_s, len(P))
    brute = np.full((3, len(P)), -np.inf)
    for m, o in enumerate(owners_s):
        for j in o:
            brute[:, j] = np.maximum(brute[:, j], scores[:, m].numpy())
    np.testing.assert_array_equal(got.numpy(), brute)


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the first Try-it solution of book/27-chunking.ipynb states (the others: test_packing.py)."""
    # 1. a 1000-token document, windows of 256 with 20% overlap (S = 205)
    cov = ck.window_coverage(1000, 256, 205)
    assert_states(NB, [f"n = {cov.n}", f"{int(cov.counts.sum())} tokens", f"{cov.counts.max().item()} windows"])
