"""Chapter 20 (ids 20.01-20.09) against scikit-learn's pairwise metrics and scipy.spatial.distance.

Tolerances, stated once:

* float64 inputs against sklearn / scipy in float64: ``atol = 1e-12`` (distances of order 1-10;
  the expansion form of the Euclidean and Mahalanobis distances: ``atol = 1e-10``, since sklearn and
  ours both lose about sqrt(eps) relative precision only for near-duplicate points, absent here);
* float32 inputs against the float64 references: ``rtol = 1e-5`` (a few float32 ulps over D = 16);
* the two Euclidean methods on the same float32 input: ``atol = 4 * sqrt(eps32) * max norm`` for the
  expansion's cancellation, and the difference form within ``1e-6`` relative of the float64 truth;
* the stable angular distance at angles 1e-3 .. 1e-7 rad in float32: relative error < 1e-5 against
  the float64 closed form; the clamped arccos is shown to fail there (it must, or the test is void).
"""

import math

import numpy as np
import pytest
import scipy.spatial.distance as ssd
import sklearn.metrics.pairwise as skp
import torch

from llmbook.rag import similarity as sim
from tests.try_it import assert_states

NOTEBOOK = "20-similarity.ipynb"


def pair(N=7, M=5, D=16, B=None, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.randn(*lead, N, D, generator=g, dtype=torch.float64) * 2
    y = torch.randn(*lead, M, D, generator=g, dtype=torch.float64) * 2
    return x.to(dtype), y.to(dtype)


def per_batch(f, x, y):
    """Apply a 2-D numpy reference to each batch element."""
    if x.ndim == 2:
        return f(x.double().numpy(), y.double().numpy())
    return np.stack([f(a.double().numpy(), b.double().numpy()) for a, b in zip(x, y, strict=True)])


def close(ours, ref, atol=1e-12, rtol=0.0):
    np.testing.assert_allclose(ours.double().numpy(), ref, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- 20.01 cosine, 20.02 dot


@pytest.mark.equation("20.01", oracle="sklearn.metrics.pairwise.cosine_similarity; scipy cdist 'cosine' (1 - cos)")
@pytest.mark.parametrize("B", [None, 3])
def test_cosine_matches_sklearn_and_scipy(B):
    x, y = pair(B=B)
    cos = sim.cosine_similarity(x, y)
    close(cos, per_batch(skp.cosine_similarity, x, y))
    close(cos, 1 - per_batch(lambda a, b: ssd.cdist(a, b, "cosine"), x, y))
    x32, y32 = x.float(), y.float()
    close(sim.cosine_similarity(x32, y32), per_batch(skp.cosine_similarity, x32, y32), atol=1e-6)


@pytest.mark.equation("20.01", oracle="sklearn.metrics.pairwise.cosine_similarity (zero rows give 0)")
def test_cosine_zero_vector_and_extreme_scales():
    x, y = pair(N=4, M=3, D=5)
    x[1] = 0.0
    close(sim.cosine_similarity(x, y), skp.cosine_similarity(x.numpy(), y.numpy()))
    assert (sim.cosine_similarity(x, y)[1] == 0).all()
    # 1e30 and 1e-30 in float32: the squared norms would overflow / underflow; the cosine does not change
    x32, y32 = x.float(), y.float()
    ref = skp.cosine_similarity(x.numpy(), y.numpy())
    for scale in (1e30, 1e-30, 1e-42):
        close(sim.cosine_similarity(x32 * scale, y32), ref, atol=1e-3 if scale == 1e-42 else 1e-6)
    out = sim.cosine_similarity(x32, x32)
    assert out.abs().max() <= 1.0


@pytest.mark.equation("20.02", oracle="sklearn.metrics.pairwise.linear_kernel")
@pytest.mark.parametrize("B", [None, 2])
def test_dot_product_matches_linear_kernel(B):
    x, y = pair(B=B)
    close(sim.dot_product(x, y), per_batch(skp.linear_kernel, x, y))
    h = sim.dot_product(x.half(), y.half())  # fp16 in, accumulated in float32, one rounding at the end
    assert h.dtype == torch.float16
    ref = per_batch(skp.linear_kernel, x.half(), y.half())
    close(h, ref, atol=0, rtol=2**-10)


def test_dot_equals_cosine_on_unit_vectors_and_ranks_like_euclidean():
    x, y = pair(N=3, M=50, D=8)
    xn, yn = x / x.norm(dim=-1, keepdim=True), y / y.norm(dim=-1, keepdim=True)
    close(sim.dot_product(xn, yn), sim.cosine_similarity(x, y).numpy(), atol=1e-14)
    # ||x - y||^2 = 2 - 2 cos for unit vectors: the same nearest neighbours
    close(sim.euclidean_distance(xn, yn) ** 2, (2 - 2 * sim.cosine_similarity(x, y)).numpy(), atol=1e-12)


# ----------------------------------------------------------------------------- 20.03 Euclidean


@pytest.mark.equation("20.03", oracle="sklearn.metrics.pairwise.euclidean_distances; scipy cdist 'euclidean'")
@pytest.mark.parametrize("method", ["expansion", "difference"])
@pytest.mark.parametrize("B", [None, 2])
def test_euclidean_matches_sklearn_and_scipy(method, B):
    x, y = pair(B=B)
    d = sim.euclidean_distance(x, y, method=method)
    close(d, per_batch(skp.euclidean_distances, x, y), atol=1e-10)
    close(d, per_batch(lambda a, b: ssd.cdist(a, b, "euclidean"), x, y), atol=1e-10)
    close(sim.euclidean_distance(x.float(), y.float(), method=method), per_batch(lambda a, b: ssd.cdist(a, b), x, y),
          rtol=1e-5)


@pytest.mark.equation("20.03", oracle="float64 scipy cdist 'euclidean' (the two float32 methods agree)")
def test_expansion_and_difference_agree_and_the_expansion_cancels():
    x, y = pair(N=20, M=20, D=16, seed=3)
    x32, y32 = x.float(), y.float()
    d_exp = sim.euclidean_distance(x32, y32)
    d_dif = sim.euclidean_distance(x32, y32, method="difference")
    norm = max(x32.norm(dim=-1).max().item(), y32.norm(dim=-1).max().item())
    assert (d_exp - d_dif).abs().max().item() <= 4 * math.sqrt(2**-23) * norm
    # near-duplicates: y = x + delta. The difference form keeps its relative accuracy, the expansion does not
    delta = 1e-5 * torch.randn(20, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    z32 = (x + delta).float()
    truth = np.diag(ssd.cdist(x32.double().numpy(), z32.double().numpy()))
    rel_dif = np.abs(np.diag(sim.euclidean_distance(x32, z32, method="difference").double().numpy()) - truth) / truth
    rel_exp = np.abs(np.diag(sim.euclidean_distance(x32, z32).double().numpy()) - truth) / truth
    assert rel_dif.max() < 1e-6
    assert rel_exp.max() > 1e-2  # the cancellation the docstring warns about is real
    assert (sim.euclidean_distance(x32, x32) >= 0).all()  # clamped: no NaN from a negative rounding


def test_distances_survive_extreme_magnitudes():
    x, y = pair(N=3, M=4, D=6)
    ref = ssd.cdist(x.numpy(), y.numpy())
    for scale in (1e30, 1e-35):
        for method in ("expansion", "difference"):
            close(sim.euclidean_distance((x * scale).float(), (y * scale).float(), method=method) / scale, ref,
                  rtol=1e-5)
    big = sim.euclidean_distance(torch.full((1, 4), 3e38), torch.full((1, 4), -3e38))
    assert torch.isinf(big).all()  # too large for float32: inf, not NaN


# ----------------------------------------------------------------------------- 20.04 Manhattan, 20.05 Minkowski


@pytest.mark.equation("20.04", oracle="sklearn.metrics.pairwise.manhattan_distances; scipy cdist 'cityblock'")
@pytest.mark.parametrize("B", [None, 2])
def test_manhattan_matches_sklearn_and_scipy(B):
    x, y = pair(B=B)
    d = sim.manhattan_distance(x, y)
    close(d, per_batch(skp.manhattan_distances, x, y))
    close(d, per_batch(lambda a, b: ssd.cdist(a, b, "cityblock"), x, y))


@pytest.mark.equation("20.05", oracle="sklearn pairwise_distances(metric='minkowski', p); scipy cdist 'minkowski' "
                                      "and 'chebyshev'")
@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, 3.0, 7.5, 100.0, math.inf])
def test_minkowski_matches_sklearn_and_scipy(p):
    x, y = pair()
    d = sim.minkowski_distance(x, y, p=p)
    if p == math.inf:
        close(d, ssd.cdist(x.numpy(), y.numpy(), "chebyshev"))
    else:
        close(d, skp.pairwise_distances(x.numpy(), y.numpy(), metric="minkowski", p=p), atol=1e-11)
        close(d, ssd.cdist(x.numpy(), y.numpy(), "minkowski", p=p), atol=1e-11)
    # large p in float32: (|d|/max)^p never overflows; the naive sum of |d|^100 would be inf
    close(sim.minkowski_distance(x.float(), y.float(), p=p), d.numpy(), rtol=1e-5)
    xb, yb = pair(B=2)
    close(sim.minkowski_distance(xb, yb, p=p), per_batch(lambda a, b: ssd.cdist(
        a, b, "chebyshev") if p == math.inf else ssd.cdist(a, b, "minkowski", p=p), xb, yb), atol=1e-11)


def test_minkowski_limits_and_bad_p():
    x, y = pair()
    close(sim.minkowski_distance(x, y, p=1), sim.manhattan_distance(x, y).numpy())
    close(sim.minkowski_distance(x, y, p=2), sim.euclidean_distance(x, y, method="difference").numpy())
    with pytest.raises(ValueError, match=r"p must lie in \[1.0, inf\]"):
        sim.minkowski_distance(x, y, p=0.5)


# ----------------------------------------------------------------------------- 20.06 Jaccard, 20.07 Hamming


def bool_pair(N=6, M=5, D=12, B=None, seed=0):
    x, y = pair(N, M, D, B, seed)
    return x > 0.5, y > 0.5


@pytest.mark.equation("20.06", oracle="scipy cdist 'jaccard' on bool (1 - J); sklearn pairwise_distances "
                                      "(metric='jaccard'); Python sets")
@pytest.mark.parametrize("B", [None, 2])
def test_jaccard_matches_scipy_sklearn_and_sets(B):
    x, y = bool_pair(B=B)
    x[..., 0, :] = False  # an empty set
    y[..., 0, :] = False
    J = sim.jaccard_similarity(x, y)
    close(J, 1 - per_batch(lambda a, b: ssd.cdist(a.astype(bool), b.astype(bool), "jaccard"), x, y), atol=1e-7)
    close(J, 1 - per_batch(lambda a, b: skp.pairwise_distances(a.astype(bool), b.astype(bool), metric="jaccard"),
                           x, y), atol=1e-7)
    xs, ys = (x, y) if B is None else (x[1], y[1])
    Js = J if B is None else J[1]
    for i in range(xs.shape[0]):
        for j in range(ys.shape[0]):
            A, Bset = set(torch.nonzero(xs[i]).flatten().tolist()), set(torch.nonzero(ys[j]).flatten().tolist())
            ref = len(A & Bset) / len(A | Bset) if A | Bset else 1.0
            assert abs(Js[i, j].item() - ref) < 1e-7
    assert J[..., 0, 0].eq(1).all()  # two empty sets: J = 1 (scipy's distance 0)


@pytest.mark.equation("20.07", oracle="scipy cdist 'hamming' (a fraction; times D for the count); sklearn "
                                      "pairwise_distances(metric='hamming')")
@pytest.mark.parametrize("kind", ["bool", "int", "float"])
def test_hamming_matches_scipy_and_sklearn(kind):
    x, y = bool_pair(D=24)
    if kind == "int":
        x, y = (x.long() * 3 - 1), (y.long() * 3 - 1)
    elif kind == "float":
        x, y = x.double() * 0.5, y.double() * 0.5
    frac = ssd.cdist(x.double().numpy(), y.double().numpy(), "hamming")
    count = sim.hamming_distance(x, y)
    assert count.dtype == torch.int64
    assert np.array_equal(count.numpy(), np.rint(frac * 24).astype(np.int64))
    close(sim.hamming_distance(x, y, normalized=True), frac, atol=1e-7)
    close(sim.hamming_distance(x, y, normalized=True),
          skp.pairwise_distances(x.double().numpy(), y.double().numpy(), metric="hamming"), atol=1e-7)
    xb, yb = bool_pair(B=3, D=24)
    assert np.array_equal(sim.hamming_distance(xb, yb).numpy(),
                          np.rint(per_batch(lambda a, b: ssd.cdist(a, b, "hamming"), xb, yb) * 24).astype(np.int64))


def test_sign_codes_estimate_the_angle():
    """SimHash: a random hyperplane separates x and y with probability theta / pi (normalised Hamming ~ angle)."""
    x, y = pair(N=4, M=4, D=16)
    R = torch.randn(16, 20000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    frac = sim.hamming_distance(x @ R > 0, y @ R > 0, normalized=True).double()
    ang = sim.angular_distance(x, y)
    assert (frac - ang).abs().max() < 4 * math.sqrt(0.25 / 20000)


# ----------------------------------------------------------------------------- 20.08 Mahalanobis


def covariance(D=5, seed=0, rho=None):
    if rho is not None:
        return torch.tensor([[1.0, rho], [rho, 1.0]], dtype=torch.float64)
    A = torch.randn(D, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return A @ A.T / D + 0.1 * torch.eye(D, dtype=torch.float64)


@pytest.mark.equation("20.08", oracle="scipy cdist 'mahalanobis' (VI = numpy.linalg.inv(Sigma)); sklearn "
                                      "pairwise_distances(metric='mahalanobis')")
@pytest.mark.parametrize("method", ["expansion", "difference"])
@pytest.mark.parametrize("B", [None, 2])
def test_mahalanobis_matches_scipy_and_sklearn(method, B):
    x, y = pair(D=5, B=B)
    Sigma = covariance(5)
    VI = np.linalg.inv(Sigma.numpy())
    d = sim.mahalanobis_distance(x, y, Sigma, method=method)
    close(d, per_batch(lambda a, b: ssd.cdist(a, b, "mahalanobis", VI=VI), x, y), atol=1e-9)
    close(d, per_batch(lambda a, b: skp.pairwise_distances(a, b, metric="mahalanobis", VI=VI), x, y), atol=1e-9)
    close(sim.mahalanobis_distance(x.float(), y.float(), Sigma.float(), method=method), d.numpy(), rtol=1e-4)


def test_mahalanobis_identity_and_correlated_example():
    x, y = pair(D=3)
    close(sim.mahalanobis_distance(x, y, torch.eye(3, dtype=torch.float64)), ssd.cdist(x.numpy(), y.numpy()))
    d = sim.mahalanobis_distance(torch.zeros(1, 2, dtype=torch.float64),
                                 torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), covariance(rho=0.9))
    close(d, [[math.sqrt(2 / 1.9), math.sqrt(2 / 0.1)]])  # 2 / (1 + rho) and 2 / (1 - rho)


def test_mahalanobis_rejects_bad_covariances():
    x, y = pair(D=2)
    with pytest.raises(ValueError, match="positive definite"):
        sim.mahalanobis_distance(x, y, torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="symmetric"):
        sim.mahalanobis_distance(x, y, torch.tensor([[1.0, 0.5], [0.0, 1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"Sigma must have shape \(2, 2\)"):
        sim.mahalanobis_distance(x, y, torch.eye(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="share one dtype"):
        sim.mahalanobis_distance(x, y, torch.eye(2))


# ----------------------------------------------------------------------------- 20.09 angular


@pytest.mark.equation("20.09", oracle="numpy.arccos of sklearn cosine_similarity in float64; scipy cdist 'cosine'")
@pytest.mark.parametrize("method", ["atan2", "acos"])
@pytest.mark.parametrize("B", [None, 2])
def test_angular_matches_float64_arccos(method, B):
    x, y = pair(B=B)
    x[..., 0, :] = -y[..., 0, :] * 3  # antipodal: distance 1
    y[..., 1, :] = x[..., 1, :] * 0.5  # parallel: distance 0
    d = sim.angular_distance(x, y, method=method)
    ref = np.arccos(np.clip(per_batch(skp.cosine_similarity, x, y), -1, 1)) / np.pi
    close(d, ref, atol=1e-7)  # the float64 arccos reference is itself only ~1e-8 accurate at 0 and 1
    close(d, np.arccos(1 - per_batch(lambda a, b: ssd.cdist(a, b, "cosine"), x, y)) / np.pi, atol=1e-7)


@pytest.mark.equation("20.09", oracle="float64 closed form: x = e1, y = cos(t) e1 + sin(t) e2 is at angle t")
def test_angular_is_stable_at_small_angles_where_acos_fails():
    t = torch.tensor([1e-3, 1e-4, 1e-5, 1e-6, 1e-7], dtype=torch.float64)
    x = torch.zeros(5, 4, dtype=torch.float64)
    x[:, 0] = 1.0
    y = torch.zeros(5, 4, dtype=torch.float64)
    y[:, 0], y[:, 1] = torch.cos(t), torch.sin(t)
    x32, y32 = (x * 3).float(), (y * 0.7).float()
    truth = t.float().double() / math.pi  # the angle of the float32 input itself (sin, cos rounded: < 1e-7 rel)
    stable = torch.diagonal(sim.angular_distance(x32, y32)).double()
    acos = torch.diagonal(sim.angular_distance(x32, y32, method="acos")).double()
    assert ((stable - truth).abs() / truth).max() < 1e-5
    assert ((acos - truth).abs() / truth).max() > 0.5  # float32 acos: cos rounds to 1, the angle to 0


def test_angular_is_a_metric_and_zero_vectors_are_half():
    x, _ = pair(N=12, M=1, D=3, seed=7)
    d = sim.angular_distance(x, x).double()
    assert (d[:, :, None] <= d[:, None, :] + d.T[None, :, :] + 1e-12).all()  # d(i,j) <= d(i,k) + d(k,j)
    c = 1 - sim.cosine_similarity(x, x).double()  # the "cosine distance" breaks it on the same points
    assert (c[:, :, None] > c[:, None, :] + c.T[None, :, :] + 1e-12).any()  # (else this check proves nothing)
    z = torch.zeros(1, 3, dtype=torch.float64)
    for method in ("atan2", "acos"):
        assert sim.angular_distance(z, torch.cat([x[:2], z]), method=method).eq(0.5).all()


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("f", [sim.cosine_similarity, sim.dot_product, sim.euclidean_distance, sim.manhattan_distance,
                               sim.minkowski_distance, sim.angular_distance])
def test_shape_contract_and_errors(f):
    x, y = pair(N=3, M=0, D=4, B=2)
    assert f(x, y).shape == (2, 3, 0)
    with pytest.raises(ValueError, match="disagree on D"):
        f(torch.zeros(3, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"must be \(B, N, D\) and \(B, M, D\)"):
        f(torch.zeros(2, 3, 4), torch.zeros(3, 3, 4))
    with pytest.raises(ValueError, match=r"must be \(B, N, D\) and \(B, M, D\)"):
        f(torch.zeros(2, 3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, D\) or \(N, D\)"):
        f(torch.zeros(4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="must not be empty"):
        f(torch.zeros(3, 0), torch.zeros(2, 0))
    with pytest.raises(ValueError, match="contains NaN"):
        f(torch.tensor([[float("nan"), 1.0]]), torch.zeros(1, 2))
    with pytest.raises(TypeError, match="share one dtype"):
        f(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64))


def test_set_and_code_inputs_are_checked():
    with pytest.raises(TypeError, match="must be a bool tensor"):
        sim.jaccard_similarity(torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(TypeError, match="normalized must be a bool"):
        sim.hamming_distance(torch.ones(2, 3), torch.ones(2, 3), normalized=1)
    with pytest.raises(ValueError, match="contains NaN"):
        sim.hamming_distance(torch.tensor([[float("nan")]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match="eps must lie in"):
        sim.cosine_similarity(torch.ones(1, 2), torch.ones(1, 2), eps=0.0)
    with pytest.raises(ValueError, match="method must be one of"):
        sim.euclidean_distance(torch.ones(1, 2), torch.ones(1, 2), method="naive")


def test_large_inputs_are_processed_in_blocks(monkeypatch):
    monkeypatch.setattr(sim, "_CHUNK", 64)  # force many row blocks
    x, y = pair(N=9, M=7, D=5, B=2)
    close(sim.manhattan_distance(x, y), per_batch(skp.manhattan_distances, x, y))
    close(sim.angular_distance(x, y), np.arccos(np.clip(per_batch(skp.cosine_similarity, x, y), -1, 1)) / np.pi,
          atol=1e-7)


# ----------------------------------------------------------------------------- the chapter's Try-it numbers


def relative_contrast(D, p, n=500, seed=0):
    """The notebook's experiment: a query and n points uniform in [0, 1]^D, (d_max - d_min) / d_min."""
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(n + 1, D, generator=g, dtype=torch.float64)
    d = sim.minkowski_distance(pts[:1], pts[1:], p=p)[0]
    return ((d.max() - d.min()) / d.min()).item()


def test_try_it_numbers():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    y = torch.tensor([[4.0, 3.0]], dtype=torch.float64)
    cos, ang = sim.cosine_similarity(x, y).item(), sim.angular_distance(x, y).item()
    e, e10 = sim.euclidean_distance(x, y).item(), sim.euclidean_distance(x, 10 * y).item()
    assert sim.cosine_similarity(x, 10 * y).item() == pytest.approx(cos)
    d = sim.mahalanobis_distance(torch.zeros(1, 2, dtype=torch.float64),
                                 torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), covariance(rho=0.5))[0]
    assert cos == pytest.approx(24 / 25, abs=1e-15) and e == pytest.approx(math.sqrt(2), abs=1e-15)  # closed forms
    assert ang == pytest.approx(math.acos(24 / 25) / math.pi, abs=1e-15) and e10 == pytest.approx(math.sqrt(2045))
    close(d, [math.sqrt(2 / 1.5), 2.0])  # 2 / (1 + rho), 2 / (1 - rho) at rho = 0.5
    r100, r10k = relative_contrast(100, 2.0), relative_contrast(10000, 2.0)
    assert_states(NOTEBOOK, [
        f"Cosine {cos:.2f}", f"angular distance {ang:.4f} ({ang * 180:.2f}°)", f"Euclidean distance {e:.3f}",
        f"becomes {e10:.2f}",
        f"{d[0].item():.3f} and {d[1].item():.3f}",
        f"{r10k:.3f} at $D = 10000$", f"From $D = 100$ ({r100:.3f})", f"a tenth of that, {r100 / 10:.3f}",
        f"For $p = 1$ it is\n   {relative_contrast(10000, 1.0):.3f} and for "
        f"$p = \\infty$ {relative_contrast(10000, math.inf):.3f}",
    ])
