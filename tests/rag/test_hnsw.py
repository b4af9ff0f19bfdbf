"""Chapter 24, HNSW (ids 24.05-24.06): the greedy step, the level law, and recall against brute force.

Tolerances: the greedy step is an exact argmin (equal ids); level probabilities against ``math.exp``
``rtol = 1e-15``; the empirical tail frequencies of 200000 drawn levels within 5 binomial standard
errors of the closed form (a false alarm has probability below 1e-6 per level); recall@10 of our HNSW
and of hnswlib 0.8.0 against float64 brute force at least 0.9 at ef = 64 on 1500 clustered vectors
(D = 16), and recall not lower at a larger ef.
"""

import math

import numpy as np
import pytest
import torch

from llmbook.rag import hnsw


def recall(I, I0, k=10):
    pairs = zip(np.asarray(I).tolist(), np.asarray(I0).tolist(), strict=True)
    return float(np.mean([len(set(a[:k]) & set(b[:k])) / k for a, b in pairs]))


def data(N=1500, D=16, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=2.0, size=(30, D))
    return (centres[rng.integers(0, 30, N)] + rng.normal(size=(N, D))).astype(np.float32)


@pytest.mark.equation("24.05", oracle="numpy float64 argmin of the Euclidean distance over the neighbour list")
def test_greedy_step_is_the_nearest_neighbour_of_v():
    rng = np.random.default_rng(0)
    x, q = rng.normal(size=(50, 6)), rng.normal(size=6)
    for _ in range(20):
        nbrs = rng.choice(50, size=7, replace=False)
        ref = nbrs[np.argmin(np.linalg.norm(x[nbrs] - q, axis=1))]
        assert hnsw.greedy_step(torch.from_numpy(q), torch.from_numpy(x), torch.from_numpy(nbrs)).item() == ref
    # ties: the first listed neighbour
    x2 = torch.tensor([[1.0], [-1.0], [3.0]])
    assert hnsw.greedy_step(torch.tensor([0.0]), x2, torch.tensor([1, 0, 2])).item() == 1
    with pytest.raises(ValueError, match="vertex ids"):
        hnsw.greedy_step(torch.tensor([0.0]), x2, torch.tensor([3]))
    with pytest.raises(ValueError):
        hnsw.greedy_step(torch.tensor([0.0]), x2, torch.tensor([], dtype=torch.long))


@pytest.mark.equation("24.06", oracle="math.exp closed form; empirical tail frequencies of HNSW's level draw")
def test_level_law():
    M = 16
    lam = 1 / math.log(M)
    p = hnsw.level_probability(torch.arange(5), lam)
    np.testing.assert_allclose(p.numpy(), [math.exp(-l / lam) for l in range(5)], rtol=1e-15)
    np.testing.assert_allclose(p.numpy(), [M ** -l for l in range(5)], rtol=1e-12)
    N = 200_000
    levels = hnsw.sample_levels(N, lam, generator=torch.Generator().manual_seed(0))
    for l in range(4):
        pl = math.exp(-l / lam)
        freq = (levels >= l).double().mean().item()
        assert abs(freq - pl) <= 5 * math.sqrt(pl * (1 - pl) / N) + 1e-12, (l, freq, pl)
    # the index draws its levels with mL = 1 / ln M: with M = 4 about a quarter of 4000 vectors reach layer 1
    idx_levels = hnsw.HNSW(torch.zeros(4000, 1), M=4, ef_construction=1).levels
    frac = float((idx_levels >= 1).mean())
    assert abs(frac - 0.25) <= 5 * math.sqrt(0.25 * 0.75 / 4000), frac
    assert hnsw.HNSW(torch.zeros(0, 3), M=4).levels.shape == (0,)
    with pytest.raises(ValueError):
        hnsw.level_probability(-1.0, lam)


def test_our_hnsw_recall_against_brute_force():
    x, q = data(), data(N=60, seed=1)
    d = ((q[:, None].astype(np.float64) - x[None]) ** 2).sum(-1)
    I0 = np.argsort(d, axis=1)[:, :10]
    idx = hnsw.HNSW(torch.from_numpy(x), M=8, ef_construction=64)
    r16 = recall(idx.search(torch.from_numpy(q), 10, ef=16)[1], I0)
    r64 = recall(idx.search(torch.from_numpy(q), 10, ef=64)[1], I0)
    assert r64 >= 0.9 and r64 >= r16
    # every layer above 0 holds about a fraction 1/M of the one below, and links are capped
    assert all(len(v) <= 16 for v in idx.links[0].values())
    assert all(len(v) <= 8 for layer in idx.links[1:] for v in layer.values())
    assert 0.06 < len(idx.links[1]) / len(x) < 0.2  # expected 1/8


def test_hnswlib_recall_against_brute_force():
    import hnswlib

    x, q = data(), data(N=60, seed=1)
    d = ((q[:, None].astype(np.float64) - x[None]) ** 2).sum(-1)
    I0 = np.argsort(d, axis=1)[:, :10]
    index = hnswlib.Index(space="l2", dim=16)
    index.init_index(max_elements=len(x), M=8, ef_construction=64, random_seed=0)
    index.set_num_threads(1)
    index.add_items(x, np.arange(len(x)))
    index.set_ef(64)
    I, _ = index.knn_query(q, k=10)
    assert recall(I, I0) >= 0.9


def test_try_it_numbers():
    """Every number the chapter's Try-it solutions state, computed."""
    from tests.try_it import assert_states

    flat_gb, pq_gb = 1e8 * 384 * 4 / 1e9, 1e8 * 48 / 1e9
    p2, p5 = hnsw.level_probability(torch.tensor([2, 5]), 1 / math.log(32)).tolist()
    table, lookups = 16 * 256, 16 * 10**6
    stated = [f"{flat_gb:.1f} GB", f"{pq_gb:.1f} GB", f"{flat_gb / pq_gb:.0f} times smaller", f"1/{32 ** 2}",
              f"{p2:.6f}", f"about {1e9 * p5:.1f} of", f"{table}", "16 \\times 10^6"]
    assert stated == ["153.6 GB", "4.8 GB", "32 times smaller", "1/1024", "0.000977", "about 29.8 of", "4096",
                      "16 \\times 10^6"]
    assert lookups == 16 * 1_000_000
    assert_states("24-ann.ipynb", stated)
