r"""Diversity: maximal marginal relevance and determinantal point processes.

Ten retrieved passages that say the same thing fill the context window with one fact. The
functions here trade *relevance* to the query against *redundancy* among the selected passages.

* **MMR** (28.01, :func:`mmr`, Carbonell & Goldstein 1998): greedily add the passage with the best
  marginal score :math:`\lambda\,\mathrm{Sim}_1(d,q) - (1-\lambda)\max_{d'\in S}\mathrm{Sim}_2(d,d')`.
* **DPP subset probability** (28.02, :func:`dpp_probability`, Macchi 1975; Kulesza & Taskar 2012):
  an L-ensemble gives every subset :math:`Y` of the :math:`N` items the probability
  :math:`P(Y)=\det(L_Y)/\det(L+I)`; sets of similar items span little volume and are unlikely.
* **Marginal kernel** (28.03, :func:`dpp_marginal_kernel`): :math:`K=L(L+I)^{-1}`, whose diagonal
  holds the inclusion probabilities :math:`P(i\in Y)` and whose minors give every joint inclusion
  probability, :math:`P(A\subseteq Y)=\det(K_A)`.
* Helpers: :func:`quality_diversity_kernel` builds :math:`L=\mathrm{diag}(q)\,S\,\mathrm{diag}(q)`
  from per-item qualities and a similarity matrix; :func:`dpp_greedy_map` is the fast greedy MAP
  inference of Chen, Zhang & Zhou (2018), which grows :math:`\log\det L_Y` one Cholesky row at a time.

Input conventions: one query at a time. ``sim_q`` is ``(N,)``, ``sim_d`` and ``L`` are ``(N, N)``;
``L`` must be symmetric positive semi-definite. Arithmetic runs in float64 (determinants of even a
dozen items under- and overflow float16 quickly); results come back in the input's floating dtype.

>>> L = torch.tensor([[1.0, 0.9], [0.9, 1.0]])          # two near-duplicates
>>> [round(float(dpp_probability(L, torch.tensor(Y))), 4) for Y in ([0, 1], [0])]
[0.0596, 0.3135]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_integer_tensor, check_unit_interval
from llmbook.registry import implements

__all__ = ["MMRResult", "mmr", "dpp_probability", "dpp_marginal_kernel", "quality_diversity_kernel",
           "GreedyMAPResult", "dpp_greedy_map"]


# ----------------------------------------------------------------------------------------------- inputs


def _out_dtype(*dtypes: torch.dtype) -> torch.dtype:
    dt = dtypes[0]
    for other in dtypes[1:]:
        dt = torch.promote_types(dt, other)
    return dt


def _restore(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype)


def _square(x, name: str) -> tuple[torch.Tensor, torch.dtype]:
    """``x`` as a finite float64 ``(N, N)`` matrix, and its dtype."""
    t = as_tensor(x, name)
    check_dim(t, name, "(N, N)", min_dim=2, max_dim=2)
    if t.shape[0] != t.shape[1]:
        raise ValueError(f"{name} must be a square (N, N) matrix, got shape {tuple(t.shape)}")
    check_finite(t, name)
    return t.double(), t.dtype


def _psd_kernel(L, name: str = "L") -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``L`` as a float64 symmetric PSD ``(N, N)`` kernel, its eigenvalues (ascending) and its dtype.

    Symmetry and the smallest eigenvalue are checked up to the rounding of the input's dtype.
    """
    L, dtype = _square(L, name)
    N = L.shape[0]
    scale = max(1.0, L.abs().max().item()) if N else 1.0
    tol = 16 * max(N, 1) * torch.finfo(dtype).eps * scale
    asym = (L - L.T).abs().max().item() if N else 0.0
    if asym > tol:
        raise ValueError(f"{name} must be symmetric, got max |L - L^T| = {asym:.3g}")
    L = (L + L.T) / 2
    lam = torch.linalg.eigvalsh(L)
    if N and lam[0].item() < -tol:
        raise ValueError(f"{name} must be positive semi-definite, got smallest eigenvalue {lam[0].item():.4g}")
    return L, lam.clamp_min(0.0), dtype


# ----------------------------------------------------------------------------------------------- MMR


