"""Chapter 24, IVF and PQ (ids 24.03, 24.04) against faiss and float64 closed forms (ScaNN: test_scann.py).

Tolerances: PQ codes against faiss (float32) equal wherever the nearest and second-nearest sub-centroid
are apart by more than 1e-4 relative (ties in float32 rounding are the only legal difference; at least
99% of the codes qualify); ADC distances against faiss's ``IndexPQ.search`` and
``compute_distance_tables``: ``rtol = 1e-5`` (float32 sums of 8 terms); against the float64 closed
form ``||y - decode(codes)||^2``: ``rtol = 1e-12``.
"""

import numpy as np
import pytest
import torch

from llmbook.rag import ann


def data(N=2000, D=16, seed=0, clusters=20):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(clusters, D))
    return (centres[rng.integers(0, clusters, N)] + rng.normal(size=(N, D))).astype(np.float32)


def test_exact_search_is_brute_force():
    x, q = data(), data(N=30, seed=1)
    D, I = ann.exact_search(torch.from_numpy(q).double(), torch.from_numpy(x).double(), 10)
    d = ((q[:, None, :].astype(np.float64) - x[None].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_array_equal(I.numpy(), np.argsort(d, axis=1, kind="stable")[:, :10])
    np.testing.assert_allclose(D.numpy(), np.sort(d, axis=1)[:, :10], rtol=1e-12)


def test_ivf_with_all_lists_is_exact_and_matches_faiss():
    import faiss

    x, q = torch.from_numpy(data()), torch.from_numpy(data(N=40, seed=1))
    from llmbook.rag.kmeans import lloyd

    c = lloyd(x, x[:16].clone(), max_iter=10).centroids
    idx = ann.IVFIndex(x, c)
    assert sorted(torch.cat(idx.lists).tolist()) == list(range(len(x)))
    D0, I0 = ann.exact_search(q, x, 10)
    D, I = idx.search(q, 10, nprobe=16)
    assert torch.equal(I, I0) and torch.equal(D, D0)
    # fewer lists: the same candidates as faiss's IndexIVFFlat built on the same centroids
    quantizer = faiss.IndexFlatL2(16)
    quantizer.add(c.numpy())
    fidx = faiss.IndexIVFFlat(quantizer, 16, 16)
    fidx.is_trained = True
    fidx.add(x.numpy())
    recalls = []
    for nprobe in (1, 2, 4, 16):
        fidx.nprobe = nprobe
        Df, If = fidx.search(q.numpy(), 10)
        D, I = idx.search(q, 10, nprobe=nprobe)
        np.testing.assert_allclose(D.numpy(), Df, rtol=1e-4, atol=1e-4)
        assert (I.numpy() == If).mean() > 0.99  # equal up to float32 near-ties in the order
        recalls.append(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(I.tolist(), I0.tolist(), strict=True)]))
    assert recalls == sorted(recalls) and recalls[-1] == 1.0 and recalls[0] < 1.0


def faiss_pq(x, M=4, nbits=8):
    import faiss

    index = faiss.IndexPQ(x.shape[1], M, nbits)
    index.train(x)
    index.add(x)
    ksub, dsub = 1 << nbits, x.shape[1] // M
    C = faiss.vector_to_array(index.pq.centroids).reshape(M, ksub, dsub)
    return index, C


@pytest.mark.equation("24.03", oracle="faiss.ProductQuantizer.compute_codes with faiss-trained codebooks")
def test_pq_codes_match_faiss():
    x = data(N=5000)
    index, C = faiss_pq(x)
    codes = ann.pq_encode(torch.from_numpy(x), torch.from_numpy(C))
    ref = index.pq.compute_codes(x).astype(np.int64)  # nbits = 8: one byte per sub-vector
    sub = torch.from_numpy(x).reshape(len(x), 4, -1)
    d = torch.stack([((sub[:, m, None, :].double() - torch.from_numpy(C[m]).double()) ** 2).sum(-1)
                     for m in range(4)], 1).sort(-1).values
    clear = ((d[..., 1] - d[..., 0]) > 1e-4 * d[..., 1]).numpy()
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(codes.numpy()[clear], ref[clear])
    # and the reconstruction is faiss's decode
    np.testing.assert_allclose(ann.pq_decode(torch.from_numpy(ref), torch.from_numpy(C)).numpy(),
                               index.pq.decode(ref.astype(np.uint8)), rtol=0, atol=0)


@pytest.mark.equation("24.04", oracle="faiss IndexPQ.search distances and ProductQuantizer.compute_distance_tables; "
                                      "float64 ||y - decode(codes)||^2")
