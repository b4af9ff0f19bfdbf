r"""Chinchilla's runs and its Approach 2: isoFLOP profiles, their minima and the allocation exponent.

:func:`load_chinchilla_runs` reads the 245 training runs of Hoffmann et al. (2022) that Besiroglu et al.
(2024, arXiv:2404.10102) reconstructed from the paper's Figure 4 (``llmbook/data/chinchilla_runs.csv``,
with its source in the file's header). Fitting the parametric law to them is
:func:`llmbook.lm.scaling.fit_parametric_law` (Approach 3).

**Approach 2** fixes a compute budget :math:`C_k`, trains models of several sizes with it, and fits a
parabola to the final loss against :math:`x = \ln N`:

.. math:: L \approx c_0 + c_1 x + c_2 x^2,\qquad \ln N_{opt}(C_k) = -\frac{c_1}{2 c_2}\quad (c_2 > 0),

then a straight line through the minima, :math:`\ln N_{opt} = a \ln C + \ln k`, whose slope :math:`a` is
the exponent of :math:`N_{opt} \propto C^{a}` (Hoffmann et al.'s Approach 2 gave :math:`a = 0.49`).
:func:`isoflop_groups` assigns runs to budgets, :func:`isoflop_minima` fits the parabolas and
:func:`fit_allocation_exponent` the line.

>>> runs = load_chinchilla_runs()
>>> groups = isoflop_groups(runs["C"], [1e19, 1e20, 1e21], tol=0.05)
>>> [int((groups == k).sum()) for k in range(3)]
[26, 16, 16]
"""

from __future__ import annotations

import math
from importlib import resources

import numpy as np

__all__ = ["HOFFMANN_BUDGETS", "load_chinchilla_runs", "isoflop_groups", "isoflop_minima", "fit_allocation_exponent"]

#: The nine isoFLOP budgets of Hoffmann et al. (2022, Figure 3), in FLOPs.
HOFFMANN_BUDGETS = (6e18, 1e19, 3e19, 6e19, 1e20, 3e20, 6e20, 1e21, 3e21)


def load_chinchilla_runs() -> dict[str, np.ndarray]:
    r"""The 245 reconstructed Chinchilla runs: a dict of float64 arrays of shape ``(245,)``.

    Keys: ``"N"`` parameters, ``"C"`` training FLOPs, ``"D"`` tokens (:math:`D = C / 6N`, as the
    replication computed them) and ``"L"`` the final loss (nats per token). The points were read off
    Figure 4 of Hoffmann et al. (2022) by Besiroglu et al. (2024) (repository
    ``epoch-research/analyzing-chinchilla``, commit 9225883, ``data/svg_extracted_data.csv``); the loss was
    decoded from each marker's colour, so it takes a limited set of values (steps of about 0.01 nats).

    >>> runs = load_chinchilla_runs()
    >>> runs["N"].shape, round(float(runs["L"].min()), 3), f"{runs['C'].max():.3g}"
    ((245,), 2.077, '1.3e+22')
    """
    text = resources.files("llmbook.data").joinpath("chinchilla_runs.csv").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line and not line.startswith("#")]
    header = rows[0].split(",")
    values = np.array([[float(v) for v in row.split(",")] for row in rows[1:]], dtype=np.float64)
    return {name: values[:, j].copy() for j, name in enumerate(header)}