class MMRResult(NamedTuple):
    """The passages MMR picked, in the order it picked them, and the marginal score of each pick."""

    indices: torch.Tensor  # (k,) long
    scores: torch.Tensor  # (k,) the MMR score of each pick at the moment it was picked


@implements("28.01")
def mmr(sim_q, sim_d, k: int, lam: float = 0.5) -> MMRResult:
    r"""Maximal marginal relevance: greedily pick ``k`` of ``N`` candidates.

    .. math::
        \mathrm{MMR}(d) = \lambda\,\mathrm{Sim}_1(d, q) - (1-\lambda)\max_{d'\in S}\mathrm{Sim}_2(d, d'),
        \qquad S \leftarrow S \cup \{\arg\max_{d\notin S}\mathrm{MMR}(d)\}

    Symbols: :math:`\mathrm{Sim}_1(d_i, q)` = ``sim_q[i]``, :math:`\mathrm{Sim}_2(d_i, d_j)` =
    ``sim_d[i, j]`` (row: the candidate, column: an already selected passage), :math:`\lambda` =
    ``lam``. The max over the empty set is taken as 0, so for ``lam > 0`` the first pick is the most
    relevant passage; ``lam = 1`` is plain ranking by relevance, ``lam = 0`` ignores the query
    altogether (every first score ties at 0). Ties go to the lowest index.

    Shapes: ``sim_q`` ``(N,)``, ``sim_d`` ``(N, N)``, ``0 <= k <= N``. Returns ``MMRResult(indices
    (k,) long, scores (k,))``.

    >>> sim_q = torch.tensor([0.9, 0.85, 0.5])
    >>> sim_d = torch.tensor([[1.0, 0.95, 0.1], [0.95, 1.0, 0.2], [0.1, 0.2, 1.0]])
    >>> mmr(sim_q, sim_d, 2, lam=0.5).indices.tolist()       # the near-duplicate 1 loses to 2
    [0, 2]
    """
    q = as_tensor(sim_q, "sim_q")
    check_dim(q, "sim_q", "(N,)", min_dim=1, max_dim=1)
    check_finite(q, "sim_q")
    S, dt_d = _square(sim_d, "sim_d")
    N = q.shape[0]
    if S.shape[0] != N:
        raise ValueError(f"sim_d must be (N, N) with N = len(sim_q) = {N}, got shape {tuple(S.shape)}")
    k = check_int(k, "k", low=0, high=N, what=f"an int in [0, N] = [0, {N}]")
    lam = check_unit_interval(lam, "lam")
    dtype = _out_dtype(q.dtype, dt_d)
    rel = q.double()
    redundancy = torch.zeros(N, dtype=torch.float64)  # max over the selected set, 0 while it is empty
    chosen = torch.zeros(N, dtype=torch.bool)
    indices, scores = [], []
    for _ in range(k):
        score = lam * rel - (1.0 - lam) * redundancy
        score = score.masked_fill(chosen, -math.inf)
        j = int(torch.argmax(score))
        indices.append(j)
        scores.append(score[j])
        chosen[j] = True
        col = S[:, j]
        redundancy = col.clone() if len(indices) == 1 else torch.maximum(redundancy, col)
    idx = torch.tensor(indices, dtype=torch.long)
    sc = torch.stack(scores) if scores else torch.zeros(0, dtype=torch.float64)
    return MMRResult(idx, _restore(sc, dtype))


# ----------------------------------------------------------------------------------------------- DPP


