"""Tests of llmbook.rag.fusion: convex, normalised and reciprocal-rank fusion (learned fusion: test_learned_fusion).

Oracles: sklearn's ``MinMaxScaler`` and ``StandardScaler`` and ``scipy.stats.zscore`` applied per query to the
retrieved documents only, with misses filled and runs summed in a plain Python loop; RRF as an independent
pure-Python loop over rank lists (documents sorted by score, ties by column order or by counting greater
scores), with documents missing from a run and ties; ``scipy.stats.rankdata`` for tied ranks.
Tolerances: 1e-12 absolute for the closed forms in float64, 1e-15 for RRF.
"""

import math

import numpy as np
import pytest
import torch
from scipy.stats import zscore
from sklearn.preprocessing import MinMaxScaler, StandardScaler

from llmbook.rag import fusion

NEG = -math.inf


def random_run(B, N, seed, p_missing=0.3, ties=False, scale=1.0):
    """A (B, N) float64 run with some -inf (not retrieved) entries; ties from rounding when asked."""
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(B, N)) * scale
    if ties:
        s = np.round(s * 2) / 2
    s[rng.random((B, N)) < p_missing] = NEG
    return s


def oracle_normalise(row, norm):
    """One query's run normalised by scipy/sklearn over its retrieved entries; misses filled with the row min."""
    row = np.asarray(row, dtype=float)
    ok = np.isfinite(row)
    out = np.full(row.shape, NEG)
    if ok.sum() == 0:
        return out, 0.0
    x = row[ok].reshape(-1, 1)
    if norm == "minmax":
        z = MinMaxScaler().fit_transform(x)[:, 0]
    elif norm == "zscore":
        z = StandardScaler().fit_transform(x)[:, 0]
        if np.ptp(x) > 0:
            np.testing.assert_allclose(z, zscore(x[:, 0]), atol=1e-12)  # the two oracles agree
    else:
        z = x[:, 0]
    out[ok] = z
    return out, float(z.min())


def oracle_fusion(runs, weights, norm):
    M, B, N = len(runs), runs[0].shape[0], runs[0].shape[1]
    out = np.full((B, N), NEG)
    for b in range(B):
        normed = [oracle_normalise(runs[m][b], norm) for m in range(M)]
        for n in range(N):
            if not any(weights[m] > 0 and math.isfinite(runs[m][b][n]) for m in range(M)):
                continue
            total = 0.0
            for m in range(M):
                if weights[m] == 0:
                    continue
                z, floor = normed[m]
                total += weights[m] * (z[n] if math.isfinite(z[n]) else floor)
            out[b, n] = total
    return out


def assert_same(ours, ref, atol=1e-12):
    ours = ours.numpy()
    assert ours.dtype == np.float64
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------------- 23.01


@pytest.mark.equation("23.01", oracle="sklearn MinMaxScaler per query over retrieved docs, Python-loop convex sum")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lam", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("norm", ["minmax", "zscore", "none"])
def test_convex_fusion_matches_scaler_oracle(seed, lam, norm):
    s_dense = random_run(3, 9, seed)
    s_sparse = random_run(3, 9, seed + 100, scale=8.0)
    ours = fusion.convex_fusion(torch.tensor(s_dense), torch.tensor(s_sparse), lam=lam, norm=norm)
    assert_same(ours, oracle_fusion([s_dense, s_sparse], [lam, 1 - lam], norm))


def test_convex_endpoints_are_the_single_runs_and_raw_sum_is_dominated_by_bm25():
    rng = np.random.default_rng(0)
    s_dense, s_sparse = torch.tensor(rng.uniform(-1, 1, (4, 20))), torch.tensor(rng.gamma(2.0, 5.0, (4, 20)))
    for lam, run in ((1.0, s_dense), (0.0, s_sparse)):
        fused = fusion.convex_fusion(s_dense, s_sparse, lam=lam)
        assert torch.equal(fused.argsort(dim=1, stable=True), run.argsort(dim=1, stable=True))
    raw = fusion.convex_fusion(s_dense, s_sparse, lam=0.5, norm="none")
    for b in range(4):  # the wide run decides: the raw sum is all but a copy of BM25's ranking
        assert np.corrcoef(raw[b].numpy(), s_sparse[b].numpy())[0, 1] > 0.99
        assert abs(np.corrcoef(raw[b].numpy(), s_dense[b].numpy())[0, 1]) < 0.5


# ----------------------------------------------------------------------------------------------- 23.02


