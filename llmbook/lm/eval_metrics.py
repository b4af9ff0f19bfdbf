r"""Model-based and sampling-based metrics (chapter 16): BERTScore, pass@k and MAUVE.

* :func:`bertscore` (16.06) matches every candidate token embedding greedily to its most similar
  reference token embedding (cosine); the embeddings are given (any encoder's hidden states);
* :func:`pass_at_k` (16.09) is Codex's unbiased estimator of the chance that at least one of
  :math:`k` samples passes, from :math:`n \ge k` samples of which :math:`c` passed, computed as a
  product (no huge binomials);
* :func:`mauve` (16.10) is the area under the divergence curve between two histograms;
  :func:`quantize` turns two sets of features into those histograms with k-means (as mauve-text),
  and :func:`divergence_curve` gives the curve itself.

Everything is computed in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_integer_tensor,
    check_nonempty,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_same_dtype,
    check_same_last_dim,
    check_shape,
)
from llmbook.registry import implements

__all__ = ["bertscore", "pass_at_k", "divergence_curve", "mauve", "quantize"]


# --------------------------------------------------------------------------- BERTScore


def _unit(x: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm (a zero row stays zero); rescaled first so no square overflows."""
    peak = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    x = x / peak
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def _weights(w, mask, shape, name: str) -> Tensor:
    out = torch.ones(shape, dtype=torch.float64)
    if w is not None:
        w = check_shape(as_tensor(w, name), shape, name, "the tokens of its embeddings").double()
        check_finite(w, name)
        if (w < 0).any():
            raise ValueError(f"{name} must be non-negative token weights (idf)")
        out = out * w
    if mask is not None:
        mask = check_shape(mask, shape, f"mask of {name[2:]}", "the tokens of its embeddings")
        if mask.dtype != torch.bool:
            raise TypeError(f"masks must be bool tensors (True = a real token), got {mask.dtype}")
        out = out * mask
    if (out.sum(-1) <= 0).any():
        raise ValueError(f"every sequence needs a token of positive weight ({name[2:]}: all masked or zero)")
    return out


@implements("16.06")
def bertscore(x_hat, x, mask_hat=None, mask=None, w_hat=None, w=None) -> tuple[Tensor, Tensor, Tensor]:
    r"""BERTScore from token embeddings: :math:`P=\frac{1}{|\hat{x}|}\sum_{\hat{x}_i}\max_{x_j} \hat{x}_i^T x_j`.

    ``x_hat`` :math:`(B, \hat T, D)` holds the candidate's token embeddings :math:`\hat x_i`, ``x``
    :math:`(B, T, D)` the reference's :math:`x_j` (2-D inputs are one pair); both are L2-normalised
    first, so :math:`\hat x_i^T x_j` is a cosine. Precision matches each candidate token to its best
    reference token, recall each reference token to its best candidate token; :math:`F = 2PR/(P+R)`.
    ``mask_hat``/``mask`` (bool, True = real token) drop padding; ``w_hat``/``w`` are optional idf
    weights (the sums become weighted means). Returns ``(P, R, F)``, each :math:`(B,)` (or 0-d) in
    ``x_hat``'s dtype, computed in float64. Soft matching: a paraphrase whose tokens sit near the
    reference's in embedding space scores high with no shared word.

    >>> e = torch.eye(3)
    >>> [round(v.item(), 4) for v in bertscore(e[:2], e)]
    [1.0, 0.6667, 0.8]
    """
    x_hat, x = as_tensor(x_hat, "x_hat"), as_tensor(x, "x")
    check_same_dtype(x_hat, x, "x_hat", "x")
    check_dim(x_hat, "x_hat", "(B, T_hat, D) or (T_hat, D)", min_dim=2, max_dim=3)
    check_dim(x, "x", "(B, T, D) or (T, D)", min_dim=x_hat.ndim, max_dim=x_hat.ndim)
    check_same_last_dim(x_hat, x, "x_hat", "x", "D")
    if x_hat.ndim == 3 and x_hat.shape[0] != x.shape[0]:
        raise ValueError(f"x_hat and x must have the same batch size B, got {x_hat.shape[0]} and {x.shape[0]}")
    check_nonempty(x_hat, "x_hat", -2)
    check_nonempty(x, "x", -2)
    check_nonempty(x, "x", -1)
    check_finite(x_hat, "x_hat")
    check_finite(x, "x")
    single = x_hat.ndim == 2
    a, b = _unit(x_hat.double()), _unit(x.double())
    if single:
        a, b = a[None], b[None]
        mask_hat, mask = (None if m is None else m[None] for m in (mask_hat, mask))
        w_hat, w = (None if v is None else as_tensor(v, "w")[None] for v in (w_hat, w))
    wt_hat = _weights(w_hat, mask_hat, a.shape[:2], "w_hat")
    wt = _weights(w, mask, b.shape[:2], "w")
    sim = a @ b.transpose(-1, -2)  # (B, T_hat, T): cosines
    sim_p = sim.masked_fill(wt[:, None, :] == 0, -math.inf).amax(-1)  # best reference token per candidate token
    sim_r = sim.masked_fill(wt_hat[:, :, None] == 0, -math.inf).amax(-2)
    P = (torch.where(wt_hat > 0, sim_p, 0.0) * wt_hat).sum(-1) / wt_hat.sum(-1)
    R = (torch.where(wt > 0, sim_r, 0.0) * wt).sum(-1) / wt.sum(-1)
    F = torch.where(P + R != 0, 2 * P * R / (P + R), torch.zeros_like(P))
    out = tuple(v.to(x_hat.dtype) for v in (P, R, F))
    return tuple(v[0] for v in out) if single else out


