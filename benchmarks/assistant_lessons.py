"""Lesson demonstrations for Reflexion (chapter 40): a measurement, not the recipe.

Chapter 40 finds that the committed assistant's own lessons add nothing to plain retries: asked what went
wrong, it writes a thought and an action, because it never saw a lesson. This script asks whether lessons help
once the model has seen some. It fine-tunes the committed assistant twice, from the same weights, with the
same steps, batch, learning rate and seed, on the SFT stage's kind of data (``"train"``-split tasks):

* **control**: the gold demonstrations only;
* **lessons**: half of the examples replaced by lesson demonstrations of two kinds, in equal numbers:
  *writing* a lesson (a typical failed attempt for the task's kind, the user turn
  ``reflexion_loop.ASK``, and a one-line lesson that names what to do; only the lesson is trained on), and
  *reading* one (the lesson as the memory turn ``reflexion_loop.MEMORY ...``, then the gold demonstration).

The failed attempts imitate the failure modes chapter 40 counts: a miscopied calculator result, an answer
given without the calculator, a look-up of the wrong field, another person's fact from the notes, and a tool
call on a forbidden request. The lessons are templates filled from the failed transcript, with nothing in them
that the transcript does not show. Then both models run ``benchmarks/assistant_reflexion.py``'s protocol on the
300 held-out tasks (3 trials; with and without their own lessons), and the JSON stores every task's outcome.

Usage::

    python benchmarks/assistant_lessons.py    # about 6 minutes on 2 idle CPU cores
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch
from _common import save  # this folder is on sys.path (run as python benchmarks/<name>.py)

from llmbook.agents.assistant_tasks import FIELDS, REFUSAL, demonstration, execute, make_tasks, render
from llmbook.agents.reflexion_loop import ASK, MEMORY, reflexion
from llmbook.lm.assistant import Assistant, encode_transcript, load_assistant, pad_right
from llmbook.lm.assistant_recipe import _optimizer, _step, heldout_tasks
from llmbook.lm.rlhf import sft_loss
from llmbook.rag.significance import compare

STEPS, B, LR, N_TASKS, SEED = 300, 32, 1e-3, 2000, 7001
TRIALS, TEMPERATURE = 3, 0.7


def _other_digit(number: str, rng: random.Random) -> str:
    i = rng.randrange(len(number))
    digits = [d for d in "0123456789" if d != number[i] and not (i == 0 and d == "0")]
    return number[:i] + rng.choice(digits) + number[i + 1:]


def failed_attempt(task, rng: random.Random) -> tuple[list[tuple[str, str]], str]:
    """A typical failed attempt at ``task`` (turns) and the lesson its transcript supports."""
    n = next(iter(task.directory))
    if task.kind == "calc":
        args = task.plan[0][1]
        result = execute(task, "calc", args)
        turns = [("assistant", f"Thought: I should use the calculator.\nAct: calc {args}"), ("tool", result),
                 ("assistant", f"Act: answer {_other_digit(result, rng)}")]
        return turns, f"Lesson: copy the calculator's result {result} digit by digit."
    if task.kind == "chain":
        (_, look), (_, calc) = task.plan
        age = execute(task, "lookup", look)
        turns = [("assistant", f"Thought: I need the age of {n} first.\nAct: lookup {look}"), ("tool", age),
                 ("assistant", f"Act: answer {age}")]
        return turns, f"Lesson: after the lookup, call calc {calc} before answering."
    if task.kind == "lookup":
        field = task.plan[0][1].split()[-1]
        wrong = rng.choice([f for f in FIELDS if f != field])
        value = execute(task, "lookup", f"{n} {wrong}")
        turns = [("assistant", f"Act: lookup {n} {wrong}"), ("tool", value), ("assistant", f"Act: answer {value}")]
        return turns, f"Lesson: look up the {field} of {n}, not the {wrong}."
    if task.kind == "notes":
        field = next(f for f in FIELDS if task.directory[n][f] == task.answer)
        others = [m for m in task.directory if m != n and m in task.notes and task.directory[m][field] != task.answer]
        wrong = task.directory[rng.choice(others)][field] if others else "unknown"
        return [("assistant", f"Act: answer {wrong}")], f"Lesson: answer with the {field} the notes give for {n}."
    turns = [("assistant", f"Act: lookup {n} city"), ("tool", task.directory[n]["city"]),
             ("assistant", f"Act: answer {task.directory[n]['city']}")]
    return turns, f"Lesson: this request breaks the policy; answer {REFUSAL}"


def examples(tasks, lessons: bool, rng: random.Random) -> list[tuple[list[int], list[bool]]]:
    """Token rows and their trained-on masks: gold demonstrations, or with ``lessons`` half of them replaced."""
    out = []
    for i, task in enumerate(tasks):
        react = (i // 4) % 4 != 3  # a quarter act-only, as in the recipe, independently of the example type
        gold = demonstration(task, react=react)
        if not lessons or i % 2 == 0:
            out.append(encode_transcript(TOK, render(task, gold)))
            continue
        turns, lesson = failed_attempt(task, rng)
        if i % 4 == 1:  # writing a lesson: only the tokens of the last assistant turn are trained on
            ids, _ = encode_transcript(TOK, render(task, [*turns, ("user", ASK), ("assistant", lesson)]))
            last = max(j for j, t in enumerate(ids) if t == TOK.special_tokens["<|assistant|>"])
            out.append((ids, [j > last for j in range(len(ids))]))
        else:  # reading one: the lesson as the memory turn, then the gold demonstration
            out.append(encode_transcript(TOK, render(task, [("user", MEMORY + lesson), *gold])))
    return out


def fine_tune(base: Assistant, rows, log) -> tuple[Assistant, list[float]]:
    model = copy.deepcopy(base.model).float().train()
    gen = torch.Generator().manual_seed(SEED)
    opt = _optimizer(model, LR)
    losses = []
    for t in range(STEPS):
        idx = torch.randint(len(rows), (B,), generator=gen).tolist()
        ids, keep = pad_right([rows[i][0] for i in idx], TOK.special_tokens["<|pad|>"], [rows[i][1] for i in idx])
        labels = torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        loss = sft_loss(model(ids[:, :-1]), labels)
        _step(model, opt, loss, t, STEPS, LR)
        losses.append(round(loss.item(), 4))
    log(f"  final loss {losses[-1]:.4f}")
    return Assistant(model.double().eval(), TOK), losses


def main() -> int:
    global TOK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)  # the embedding's backward adds in a fixed order with 2 threads
    base = load_assistant()
    TOK = base.tok
    tasks, held = make_tasks(N_TASKS, seed=SEED, split="train"), heldout_tasks()
    result = {"benchmark": "assistant_lessons", "steps": STEPS, "batch": B, "lr": LR, "tasks": N_TASKS,
              "seed": SEED, "trials": TRIALS, "temperature": TEMPERATURE, "torch": torch.__version__, "models": {}}
    for name in ("control", "lessons"):
        t0 = time.perf_counter()
        rows = examples(tasks, name == "lessons", random.Random(SEED))
        print(f"{name}: fine-tuning on {len(rows)} examples")
        model, losses = fine_tune(base, rows, print)
        arms = {arm: reflexion(model, held, trials=TRIALS, memory=arm == "reflexion", temperature=TEMPERATURE,
                               seed=0, max_new_tokens=40) for arm in ("retry", "reflexion")}
        rec = {"loss": losses, "kinds": [t.kind for t in held],
               "greedy": [r.trials[0].reward for r in arms["retry"]],
               **{arm: [r.solved for r in recs] for arm, recs in arms.items()},
               "lessons": [r.reflections[0] if r.reflections else None for r in arms["reflexion"]],
               "seconds": round(time.perf_counter() - t0, 1)}
        result["models"][name] = rec
        print(f"  greedy {sum(rec['greedy']) / len(held):.3f}; up to {TRIALS} trials: retry "
              f"{sum(rec['retry']) / len(held):.3f}, own lessons {sum(rec['reflexion']) / len(held):.3f}; "
              f"lessons - retry: {compare(rec['reflexion'], rec['retry'])} ({rec['seconds']:.0f} s)")
    c, m = result["models"]["control"], result["models"]["lessons"]
    print("lesson-trained minus control, greedy:", compare(m["greedy"], c["greedy"]))
    save(result, args.out)
    return 0


TOK = None

if __name__ == "__main__":
    raise SystemExit(main())
