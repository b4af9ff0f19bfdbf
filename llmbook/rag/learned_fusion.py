r"""Learned fusion: weights fitted on labelled queries, evaluated on held-out ones (chapter 23).

The fusions of :mod:`llmbook.rag.fusion` fix their parameters in advance (RRF's :math:`k=60`, equal
z-score weights). With relevance labels the combination can be *learned*:

* **Learned linear fusion** (23.04, :func:`linear_fusion`): :math:`s(q,d)=w^\top\phi(q,d)` over per-run
  features (:func:`fusion_features`: each run's normalised score and its scaled reciprocal rank), with
  :math:`w` fitted on labelled ``(query, document)`` pairs by :func:`fit_linear_fusion` (L2-regularised
  logistic regression, relevant versus not, or least squares on the grades).
* **Held-out evaluation.** Scores of the queries a model was fitted on flatter it, so every number to report
  comes from queries it never saw: :func:`query_folds` splits the *queries* into folds,
  :func:`held_out_linear_fusion` scores each fold with a model fitted on the others, and
  :func:`select_on_folds` picks a hand-set parameter (the convex :math:`\lambda`, RRF's :math:`k`) on the
  other folds in the same way.

Conventions as in :mod:`llmbook.rag.fusion`: runs are ``(B, N)`` score matrices with ``-inf`` for *not
retrieved*; features are ``(B, N, F)``; arithmetic and results are float64.

>>> runs = [torch.tensor([[3.0, 1.0, float("-inf")]]), torch.tensor([[0.2, 0.4, 0.9]])]
>>> fusion_features(runs, norm="minmax").shape
torch.Size([1, 3, 4])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_int,
    check_positive_int,
    check_range,
    check_same_shape,
)
from llmbook.rag.fusion import NORMS, _filled, _runs, _scores, rank_matrix
from llmbook.rag.metrics import evaluate
from llmbook.registry import implements

__all__ = ["fusion_features", "linear_fusion", "LinearFusionModel", "fit_linear_fusion", "query_folds",
           "held_out_linear_fusion", "select_on_folds"]



def fusion_features(runs, norm: str = "zscore", k: float = 60.0) -> Tensor:
    r"""The feature vector :math:`\phi(q,d)` of learned fusion, ``(B, N, 2M)`` float64.

    Per run :math:`m`: its normalised score (:func:`~llmbook.rag.fusion.normalize_scores`, misses filled as
    in :func:`~llmbook.rag.fusion.normalized_fusion`), then its RRF term scaled so that rank 1 gives 1,
    :math:`(k+1)/(k+\mathrm{rank}_m(d))` (0 when missed; the scaling keeps the features of one order, so the
    fitted weights compare and the fit is well conditioned). The columns are
    ``[score_1, ..., score_M, rr_1, ..., rr_M]``.

    >>> fusion_features([torch.tensor([[2.0, 1.0]])], norm="minmax", k=0).tolist()
    [[[1.0, 1.0], [0.0, 0.5]]]
    """
    S = _runs(runs)
    check_choice(norm, "norm", NORMS)
    k = check_range(k, "k", 0.0)
    Z, _ = _filled(S, norm)
    R = torch.stack([rank_matrix(s) for s in S])
    rr = torch.where(torch.isfinite(R), (k + 1.0) / (k + torch.where(torch.isfinite(R), R, 1.0)), 0.0)
    return torch.cat([Z, rr]).permute(1, 2, 0).contiguous()


def _phi(phi) -> Tensor:
    p = as_tensor(phi, "phi")
    check_dim(p, "phi", "(B, N, F)", min_dim=3, max_dim=3)
    check_finite(p, "phi")
    return p.double()


@implements("23.04")
def linear_fusion(phi, w, b: float = 0.0) -> Tensor:
    r"""Learned linear fusion :math:`s(q,d)=w^\top\phi(q,d)+b`.

    ``phi``: :math:`\phi`, ``(B, N, F)`` features (:func:`fusion_features`); ``w``: :math:`w`, ``(F,)``;
    ``b``: an intercept (ranking-neutral, kept so the scores equal the fitted model's decision function).
    Fit :math:`w` with :func:`fit_linear_fusion` on training queries only. Returns float64 ``(B, N)``.

    >>> linear_fusion(torch.ones(1, 2, 3), torch.tensor([1.0, 2.0, 3.0])).tolist()
    [[6.0, 6.0]]
    """
    phi = _phi(phi)
    w = as_tensor(w, "w").double()
    check_dim(w, "w", f"(F,) = ({phi.shape[2]},)", min_dim=1, max_dim=1)
    if w.shape[0] != phi.shape[2]:
        raise ValueError(f"w must have F = {phi.shape[2]} entries (phi's last axis), got {w.shape[0]}")
    check_finite(w, "w")
    return phi @ w + check_range(b, "b")


class LinearFusionModel(NamedTuple):
    """A fitted linear fusion: weights ``w`` (F,) and intercept ``b``; score with :func:`linear_fusion`."""

    w: Tensor
    b: float


def fit_linear_fusion(phi, labels, loss: str = "logistic", C: float = 1.0, max_iter: int = 100) -> LinearFusionModel:
    r"""Fit :math:`w, b` of :func:`linear_fusion` on labelled ``(query, document)`` pairs.

    ``phi``: ``(B, N, F)``; ``labels``: ``(B, N)`` grades :math:`\ge 0`. ``loss="logistic"``: relevant
    (grade > 0) versus not, minimising :math:`C\sum_i \log(1+e^{-y_i(w^\top\phi_i+b)}) + \tfrac12\lVert w\rVert^2`
    (sklearn's ``LogisticRegression(C=C)``; :math:`b` unpenalised) by Newton's method in float64;
    ``loss="least_squares"``: ordinary least squares on the grades (``LinearRegression``).
    """
    phi = _phi(phi)
    y = as_tensor(labels, "labels").double()
    check_same_shape(phi[..., 0], y, "phi[..., 0]", "labels")
    check_finite(y, "labels")
    check_choice(loss, "loss", ("logistic", "least_squares"))
    C = check_range(C, "C", 0.0, low_open=True)
    max_iter = check_positive_int(max_iter, "max_iter")
    F = phi.shape[2]
    X = torch.cat([phi.reshape(-1, F), torch.ones(phi.shape[0] * phi.shape[1], 1, dtype=torch.float64)], dim=1)
    if X.shape[0] == 0:
        raise ValueError("phi must hold at least one (query, document) pair")
    t = y.reshape(-1)
    if loss == "least_squares":
        theta = torch.linalg.lstsq(X, t.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        return LinearFusionModel(theta[:F], float(theta[F]))
    t = (t > 0).double()
    pen = torch.ones(F + 1, dtype=torch.float64)
    pen[F] = 0.0
    theta = torch.zeros(F + 1, dtype=torch.float64)
    for _ in range(max_iter):
        p = torch.sigmoid(X @ theta)
        grad = C * X.T @ (p - t) + pen * theta
        H = C * (X.T * (p * (1 - p))) @ X + torch.diag(pen) + 1e-12 * torch.eye(F + 1, dtype=torch.float64)
        step = torch.linalg.solve(H, grad)
        theta = theta - step
        if step.abs().max() < 1e-12 * (1 + theta.abs().max()):
            break
    return LinearFusionModel(theta[:F], float(theta[F]))


def query_folds(B: int, n_folds: int = 5, seed: int = 0) -> Tensor:
    """A fold id in ``[0, n_folds)`` for each of ``B`` queries (a seeded shuffle; ``n_folds = B``: leave-one-out).

    >>> query_folds(5, 5, seed=0).sort().values.tolist()
    [0, 1, 2, 3, 4]
    """
    B = check_positive_int(B, "B")
    n_folds = check_int(n_folds, "n_folds", low=2, high=B)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(check_int(seed, "seed")))
    folds = torch.empty(B, dtype=torch.long)
    folds[perm] = torch.arange(B) % n_folds
    return folds


def _folds(folds, B: int) -> Tensor:
    f = as_tensor(folds, "folds", floating=False)
    if f.shape != (B,) or f.is_floating_point() or f.dtype == torch.bool:
        raise ValueError(f"folds must be a (B,) = ({B},) integer tensor of fold ids, got {tuple(f.shape)} {f.dtype}")
    return f.long()


def held_out_linear_fusion(phi, labels, folds, **fit_kw) -> Tensor:
    """Scores of every query from a :func:`fit_linear_fusion` model that never saw that query's fold.

    ``phi`` ``(B, N, F)``, ``labels`` ``(B, N)``, ``folds`` ``(B,)`` fold ids (:func:`query_folds`).
    Returns float64 ``(B, N)``: the numbers to report, never training-set ones.
    """
    phi = _phi(phi)
    folds = _folds(folds, phi.shape[0])
    labels = as_tensor(labels, "labels").double()
    out = torch.empty(phi.shape[:2], dtype=torch.float64)
    for f in folds.unique().tolist():
        test = folds == f
        if test.all():
            raise ValueError("folds must hold at least two folds (one to fit, one to score)")
        model = fit_linear_fusion(phi[~test], labels[~test], **fit_kw)
        out[test] = linear_fusion(phi[test], model.w, model.b)
    return out


def select_on_folds(candidates: dict, labels, folds, metric: str = "ndcg@10") -> tuple[Tensor, dict]:
    """Pick a parameter per fold on the OTHER folds' queries, and score each fold with its pick.

    ``candidates``: ``{parameter: (B, N) scores}`` (e.g. one convex fusion per :math:`\\lambda`);
    ``metric``: a chapter 26 metric name. Returns the held-out ``(B, N)`` scores and ``{fold: parameter}``
    (ties go to the first candidate).
    """
    if not isinstance(candidates, dict) or not candidates:
        raise ValueError("candidates must be a non-empty dict {parameter: (B, N) scores}")
    runs = {p: _scores(s, f"candidates[{p!r}]") for p, s in candidates.items()}
    first = next(iter(runs.values()))
    folds = _folds(folds, first.shape[0])
    per_query = {p: evaluate(s, labels, metrics=(metric,), reduction="none")[metric] for p, s in runs.items()}
    out, chosen = torch.empty_like(first), {}
    for f in folds.unique().tolist():
        test = folds == f
        if test.all():
            raise ValueError("folds must hold at least two folds (one to choose on, one to score)")
        best = max(per_query, key=lambda p: (float(per_query[p][~test].mean()), -list(runs).index(p)))
        chosen[f] = best
        out[test] = runs[best][test]
    return out, chosen
