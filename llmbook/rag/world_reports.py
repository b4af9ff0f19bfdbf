r"""GraphRAG with written summaries: the book's assistant summarises its world's entities for a global search.

Chapter 31's global search reads community summaries that an LLM wrote; on the book's corpus no model the book
runs can write them, so the chapter builds extractive ones. In the assistant's world of made-up people
(:mod:`llmbook.agents.assistant_tasks`) a copy of the assistant can write, and the world has questions that only
a summary joined across facts can answer. A fact names one person and one value ("Pim Dovik lives in
Pallow.", "Pim Dovik works as a miner."), so a question such as "Which jobs do the people who live in Pallow
have?" needs two facts per person, and the job facts never mention the city: plain retrieval over facts
finds the residents and never their jobs.

GraphRAG's indexing, in this world:

* **The entity graph** (:func:`entity_graph`): a node per person, city and job, an edge for every fact that
  links a person to a city or a job (ages are values, not entities).
* **Element summaries**: GraphRAG has the LLM merge what the corpus says about each entity. Here the
  *summariser*, a copy of the assistant fine-tuned by :func:`train_summariser` on :func:`summary_examples`,
  reads a person's three facts (in random order) and writes one line, ``"Pim Dovik: Pallow, 34, miner."``
  (:func:`write_lines`). The control is the same join without a generator: the person's three sentences as
  they stand (:func:`person_blocks`).
* **Communities and reports**: Louvain (:func:`communities`, networkx) on the entity graph; a community's
  report is the lines (or blocks) of its people, most central first (:func:`reports`), the input of chapter
  31's map-reduce :func:`~llmbook.rag.graph_search.global_search`.

:func:`world_contexts` builds, for each question and a budget of words, the context of five searches (plain
retrieval over the facts; a two-hop walk from the facts found to the same people's other facts; global search
over the reports of blocks; global search over the reports of lines; plain retrieval over the lines, with no
communities). :func:`global_questions` asks, for every city, which jobs its residents have, and for every job, where the
people who do it live; a question's *aspects* are the people it is about, and :func:`coverage` counts an aspect
when the context states both of that person's values the question joins (in sentences or in summary lines,
:func:`statements`). Registers no equation (chapter 31's are in :mod:`llmbook.rag.graph` and
:mod:`llmbook.rag.graph_search`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import networkx as nx
import torch

from llmbook._checks import check_positive_int
from llmbook.agents.assistant_tasks import FIELDS, fact_sentence, random_person
from llmbook.lm.assistant import Assistant, load_assistant
from llmbook.lm.assistant_recipe import fine_tune
from llmbook.lm.training import _data_dir
from llmbook.rag.graph import pagerank
from llmbook.rag.graph_search import CommunitySummary, fill_budget, global_search
from llmbook.rag.rag_generation import Fact
from llmbook.rag.sparse import analyze, bm25_scores

__all__ = ["SUMMARISER", "SUMMARY_SYSTEM", "GlobalWorldQuestion", "communities", "coverage", "entity_graph",
           "global_questions", "load_summariser", "person_blocks", "person_line", "reports", "statements",
           "summary_examples", "summary_prompt", "train_summariser", "world_contexts", "write_lines"]

SUMMARY_SYSTEM = "Summarise the notes about one person in one line."
SUMMARISER = "assistant_summariser.pt"  # in llmbook/data, written by benchmarks/assistant_graphrag.py
_STOP = "<|end|>"
_SENTENCE = re.compile(r"([A-Z][a-z]+ [A-Z][a-z]+) (?:lives in ([A-Z][a-z]+)|is (\d+) years old|works as a ([a-z]+))\.")
_LINE = re.compile(r"([A-Z][a-z]+ [A-Z][a-z]+): ([A-Z][a-z]+), (\d+), ([a-z]+)\.")


def person_line(name: str, person: dict) -> str:
    """A person's summary line: ``"Pim Dovik: Pallow, 34, miner."`` (city, age, job)."""
    return f"{name}: {person['city']}, {person['age']}, {person['job']}."


def summary_prompt(sentences: Sequence[str]) -> str:
    """The summariser's prompt: the instruction, the person's facts as notes, and the assistant's turn begun."""
    return f"<|system|>{SUMMARY_SYSTEM}<|end|><|user|>Notes:{''.join(' ' + s for s in sentences)}<|end|><|assistant|>"


