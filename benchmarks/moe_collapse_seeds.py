"""Routing collapse over seeds (chapter 14, claim C13): the toy MoE of ``simulate_routing`` for seeds 0-9.

For each seed, five runs of :func:`llmbook.lm.moe_layer.simulate_routing` with the chapter's settings
(E = 8, K = 2, 256 tokens, ``shared=0.9``, alpha = 0.3, u = 0.003): no balancing for 400 steps (its first
200 steps are the chapter's unbalanced run), the auxiliary loss and the routing bias for 200 steps from the
start, and the auxiliary loss and the routing bias switched on at step 200 of an unbalanced run
(``balance_from=200``, 400 steps). Everything is float64 and seeded, so the JSON is the same on every run
(a minute or so on one CPU core). The chapter shows the JSON; rerun with::

    python benchmarks/moe_collapse_seeds.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llmbook.lm.moe_layer import simulate_routing

SEEDS = list(range(10))
LAST = 20  # the final imbalance is the mean over the last 20 steps of a run


def summary(run, end: int) -> dict:
    """Imbalance, loads and task loss of ``run`` over its steps ``end - LAST`` .. ``end - 1``."""
    window = run.load[end - LAST:end]
    return {"imbalance": round(float(run.imbalance[end - LAST:end].mean()), 6),
            "min_load": int(window.min()),  # the smallest load of any expert at any of those steps
            "final_load": sorted(int(v) for v in run.load[end - 1]),
            "task_loss": round(float(run.main_loss[end - 1]), 6)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seeds = []
    curves = {}
    for seed in SEEDS:
        none = simulate_routing(balance="none", seed=seed, steps=400)
        aux = simulate_routing(balance="aux", seed=seed)
        bias = simulate_routing(balance="bias", seed=seed)
        aux_late = simulate_routing(balance="aux", seed=seed, steps=400, balance_from=200)
        bias_late = simulate_routing(balance="bias", seed=seed, steps=400, balance_from=200)
        assert torch.equal(aux_late.load[:200], none.load[:200]) and torch.equal(bias_late.load[:200], none.load[:200])
        seeds.append({"seed": seed, "start_imbalance": round(float(none.imbalance[0]), 6),
                      "start_load": sorted(int(v) for v in none.load[0]),
                      "none": summary(none, 200), "aux": summary(aux, 200), "bias": summary(bias, 200),
                      "none_400": summary(none, 400), "aux_from_200": summary(aux_late, 400),
                      "bias_from_200": summary(bias_late, 400)})
        if seed == 0:
            curves = {"none": none.imbalance.tolist(), "aux_from_200": aux_late.imbalance.tolist(),
                      "bias_from_200": bias_late.imbalance.tolist()}
        print(f"seed {seed}: start {seeds[-1]['start_imbalance']:.2f}, none {seeds[-1]['none']['imbalance']:.2f}, "
              f"aux {seeds[-1]['aux']['imbalance']:.2f}, bias {seeds[-1]['bias']['imbalance']:.2f}; switched on at "
              f"200: aux {seeds[-1]['aux_from_200']['imbalance']:.2f}, "
              f"bias {seeds[-1]['bias_from_200']['imbalance']:.2f}"
              f" (none at 400: {seeds[-1]['none_400']['imbalance']:.2f})")
    result = {"benchmark": "moe_collapse_seeds",
              "settings": {"E": 8, "K": 2, "N": 256, "C": 16, "shared": 0.9, "alpha": 0.3, "u": 0.003,
                           "steps": 200, "switch_on_at": 200, "steps_after_switch": 200, "last": LAST},
              "seeds": seeds, "curves_seed_0": {k: [round(v, 6) for v in c] for k, c in curves.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "moe_collapse_seeds.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