def _vector(x, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {x.shape}")
    if not np.isfinite(x).all() or (x <= 0).any():
        raise ValueError(f"{name} must be finite and positive")
    return x


def isoflop_groups(C, budgets=HOFFMANN_BUDGETS, *, tol: float = 0.05) -> np.ndarray:
    r"""The isoFLOP group of each run: the index of the budget within ``tol`` decades of its compute, or -1.

    Run :math:`i` joins budget :math:`k` when :math:`|\log_{10} C_i - \log_{10} C_k| \le` ``tol`` (the
    nearest budget if several qualify); runs near no budget get -1. ``C`` of shape ``(n,)`` and ``budgets``
    of shape ``(K,)``, positive; ``tol > 0``. Returns an int64 array of shape ``(n,)``.

    >>> isoflop_groups([1.05e19, 2e19, 9.5e19], [1e19, 1e20]).tolist()
    [0, -1, 1]
    """
    C, budgets = _vector(C, "C"), _vector(budgets, "budgets")
    if not (isinstance(tol, (int, float)) and math.isfinite(tol) and tol > 0):
        raise ValueError(f"tol must be a positive number of decades, got {tol!r}")
    dist = np.abs(np.log10(C)[:, None] - np.log10(budgets)[None, :])
    k = dist.argmin(1)
    return np.where(dist[np.arange(C.size), k] <= tol, k, -1).astype(np.int64)


def isoflop_minima(N, C, L, groups) -> dict[str, np.ndarray]:
    r"""Fit :math:`L = c_0 + c_1 \ln N + c_2 (\ln N)^2` in each isoFLOP group and return its minimum.

    ``N``, ``C``, ``L`` of shape ``(n,)`` (parameters, FLOPs, loss), ``groups`` of shape ``(n,)`` from
    :func:`isoflop_groups` (-1 is left out). Each group needs at least 3 runs and an upward parabola
    (:math:`c_2 > 0`). The least-squares problem is solved by its normal equations in the centred
    variable :math:`u = \ln N - \overline{\ln N}`, then mapped back to :math:`\ln N`.
    Returns a dict over the :math:`K` groups present, in increasing group index: ``"group"`` (K,),
    ``"C"`` (K,) the geometric mean compute of the group's runs, ``"N_opt"`` (K,) :math:`\exp(-c_1/2c_2)`,
    ``"L_opt"`` (K,) the parabola's minimum, ``"coef"`` (K, 3) :math:`(c_2, c_1, c_0)` (numpy.polyfit's order)
    and ``"n"`` (K,) runs per group.

    >>> x = np.log(np.array([1e8, 2e8, 4e8, 8e8]))
    >>> out = isoflop_minima(np.exp(x), [1e19] * 4, 2 + 0.1 * (x - np.log(3e8)) ** 2, [0] * 4)
    >>> f"{out['N_opt'][0]:.4g}", round(float(out["L_opt"][0]), 6)
    ('3e+08', 2.0)
    """
    N, C, L = _vector(N, "N"), _vector(C, "C"), _vector(L, "L")
    groups = np.asarray(groups)
    if not (N.shape == C.shape == L.shape == groups.shape):
        raise ValueError(f"N, C, L and groups must have one shape, got {N.shape}, {C.shape}, {L.shape}, {groups.shape}")
    if not np.issubdtype(groups.dtype, np.integer):
        raise TypeError(f"groups must be integers (from isoflop_groups), got dtype {groups.dtype}")
    out = {key: [] for key in ("group", "C", "N_opt", "L_opt", "coef", "n")}
    for k in np.unique(groups[groups >= 0]):
        m = groups == k
        if m.sum() < 3:
            raise ValueError(f"group {k} has {int(m.sum())} runs; a parabola needs at least 3")
        x, y = np.log(N[m]), L[m]
        mu = x.mean()
        V = np.stack([np.ones_like(x), x - mu, (x - mu) ** 2], 1)
        d0, d1, d2 = np.linalg.solve(V.T @ V, V.T @ y)  # y = d0 + d1 u + d2 u^2, u = x - mu
        if not d2 > 0:
            raise ValueError(f"group {k}: the fitted parabola opens downwards (c2 = {d2:.3g}); no minimum")
        u_opt = -d1 / (2 * d2)
        coef = (d2, d1 - 2 * d2 * mu, d0 - d1 * mu + d2 * mu**2)  # expand in x = u + mu
        out["group"].append(int(k)), out["C"].append(math.exp(np.log(C[m]).mean()))
        out["N_opt"].append(math.exp(mu + u_opt)), out["L_opt"].append(d0 - d1**2 / (4 * d2))
        out["coef"].append(coef), out["n"].append(int(m.sum()))
    if not out["group"]:
        raise ValueError("no run belongs to a group (all groups are -1)")
    return {key: np.array(v, dtype=np.int64 if key in ("group", "n") else np.float64) for key, v in out.items()}


def fit_allocation_exponent(C, N_opt) -> dict[str, float]:
    r"""Least-squares line :math:`\ln N_{opt} = a \ln C + \ln k` through the isoFLOP minima, with its standard error.

    ``C``, ``N_opt`` of shape ``(K,)``, positive, :math:`K \ge 3` with at least two distinct budgets.
    :math:`a = \sum (x_i - \bar x)(y_i - \bar y) / \sum (x_i - \bar x)^2` with :math:`x = \ln C,\ y = \ln N_{opt}`;
    the standard error of :math:`a` is :math:`\sqrt{\frac{\sum r_i^2}{K-2} / \sum (x_i - \bar x)^2}` from the
    residuals :math:`r_i`. Returns ``{"a", "log_k", "se_a"}`` (floats); :math:`D_{opt} = C/(6N_{opt})`
    then grows as :math:`C^{1-a}`.

    >>> C = np.array([1e19, 1e20, 1e21, 1e22]); fit = fit_allocation_exponent(C, 0.1 * C ** 0.5)
    >>> round(fit["a"], 6), round(math.exp(fit["log_k"]), 6), round(fit["se_a"], 6)
    (0.5, 0.1, 0.0)
    """
    C, N_opt = _vector(C, "C"), _vector(N_opt, "N_opt")
    if C.shape != N_opt.shape or C.size < 3:
        raise ValueError(f"C and N_opt must have one shape with at least 3 budgets, got {C.shape} and {N_opt.shape}")
    x, y = np.log(C), np.log(N_opt)
    if np.ptp(x) == 0:
        raise ValueError("C must take at least two distinct values")
    sxx = ((x - x.mean()) ** 2).sum()
    a = float(((x - x.mean()) * (y - y.mean())).sum() / sxx)
    log_k = float(y.mean() - a * x.mean())
    r = y - (a * x + log_k)
    return {"a": a, "log_k": log_k, "se_a": float(math.sqrt((r @ r) / (C.size - 2) / sxx))}
