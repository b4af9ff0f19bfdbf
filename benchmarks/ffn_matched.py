"""Chapter 6's parameter-matched FFN experiment over seeds: no FFN, a GELU FFN and a SwiGLU FFN.

Full-batch Adam (lr 0.03, 150 steps) on the next character from the previous two, on the book's corpus
(:mod:`llmbook.lm.ffn_experiment`): the two FFNs, each 1,152 weights, from seeds 0-6, and the model without
an FFN from seed 0. Everything is float64 and seeded, so the JSON is the same on every run, up to the last
bits of float64 arithmetic on another CPU (about 10 seconds on one core). The chapter shows the JSON and
re-trains seed 0 to check it; rerun with::

    python benchmarks/ffn_matched.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import save  # this folder is on sys.path (run as python benchmarks/<name>.py)

from llmbook.lm.ffn_experiment import context_counts, run_experiment
from llmbook.lm.training import corpus_tokens

SEEDS = list(range(7))  # the fewest for which a paired sign-flip test can reach p < 0.05 (2 / 2^7 = 0.016)
STEPS = 150


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok, train_ids, heldout_ids = corpus_tokens()
    V = tok.vocab_size
    train, heldout = context_counts(train_ids, V), context_counts(heldout_ids, V)
    t0 = time.perf_counter()
    runs = run_experiment(V, train, heldout, seeds=SEEDS, steps=STEPS)
    for name, rec in runs.items():
        rec["curves"] = [[round(x, 6) for x in c] for c in rec["curves"]]  # for the plot; the finals stay exact
        train_3, heldout_3 = [round(x, 3) for x in rec["train"]], [round(x, 3) for x in rec["heldout"]]
        print(f"{name:<30} train {train_3}  held-out {heldout_3}")
    record = {"benchmark": "ffn_matched", "seeds": SEEDS, "steps": STEPS, "lr": 3e-2, "d": 12, "V": V,
              "contexts": {"train": len(train[0]), "heldout": len(heldout[0])},
              "torch": torch.__version__, "runs": runs}
    print(f"{time.perf_counter() - t0:.1f} s of training")
    save(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
