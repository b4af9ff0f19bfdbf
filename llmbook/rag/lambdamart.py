r"""LambdaMART as practitioners run it: LightGBM's ``lambdarank`` objective on padded lists (chapter 25).

LambdaMART {Burges 2010} fits gradient-boosted regression trees to LambdaRank's per-document gradients
(25.08): at boosting round :math:`m` every candidate :math:`i` of a list gets

.. math:: \lambda_i=\sum_{j:\,y_i>y_j}\lambda_{ij}-\sum_{j:\,y_j>y_i}\lambda_{ji},\qquad
          \lambda_{ij}=\frac{-\sigma}{1+e^{\sigma(s_i-s_j)}}\,|\Delta NDCG_{ij}|

(:func:`llmbook.rag.ranking.lambdarank_lambdas`), and the next tree :math:`f_m` is fitted to them, so the
score is :math:`s(x) = \sum_m \eta f_m(x)`. The trees are LightGBM's (``objective="lambdarank"``); this
module is the glue between the book's ``(B, N, d)`` padded lists and LightGBM's flat rows plus *group
sizes* (the number of rows of each query, in order): chapter 25 trains on the dev questions and scores the test
questions (:func:`lambdamart_fit_predict`); :func:`lambdamart_cross_fit` is the k-fold protocol for a collection
without a split.

Everything is deterministic: ``seed``, ``deterministic=True``, ``num_threads=1`` and ``force_row_wise=True``
are always passed, so two runs give identical scores. LightGBM is imported when a model is trained.

>>> import torch
>>> rows, labels, group = flatten_lists(torch.arange(12.).reshape(2, 3, 2), torch.tensor([[2, 0, 1], [1, 0, 0]]),
...                                     torch.tensor([[True, True, False], [True, True, True]]))
>>> rows.shape, labels.tolist(), group.tolist()
((5, 2), [2, 0, 1, 0, 0], [2, 3])
"""

from __future__ import annotations

import math

import numpy as np
import torch

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_range

__all__ = ["flatten_lists", "lambdamart_params", "lambdamart_fit_predict", "lambdamart_cross_fit"]