@pytest.mark.equation("23.02", oracle="scipy.stats.zscore and sklearn StandardScaler per query, Python-loop sum")
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("norm", ["zscore", "minmax"])
def test_normalized_fusion_matches_scaler_oracle(seed, norm):
    runs = [random_run(4, 11, seed + 10 * m, scale=10.0 ** m) for m in range(3)]
    weights = [0.5, 0.0, 2.0] if seed % 2 else [1.0, 1.0, 1.0]
    ours = fusion.normalized_fusion(torch.tensor(np.stack(runs)), weights=weights, norm=norm)
    assert_same(ours, oracle_fusion(runs, weights, norm))
    ours_list = fusion.normalized_fusion([torch.tensor(r) for r in runs], weights=weights, norm=norm)
    assert torch.equal(ours.isinf(), ours_list.isinf())


def test_normalize_scores_edge_rows():
    s = torch.tensor([[2.0, 2.0, NEG], [NEG, NEG, NEG], [1e300, -1e300, 0.0], [5.0, NEG, NEG]], dtype=torch.float64)
    for norm in ("zscore", "minmax"):
        out = fusion.normalize_scores(s, norm)
        assert not out.isnan().any()
        assert out[0, :2].tolist() == [0.0, 0.0] and out[1].isinf().all() and out[3, 0] == 0.0
    np.testing.assert_allclose(fusion.normalize_scores(s, "zscore")[2].numpy(), zscore([1.0, -1.0, 0.0]), atol=1e-12)
    # a doc missing from both runs stays unretrieved; missing from one gets that run's floor
    fused = fusion.normalized_fusion([torch.tensor([[3.0, 1.0, NEG, NEG]]), torch.tensor([[0.1, NEG, 0.9, NEG]])],
                                     norm="minmax")
    assert fused.tolist() == [[1.0, 0.0, 1.0, NEG]]


@pytest.mark.parametrize("bad, err", [
    (dict(runs=[torch.zeros(2, 3), torch.zeros(2, 4)]), ValueError),
    (dict(runs=[]), ValueError),
    (dict(runs=[torch.zeros(2, 3)], weights=[-1.0]), ValueError),
    (dict(runs=[torch.zeros(2, 3)], weights=[1.0, 1.0]), ValueError),
    (dict(runs=[torch.tensor([[math.nan]])]), ValueError),
    (dict(runs=[torch.tensor([[math.inf]])]), ValueError),
    (dict(runs=[torch.zeros(2, 3)], norm="l2"), ValueError),
    (dict(runs="abc"), TypeError),
])
def test_normalized_fusion_rejects_bad_input(bad, err):
    with pytest.raises(err):
        fusion.normalized_fusion(**bad)


# ----------------------------------------------------------------------------------------------- 23.03


def python_ranks(row, ties):
    """Ranks of one run's retrieved documents by a plain loop (None where not retrieved)."""
    ids = [n for n in range(len(row)) if math.isfinite(row[n])]
    ranks = {}
    if ties == "ordinal":
        ordered = sorted(ids, key=lambda n: (-row[n], n))
        for pos, n in enumerate(ordered, start=1):
            ranks[n] = pos
    else:
        for n in ids:
            above = sum(1 for j in ids if row[j] > row[n])
            same = sum(1 for j in ids if row[j] == row[n])
            ranks[n] = above + 1 + ((same - 1) / 2 if ties == "average" else 0)
    return ranks


def python_rrf(runs, k, weights, depth, ties):
    B, N = runs[0].shape
    out = np.full((B, N), NEG)
    for b in range(B):
        fused = {}
        for m, run in enumerate(runs):
            for n, r in python_ranks(list(run[b]), ties).items():
                if weights[m] > 0 and (depth is None or r <= depth):
                    fused[n] = fused.get(n, 0.0) + weights[m] / (k + r)
        for n, v in fused.items():
            out[b, n] = v
    return out


@pytest.mark.equation("23.03", oracle="independent pure-Python loop over rank lists, with ties and missing documents")
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ties", ["ordinal", "min", "average"])
@pytest.mark.parametrize("k, depth", [(60.0, None), (0.0, None), (10.0, 4)])
def test_rrf_matches_python_loop(seed, ties, k, depth):
    runs = [random_run(3, 12, seed + 7 * m, p_missing=0.35, ties=True) for m in range(3)]
    weights = [1.0, 1.0, 1.0] if seed % 2 else [1.0, 0.0, 0.5]
    ours = fusion.reciprocal_rank_fusion([torch.tensor(r) for r in runs], k=k, weights=weights, depth=depth, ties=ties)
    assert_same(ours, python_rrf(runs, k, weights, depth, ties), atol=1e-15)


