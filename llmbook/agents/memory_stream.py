r"""Chapter 42's memory stream: an agent that writes facts over time, reads them back, and answers from them.

A seeded program plays a stream of events against an append-only memory of fact sentences (the facts of
:mod:`llmbook.rag.rag_generation`, about made-up people, so only the memory can answer):

* at the start, one ``city`` fact per person is written;
* then, at each step, one of: the user asks about an *active* person (a **read**: the agent retrieves its
  best memory and uses it); a new person whose first or last name matches an existing one is mentioned (a
  **distractor** write: a fact that matches part of later questions); a person **moves** (a new city fact is
  written; the old one stays in memory, now stale).

Retrieval scores each memory by Generative Agents' sum (:func:`~llmbook.agents.memory.episodic_score`, 42.02)
of its BM25 relevance to the question and its recency, an exponential decay
(:func:`~llmbook.agents.memory.exponential_decay`, 42.03) of the time since a reference time, which is either

* the **write** time (``recency="write"``): a memory ages from the moment it is stored, or
* the last **read** (``recency="read"``, Park et al.'s choice): retrieving a memory refreshes it.

At the end every person's city is asked once; :func:`recall` returns, per question, the memories that fit a
token budget in score order, ready for the assistant to read (:func:`llmbook.rag.rag_generation.answer`).
Registers no equation: it runs chapter 42's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from llmbook._checks import check_choice, check_positive_int, check_range
from llmbook.agents.assistant_tasks import _CITIES, _FIRST, _LAST, Task, notes_question
from llmbook.agents.memory import episodic_score, exponential_decay
from llmbook.rag.rag_generation import Fact
from llmbook.rag.sparse import analyze, bm25_scores

__all__ = ["RECENCY", "MemoryStream", "Stored", "recall", "simulate"]

RECENCY = ("write", "read")


@dataclass
class Stored:
    """One memory: its ``fact``, the step it was written, the step it was last read (``t_write`` if never), its size."""

    fact: Fact
    t_write: int
    t_read: int
    tokens: int = 0


@dataclass
class MemoryStream:
    """The end state of a stream: the memories, the questions asked at the end and the truth for each.

    ``names[q]`` is question ``q``'s person; ``group[q]`` says what happened to that person: ``"active"`` (read
    during the stream), ``"moved"`` (has a stale memory) or ``"quiet"`` (neither). ``reads`` counts the reads
    during the stream, ``wrong_reads`` those whose best memory was not the person's current fact (a stale one
    or a distractor), ``evicted`` the memories dropped to stay within the capacity.
    """

    memories: list[Stored]
    tasks: list[Task]
    names: list[str]
    group: list[str]
    t_end: int
    reads: int = 0
    wrong_reads: int = 0
    evicted: int = 0


def _scores(memories: list[Stored], question: str, t: int, recency: str, lam: float, lambda_t: float):
    rel = bm25_scores([analyze(question)], [analyze(m.fact.index_text) for m in memories])[0].double()
    t_ref = torch.tensor([float(m.t_write if recency == "write" else m.t_read) for m in memories],
                         dtype=torch.float64)
    rec = exponential_decay(float(t), t_ref, lam)
    return episodic_score(rel, rec, torch.zeros_like(rel), lambda_r=1.0, lambda_t=lambda_t, lambda_s=0.0)


def _ranked(scores) -> list[int]:
    return sorted(range(len(scores)), key=lambda j: (-round(float(scores[j]), 9), -j))  # ties: the newer first


def _evict(mem: list[Stored], recency: str, capacity: int | None) -> int:
    """Drop the weakest memories (oldest reference time; ties: the earlier written) until ``capacity`` tokens fit."""
    if capacity is None:
        return 0
    dropped = 0
    while sum(m.tokens for m in mem) > capacity and len(mem) > 1:
        weakest = min(range(len(mem)), key=lambda j: (mem[j].t_write if recency == "write" else mem[j].t_read,
                                                     mem[j].t_write))
        mem.pop(weakest)
        dropped += 1
    return dropped


def simulate(recency: str, *, n_people: int = 30, n_active: int = 10, steps: int = 150, p_read: float = 0.5,
             p_move: float = 0.15, lam: float = 0.05, lambda_t: float = 0.25, capacity: int | None = None,
             count_tokens=None, seed: int = 0) -> MemoryStream:
    """Play the stream (module docstring) under one ``recency`` rule; the same ``seed`` gives the same events.

    After the ``n_people`` initial writes come ``steps`` events: a read of one of the ``n_active`` first people
    with probability ``p_read``, a move with ``p_move``, otherwise a distractor. ``lam`` is the decay rate per
    step (half-life ``ln 2 / lam``), ``lambda_t`` the weight of recency against relevance (weight 1).
    ``capacity`` is the memory's budget in tokens (``count_tokens`` measures a sentence; default: words):
    after each write the weakest memories are evicted until the rest fit, the weakest being the one whose
    reference time (write, or last read) is oldest. Under ``"write"`` this is first-in-first-out; under
    ``"read"`` it is least-recently-used.
    """
    check_choice(recency, "recency", RECENCY)
    n_people, steps = check_positive_int(n_people, "n_people"), check_positive_int(steps, "steps")
    if not 0 <= n_active <= n_people:
        raise ValueError(f"n_active ({n_active}) must lie in [0, n_people = {n_people}]")
    for v, name in ((p_read, "p_read"), (p_move, "p_move")):
        check_range(v, name, 0.0, 1.0)
    if p_read + p_move > 1:
        raise ValueError(f"p_read + p_move ({p_read + p_move}) must be <= 1")
    if capacity is not None:
        capacity = check_positive_int(capacity, "capacity")
    count_tokens = count_tokens or (lambda text: len(text.split()))
    rng = random.Random(seed)
    all_names = [f"{a} {b}" for a in _FIRST for b in _LAST]
    people = rng.sample(all_names, n_people)
    city = {n: rng.choice(_CITIES) for n in people}
    def stored(fact: Fact, t: int) -> Stored:
        return Stored(fact, t, t, count_tokens(" " + fact.sentence))

    mem = [stored(Fact(n, "city", city[n]), t) for t, n in enumerate(people)]
    out = MemoryStream(mem, [], [], [], 0)
    out.evicted += _evict(mem, recency, capacity)
    moved = set()
    t = n_people
    for _ in range(steps):
        u = rng.random()
        if u < p_read and n_active:
            n = people[rng.randrange(n_active)]
            s = _scores(mem, notes_question(n, "city", rng), t, recency, lam, lambda_t)
            best = _ranked(s)[0]
            mem[best].t_read = t
            out.reads += 1
            out.wrong_reads += mem[best].fact.name != n or mem[best].fact.value != city[n]
        elif u < p_read + p_move:
            n = rng.choice(people)
            city[n] = rng.choice([c for c in _CITIES if c != city[n]])
            mem.append(stored(Fact(n, "city", city[n]), t))
            moved.add(n)
            out.evicted += _evict(mem, recency, capacity)
        else:  # a new person sharing a first or a last name with one we know
            first, last = rng.choice(people).split()
            cands = [m for m in all_names if m not in people and (m.startswith(first + " ") or m.endswith(" " + last))]
            mem.append(stored(Fact(rng.choice(cands), "city", rng.choice(_CITIES)), t))
            out.evicted += _evict(mem, recency, capacity)
        t += 1
    out.t_end = t
    for i, n in enumerate(people):
        out.tasks.append(Task("notes", notes_question(n, "city", rng), city[n], seed=seed))
        out.names.append(n)
        out.group.append("active" if i < n_active else "moved" if n in moved else "quiet")
    return out


def recall(stream: MemoryStream, recency: str, budget: int, count_tokens, *, lam: float = 0.05,
           lambda_t: float = 0.25) -> list[list[str]]:
    """For each end question, the memory sentences in score order that fit ``budget`` tokens (at least one).

    ``count_tokens`` measures a sentence (the assistant's tokenizer: ``assistant.count_tokens``). The scores
    use the stream's memories at its end, under ``recency`` (the same rule that ran the stream).
    """
    check_choice(recency, "recency", RECENCY)
    budget = check_positive_int(budget, "budget")
    out = []
    for task in stream.tasks:
        s = _scores(stream.memories, task.question, stream.t_end, recency, lam, lambda_t)
        picked, used = [], 0
        for j in _ranked(s):
            n = count_tokens(" " + stream.memories[j].fact.sentence)
            if picked and used + n > budget:
                break
            picked.append(stream.memories[j].fact.sentence)
            used += n
        out.append(picked)
    return out