def _check_lists(H, y, mask) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    H = as_tensor(H, "H")
    check_dim(H, "H", "(B, N, d)", min_dim=3, max_dim=3)
    check_finite(H, "H")
    B, N, _ = H.shape
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (B, N):
        raise ValueError(f"mask must be a bool tensor of shape (B, N) = {(B, N)} (True on real candidates), "
                         f"got {getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    if y is not None:
        y = as_tensor(y, "y")
        if y.shape != (B, N):
            raise ValueError(f"y must be (B, N) = {(B, N)} like H's first two dims, got {tuple(y.shape)}")
        check_finite(y, "y")
        real = y[mask]
        if real.numel() and (real.min().item() < 0 or (real != real.round()).any().item()):
            raise ValueError("y must hold non-negative integer grades on the real candidates (LightGBM's "
                             f"lambdarank labels), got values in [{real.min().item():g}, {real.max().item():g}]")
    return H, y, mask


def flatten_lists(H, y, mask) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Padded lists to LightGBM's layout: ``rows`` ``(M, d)``, ``labels`` ``(M,)`` int, ``group`` ``(B',)`` int.

    ``H`` ``(B, N, d)`` features, ``y`` ``(B, N)`` integer grades (or ``None`` when only predicting), ``mask``
    ``(B, N)`` bool. The real candidates of list 0 come first, in their order, then those of list 1, ...;
    ``group[b]`` is the number of real candidates of the ``b``-th non-empty list (lists without a candidate
    are skipped, LightGBM refuses empty groups), so ``group.sum() == M == mask.sum()``.
    """
    H, y, mask = _check_lists(H, y, mask)
    rows = H[mask].double().numpy()
    sizes = mask.sum(1).numpy().astype(np.int64)
    labels = None if y is None else y[mask].numpy().astype(np.int64)
    return rows, labels, sizes[sizes > 0]


def lambdamart_params(*, n_leaves: int = 7, eta: float = 0.05, min_rows_in_leaf: int = 20, seed: int = 0) -> dict:
    """LightGBM's parameters for LambdaMART, with every switch that makes it deterministic.

    ``n_leaves`` leaves per tree, ``eta`` the shrinkage :math:`\\eta`, ``min_rows_in_leaf`` the smallest leaf;
    the NDCG of the lambdas has LightGBM's default exponential gain :math:`2^y - 1`.
    """
    return {"objective": "lambdarank", "num_leaves": check_int(n_leaves, "n_leaves", low=2),
            "learning_rate": check_range(eta, "eta", 0.0, math.inf, low_open=True),
            "min_data_in_leaf": check_int(min_rows_in_leaf, "min_rows_in_leaf", low=1),
            "seed": check_int(seed, "seed", low=0), "deterministic": True, "num_threads": 1,
            "force_row_wise": True, "verbosity": -1}


def lambdamart_fit_predict(H_train, y_train, mask_train, H_test, mask_test, *, n_trees: int = 100,
                           **params) -> torch.Tensor:
    """Train LambdaMART on the training lists and score the test lists: ``(B_test, N_test)`` float64.

    ``H_*`` ``(B, N, d)`` features (the same ``d``), ``y_train`` ``(B, N)`` integer grades, ``mask_*`` ``(B, N)``
    bool; ``n_trees`` boosting rounds; ``params`` go to :func:`lambdamart_params`. Padding gets ``-inf``.
    """
    import lightgbm

    rows, labels, group = flatten_lists(H_train, y_train, mask_train)
    H_test, _, mask_test = _check_lists(H_test, None, mask_test)
    if H_test.shape[-1] != rows.shape[1]:
        raise ValueError(f"H_test has {H_test.shape[-1]} features, H_train {rows.shape[1]}: they must match")
    if rows.shape[0] == 0:
        raise ValueError("the training lists hold no real candidate (mask_train is all False)")
    n_trees = check_int(n_trees, "n_trees", low=1)
    data = lightgbm.Dataset(rows, label=labels, group=group, params={"verbosity": -1})
    booster = lightgbm.train(lambdamart_params(**params), data, num_boost_round=n_trees)
    out = torch.full(mask_test.shape, -math.inf, dtype=torch.float64)
    if mask_test.any():
        out[mask_test] = torch.from_numpy(booster.predict(H_test[mask_test].double().numpy()))
    return out


def lambdamart_cross_fit(H, y, mask, fold, *, n_trees: int = 100, **params) -> torch.Tensor:
    """Held-out LambdaMART scores: each fold's lists scored by a model trained on all the other folds.

    ``fold`` ``(B,)`` integer fold of each list (e.g. ``arange(B) % 2`` for two folds). Returns
    ``(B, N)`` float64, ``-inf`` on padding; every score comes from a model that never saw its list.

    >>> g = torch.Generator().manual_seed(0)
    >>> H = torch.randn(8, 10, 1, generator=g, dtype=torch.float64); y = (H[..., 0] > 0.5).long()
    >>> s = lambdamart_cross_fit(H, y, torch.ones(8, 10, dtype=torch.bool), torch.arange(8) % 2, n_trees=5,
    ...                          min_rows_in_leaf=2)
    >>> s.shape, bool(torch.isfinite(s).all())
    (torch.Size([8, 10]), True)
    """
    H, y, mask = _check_lists(H, y, mask)
    fold = as_tensor(fold, "fold", floating=False)
    if fold.shape != (H.shape[0],) or fold.is_floating_point() or fold.is_complex() or fold.dtype == torch.bool:
        raise ValueError(f"fold must be an integer tensor of shape (B,) = ({H.shape[0]},), got {fold.dtype} "
                         f"{tuple(fold.shape)}")
    folds = torch.unique(fold).tolist()
    if len(folds) < 2:
        raise ValueError(f"fold must name at least 2 folds (a list is never scored by a model trained on it), "
                         f"got {folds}")
    out = torch.full(mask.shape, -math.inf, dtype=torch.float64)
    for f in folds:
        test = fold == f
        out[test] = lambdamart_fit_predict(H[~test], y[~test], mask[~test], H[test], mask[test], n_trees=n_trees,
                                           **params)
    return out