def test_rrf_is_scale_free_and_uses_k_60_by_default():
    rng = np.random.default_rng(3)
    a, b = torch.tensor(rng.normal(size=(2, 30))), torch.tensor(rng.normal(size=(2, 30)))
    base = fusion.reciprocal_rank_fusion([a, b])
    assert torch.equal(base, fusion.reciprocal_rank_fusion([1000 * a + 7, torch.exp(b)]))  # monotone maps
    assert torch.allclose(base, torch.tensor(python_rrf([a.numpy(), b.numpy()], 60.0, [1, 1], None, "ordinal")))
    assert torch.equal(fusion.hybrid_scores(a, b), base)


def test_rank_matrix_min_ties_match_scipy_rankdata():
    from scipy.stats import rankdata

    s = torch.tensor(random_run(4, 15, 5, p_missing=0.0, ties=True))
    for ties, method in (("min", "min"), ("average", "average")):
        ref = np.stack([rankdata(-row, method=method) for row in s.numpy()])
        np.testing.assert_array_equal(fusion.rank_matrix(s, ties).numpy(), ref)


# ----------------------------------------------------------------------------------------------- Try it


def test_try_it_numbers():
    """The numbers the Try-it solutions of book/23-fusion.ipynb state."""
    from tests.try_it import assert_states

    f = lambda xs: [round(x, 3) for x in xs]  # noqa: E731
    # 1: RRF and min-max convex with a miss in each run
    sp, de = torch.tensor([[9.0, 5.0, 1.0, NEG]]), torch.tensor([[0.8, NEG, 0.9, 0.3]])
    rrf = (fusion.reciprocal_rank_fusion([sp, de]) * 1000)[0].tolist()
    cvx = fusion.convex_fusion(de, sp, lam=0.5)[0].tolist()
    assert np.argsort(rrf)[::-1].tolist() == np.argsort(cvx)[::-1].tolist() == [0, 2, 1, 3]
    dmm = fusion.normalize_scores(de, "minmax")[0]
    # 2: an outlier BM25 score
    sp2, de2 = torch.tensor([[20.0, 4, 3, 2, 1]]), torch.tensor([[0.50, 0.72, 0.70, 0.40, 0.30]])
    c2 = fusion.convex_fusion(de2, sp2, lam=0.5)[0]
    z2 = fusion.normalized_fusion([sp2, de2])[0]
    r2 = fusion.reciprocal_rank_fusion([sp2, de2])[0]
    assert c2.argmax() == 0 and z2.argmax() == 0 and r2.argmax() == 1
    squeezed = fusion.normalize_scores(sp2, "minmax")[0, 1].item()
    # 3: ties, before and after swapping the tied columns
    sp3, de3 = torch.tensor([[2.0, 2.0, 1.0]]), torch.tensor([[0.1, 0.9, 0.5]])
    swap = [1, 0, 2]
    o = (fusion.reciprocal_rank_fusion([sp3, de3], ties="ordinal") * 1000)[0].tolist()
    o_sw = (fusion.reciprocal_rank_fusion([sp3[:, swap], de3[:, swap]], ties="ordinal") * 1000)[0].tolist()
    m = (fusion.reciprocal_rank_fusion([sp3, de3], ties="min") * 1000)[0].tolist()
    m_sw = (fusion.reciprocal_rank_fusion([sp3[:, swap], de3[:, swap]], ties="min") * 1000)[0].tolist()
    assert m_sw == [m[1], m[0], m[2]] and o_sw != [o[1], o[0], o[2]]
    assert_states("23-fusion.ipynb", [
        "RRF (×1000): " + ", ".join(f"{x:.3f}" for x in f(rrf)),
        f"dense {dmm[0].item():.4f}, 0 (missed), 1, 0",
        "the convex scores\n   are " + ", ".join(f"{x:.4g}" for x in cvx),
        f"Min-max convex: {c2[0]:.4f} for the first passage against {c2[1]:.4f}",
        f"({z2[0]:.4f} against {z2[1]:.4f})", f"into $[0, {squeezed:.2f}]$",
        "Ordinal: " + ", ".join(f"{x:.3f}" for x in o),
        f"{o_sw[0]:.3f} for passage 2 and {o_sw[1]:.3f} for passage 1",
        f"passage 1 has {m[0]:.3f} and passage 2 has {m[1]:.3f}",
    ])
