"""Bootstrap intervals for Chinchilla's Approaches 2 and 3 on the reconstructed runs (chapter 13, section 13.03).

The runs are those of :func:`llmbook.lm.isoflop.load_chinchilla_runs` without the five of highest loss (the
replication's rule, 240 runs). Approach 3: 100 resamples of the 240 runs with replacement
(``numpy.random.default_rng(0)``), each fitted with :func:`llmbook.lm.scaling.fit_parametric_law`; for each we
keep alpha, beta, the allocation exponent a = beta / (alpha + beta) and the optimum N*, D* at Chinchilla's
budget 5.76e23 FLOPs. Approach 2: 1000 resamples of the runs *within* each isoFLOP group
(``default_rng(1)``, the groups of :func:`~llmbook.lm.isoflop.isoflop_groups` with ``tol=0.05``), the
parabola minima and the slope a of :func:`~llmbook.lm.isoflop.fit_allocation_exponent`. The JSON holds the
percentile intervals (2.5 %, 97.5 %) and the medians, rounded; seeded and float64, so it is the same on every
run (a few minutes on one core). Rerun with::

    python benchmarks/chinchilla_bootstrap.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from llmbook.lm import isoflop
from llmbook.lm import scaling as sl

C_CHINCHILLA = 5.76e23
B3, B2 = 100, 1000


def summary(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    lo, med, hi = np.percentile(v, [2.5, 50, 97.5])
    return {"median": float(f"{med:.6g}"), "ci95": [float(f"{lo:.6g}"), float(f"{hi:.6g}")]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = isoflop.load_chinchilla_runs()
    keep = runs["L"] < np.sort(runs["L"])[-5]
    N, C, D, L = (runs[k][keep] for k in ("N", "C", "D", "L"))

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(B3):
        i = rng.integers(0, N.size, N.size)
        fit = sl.fit_parametric_law(N[i], D[i], L[i])
        N_opt, D_opt = sl.chinchilla_optimal(C_CHINCHILLA, **fit)
        rows.append((fit["alpha"], fit["beta"], fit["beta"] / (fit["alpha"] + fit["beta"]), N_opt, D_opt))
    rows = np.array(rows)
    approach3 = {name: summary(rows[:, j]) for j, name in enumerate(("alpha", "beta", "a", "N_opt", "D_opt"))}

    groups = isoflop.isoflop_groups(C, isoflop.HOFFMANN_BUDGETS, tol=0.05)
    rng = np.random.default_rng(1)
    members = [np.flatnonzero(groups == k) for k in np.unique(groups[groups >= 0])]
    slopes = []
    for _ in range(B2):
        idx = np.concatenate([rng.choice(m, m.size) for m in members])
        try:
            m = isoflop.isoflop_minima(N[idx], C[idx], L[idx], groups[idx])
        except ValueError:  # a resample whose parabola opens downwards: count it
            slopes.append(np.nan)
            continue
        slopes.append(isoflop.fit_allocation_exponent(m["C"], m["N_opt"])["a"])
    slopes = np.array(slopes)
    approach2 = {"a": summary(slopes[np.isfinite(slopes)]), "failed_resamples": int(np.isnan(slopes).sum())}

    result = {"benchmark": "chinchilla_bootstrap", "runs": int(N.size), "approach3_resamples": B3,
              "approach2_resamples": B2, "seed_approach3": 0, "seed_approach2": 1, "tol_decades": 0.05,
              "approach3": approach3, "approach2": approach2}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chinchilla_bootstrap.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
