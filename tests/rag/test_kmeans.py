"""Chapter 24, k-means (ids 24.01-24.02) against scikit-learn and faiss.

Tolerances: float64 data against sklearn in float64: centroids ``atol = 1e-10``, inertia ``rtol = 1e-10``
(sklearn centres the data before iterating, so the last bits may differ), labels equal; the assignment
against faiss's ``IndexFlatL2`` (float32, expansion form) on data whose nearest and second nearest
centroids are well separated: equal labels.
"""

import numpy as np
import pytest
import torch

from llmbook.rag import kmeans


def blobs(N=600, D=8, K=5, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=6.0, size=(K, D))
    x = centres[rng.integers(0, K, N)] + rng.normal(size=(N, D))
    return torch.from_numpy(x)


@pytest.mark.equation("24.01", oracle="sklearn.cluster.KMeans inertia_ and -score(X); float64 numpy loop")
def test_objective_matches_sklearn_inertia():
    from sklearn.cluster import KMeans

    x = blobs()
    km = KMeans(n_clusters=5, n_init=1, random_state=0, algorithm="lloyd").fit(x.numpy())
    J = kmeans.kmeans_objective(x, torch.from_numpy(km.cluster_centers_))
    assert J.item() == pytest.approx(km.inertia_, rel=1e-10)
    assert J.item() == pytest.approx(-km.score(x.numpy()), rel=1e-10)
    # a float64 loop at other centroids (not a local minimum)
    c = x[:7] + 0.3
    loop = sum(min(float(((xi - ck) ** 2).sum()) for ck in c.numpy()) for xi in x.numpy())
    assert kmeans.kmeans_objective(x, c).item() == pytest.approx(loop, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lloyd_matches_sklearn_lloyd(seed):
    from sklearn.cluster import KMeans

    x = blobs(seed=seed)
    g = torch.Generator().manual_seed(seed)
    init = x[torch.randperm(x.shape[0], generator=g)[:6]].clone()
    km = KMeans(n_clusters=6, init=init.numpy(), n_init=1, algorithm="lloyd", tol=0.0, max_iter=300).fit(x.numpy())
    r = kmeans.lloyd(x, init, max_iter=300)
    assert torch.bincount(r.labels, minlength=6).min() > 0  # no empty cluster: the two relocation rules never act
    np.testing.assert_allclose(r.centroids.numpy(), km.cluster_centers_, atol=1e-10)
    np.testing.assert_array_equal(r.labels.numpy(), km.labels_)
    assert r.inertia == pytest.approx(km.inertia_, rel=1e-10)
    # Lloyd never increases the objective
    assert all(b <= a * (1 + 1e-12) for a, b in zip(r.history, r.history[1:], strict=False))
    assert r.inertia <= r.history[0]


@pytest.mark.equation("24.02", oracle="sklearn.metrics.pairwise_distances_argmin (float64) and faiss.IndexFlatL2")
def test_assign_matches_sklearn_and_faiss():
    import faiss
    from sklearn.metrics import pairwise_distances_argmin

    x = blobs(N=400, D=16, K=4, seed=3)
    c = blobs(N=12, D=16, K=4, seed=4)
    a = kmeans.assign(x, c)
    np.testing.assert_array_equal(a.numpy(), pairwise_distances_argmin(x.numpy(), c.numpy()))
    index = faiss.IndexFlatL2(16)
    index.add(c.float().numpy())
    _, I = index.search(x.float().numpy(), 1)
    d = kmeans.squared_distances(x, c).sort(-1).values
    clear = (d[:, 1] - d[:, 0]) > 1e-3 * d[:, 1]  # float32 expansion in faiss cannot flip these
    assert clear.float().mean() > 0.95
    np.testing.assert_array_equal(a.numpy()[clear.numpy()], I[clear.numpy(), 0])
    # ties go to the lowest centroid index
    assert kmeans.assign(torch.tensor([[0.5]]), torch.tensor([[0.0], [1.0]])).item() == 0


def test_near_duplicates_are_exact():
    """The difference form keeps tiny distances that the expansion ||x||^2 + ||c||^2 - 2 x.c loses."""
    c = torch.tensor([[1000.0, 1000.0], [1000.0, 1000.001]], dtype=torch.float32)
    x = torch.tensor([[1000.0, 1000.0007]], dtype=torch.float32)
    assert kmeans.assign(x, c).item() == 1
    ref = ((x.double() - c.double()) ** 2).sum(-1)
    torch.testing.assert_close(kmeans.squared_distances(x, c).double()[0], ref, rtol=1e-3, atol=0)


def test_errors():
    with pytest.raises(ValueError, match="D"):
        kmeans.assign(torch.zeros(3, 2), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="dtype"):
        kmeans.kmeans_objective(torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError):
        kmeans.assign(torch.zeros(3, 2), torch.zeros(0, 2))
    with pytest.raises(ValueError, match="NaN"):
        kmeans.lloyd(torch.tensor([[float("nan")]]), torch.zeros(1, 1))
