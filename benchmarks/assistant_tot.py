"""Tree of Thoughts with the book's assistant: the assistant proposes the steps, a rater made from it scores them.

Chapter 40's equation 40.05 scores a path of thoughts by the sum of a value model's ratings. Yao et al. prompt the
same LLM to rate each partial solution; the book's assistant was never taught to rate, so this script teaches a
copy of it, then searches with it (``llmbook.agents.tree_of_thoughts``):

1. **Rating data**, with no held-out task: the committed assistant (float32) samples one episode at temperature 1
   for each of ``--tasks`` training-template and as many ``rl``-template tasks (seeds 50,000 and 51,000, fresh
   people and numbers); every state of every episode is labelled by ``step_is_good`` against the task's gold plan,
   and each action also gets a near miss (one digit or word changed), the mistakes the model's samples rarely show.
2. **The rater**: ``train_rater`` fine-tunes a copy of the assistant on those states for ``--steps`` steps
   (class-balanced batches of 32, AdamW at 1e-3 with warm-up and cosine). It is saved as
   ``llmbook/data/assistant_rater.pt``, the assistant's format, so ``load_assistant(path)`` reads it.
3. **How well it rates**: the committed assistant samples one episode per held-out task (seed 53,000); the AUROC
   of the rater's value against the gold labels of those states, overall and by kind (scikit-learn's
   ``roc_auc_score``), with a bootstrap interval over tasks; and, for every right step with an action, whether
   the rater values it above its near miss (the same step with one digit or word changed, ``perturbed_states``).
4. **The search**: ToT-BFS on the 300 held-out tasks (k = 4 proposals: the greedy turn and 3 sampled at
   temperature 1; beam 2; at most 4 steps; seed 54,000), in float64, with three evaluators: the rater; the
   assistant's own log-probability of the turn (beam search over log-probabilities, the control); and the gold
   labels (a perfect evaluator, the ceiling a rater could reach with these proposals). Each is compared task by
   task with the greedy ReAct episode of the committed log (``llmbook.rag.significance.compare``).
   The first 12 held-out tasks are also searched on their own with the rater (a search's samples depend on its
   batch), so that chapter 40 can re-run that call and compare.

Deterministic kernels on 2 threads; the stored run took about 5 minutes on 2 cores, and a rerun wrote a
bit-identical rater. Usage::

    python benchmarks/assistant_tot.py
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from _common import Progress
from sklearn.metrics import roc_auc_score

from llmbook.agents.agent_loop import run_agent
from llmbook.agents.assistant_tasks import make_tasks
from llmbook.agents.tree_of_thoughts import (
    RATER,
    episode_states,
    logprob_value,
    perturbed_states,
    rater_values,
    rating_examples,
    train_rater,
    tree_of_thoughts,
)
from llmbook.lm.assistant import load_assistant, save_assistant
from llmbook.lm.assistant_recipe import heldout_tasks, read_assistant_log
from llmbook.lm.training import _data_dir
from llmbook.rag.significance import compare

CHECK = 12  # held-out tasks searched again on their own, for the chapter's live check
TOT = {"k": 4, "beam": 2, "max_steps": 4, "temperature": 1.0, "seed": 54_000}


def gold_value(states) -> list[float]:
    """A perfect evaluator: 0 for a state whose last step is good, -10 for a bad one (the gold labels)."""
    return [0.0 if episode_states(s)[-1][1] else -10.0 for s in states]


def auroc_by_task(scores, labels, task_of, n_boot=2000, seed=0):
    """AUROC and a 95% bootstrap interval that resamples tasks (the states of one episode are not independent)."""
    scores, labels, task_of = map(np.asarray, (scores, labels, task_of))
    tasks = np.unique(task_of)
    rows = {t: np.flatnonzero(task_of == t) for t in tasks}
    rng, boot = np.random.default_rng(seed), []
    for _ in range(n_boot):
        idx = np.concatenate([rows[t] for t in rng.choice(tasks, len(tasks))])
        if 0 < labels[idx].sum() < len(idx):
            boot.append(roc_auc_score(labels[idx], scores[idx]))
    return float(roc_auc_score(labels, scores)), [float(x) for x in np.quantile(boot, [0.025, 0.975])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--heldout", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--weights", type=Path, default=_data_dir() / RATER)  # where load_rater() reads it
    args = ap.parse_args()
    say = Progress()  # deterministic kernels on 2 threads; prints the seconds since the start

    a32 = load_assistant(dtype=torch.float32)
    train = make_tasks(args.tasks, seed=50_000, split="train") + make_tasks(args.tasks, seed=51_000, split="rl")
    episodes = run_agent(a32, train, temperature=1.0, seed=52_000)
    examples = rating_examples(episodes, near_misses=True, seed=52_001)
    say(f"{len(examples)} rating examples, {sum(g for _, g in examples)} good")
    rater, losses = train_rater(a32, examples, steps=args.steps, progress=say)
    save_assistant(rater.model, rater.tok, args.weights)
    rater64 = load_assistant(args.weights)  # float64, as the chapter loads it
    a64 = load_assistant()

    held = heldout_tasks(n=args.heldout)
    probe = run_agent(a64, held, temperature=1.0, seed=53_000)
    states, labels, task_of, kinds = [], [], [], []
    for j, tr in enumerate(probe):
        for state, good in episode_states(tr):
            states.append(state)
            labels.append(good)
            task_of.append(j)
            kinds.append(tr.task.kind)
    values = rater_values(rater64, states)
    rating = {"states": len(states), "good": int(sum(labels)), "auroc": auroc_by_task(values, labels, task_of)}
    for kind in dict.fromkeys(kinds):
        sel = [i for i, k in enumerate(kinds) if k == kind]
        ys = [labels[i] for i in sel]
        rating[kind] = {"states": len(sel), "good": int(sum(ys)),
                        "auroc": auroc_by_task([values[i] for i in sel], ys, [task_of[i] for i in sel])
                        if 0 < sum(ys) < len(ys) else None}
    say(f"rater AUROC on held-out states {rating['auroc']}")
    # near misses of the same states: does the rater prefer a right step to that step with one detail changed?
    rng, right, near, pair_kind = random.Random(53_001), [], [], []
    for tr in probe:
        for (state, good), x in zip(episode_states(tr), perturbed_states(tr, rng), strict=True):
            if good and x is not None and not x[1]:
                right.append(state)
                near.append(x[0])
                pair_kind.append(tr.task.kind)
    prefer = [r > n for r, n in zip(rater_values(rater64, right), rater_values(rater64, near), strict=True)]
    rating["near_miss"] = {k: [sum(p for p, kk in zip(prefer, pair_kind, strict=True) if kk == k), pair_kind.count(k)]
                           for k in dict.fromkeys(pair_kind)}
    say(f"right step preferred to its near miss in {sum(prefer)} of {len(prefer)} pairs")

    greedy = read_assistant_log()["stages"]["grpo"]["heldout"]["reward"][:args.heldout]
    runs, rated, answers = {}, {}, {}
    for name, value in (("rater", lambda s: rater_values(rater64, s)), ("logprob", logprob_value(a64)),
                        ("gold", gold_value)):
        res = tree_of_thoughts(a64, value, held, **TOT)
        runs[name] = [r.trajectory.reward for r in res]
        rated[name] = [r.rated for r in res]
        answers[name] = [r.trajectory.answer for r in res]
        say(f"ToT with the {name} evaluator: {np.mean(runs[name]):.3f} (greedy {np.mean(greedy):.3f}); "
            f"{compare(runs[name], greedy)}")
    check = tree_of_thoughts(a64, lambda s: rater_values(rater64, s), held[:CHECK], **TOT)  # the chapter re-runs it
    result = {"check": {"n": CHECK, "turns": [r.trajectory.turns for r in check], "values": [r.values for r in check]},
              "benchmark": "assistant_tot", "tot": TOT, "rater_steps": args.steps, "rater_tasks": 2 * args.tasks,
              "rating_examples": len(examples), "rating_examples_good": int(sum(g for _, g in examples)),
              "rater_loss": [round(x, 4) for x in losses], "rating": rating, "kinds": [t.kind for t in held],
              "greedy": greedy, "tot_reward": runs, "tot_rated": rated, "tot_answer": answers,
              "minutes": say.minutes()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "assistant_tot.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
