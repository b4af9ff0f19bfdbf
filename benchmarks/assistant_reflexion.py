"""Reflexion with the book's assistant (chapter 40): lessons the model writes itself, against plain retries.

Protocol (seeded; 2 threads; the assistant as ``load_assistant`` gives it, float64):

* the 300 held-out tasks of the recipe (``assistant_recipe.heldout_tasks``), up to 3 trials each, stopping at
  the first one the verifier accepts (:func:`llmbook.agents.reflexion_loop.reflexion`);
* trial 1 greedy; trials 2 and 3 sampled at temperature 0.7 (seeds 200 and 300), in two arms that differ only
  in the context: ``reflexion`` (the model's own lessons, written after each failure, as a user turn before its
  first turn) and ``retry`` (no lessons);
* per task the JSON stores each arm's solved flag, each trial's answer, reward and truncated steps, and the
  lessons; the chapter computes the comparisons from it and re-writes the first lessons to check the record.

Usage::

    python benchmarks/assistant_reflexion.py    # about 30 seconds on 2 CPU cores
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import save  # this folder is on sys.path (run as python benchmarks/<name>.py)

from llmbook.agents.reflexion_loop import reflexion
from llmbook.lm.assistant import load_assistant
from llmbook.lm.assistant_recipe import heldout_tasks

TRIALS, TEMPERATURE, SEED, MAX_NEW_TOKENS = 3, 0.7, 0, 40


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    assistant, tasks = load_assistant(), heldout_tasks()
    arms = {}
    for arm, memory in (("reflexion", True), ("retry", False)):
        t0 = time.perf_counter()
        arms[arm] = reflexion(assistant, tasks, trials=TRIALS, memory=memory, temperature=TEMPERATURE, seed=SEED,
                              max_new_tokens=MAX_NEW_TOKENS)
        solved = sum(r.solved for r in arms[arm]) / len(tasks)
        print(f"{arm:9s}: solved within {TRIALS} trials {solved:.3f} ({time.perf_counter() - t0:.0f} s)")
    rows = []
    for i, task in enumerate(tasks):
        row = {"kind": task.kind, "question": task.question, "gold": task.answer}
        for arm, recs in arms.items():
            rec = recs[i]
            row[arm] = {"solved": rec.solved, "answers": [tr.answer for tr in rec.trials],
                        "rewards": [tr.reward for tr in rec.trials], "omitted": [tr.omitted for tr in rec.trials]}
        row["lessons"] = arms["reflexion"][i].reflections
        rows.append(row)
    record = {"benchmark": "assistant_reflexion", "tasks": len(tasks), "trials": TRIALS, "temperature": TEMPERATURE,
              "seed": SEED, "max_new_tokens": MAX_NEW_TOKENS, "torch": torch.__version__, "rows": rows}
    save(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