def _logdet_I_plus(L: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    r"""log det(L + I) by ``slogdet``; from the eigenvalues if rounding makes L + I look singular.

    Beyond :math:`\|L\| \approx 10^{16}` the 1 of :math:`L+I` is lost in float64 (the problem is then
    ill-posed); :math:`\sum_i\log(1+\lambda_i)` with clamped eigenvalues at least stays finite.
    """
    sign, logabs = torch.linalg.slogdet(L + torch.eye(L.shape[0], dtype=L.dtype))
    if sign.item() > 0 and torch.isfinite(logabs):
        return logabs
    return torch.log1p(lam).sum()


@implements("28.02")
def dpp_probability(L, Y, log: bool = False) -> torch.Tensor:
    r"""The probability that the L-ensemble DPP with kernel ``L`` draws exactly the subset ``Y``.

    .. math::
        P(Y) = \frac{\det(L_Y)}{\det(L + I)}, \qquad \sum_{Y\subseteq\{1..N\}} \det(L_Y) = \det(L+I)

    Symbols: :math:`L` = ``L`` (symmetric PSD ``(N, N)``), :math:`Y` = ``Y`` (distinct item indices,
    ``(|Y|,)`` integers in ``[0, N)``; the empty set has :math:`\det(L_\emptyset) = 1`). Both
    determinants are taken with ``slogdet`` and divided in log space; a principal minor that rounds
    to zero or below (a set of linearly dependent items) has probability 0. With ``log=True`` the
    log-probability is returned (``-inf`` for such a set).

    Returns a 0-d tensor in ``L``'s dtype.

    >>> L = torch.eye(3)                                  # independent items, each in with prob. 1/2
    >>> round(float(dpp_probability(L, torch.tensor([0, 2]))), 4)
    0.125
    """
    L, lam, dtype = _psd_kernel(L)
    N = L.shape[0]
    Y = check_integer_tensor(Y, "Y", "a 1-d integer tensor of item indices")
    check_dim(Y, "Y", "(|Y|,)", min_dim=1, max_dim=1)
    Y = Y.long()
    if Y.numel() and (Y.min() < 0 or Y.max() >= N):
        raise ValueError(f"Y must hold item indices in [0, N) = [0, {N}), "
                         f"got range [{Y.min().item()}, {Y.max().item()}]")
    if Y.unique().numel() != Y.numel():
        raise ValueError(f"Y must be a set of distinct indices, got {Y.tolist()}")
    sign, logabs = torch.linalg.slogdet(L[Y][:, Y])
    log_num = logabs if sign.item() > 0 else torch.tensor(-math.inf, dtype=torch.float64)
    log_p = log_num - _logdet_I_plus(L, lam)
    out = log_p if log else torch.exp(log_p)
    return out.to(dtype)


@implements("28.03")
def dpp_marginal_kernel(L) -> torch.Tensor:
    r"""The marginal kernel of an L-ensemble: :math:`P(A \subseteq Y) = \det(K_A)` for every set ``A``.

    .. math::
        K = L(L + I)^{-1} = I - (L + I)^{-1}

    Computed by one linear solve, :math:`K = (L+I)^{-1}L` (the two factors commute), never by an
    explicit inverse, then symmetrised. Should :math:`L+I` be numerically singular (entries beyond
    :math:`10^{16}`, where the 1 of :math:`L+I` is lost), the eigendecomposition
    :math:`K = V\,\mathrm{diag}(\lambda/(1+\lambda))\,V^\top` is used instead.
    ``K_ii`` is the probability that item ``i`` is drawn; ``K_ii K_jj - K_ij^2`` that both are.

    Shapes: ``L`` ``(N, N)`` symmetric PSD -> ``K`` ``(N, N)`` with eigenvalues in [0, 1).

    >>> K = dpp_marginal_kernel(torch.tensor([[1.0, 0.9], [0.9, 1.0]]))
    >>> [round(v, 4) for v in K.diagonal().tolist()]     # alone each would be in with prob. 0.5
    [0.373, 0.373]
    """
    L, _, dtype = _psd_kernel(L)
    N = L.shape[0]
    K, info = torch.linalg.solve_ex(L + torch.eye(N, dtype=L.dtype), L)
    if info.item() != 0 or not torch.isfinite(K).all():
        lam, V = torch.linalg.eigh(L)
        lam = lam.clamp_min(0.0)
        K = (V * (lam / (1.0 + lam))) @ V.T
    return ((K + K.T) / 2).to(dtype)


# ----------------------------------------------------------------------------------------------- helpers


def quality_diversity_kernel(q, S) -> torch.Tensor:
    r"""The quality-diversity kernel :math:`L = \mathrm{diag}(q)\,S\,\mathrm{diag}(q)`, :math:`L_{ij} = q_i S_{ij} q_j`.

    :math:`q_i \ge 0` is item ``i``'s quality (relevance; e.g. :math:`e^{\alpha\,r_i}`), :math:`S` a
    PSD similarity with unit diagonal (a Gram matrix of unit vectors). Then
    :math:`\det L_Y = \prod_{i\in Y} q_i^2\,\det S_Y`: quality squared times the squared volume the
    items span (Kulesza & Taskar 2012, sec. 3.1). Shapes: ``q`` ``(N,)``, ``S`` ``(N, N)`` -> ``(N, N)``.

    >>> quality_diversity_kernel(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 0.5], [0.5, 1.0]])).tolist()
    [[1.0, 1.0], [1.0, 4.0]]
    """
    q = as_tensor(q, "q")
    check_dim(q, "q", "(N,)", min_dim=1, max_dim=1)
    check_finite(q, "q")
    if q.numel() and q.min() < 0:
        raise ValueError(f"q must be non-negative qualities, got min {q.min().item():.4g}")
    S64, dt_s = _square(S, "S")
    if S64.shape[0] != q.shape[0]:
        raise ValueError(f"S must be (N, N) with N = len(q) = {q.shape[0]}, got shape {tuple(S64.shape)}")
    q64 = q.double()
    return (q64[:, None] * S64 * q64[None, :]).to(_out_dtype(q.dtype, dt_s))


class GreedyMAPResult(NamedTuple):
    """The items greedy MAP picked, in order, and :math:`\\log d_j^2`, the gain in :math:`\\log\\det L_Y` of each."""

    indices: torch.Tensor  # (k,) long
    log_gains: torch.Tensor  # (k,) float64; their cumulative sum is log det L_Y after each pick


def dpp_greedy_map(L, k: int | None = None, eps: float = 1e-10) -> GreedyMAPResult:
    r"""Greedy MAP inference for a DPP by incremental Cholesky updates (Chen, Zhang & Zhou 2018, Alg. 1).

    Greedy MAP adds, one at a time, the item :math:`j = \arg\max_i \log\det L_{Y\cup\{i\}}`. Since
    :math:`\det L_{Y\cup\{i\}} = \det L_Y \cdot d_i^2`, with :math:`d_i^2` the squared residual of item
    ``i`` after projecting out the selected ones (the next diagonal entry of the Cholesky factor),
    it suffices to keep :math:`d_i^2` for every candidate and update it after each pick:

    .. math::
        e_i = \frac{L_{ji} - \langle c_j, c_i\rangle}{d_j}, \qquad c_i \leftarrow [c_i, e_i],
        \qquad d_i^2 \leftarrow d_i^2 - e_i^2

    :math:`O(N t)` at step :math:`t` (an inner product of length :math:`t` per item), so :math:`O(N k^2)` for
    ``k`` steps, instead of one determinant per candidate (:math:`O(N k^4)` in total). Stops after ``k`` items
    (default ``N``) or when the best :math:`d_j^2` falls below ``eps`` (the set would be singular).

    >>> L = torch.tensor([[1.0, 0.99, 0.0], [0.99, 1.0, 0.0], [0.0, 0.0, 0.8]])
    >>> dpp_greedy_map(L, 2).indices.tolist()            # 0 first, then 2, not its near-copy 1
    [0, 2]
    """
    L, _, _ = _psd_kernel(L)
    N = L.shape[0]
    k = N if k is None else check_int(k, "k", low=0, high=N, what=f"an int in [0, N] = [0, {N}]")
    C = torch.zeros(k, N, dtype=torch.float64)  # row t: the t-th column of the Cholesky factor, for every item
    d2 = L.diagonal().clone()
    chosen = torch.zeros(N, dtype=torch.bool)
    indices, gains = [], []
    for t in range(k):
        j = int(torch.argmax(d2.masked_fill(chosen, -math.inf)))
        if d2[j].item() < eps:
            break
        indices.append(j)
        gains.append(math.log(d2[j].item()))
        chosen[j] = True
        e = (L[j] - C[:t, j] @ C[:t]) / math.sqrt(d2[j].item())
        C[t] = e
        d2 = d2 - e**2
    return GreedyMAPResult(torch.tensor(indices, dtype=torch.long), torch.tensor(gains, dtype=torch.float64))
