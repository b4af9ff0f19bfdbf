"""Chapter 11's comparison: every PEFT method and full fine-tuning, one step budget, several seeds.

Protocol: the book's trained tiny GPT (``llmbook.lm.training.pretrained_tiny``) is adapted to chapter 11's
five-line bread recipe with each method, all with the same budget (``--steps`` Adam steps of 4 random windows
of 64 characters, ``llmbook.lm.adapters.train_adapter``), for ``--seeds`` seeds. The seed sets both the
adapter's initialisation (``torch.manual_seed``) and the order of the training windows. Each run reports its
loss on the recipe (what was trained) and on the first 4,096 + 1 characters of the held-out corpus (what the
model knew before; chapter 11's ``heldout``). Differences from LoRA are paired by seed
(``llmbook.rag.significance.compare``: bootstrap interval of the mean difference and sign-flip p-value).
Learning rates are the chapter's, not tuned: 1e-2 for the low-rank methods and BitFit, 3e-2 for prefix,
prompt and IA3, 1e-3 for full fine-tuning (every weight moves, so a smaller step).

Usage::

    python benchmarks/peft_compare.py            # writes benchmarks/results/peft_compare.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from llmbook.lm import adapters, gptq, lora
from llmbook.lm.training import corpus_tokens, evaluate_loss, pretrained_tiny
from llmbook.rag.significance import compare

TEXT = """A recipe for bread, in five lines:
mix flour, water, salt and yeast;
knead the dough for ten minutes;
let it rise until it doubles;
shape it, rise again, then bake
at two hundred degrees for forty minutes.
"""


def _full(m):
    return m  # every parameter stays trainable


def _qlora(m):
    """QLoRA: the whole frozen model in NF4 (blocks of 64), LoRA r = 4 on q and v through NF4 weights."""
    q = gptq.quantize_model(m, "nf", 4)
    lora.add_lora(q, r=4, alpha=8, kind="qlora")
    return q


def setups(tok):
    return {
        "full fine-tuning": (_full, 1e-3),
        "LoRA r=4 (q, v)": (lambda m: lora.add_lora(m, r=4, alpha=8), 1e-2),
        "QLoRA r=4 (q, v), NF4 base": (_qlora, 1e-2),
        "DoRA r=4 (q, v)": (lambda m: lora.add_lora(m, r=4, alpha=8, kind="dora"), 1e-2),
        "prefix P=8": (lambda m: adapters.add_prefix(m, 8), 3e-2),
        "prompt m=8": (lambda m: adapters.PromptedGPT(m, 8, init_ids=torch.tensor(tok.encode("Recipe: "))), 3e-2),
        "IA3": (lambda m: adapters.add_ia3(m), 3e-2),
        "BitFit": (lambda m: adapters.bitfit(m, add_bias=True), 1e-2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base, tok = pretrained_tiny()
    _, _, heldout_ids = corpus_tokens()
    heldout = heldout_ids[:64 * 64 + 1]
    text_ids = np.array(tok.encode(TEXT), dtype=np.int64)
    t0 = time.perf_counter()
    runs = {}
    for name, (make, lr) in setups(tok).items():
        rec = {"lr": lr, "trainable": None, "recipe_loss": [], "heldout_loss": [], "train_curve": []}
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            m = copy.deepcopy(base)
            out = make(m)
            m = out if isinstance(out, torch.nn.Module) else m
            rec["trainable"] = lora.count_trainable(m)
            curve = adapters.train_adapter(m, text_ids, steps=args.steps, lr=lr, B=4, T=64, seed=seed)
            rec["train_curve"].append(curve)
            rec["recipe_loss"].append(evaluate_loss(m, text_ids, 64))
            rec["heldout_loss"].append(evaluate_loss(m, heldout, 64))
        runs[name] = rec
        print(f"{name:28s} recipe {np.mean(rec['recipe_loss']):.3f}  held-out {np.mean(rec['heldout_loss']):.3f}")
    ref = runs["LoRA r=4 (q, v)"]
    for rec in runs.values():
        for key in ("recipe_loss", "heldout_loss"):
            c = compare(rec[key], ref[key], seed=0)
            rec[f"{key}_minus_lora"] = {"mean": c.diff, "low": c.low, "high": c.high, "p": c.p}
    result = {"benchmark": "peft_compare", "steps": args.steps, "seeds": args.seeds, "B": 4, "T": 64,
              "base_recipe_loss": evaluate_loss(base, text_ids, 64),
              "base_heldout_loss": evaluate_loss(base, heldout, 64), "runs": runs,
              "seconds": round(time.perf_counter() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "peft_compare.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