# --------------------------------------------------------------------------- pass@k


def _pass_at_k_one(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0  # every k-subset holds a passing sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): a sum of log1p, no factorials
    return -math.expm1(math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1)))


@implements("16.09")
def pass_at_k(n, c, k: int):
    r"""Unbiased pass@k: :math:`\mathrm{pass@}k = 1-\binom{n-c}{k}\big/\binom{n}{k}`.

    Draw :math:`n` samples for a problem, of which :math:`c` pass the tests; the chance that a random
    :math:`k`-subset holds at least one passing sample is one minus the chance that all :math:`k` come
    from the :math:`n - c` failures. Unlike :math:`1-(1-c/n)^k`, this is unbiased for the
    :math:`k`-sample success rate. It is computed as
    :math:`1-\prod_{i=n-c+1}^{n}(1-k/i)` in log space, so :math:`n = 10^6` costs no big integers.
    ``n`` and ``c`` are ints or integer tensors (broadcast: one entry per problem), :math:`0 \le c \le n`,
    :math:`1 \le k \le n`. Returns a float, or a float64 tensor of the broadcast shape (average it over
    problems for the benchmark's pass@k).

    >>> pass_at_k(10, 3, 1), round(pass_at_k(10, 3, 5), 4)
    (0.30000000000000004, 0.9167)
    """
    k = check_positive_int(k, "k")
    if isinstance(n, Tensor) or isinstance(c, Tensor):
        n_t, c_t = check_integer_tensor(n, "n"), check_integer_tensor(c, "c")
        try:
            n_t, c_t = torch.broadcast_tensors(n_t, c_t)
        except RuntimeError as err:
            raise ValueError(f"n {tuple(n_t.shape)} and c {tuple(c_t.shape)} must broadcast") from err
        if n_t.numel() and ((c_t < 0).any() or (c_t > n_t).any() or (n_t < k).any()):
            raise ValueError(f"pass_at_k needs 0 <= c <= n and n >= k = {k} for every problem, got n in "
                             f"[{n_t.min().item()}, {n_t.max().item()}], c in [{c_t.min().item()}, {c_t.max().item()}]")
        vals = [_pass_at_k_one(int(a), int(b), k) for a, b in zip(n_t.flatten().tolist(), c_t.flatten().tolist(),
                                                                    strict=True)]
        return torch.tensor(vals, dtype=torch.float64).reshape(n_t.shape)
    n = check_int(n, "n", low=k, what=f"an int >= k = {k}")
    c = check_int(c, "c", low=0, high=n)
    return _pass_at_k_one(n, c, k)


