"""HyDE with the book's assistant as the generator: a copy of it writes the hypothetical notes, in its own world.

Chapter 30's HyDE (eq. 30.04) embeds a document that an LLM wrote for the question instead of the question.
On the book's corpus the book has no model that can write such a document; in the assistant's world of made-up
people it has one (``llmbook.rag.hyde_writer``). This script:

1. **Trains the writer**: ``train_writer`` fine-tunes a copy of the committed assistant (float32) for ``--steps``
   steps (batches of 32, AdamW at 1e-3 with warm-up and cosine) on ``--examples`` pairs of
   ``writer_examples`` (seed 70,000; training templates only; each note's value drawn at random). It is saved as
   ``llmbook/data/assistant_writer.pt``, the assistant's format, so ``load_writer()`` reads it.
2. **Builds the collections**: ``--collections`` knowledge bases of 60 made-up people (180 facts, one sentence
   each, seeds 71,000, 71,001, ...), each shuffled by its seed so that a tie in BM25 falls on no particular
   field, with 90 questions each from the *held-out* ``lookup`` and ``notes`` templates (30 per field).
3. **Writes the notes**: the writer in float64, greedy, then ``M = 8`` sampled at temperature 0.7 (the paper's
   number of samples and temperature; seed = the collection's seed).
4. **Retrieves** with the ten runs of ``retrieval_runs`` (BM25 and MiniLM cosine; the question, the greedy note,
   both, the 8 samples, the question with the 8 samples) and two controls: BM25 over the facts indexed with
   their field name (the fix on the document side, as chapter 29 indexes them) and BM25 with ``form_notes``
   (the right form with a random value, written by program). MiniLM embeddings come from the package cache
   where present, else from the model (offline).
5. **Measures** each run's success@1 (the question's own fact ranked first; ties by position) and reciprocal rank,
   per question, and compares runs question by question (``llmbook.rag.significance.compare``). It checks what
   the writer wrote: the name copied, the field's verb right, the value right (against chance).
6. **Answers**: the committed assistant (float64) reads each run's top fact as its notes and answers greedily;
   accuracy per run, so retrieval is judged by what the reader gets right.

The first collection is the one chapter 30 re-runs live; its notes are stored so that the chapter can check that
it generates the same. Deterministic kernels on 2 threads. Usage::

    python benchmarks/assistant_hyde.py
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from _common import Progress

from llmbook.agents.assistant_tasks import FIELDS, Task
from llmbook.lm.assistant import load_assistant, save_assistant
from llmbook.lm.training import _data_dir
from llmbook.rag import encoder
from llmbook.rag.hyde_writer import (
    WRITER,
    collection,
    form_notes,
    gold_ranks,
    load_writer,
    retrieval_runs,
    train_writer,
    write_documents,
    writer_examples,
)
from llmbook.rag.rag_generation import answer
from llmbook.rag.significance import compare, rate_interval
from llmbook.rag.sparse import analyze, bm25_scores

SEED, PEOPLE, QUESTIONS, M, TEMPERATURE = 71_000, 60, 90, 8, 0.7
COMPARE = (("BM25 h", "BM25 q"), ("BM25 q + h", "BM25 q"), ("BM25 q + h x M", "BM25 q"), ("BM25 h x M", "BM25 h"),
           ("dense q", "BM25 q"), ("dense h", "dense q"), ("dense q + h", "dense q"), ("dense h x M", "dense h"),
           ("dense q + h x M", "dense q"), ("BM25 form", "BM25 h"))
READ = ("BM25 q", "BM25 h", "BM25 q + h x M", "dense q", "dense q + h x M")  # runs whose top fact the assistant reads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=6000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--collections", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--weights", type=Path, default=_data_dir() / WRITER)  # where load_writer() reads it
    args = ap.parse_args()
    say = Progress()  # deterministic kernels on 2 threads; prints the seconds since the start

    a32 = load_assistant(dtype=torch.float32)
    writer, losses = train_writer(a32, writer_examples(args.examples, seed=70_000), steps=args.steps, seed=70_001,
                                  progress=say)
    save_assistant(writer.model, writer.tok, args.weights)
    w64, a64 = load_writer(args.weights), load_assistant()

    rows = {"collection": [], "field": [], "name_copied": [], "verb_right": [], "value_right": []}
    success, rr, read = {}, {}, {}
    first = None
    for c in range(args.collections):
        seed = SEED + c
        facts, qs = collection(seed, PEOPLE, QUESTIONS)
        questions, gold = [q for q, _ in qs], [g for _, g in qs]
        docs = write_documents(w64, questions, n_samples=M, temperature=TEMPERATURE, seed=seed)
        runs = retrieval_runs(facts, questions, docs, embed=encoder.encode)
        runs["BM25 q, field-indexed"] = bm25_scores([analyze(q) for q in questions],
                                                    [analyze(f.index_text) for f in facts]).double()
        runs["BM25 form"] = bm25_scores([analyze(x) for x in form_notes(facts, gold, seed=seed)],
                                        [analyze(f.sentence) for f in facts]).double()
        for name, S in runs.items():
            r = gold_ranks(S, gold).double()
            success.setdefault(name, []).extend((r == 1).double().tolist())
            rr.setdefault(name, []).extend((1 / r).tolist())
        tasks = [Task("notes", q, facts[g].value) for q, g in qs]
        for name in READ:
            top = runs[name].argmax(1).tolist()  # the first maximum: ties by position, as in gold_ranks
            said = answer(a64, tasks, [[facts[j].sentence] for j in top])
            read.setdefault(name, []).extend(float(s == t.answer) for s, t in zip(said, tasks, strict=True))
        for (_, g), d in zip(qs, docs, strict=True):
            f = facts[g]
            rows["collection"].append(c)
            rows["field"].append(f.field)
            rows["name_copied"].append(d[0].startswith(f.name + " "))
            verb = {"city": " lives in ", "age": " years old", "job": " works as a "}[f.field]
            rows["verb_right"].append(verb in d[0])
            rows["value_right"].append(d[0] == f.sentence)
        if c == 0:
            first = {"seed": seed, "questions": questions, "gold": gold, "docs": docs}
        say(f"collection {c}: " + ", ".join(f"{k} {np.mean(v[-QUESTIONS:]):.3f}" for k, v in success.items()))

    n = len(rows["field"])
    summary = {name: {"success_at_1": rate_interval(v), "mrr": round(float(np.mean(rr[name])), 4)}
               for name, v in success.items()}
    comparisons = {f"{a} - {b}": asdict(compare(success[a], success[b])) for a, b in COMPARE}
    for k, v in comparisons.items():
        say(f"{k}: {v['diff']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}], p = {v['p']:.4f}")
    chance = {"city": 1 / 16, "age": 1 / 72, "job": 1 / 12}
    writer_stats = {k: int(sum(rows[k])) for k in ("name_copied", "verb_right", "value_right")}
    writer_stats["value_right_chance"] = round(sum(chance[f] for f in rows["field"]), 2)
    reading = {name: rate_interval(v) for name, v in read.items()}
    reading_cmp = {f"{a} - BM25 q": asdict(compare(read[a], read["BM25 q"])) for a in READ[1:]}
    say(f"writer: {writer_stats} of {n}; reading: {reading}")
    result = {"benchmark": "assistant_hyde", "examples": args.examples, "steps": args.steps,
              "writer_loss": [round(x, 4) for x in losses], "collections": args.collections, "people": PEOPLE,
              "questions": QUESTIONS, "M": M, "temperature": TEMPERATURE, "fields": list(FIELDS), "rows": rows,
              "success_at_1": success, "reciprocal_rank": rr, "summary": summary, "comparisons": comparisons,
              "writer": writer_stats, "read": read, "reading": reading, "reading_comparisons": reading_cmp,
              "first": first, "minutes": say.minutes()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "assistant_hyde.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
