"""Learning rate, schedule and optimiser on a small TinyGPT: AdamW with cosine or WSD, and Muon (chapter 8).

Protocol: a 2-layer TinyGPT (``d_model = 64``, 4 heads, SwiGLU width 172, context 64) on the book's
character corpus (``llmbook.lm.training.corpus_tokens``: the first 90 % for training, the last 10 % held
out), ``--steps`` steps of ``B = 16`` random windows, global clipping at 1, a linear warm-up over the first
10 % of the steps, and three set-ups, each at three peak learning rates and ``--seeds`` seeds:

* ``adamw-cosine``: ``op.AdamW`` (betas 0.9, 0.95; decay 0.1 on matrices), ``sc.warmup_cosine`` to 10 %;
* ``adamw-wsd``: the same AdamW, ``sc.warmup_stable_decay`` (constant, then linear decay to 10 % over
  the last 20 % of the steps);
* ``muon-wsd``: ``llmbook.lm.muon.Muon`` on the blocks' weight matrices (its peak rate is the swept one),
  ``op.AdamW`` at peak 3e-3 on the embedding, the output head and the norm gains; both under the WSD
  schedule.

Seed ``s`` fixes the initialisation (``torch.manual_seed(s)``) and the batches (a generator seeded with
``s + 1``), the same for every set-up, so runs with the same seed are paired. The held-out loss is the mean
cross-entropy over the first 128 non-overlapping windows of 64 characters of the held-out text (8,192
characters, 8,192 predictions), recorded per window so that set-ups can be compared window by window. One
thread; on the shared 2-core machine that wrote ``results/lr_sweep.json`` the default took about 10 minutes.

Usage::

    python benchmarks/lr_sweep.py [--steps 120] [--seeds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from _common import machine

from llmbook.lm import optim as op
from llmbook.lm import schedules as sc
from llmbook.lm import training as tr
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.muon import Muon
from llmbook.lm.probability import cross_entropy_loss

MODEL = GPTConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, d_ff=172, max_seq_len=64)
B, T, N_WINDOWS = 16, 64, 128
RATES = {"adamw-cosine": [1e-3, 3e-3, 1e-2], "adamw-wsd": [1e-3, 3e-3, 1e-2], "muon-wsd": [0.01, 0.03, 0.1]}
ADAMW_LR_WITH_MUON = 3e-3


def heldout_windows(heldout_ids) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(heldout_ids[:N_WINDOWS * T + 1], dtype=torch.long)
    return ids[:-1].reshape(N_WINDOWS, T), ids[1:].reshape(N_WINDOWS, T)


def schedule(setup: str, t: int, steps: int, eta_max: float) -> float:
    T_warm = steps // 10
    if setup.endswith("cosine"):
        return sc.warmup_cosine(t, T_warm, steps, eta_max, 0.1 * eta_max)
    return sc.warmup_stable_decay(t, T_warm, steps, eta_max, 0.1 * eta_max, decay_fraction=0.2)


def run(setup: str, eta_max: float, seed: int, steps: int, train_ids, windows) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(MODEL)
    if setup.startswith("muon"):
        hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
        ids = {id(p) for p in hidden}
        rest = [p for p in model.parameters() if id(p) not in ids]
        opts = [(Muon(hidden, lr=eta_max, weight_decay=0.1), eta_max),
                (op.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": 0.1},
                           {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                          lr=ADAMW_LR_WITH_MUON, betas=(0.9, 0.95)), ADAMW_LR_WITH_MUON)]
    else:
        params = list(model.parameters())
        opts = [(op.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                           {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                          lr=eta_max, betas=(0.9, 0.95)), eta_max)]
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    model.train()
    for t in range(steps):
        x, y = tr.get_batch(train_ids, B, T, gen)
        loss = cross_entropy_loss(model(x), y)
        for opt, _ in opts:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        sc.clip_grad_norm_(model.parameters(), 1.0)
        for opt, peak in opts:
            for group in opt.param_groups:
                group["lr"] = schedule(setup, t, steps, peak)
            opt.step()
        losses.append(round(loss.item(), 5))
    model.eval()
    x, y = windows
    with torch.no_grad():
        per_window = cross_entropy_loss(model(x), y, reduction="none").mean(-1)
    return {"setup": setup, "eta_max": eta_max, "seed": seed, "train_loss": losses,
            "heldout_windows": [round(v, 6) for v in per_window.tolist()],
            "heldout_loss": round(float(per_window.mean()), 6)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _, train_ids, heldout_ids = tr.corpus_tokens()
    windows = heldout_windows(heldout_ids)
    runs, t0 = [], time.perf_counter()
    for setup, rates in RATES.items():
        for eta_max in rates:
            for seed in range(args.seeds):
                runs.append(run(setup, eta_max, seed, args.steps, train_ids, windows))
                print(f"{setup:13s} eta_max {eta_max:g} seed {seed}: held-out {runs[-1]['heldout_loss']:.4f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"benchmark": "lr_sweep", "model": dataclasses.asdict(MODEL),
              "settings": {"steps": args.steps, "seeds": args.seeds, "B": B, "T": T, "T_warm": args.steps // 10,
                           "eta_min_fraction": 0.1, "wsd_decay_fraction": 0.2, "wsd_shape": "linear",
                           "adamw_betas": [0.9, 0.95], "weight_decay": 0.1, "max_norm": 1.0,
                           "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5,
                                    "adamw_lr_for_other_params": ADAMW_LR_WITH_MUON},
                           "rates": RATES, "heldout": f"first {N_WINDOWS} windows of {T} held-out characters"},
              "n_params": TinyGPT(MODEL).num_parameters(), "runs": runs,
              "machine": machine(threads=1, torch=torch.__version__), "date": time.strftime("%Y-%m-%d"),
              "seconds": round(time.perf_counter() - t0)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lr_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    best = {s: min((np.mean([r["heldout_loss"] for r in runs if r["setup"] == s and r["eta_max"] == e]), e)
                   for e in RATES[s]) for s in RATES}
    print("best mean held-out loss per set-up:", {s: (round(v, 4), e) for s, (v, e) in best.items()})
    print(f"wrote {args.out / 'lr_sweep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
