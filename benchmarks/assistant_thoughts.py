"""Grounded thoughts for the book's assistant (issue 24's 80 % tool-use target): a measurement, not a recipe.

The committed assistant fails three kinds of held-out task in three ways (chapter 40's failure modes): on
``notes`` it copies the value of the wrong person, on ``chain`` it answers the looked-up age without the
calculator, and on ``calc`` it miscopies a five-digit result while restating it in its last thought. Its
demonstrations' thoughts carry nothing the next action needs ("The notes state it for Mira Quin.").

Protocol: the recipe's own stages (``llmbook.lm.assistant_recipe``, default config: the same tokenizer size,
pre-training, and, at the time, 1400 SFT steps over 8000 demonstrations), with one change: the demonstrations'
thoughts are *grounded* (``demonstration(..., grounded=True)``): the notes' sentence about the person asked
about is copied into the thought, a chain's first thought states the operation and operand, and no thought
restates an observation before the answer. Then the recipe's held-out evaluation (the same 300 held-out
tasks, greedy, float64), compared task by task with the committed SFT evaluation in
``llmbook/data/assistant_log.json`` (paired bootstrap and sign-flip permutation,
``llmbook.rag.significance.compare``). The stage times are printed and stored; they are only meaningful on
an otherwise idle 2-core machine.

Measured (``benchmarks/results/assistant_thoughts.json``, one run, on a 2-core machine shared with other
work, so its stage times say nothing about the recipe's budget): the grounded thoughts made SFT *worse*,
0.397 against 0.537 on all 300 held-out tasks (-0.140 [-0.200, -0.077], p = 0.0001) and 0.589 against 0.728
on the 180 tool-use tasks (-0.139 [-0.222, -0.056]). Only ``chain`` moved up (0.50 -> 0.55); ``lookup``
fell from 0.93 to 0.52 (wrong calls and format errors), ``notes`` from 0.38 to 0.22 (the copied note
was still the wrong person's in 47 of 60), and ``refuse`` from 0.12 to 0. One seed cannot separate the
format from the run's other changes (a different tokenizer, trained on the new demonstrations), but the
hypothesis that thoughts which quote what the action needs are enough at this size is not supported.

**A record of an earlier recipe.** The stored result (``benchmarks/results/assistant_thoughts.json``) was measured
with the recipe and the assistant of commit a2c8920: three or four question templates per kind in the training
split, 1400 SFT steps over 8000 demonstrations, one padded batch per step. Its "committed_sft" baseline is that
assistant's SFT evaluation, not the one in today's ``assistant_log.json``. The recipe has since changed
(compositional training templates, 1600 steps over 16,000 demonstrations, length-sorted chunks), so re-running the
script now measures a different question; the stored numbers are kept as the record of what was measured then.

Usage::

    python benchmarks/assistant_thoughts.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llmbook.lm import assistant_recipe as R
from llmbook.lm.assistant import Assistant
from llmbook.rag.significance import compare

TOOL_KINDS = ("calc", "lookup", "chain")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=R.RecipeConfig().sft_steps)
    ap.add_argument("--examples", type=int, default=R.RecipeConfig().sft_examples)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    cfg = R.RecipeConfig(sft_steps=args.steps, sft_examples=args.examples)
    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)
    seconds, clock = {}, time.perf_counter()

    def done(stage):
        nonlocal clock
        seconds[stage] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()
        print(f"[{stage}] {seconds[stage]} s", flush=True)

    tok, text, _ = R.train_tokenizer(cfg, grounded=True)
    done("tokenizer")
    model, _, _ = R.pretrain(cfg, tok, text)
    done("pretrain")
    log = {"stages": {}}
    model = R._sft(cfg, model, tok, log, grounded=True)
    done("sft")
    ev = R.evaluate(Assistant(model, tok), R.heldout_tasks(cfg), max_new_tokens=cfg.episode_tokens, agent=True)
    done("evaluation")
    base = R.read_assistant_log()["stages"]["sft"]["heldout"]
    kinds, new, old = ev["kinds"], ev["reward"], base["reward"]
    tool = [i for i, k in enumerate(kinds) if k in TOOL_KINDS]
    result = {"benchmark": "assistant_thoughts", "sft_steps": args.steps, "sft_examples": args.examples,
              "seconds": seconds, "final_sft_loss": log["stages"]["sft"]["loss"][-1],
              "by_kind": {k: [sum(r for r, kk in zip(rs, kinds, strict=True) if kk == k) / kinds.count(k)
                              for rs in (old, new)] for k in sorted(set(kinds))},
              "format_error_episodes": sum(1 for f in ev["format_errors"] if f),
              "closed_book": sum(ev["closed_book"]) / len(kinds), "failure_modes": ev["failure_mode"],
              "act_only": ev["act_only"], "reward": new}
    for name, idx in (("all", range(len(kinds))), ("tool_use", tool)):
        a = torch.tensor([new[i] for i in idx], dtype=torch.float64)
        b = torch.tensor([old[i] for i in idx], dtype=torch.float64)
        result[name] = {"committed_sft": float(b.mean()), "grounded_sft": float(a.mean()), "n": len(a),
                        "difference": str(compare(a, b))}
        print(f"{name:9s} committed SFT {float(b.mean()):.3f}, grounded thoughts {float(a.mean()):.3f}; "
              f"{compare(a, b)}")
    print("by kind (committed, grounded):", {k: [round(x, 3) for x in v] for k, v in result["by_kind"].items()})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "assistant_thoughts.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