def test_adc_matches_faiss():
    x, y = data(N=5000), data(N=20, seed=7)
    index, C = faiss_pq(x)
    codes = torch.from_numpy(index.pq.compute_codes(x).astype(np.int64))
    A = ann.pq_adc(torch.from_numpy(y), codes, torch.from_numpy(C))
    Df, If = index.search(y, 10)
    np.testing.assert_allclose(np.take_along_axis(A.numpy(), If, 1), Df, rtol=1e-5, atol=1e-5)
    import faiss

    tables = np.zeros((20, 4 * 256), dtype=np.float32)
    index.pq.compute_distance_tables(20, faiss.swig_ptr(y), faiss.swig_ptr(tables))
    np.testing.assert_allclose(ann.pq_distance_tables(torch.from_numpy(y), torch.from_numpy(C)).numpy(),
                               tables.reshape(20, 4, 256), rtol=1e-5, atol=1e-5)
    # the asymmetric distance is the exact distance to the reconstruction (float64 closed form)
    y64, C64 = torch.from_numpy(y).double(), torch.from_numpy(C).double()
    rec = ann.pq_decode(codes, C64).numpy()
    ref = ((y64.numpy()[:, None, :] - rec[None]) ** 2).sum(-1)
    np.testing.assert_allclose(ann.pq_adc(y64, codes, C64).numpy(), ref, rtol=1e-12)


def test_pq_train_beats_its_start():
    x = torch.from_numpy(data(N=1500, D=8))
    C = ann.pq_train(x, M=2, K=16, max_iter=15)
    start = x[torch.randperm(1500, generator=torch.Generator().manual_seed(0))[:16]].reshape(16, 2, 4).transpose(0, 1)
    err = lambda C: ((ann.pq_decode(ann.pq_encode(x, C), C) - x) ** 2).sum().item()  # noqa: E731
    assert C.shape == (2, 16, 4) and err(C) < 0.8 * err(start.contiguous())
    with pytest.raises(ValueError, match="divisible"):
        ann.pq_train(x, M=3, K=4)


def test_errors():
    C = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="D = 5"):
        ann.pq_encode(torch.zeros(3, 5), C)
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        ann.pq_adc(torch.zeros(1, 6), torch.tensor([[0, 4]]), C)
    with pytest.raises(TypeError):
        ann.pq_adc(torch.zeros(1, 6), torch.zeros(1, 2), C)
    idx = ann.IVFIndex(torch.zeros(4, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="nprobe"):
        idx.search(torch.zeros(1, 2), 1, nprobe=3)


def test_rerank_exact_equals_faiss_index_refine_flat():
    """Oracle: faiss's IndexRefineFlat over an IndexPQ (PQ picks k_factor * k candidates, exact distances order
    them), on the same codebooks; and a candidate list holding the exact top k gives exact search's answer."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 16, generator=g, dtype=torch.float64)
    q = torch.randn(20, 16, generator=g, dtype=torch.float64)
    codebooks = ann.pq_train(x, M=4, K=16, seed=0)
    codes = ann.pq_encode(x, codebooks)
    k, R = 10, 40
    cand = ann.pq_adc(q, codes, codebooks).argsort(dim=-1, stable=True)[:, :R]
    dist, ids = ann.rerank_exact(q, x, cand, k)
    faiss = pytest.importorskip("faiss")
    base = faiss.IndexPQ(16, 4, 4)
    faiss.copy_array_to_vector(codebooks.float().numpy().ravel(), base.pq.centroids)
    base.is_trained = True
    refine = faiss.IndexRefineFlat(base)
    refine.k_factor = R / k
    refine.add(x.float().numpy())
    D_f, I_f = refine.search(q.float().numpy(), k)
    assert (ids.numpy() == I_f).mean() > 0.99  # float32 ADC may swap a candidate at the R-th place
    torch.testing.assert_close(dist[torch.from_numpy(I_f) == ids], torch.from_numpy(D_f).double()[
        torch.from_numpy(I_f) == ids], rtol=1e-5, atol=1e-5)
    exact_d, exact_i = ann.exact_search(q, x, k)
    full = torch.cat([exact_i, cand], dim=1)  # the true top k among the candidates: exact answer
    assert torch.equal(ann.rerank_exact(q, x, full, k)[1], exact_i)
    padded = torch.full((20, 3), -1)
    padded[:, 0] = 7
    d1, i1 = ann.rerank_exact(q, x, padded, 2)
    assert (i1[:, 0] == 7).all() and (i1[:, 1] == -1).all() and torch.isinf(d1[:, 1]).all()
    with pytest.raises(ValueError, match="candidate ids"):
        ann.rerank_exact(q, x, torch.full((20, 3), 500), 2)
    with pytest.raises(TypeError, match="integer ids"):
        ann.rerank_exact(q, x, torch.zeros(20, 3), 2)