# --------------------------------------------------------------------------- MAUVE


def _histogram(p, name: str) -> Tensor:
    if not isinstance(p, Tensor):  # a list of counts or probabilities: read it in float64, not float32
        as_tensor(p, name)
        p = torch.as_tensor(p, dtype=torch.float64)
    p = as_tensor(p, name)
    check_dim(p, name, "(K,)", min_dim=1, max_dim=1)
    check_nonempty(p, name)
    check_finite(p, name)
    p = p.double()
    if (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"{name} must be non-negative counts or probabilities with a positive sum")
    return p / p.sum()


def _kl(p: Tensor, r: Tensor) -> Tensor:
    """KL(p || r) where r > 0 wherever p > 0; terms with p = 0 are 0; rounding below 0 is clipped to 0."""
    return torch.where(p > 0, p * torch.log(p / r.clamp_min(torch.finfo(r.dtype).tiny)), 0.0).sum().clamp_min(0.0)


def divergence_curve(p, q, c: float = 5.0, num_lambdas: int = 25) -> Tensor:
    r"""The divergence curve :math:`(e^{-c\,KL(Q\|R_\lambda)}, e^{-c\,KL(P\|R_\lambda)})`.

    :math:`R_\lambda=\lambda P+(1-\lambda)Q` mixes the two distributions.
    ``p``, ``q``: histograms over the same :math:`K` bins (counts or probabilities, normalised here).
    :math:`\lambda` runs over ``num_lambdas`` points of :math:`[10^{-6}, 1-10^{-6}]`, and the two
    extreme points :math:`(1, 0)` (:math:`\lambda = 0`) and :math:`(0, 1)` (:math:`\lambda = 1`) close the
    curve, as in mauve-text. Returns a float64 tensor of shape ``(num_lambdas + 2, 2)``.

    >>> divergence_curve([0.5, 0.5], [0.5, 0.5], num_lambdas=2)[1:-1]
    tensor([[1., 1.],
            [1., 1.]], dtype=torch.float64)
    """
    P, Q = _histogram(p, "p"), _histogram(q, "q")
    check_same_last_dim(P, Q, "p", "q", "K (the bins)")
    c = check_range(c, "c", 0.0, low_open=True)
    num_lambdas = check_positive_int(num_lambdas, "num_lambdas")
    lams = torch.linspace(1e-6, 1 - 1e-6, num_lambdas, dtype=torch.float64)
    pts = [[1.0, 0.0]]
    for lam in lams:
        R = lam * P + (1 - lam) * Q
        pts.append([math.exp(-c * _kl(Q, R).item()), math.exp(-c * _kl(P, R).item())])
    pts.append([0.0, 1.0])
    return torch.tensor(pts, dtype=torch.float64)


def _area(x: Tensor, y: Tensor) -> Tensor:
    """Trapezoid area under the monotone curve y(x): sorted by x, ties by decreasing y (the curve's order)."""
    order = torch.argsort(-y, stable=True)
    order = order[torch.argsort(x[order], stable=True)]
    return torch.trapezoid(y[order], x[order])


