r"""HyDE with a real generator: the book's assistant writes the hypothetical documents, in its own world.

HyDE (chapter 30, :func:`~llmbook.rag.expansion.hyde`) needs a model that, given a question, writes a passage
that *would* answer it. On the book's own corpus no model the book runs can write about attention or RoPE, so
chapter 30 measures HyDE there with hand-written stand-ins. The assistant's world (made-up people with a city,
an age and a job, :mod:`llmbook.agents.assistant_tasks`) is a collection where it can. The facts are stated as
the notes state them ("Pim Dovik lives in Pallow."), and the questions ask for a *field* ("Which city do the
notes give for Pim Dovik?"). The field's name never occurs in a fact, so BM25 on the question matches only
the person's name, which all three of that person's facts share: a small, exact case of vocabulary mismatch.

* **The writer.** The assistant was never taught to write a passage (HyDE's InstructGPT was instruction-tuned on
  such requests), so :func:`train_writer` fine-tunes a copy of it to answer ``Write the note that would answer
  the question.`` with one note. It learns on :func:`writer_examples`: questions of the *training* templates,
  each paired with a note whose value is drawn at random, because the writer cannot know the value: it sees
  no directory. It learns the form of the answer (the name, the verb of the field) and guesses the value, which
  is what HyDE expects of its generator: the right vocabulary and often the wrong facts.
* :func:`write_documents` generates the notes greedily, or samples several (the paper averages 8 samples).
* :func:`heldout_questions` asks about a collection's facts with the *held-out* templates of the ``lookup`` and
  ``notes`` kinds, which neither the assistant nor the writer saw in training; :func:`collection` draws a
  shuffled knowledge base and its questions from one seed.
* :func:`retrieval_runs` scores every fact against every question in ten ways: BM25 and MiniLM cosine, each
  with the question :math:`q`, the greedy note :math:`h`, both, the :math:`M` sampled notes, and :math:`q` with
  the :math:`M` notes (the paper's setting, eq. 30.04's mean of :math:`f(q)` and the :math:`f(h_m)`).
  :func:`form_notes` writes the control: the right form with a random value, by program, no model.
* :func:`gold_ranks` ranks each question's own fact under a score matrix, ties broken by position.

The writer is trained and measured by ``benchmarks/assistant_hyde.py``, which writes its weights to
``llmbook/data/assistant_writer.pt`` (:func:`load_writer`). Registers no equation (30.04 is
:func:`~llmbook.rag.expansion.hyde`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from llmbook._checks import check_positive_int
from llmbook.agents.assistant_tasks import FIELDS, fact_question, fact_sentence, random_person
from llmbook.lm.assistant import Assistant, load_assistant
from llmbook.lm.assistant_recipe import fine_tune
from llmbook.lm.training import _data_dir
from llmbook.rag.expansion import hyde
from llmbook.rag.rag_generation import Fact, knowledge_base
from llmbook.rag.sparse import analyze, bm25_scores

__all__ = ["WRITER", "WRITE_SYSTEM", "collection", "form_notes", "gold_ranks", "heldout_questions", "load_writer",
           "retrieval_runs", "train_writer", "write_documents", "writer_examples", "writer_prompt"]

WRITE_SYSTEM = "Write the note that would answer the question."
WRITER = "assistant_writer.pt"  # in llmbook/data, written by benchmarks/assistant_hyde.py
_STOP = "<|end|>"


def writer_prompt(question: str) -> str:
    """The writer's prompt: the instruction as the system turn, the question, and the assistant's turn begun.

    >>> writer_prompt("Which city do the notes give for Pim Dovik?")[-40:]
    ' give for Pim Dovik?<|end|><|assistant|>'
    """
    return f"<|system|>{WRITE_SYSTEM}<|end|><|user|>{question}<|end|><|assistant|>"


def writer_examples(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` training pairs ``(writer_prompt(question), note + "<|end|>")`` from the *training* templates.

    Each pair draws a person, cycles over the fields, and asks with a ``lookup`` or ``notes`` training template.
    The note's value is drawn at random (:func:`~llmbook.agents.assistant_tasks.random_person`): the writer sees
    no directory, so no value could be right, and it learns only the form.

    >>> p, y = writer_examples(1, seed=0)[0]
    >>> y.endswith("<|end|>"), y.split()[2] in ("lives", "is", "works")
    (True, True)
    """
    n = check_positive_int(n, "n")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        f = FIELDS[i % len(FIELDS)]
        name = _name(rng)
        q = fact_question(name, f, rng, split="train")
        out.append((writer_prompt(q), fact_sentence(name, f, random_person(rng)[f]) + _STOP))
    return out