def summary_examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` training pairs ``(summary_prompt(facts), line + "<|end|>")``: a random person's facts, shuffled.

    >>> p, y = summary_examples(1, seed=0)[0]
    >>> p.count(" years old.") == 1 and y.endswith(".<|end|>")
    True
    """
    from llmbook.agents.assistant_tasks import _FIRST, _LAST

    n = check_positive_int(n, "n")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, person = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", random_person(rng)
        sentences = [fact_sentence(name, f, person[f]) for f in FIELDS]
        rng.shuffle(sentences)
        out.append((summary_prompt(sentences), person_line(name, person) + _STOP))
    return out


def train_summariser(assistant: Assistant, examples: Sequence[tuple[str, str]], *, steps: int = 300, B: int = 32,
                     lr: float = 1e-3, seed: int = 0, chunk: int = 8,
                     progress: Callable[[str], None] | None = None) -> tuple[Assistant, list[float]]:
    """Fine-tune a copy of ``assistant`` into the summariser (:func:`~llmbook.lm.assistant_recipe.fine_tune`).

    Batches of ``B`` pairs drawn with replacement (seeded); the loss is on the line and its ``<|end|>`` only.
    """
    examples = list(examples)
    if not examples:
        raise ValueError("train_summariser needs at least one (prompt, line) example, got none")
    B = check_positive_int(B, "B")
    return fine_tune(assistant, lambda rng: [rng.choice(examples) for _ in range(B)],
                     steps=check_positive_int(steps, "steps"), lr=lr, seed=seed, chunk=chunk, progress=progress,
                     name="summariser")


def load_summariser(path=None, dtype: torch.dtype = torch.float64) -> Assistant:
    """The committed summariser (``llmbook/data/assistant_summariser.pt``), from :func:`train_summariser`."""
    return load_assistant(path if path is not None else _data_dir() / SUMMARISER, dtype=dtype)


def _by_person(facts: Sequence[Fact]) -> dict[str, list[Fact]]:
    out: dict[str, list[Fact]] = {}
    for f in facts:
        out.setdefault(f.name, []).append(f)
    return out


def write_lines(summariser, facts: Sequence[Fact], max_new_tokens: int = 24) -> dict[str, str]:
    """Each person's summary line, written greedily by ``summariser`` from their facts (in collection order)."""
    people = _by_person(facts)
    outs = summariser.generate([summary_prompt([f.sentence for f in fs]) for fs in people.values()],
                               max_new_tokens=max_new_tokens, stop=(_STOP,))
    return {name: o.text.strip() for name, o in zip(people, outs, strict=True)}


def person_blocks(facts: Sequence[Fact]) -> dict[str, str]:
    """The control for the summariser: each person's facts joined as they stand, in collection order."""
    return {name: " ".join(f.sentence for f in fs) for name, fs in _by_person(facts).items()}


def entity_graph(facts: Sequence[Fact]) -> tuple[list[str], torch.Tensor]:
    """Nodes (people, then cities, then jobs, each in order of first appearance) and the ``(n, n)`` adjacency.

    An edge of weight 1 joins a person to their city and to their job.
    """
    people = list(dict.fromkeys(f.name for f in facts))
    values = [list(dict.fromkeys(f.value for f in facts if f.field == k)) for k in ("city", "job")]
    nodes = people + values[0] + values[1]
    index = {v: i for i, v in enumerate(nodes)}
    A = torch.zeros(len(nodes), len(nodes), dtype=torch.float64)
    for f in facts:
        if f.field in ("city", "job"):
            i, j = index[f.name], index[f.value]
            A[i, j] = A[j, i] = 1.0
    return nodes, A


def communities(A: torch.Tensor, seed: int = 0, resolution: float = 1.0) -> torch.Tensor:
    """Louvain communities of the graph (networkx's ``louvain_communities``, seeded): ``(n,)`` labels.

    Labels follow the communities' smallest node index, so they do not depend on the order networkx returns.
    """
    G = nx.from_numpy_array(A.numpy())
    found = nx.community.louvain_communities(G, weight="weight", resolution=resolution, seed=seed)
    labels = torch.empty(A.shape[0], dtype=torch.long)
    for k, members in enumerate(sorted(found, key=min)):
        labels[sorted(members)] = k
    return labels


def reports(nodes: Sequence[str], A: torch.Tensor, labels: torch.Tensor, units: dict[str, str],
            d: float = 0.85) -> tuple[list[CommunitySummary], list[str]]:
    """Community reports over ``units`` (one text per person): ``(summaries, texts)`` for ``global_search``.

    A community's report is the units of its people in descending PageRank (damping ``d``) on the community's
    sub-graph, ties by node index; ``texts[u]`` is unit ``u``. A community without people has no report.
    """
    texts: list[str] = []
    out = []
    for label in sorted(set(labels.tolist())):
        M = (labels == label).nonzero().flatten().tolist()
        pr = pagerank(A[M][:, M], d) if len(M) > 1 else torch.ones(1, dtype=torch.float64)
        order = sorted(range(len(M)), key=lambda i: (-round(float(pr[i]), 12), M[i]))
        members = [nodes[M[i]] for i in order if nodes[M[i]] in units]
        if not members:
            continue
        ids = tuple(range(len(texts), len(texts) + len(members)))
        texts += [units[m] for m in members]
        out.append(CommunitySummary(int(label), tuple(M[i] for i in order[:5]), ids,
                                    sum(len(units[m].split()) for m in members)))
    return out, texts


def statements(text: str) -> dict[str, set[str]]:
    """What a context states about each person: ``{name: {values}}``, from fact sentences and summary lines.

    >>> sorted(statements("Pim Dovik lives in Pallow. Pim Dovik: Velm, 34, miner.")["Pim Dovik"])
    ['34', 'Pallow', 'Velm', 'miner']
    """
    out: dict[str, set[str]] = {}
    for m in _SENTENCE.finditer(text):
        out.setdefault(m.group(1), set()).update(v for v in m.groups()[1:] if v)
    for m in _LINE.finditer(text):
        out.setdefault(m.group(1), set()).update(m.groups()[1:])
    return out


@dataclass(frozen=True)
class GlobalWorldQuestion:
    """A global question about a world: its text and its aspects, ``(person, value, value)`` the answer joins."""

    text: str
    aspects: tuple[tuple[str, str, str], ...]


def global_questions(facts: Sequence[Fact]) -> list[GlobalWorldQuestion]:
    """One question per city ("Which jobs do the people who live in X have?") and per job ("Where do the people
    who work as a X live?"), cities then jobs in order of first appearance. An aspect is one person the question
    is about, with the two values a full answer states for them (the asked value and the joined one)."""
    people = {name: {f.field: f.value for f in fs} for name, fs in _by_person(facts).items()}
    cities = dict.fromkeys(p["city"] for p in people.values())
    jobs = dict.fromkeys(p["job"] for p in people.values())
    out = [GlobalWorldQuestion(f"Which jobs do the people who live in {c} have?",
                               tuple((n, c, p["job"]) for n, p in people.items() if p["city"] == c)) for c in cities]
    out += [GlobalWorldQuestion(f"Where do the people who work as a {j} live?",
                                tuple((n, j, p["city"]) for n, p in people.items() if p["job"] == j)) for j in jobs]
    return out


def coverage(question: GlobalWorldQuestion, text: str) -> float:
    """Share of the question's aspects whose person the context states both values for (:func:`statements`)."""
    said = statements(text)
    return sum(a in said.get(n, set()) and b in said.get(n, set()) for n, a, b in question.aspects) / len(
        question.aspects)


def _words(texts: Sequence[str]) -> torch.Tensor:
    return torch.tensor([len(t.split()) for t in texts])


def _bm25(questions: Sequence[GlobalWorldQuestion], texts: Sequence[str]) -> torch.Tensor:
    """BM25 ``(Q, U)``, rounded to 9 decimals so that equal scores tie exactly (ties then go to the lower index)."""
    S = bm25_scores([analyze(q.text) for q in questions], [analyze(t) for t in texts]).double()
    return torch.round(S, decimals=9)


def world_contexts(facts: Sequence[Fact], lines: dict[str, str], questions: Sequence[GlobalWorldQuestion],
                   budget: int, *, seed: int = 0) -> dict[str, list[str]]:
    """The context of every question under ``budget`` words, for five searches (all scored by chapter 21's BM25):

    * ``"plain, facts"``: the facts, best first, each taken if it still fits
      (:func:`~llmbook.rag.graph_search.fill_budget`);
    * ``"two-hop, facts"``: the facts BM25 finds, best first, each followed by the same person's other facts
      (the entity graph's walk from a person), each taken if it still fits;
    * ``"global, blocks"`` and ``"global, lines"``: :func:`~llmbook.rag.graph_search.global_search` over the
      :func:`reports` of :func:`person_blocks` or of the summariser's ``lines``, Louvain communities seeded by
      ``seed``, each community's partial answer allowed the whole budget;
    * ``"plain, lines"``: the lines, best first, no communities.
    """
    budget = check_positive_int(budget, "budget")
    sentences = [f.sentence for f in facts]
    S = _bm25(questions, sentences)
    n = _words(sentences)
    people = _by_person(facts)
    index = {s: i for i, s in enumerate(sentences)}
    out = {"plain, facts": [" ".join(sentences[i] for i in fill_budget(row, n, budget)) for row in S]}
    two_hop = []
    for row in S:
        taken, used = [], 0
        for i in fill_budget(row, n, sum(n.tolist())):  # every positive fact, best first
            for j in [i] + [index[f.sentence] for f in people[facts[i].name] if index[f.sentence] != i]:
                if j not in taken and used + int(n[j]) <= budget:
                    taken.append(j)
                    used += int(n[j])
        two_hop.append(" ".join(sentences[j] for j in taken))
    out["two-hop, facts"] = two_hop
    nodes, A = entity_graph(facts)
    labels = communities(A, seed=seed)
    for name, units in (("global, blocks", person_blocks(facts)), ("global, lines", lines)):
        summaries, texts = reports(nodes, A, labels, units)
        answers = global_search(_bm25(questions, texts), summaries, _words(texts), map_budget=budget, budget=budget)
        out[name] = [" ".join(texts[u] for u in a.units) for a in answers]
    texts = list(lines.values())
    out["plain, lines"] = [" ".join(texts[i] for i in fill_budget(row, _words(texts), budget))
                           for row in _bm25(questions, texts)]
    return out
