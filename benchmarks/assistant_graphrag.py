"""GraphRAG's written summaries with the book's assistant: a copy of it summarises each person of its world.

Chapter 31's global search reads summaries an LLM wrote; on the book's corpus the book has no such model. In the
assistant's world of made-up people it has one (``llmbook.rag.world_reports``). This script:

1. **Trains the summariser**: ``train_summariser`` fine-tunes a copy of the committed assistant (float32) for
   ``--steps`` steps (batches of 32, AdamW at 1e-3 with warm-up and cosine) on ``--examples`` pairs of
   ``summary_examples`` (seed 72,000: a random person's three facts in random order, and the line
   ``"Name: city, age, job."``). It is saved as ``llmbook/data/assistant_summariser.pt``.
2. **Writes the lines**: for each of ``--collections`` knowledge bases of 60 people (``hyde_writer.collection``,
   seeds 71,000, 71,001, ..., the collections of ``assistant_hyde.py``), the summariser in float64 writes one line
   per person from that person's facts, greedily; each line is checked against the facts.
3. **Asks the global questions** of ``global_questions`` (one per city: which jobs its residents have; one per job:
   where its workers live), whose every aspect joins two facts about one person, and builds the five contexts of
   ``world_contexts`` for budgets of 25, 50 and 100 words (fixed before any run): plain BM25 over the facts; the
   two-hop walk to the same people's other facts; global search (Louvain communities, seed 0) over the reports
   of the people's fact blocks or of the summariser's lines; plain BM25 over the lines.
4. **Measures** each context's aspect coverage per question (``coverage``: both values of the person stated
   somewhere in the context) and compares contexts question by question (``llmbook.rag.significance.compare``).

The first collection is the one chapter 31 re-runs live; its lines are stored so that the chapter can check that
it writes the same. Deterministic kernels on 2 threads. Usage::

    python benchmarks/assistant_graphrag.py
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from _common import Progress

from llmbook.lm.assistant import load_assistant, save_assistant
from llmbook.lm.training import _data_dir
from llmbook.rag.hyde_writer import collection
from llmbook.rag.significance import compare
from llmbook.rag.world_reports import (
    SUMMARISER,
    coverage,
    global_questions,
    load_summariser,
    person_line,
    summary_examples,
    train_summariser,
    world_contexts,
    write_lines,
)

SEED, BUDGETS = 71_000, (25, 50, 100)
COMPARE = (("two-hop, facts", "plain, facts"), ("global, lines", "global, blocks"), ("global, lines", "two-hop, facts"),
           ("plain, lines", "global, lines"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--collections", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--weights", type=Path, default=_data_dir() / SUMMARISER)  # where load_summariser() reads it
    args = ap.parse_args()
    say = Progress()  # deterministic kernels on 2 threads; prints the seconds since the start

    a32 = load_assistant(dtype=torch.float32)
    summariser, losses = train_summariser(a32, summary_examples(args.examples, seed=72_000), steps=args.steps,
                                          seed=72_001, progress=say)
    save_assistant(summariser.model, summariser.tok, args.weights)
    s64 = load_summariser(args.weights)

    cover = {b: {} for b in BUDGETS}
    n_lines, exact, n_aspects, first = 0, 0, [], None
    for c in range(args.collections):
        facts, _ = collection(SEED + c)
        lines = write_lines(s64, facts)
        truth = {}
        for f in facts:
            truth.setdefault(f.name, {})[f.field] = f.value
        n_lines += len(lines)
        exact += sum(line == person_line(name, truth[name]) for name, line in lines.items())
        questions = global_questions(facts)
        n_aspects += [len(q.aspects) for q in questions]
        for b in BUDGETS:
            for name, ctx in world_contexts(facts, lines, questions, b).items():
                cover[b].setdefault(name, []).extend(coverage(q, t) for q, t in zip(questions, ctx, strict=True))
        if c == 0:
            first = {"seed": SEED, "lines": lines}
        say(f"collection {c}: {len(questions)} questions; coverage at 50 words: "
            + ", ".join(f"{k} {np.mean(v[-len(questions):]):.3f}" for k, v in cover[50].items()))
    comparisons = {str(b): {f"{x} - {y}": asdict(compare(cover[b][x], cover[b][y])) for x, y in COMPARE}
                   for b in BUDGETS}
    for b in BUDGETS:
        say(f"{b} words: " + ", ".join(f"{k} {np.mean(v):.3f}" for k, v in cover[b].items()))
    say(f"summary lines exact: {exact} of {n_lines}")
    result = {"benchmark": "assistant_graphrag", "examples": args.examples, "steps": args.steps,
              "summariser_loss": [round(x, 4) for x in losses], "collections": args.collections,
              "budgets": list(BUDGETS), "lines": n_lines, "lines_exact": exact, "aspects": n_aspects,
              "coverage": {str(b): v for b, v in cover.items()}, "comparisons": comparisons, "first": first,
              "minutes": say.minutes()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "assistant_graphrag.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