def _name(rng: random.Random) -> str:
    from llmbook.agents.assistant_tasks import _FIRST, _LAST

    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def train_writer(assistant: Assistant, examples: Sequence[tuple[str, str]], *, steps: int = 300, B: int = 32,
                 lr: float = 1e-3, seed: int = 0, chunk: int = 8,
                 progress: Callable[[str], None] | None = None) -> tuple[Assistant, list[float]]:
    """Fine-tune a copy of ``assistant`` into the writer: batches of ``B`` pairs drawn with replacement (seeded).

    The loss is the next-token loss on the note and its ``<|end|>`` only
    (:func:`~llmbook.lm.assistant_recipe.fine_tune`). Returns ``(writer, losses)``, the writer in float32.
    """
    examples = list(examples)
    if not examples:
        raise ValueError("train_writer needs at least one (prompt, note) example, got none")
    B = check_positive_int(B, "B")

    def draw(rng: random.Random) -> list[tuple[str, str]]:
        return [rng.choice(examples) for _ in range(B)]

    return fine_tune(assistant, draw, steps=check_positive_int(steps, "steps"), lr=lr, seed=seed, chunk=chunk,
                     progress=progress, name="writer")


def load_writer(path=None, dtype: torch.dtype = torch.float64) -> Assistant:
    """The committed writer (``llmbook/data/assistant_writer.pt``): the assistant fine-tuned by :func:`train_writer`."""
    return load_assistant(path if path is not None else _data_dir() / WRITER, dtype=dtype)