@implements("16.10")
def mauve(p, q, c: float = 5.0, num_lambdas: int = 25) -> float:
    r"""MAUVE: :math:`\mathrm{Area}(\{(e^{-c\,D_{KL}(Q\|R_\lambda)}, e^{-c\,D_{KL}(P\|R_\lambda)})\}_\lambda)`.

    :math:`P` (model text) and :math:`Q` (human text) are histograms over :math:`K` clusters of text
    features (:func:`quantize`). The curve (:func:`divergence_curve`) trades the two kinds of error
    a generator makes: mass where humans put none (:math:`KL(Q\|R_\lambda)` small but
    :math:`KL(P\|R_\lambda)` large) and missing mass where humans put some. Identical histograms give
    the point :math:`(1, 1)` and an area of 1; disjoint ones the curve
    :math:`((1-\lambda)^c, \lambda^c)`, of area :math:`1/\binom{2c}{c} \approx 0.004` for :math:`c = 5`.
    ``c`` is mauve-text's scaling factor (5). The area is the trapezoid rule, averaged over the two axes
    as mauve-text does; where points tie (identical or disjoint supports) they are ordered along the curve, so
    :math:`\mathrm{MAUVE}(P, P) = 1` (mauve-text's unstable sort reports 0.75 there).

    >>> mauve([0.5, 0.5], [0.5, 0.5]), round(mauve([1.0, 0.0], [0.0, 1.0]), 4)
    (1.0, 0.0041)
    """
    curve = divergence_curve(p, q, c, num_lambdas)
    x, y = curve[:, 0], curve[:, 1]
    return float(0.5 * (_area(x, y) + _area(y, x)))


def _kmeans(z: Tensor, K: int, gen: torch.Generator, iters: int) -> tuple[Tensor, float]:
    """Lloyd's k-means from a k-means++ start: (labels, inertia)."""
    centers = z[torch.randint(len(z), (1,), generator=gen)]
    for _ in range(1, K):
        d2 = torch.cdist(z, centers).amin(-1) ** 2
        probs = d2 / d2.sum() if d2.sum() > 0 else torch.full_like(d2, 1 / len(z))
        centers = torch.cat([centers, z[torch.multinomial(probs, 1, generator=gen)]])
    for _ in range(iters):
        labels = torch.cdist(z, centers).argmin(-1)
        new = torch.stack([z[labels == j].mean(0) if (labels == j).any() else centers[j] for j in range(K)])
        if torch.equal(new, centers):
            break
        centers = new
    d = torch.cdist(z, centers)
    return d.argmin(-1), float((d.amin(-1) ** 2).sum())


def quantize(p_features, q_features, K: int, n_init: int = 5, iters: int = 100, seed: int = 0) -> tuple[Tensor, Tensor]:
    r"""Histograms of two feature sets over ``K`` shared k-means clusters (MAUVE's quantisation).

    ``p_features`` :math:`(N_p, D)` and ``q_features`` :math:`(N_q, D)` (e.g. the last hidden state
    of each text) are L2-normalised, pooled and clustered by k-means (k-means++ start, ``n_init``
    restarts, the lowest inertia kept, seeded by ``seed``); returns the two normalised histograms of
    cluster labels, float64 ``(K,)``. mauve-text also projects on the principal components that
    keep 90 % of the variance and clusters with faiss, so its clusters can differ from these on data
    without clear clusters.

    >>> f = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> [h.tolist() for h in quantize(f, f.flip(0)[:1], K=2)]
    [[0.5, 0.5], [1.0, 0.0]]
    """
    fp, fq = as_tensor(p_features, "p_features"), as_tensor(q_features, "q_features")
    for f, name in ((fp, "p_features"), (fq, "q_features")):
        check_dim(f, name, "(N, D)", min_dim=2, max_dim=2)
        check_nonempty(f, name, 0)
        check_nonempty(f, name, 1)
        check_finite(f, name)
    check_same_last_dim(fp, fq, "p_features", "q_features", "D")
    K = check_positive_int(K, "K")
    n_init, iters = check_positive_int(n_init, "n_init"), check_nonnegative_int(iters, "iters")
    z = _unit(torch.cat([fq, fp]).double())
    if K > len(z):
        raise ValueError(f"K ({K}) must be at most the number of features N_p + N_q = {len(z)}")
    gen = torch.Generator().manual_seed(check_int(seed, "seed"))
    labels = min((_kmeans(z, K, gen, iters) for _ in range(n_init)), key=lambda t: t[1])[0]
    q_hist = torch.bincount(labels[:len(fq)], minlength=K).double()
    p_hist = torch.bincount(labels[len(fq):], minlength=K).double()
    return p_hist / p_hist.sum(), q_hist / q_hist.sum()