def write_documents(writer, questions: Sequence[str], *, n_samples: int = 0, temperature: float = 1.0,
                    seed: int = 0, max_new_tokens: int = 16) -> list[list[str]]:
    """Hypothetical documents :math:`h_\\theta(q)` for each question: the greedy note, then ``n_samples`` sampled.

    Returns one list per question, ``1 + n_samples`` notes long, each note stripped of its stop string.
    ``writer`` is any :class:`~llmbook.agents.generation.Generator`.
    """
    prompts = [writer_prompt(q) for q in questions]
    greedy = writer.generate(prompts, max_new_tokens=max_new_tokens, stop=(_STOP,))
    out = [[c.text.strip()] for c in greedy]
    if n_samples:
        n_samples = check_positive_int(n_samples, "n_samples")
        sampled = writer.generate([p for p in prompts for _ in range(n_samples)], max_new_tokens=max_new_tokens,
                                  stop=(_STOP,), temperature=temperature, seed=seed)
        for j, c in enumerate(sampled):
            out[j // n_samples].append(c.text.strip())
    return out


def heldout_questions(facts: Sequence[Fact], n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` questions about distinct facts, cycling over the fields: ``(question, index of its fact)``.

    The questions use the held-out templates of the ``lookup`` and ``notes`` kinds
    (:func:`~llmbook.agents.assistant_tasks.fact_question`), drawn by ``random.Random(seed)``.

    >>> from llmbook.rag.rag_generation import knowledge_base
    >>> heldout_questions(knowledge_base(2, seed=0), 1, seed=0)[0][1] in (0, 3)
    True
    """
    n = check_positive_int(n, "n")
    rng = random.Random(seed)
    by_field = {f: [i for i, x in enumerate(facts) if x.field == f] for f in FIELDS}
    if n > len(facts):
        raise ValueError(f"n ({n}) must be at most the number of facts ({len(facts)})")
    picks = {f: rng.sample(ix, len(ix)) for f, ix in by_field.items()}
    out = []
    for j in range(n):
        i = picks[FIELDS[j % 3]][j // 3]
        out.append((fact_question(facts[i].name, facts[i].field, rng, split="heldout"), i))
    return out


def collection(seed: int, people: int = 60, questions: int = 90) -> tuple[list[Fact], list[tuple[str, int]]]:
    """A knowledge base of ``people`` (``3 people`` facts) in an order shuffled by ``seed``, and ``questions`` about it.

    The shuffle puts a person's three facts at random places, so a tie in BM25 (broken by position) favours no
    field. Returns ``(facts, [(question, index of its fact), ...])`` from :func:`heldout_questions`.
    """
    facts = knowledge_base(people, seed=seed)
    random.Random(seed).shuffle(facts)
    return facts, heldout_questions(facts, questions, seed=seed)


def gold_ranks(S: Tensor, gold: Sequence[int]) -> Tensor:
    """1-based rank of each row's gold column under the scores ``S`` ``(Q, N)``, ties broken by column order.

    Scores are compared after rounding to 9 decimals, so the ranks do not depend on a CPU's last bits.

    >>> gold_ranks(torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]]), [2, 1]).tolist()
    [2, 2]
    """
    if S.ndim != 2 or S.shape[0] != len(gold):
        raise ValueError(f"S must be (Q, N) with Q = len(gold) ({len(gold)}), got shape {tuple(S.shape)}")
    R = torch.round(S.double() * 1e9)
    out = []
    for q, g in enumerate(gold):
        row = R[q]
        out.append(int((row > row[g]).sum()) + int((row[:g] == row[g]).sum()) + 1)
    return torch.tensor(out)


def form_notes(facts: Sequence[Fact], gold: Sequence[int], seed: int = 0) -> list[str]:
    """The control for the writer: each question's note in the right form, with a random value, written by program.

    >>> from llmbook.rag.rag_generation import knowledge_base
    >>> form_notes(knowledge_base(1, seed=0), [2], seed=0)[0].startswith("Sela Fenwick works as a")
    True
    """
    rng = random.Random(seed)
    return [fact_sentence(facts[g].name, facts[g].field, random_person(rng)[facts[g].field]) for g in gold]


def retrieval_runs(facts: Sequence[Fact], questions: Sequence[str], docs: Sequence[Sequence[str]],
                   embed: Callable[[list[str]], Tensor] | None = None) -> dict[str, Tensor]:
    """Scores ``(Q, N)`` of the facts' sentences for each question, by BM25 and (with ``embed``) by cosine.

    ``docs[i]`` is question ``i``'s notes from :func:`write_documents`: the greedy note first, then :math:`M`
    sampled ones (:math:`M \\ge 1`). BM25 (chapter 21, over :func:`~llmbook.rag.sparse.analyze` terms) takes a
    query's terms with repetition, so "q + h x M" is the question's terms followed by those of all :math:`M`
    notes. The dense runs embed with ``embed(texts) -> (n, d)`` unit vectors and score with HyDE's cosine
    (:func:`~llmbook.rag.expansion.hyde`), whose ``q=`` argument averages the question's embedding in.
    """
    if len(docs) != len(questions) or any(len(d) < 2 for d in docs):
        raise ValueError(f"docs must hold, for each of the {len(questions)} questions, the greedy note and at least "
                         f"one sampled note; got {len(docs)} lists of lengths {sorted({len(d) for d in docs})}")
    D = [analyze(f.sentence) for f in facts]
    q = [analyze(x) for x in questions]
    h = [analyze(d[0]) for d in docs]
    hs = [[t for x in d[1:] for t in analyze(x)] for d in docs]
    runs = {"BM25 q": q, "BM25 h": h, "BM25 q + h": [a + b for a, b in zip(q, h, strict=True)],
            "BM25 h x M": hs, "BM25 q + h x M": [a + b for a, b in zip(q, hs, strict=True)]}
    out = {name: bm25_scores(terms, D).double() for name, terms in runs.items()}
    if embed is not None:
        G = embed([f.sentence for f in facts]).double()
        Qe = embed(list(questions)).double()
        M = len(docs[0])
        H = embed([x for d in docs for x in d]).double().reshape(len(docs), M, -1)
        out.update({"dense q": hyde(Qe[:, None], G).scores, "dense h": hyde(H[:, :1], G).scores,
                    "dense q + h": hyde(H[:, :1], G, q=Qe).scores, "dense h x M": hyde(H[:, 1:], G).scores,
                    "dense q + h x M": hyde(H[:, 1:], G, q=Qe).scores})
    return out
