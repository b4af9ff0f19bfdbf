r"""Retrieval-augmented generation with the book's assistant: retrieve facts into the context, then answer.

Chapter 29's objectives need a generator that reads a context. The book's assistant
(:mod:`llmbook.lm.assistant`) learned to answer a question from notes in its prompt; here the notes come from a
retriever instead of the user. The world is the assistant's (:mod:`llmbook.agents.assistant_tasks`): a
*knowledge base* of made-up people, one sentence per fact (:func:`knowledge_base`), drawn at random from a
seed, so no answer can come from the model's weights. Questions use the held-out ``notes`` templates
(never seen in training).

* :func:`retrieve`: chapter 21's BM25 (:func:`~llmbook.rag.sparse.bm25_scores`) over each fact's index text,
  its field name followed by its sentence (the field name is the fact's metadata, indexed as a BM25F-style
  extra field would be, so that "the city of X" finds "X lives in ..."). Ties break by position in the base.
* :func:`answer` reads the retrieved sentences as the notes and answers greedily (the act-only turn
  ``Act: answer ...``): the usual way RAG is run, all passages in one context.
* :func:`rag_token_decode` and :func:`rag_sequence_decode` are Lewis et al.'s two decoders over ``k`` single-
  passage contexts weighted by :math:`p_\eta(z\mid x)`: RAG-Token mixes the :math:`k` next-token
  distributions at every step (29.02) and takes the greedy token; RAG-Sequence ("thorough decoding") takes each
  passage's greedy answer as a candidate and keeps the candidate with the largest marginal likelihood (29.01)
  under all :math:`k` passages.
* :func:`supported`: whether the context states the answer's claim ("the city of X is Y"), the unit of
  faithfulness (29.05).

Registers no equation: it feeds chapter 29's (:mod:`llmbook.rag.rag_objectives`, :mod:`llmbook.rag.ragas`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from llmbook._checks import check_positive_int
from llmbook.agents.assistant_tasks import FIELDS, Task, fact_sentence, notes_question, render
from llmbook.rag.rag_objectives import rag_sequence_log_likelihood
from llmbook.rag.sparse import analyze, bm25_scores

__all__ = ["Fact", "answer", "answer_prompt", "knowledge_base", "questions", "rag_sequence_decode",
           "rag_token_decode", "retrieve", "supported"]

_STOP = "<|end|>"


@dataclass(frozen=True)
class Fact:
    """One fact of the knowledge base: ``name``'s ``field`` is ``value``."""

    name: str
    field: str
    value: str

    @property
    def sentence(self) -> str:
        """The fact in the notes' words (:func:`~llmbook.agents.assistant_tasks.fact_sentence`)."""
        return fact_sentence(self.name, self.field, self.value)

    @property
    def index_text(self) -> str:
        """The field name followed by the sentence, as the retriever indexes it."""
        return f"{self.field} {self.sentence}"


def knowledge_base(n_people: int, seed: int = 0) -> list[Fact]:
    """``3 n_people`` facts about ``n_people`` random people (city, age, job each), from ``random.Random(seed)``.

    >>> [f.sentence for f in knowledge_base(1, seed=0)]
    ['Sela Fenwick lives in Holloway.', 'Sela Fenwick is 71 years old.', 'Sela Fenwick works as a baker.']
    """
    from llmbook.agents.assistant_tasks import _FIRST, _LAST, _person

    n_people = check_positive_int(n_people, "n_people")
    rng = random.Random(seed)
    names = rng.sample([f"{a} {b}" for a in _FIRST for b in _LAST], n_people)
    return [Fact(n, f, v) for n in names for f, v in _person(rng).items()]


def questions(facts: Sequence[Fact], n: int, seed: int = 0) -> list[tuple[Task, int]]:
    """``n`` questions about distinct facts (cycling over the fields), each as ``(task, index of its fact)``.

    The task is a ``notes`` task of the held-out templates with empty notes: the retriever fills them.
    """
    n = check_positive_int(n, "n")
    rng = random.Random(seed)
    by_field = {f: [i for i, x in enumerate(facts) if x.field == f] for f in FIELDS}
    picks = {f: rng.sample(ix, min(len(ix), n)) for f, ix in by_field.items()}
    out = []
    for j in range(n):
        i = picks[FIELDS[j % 3]][j // 3]
        q = notes_question(facts[i].name, facts[i].field, rng)
        out.append((Task("notes", q, facts[i].value, seed=seed), i))
    return out


def retrieve(tasks: Sequence[Task], facts: Sequence[Fact], k: int) -> tuple[list[list[int]], Tensor]:
    """The top ``k`` facts of each question by BM25 and their scores ``(Q, k)`` (float64, descending).

    Ties (equal scores, to 9 decimals) break by position in ``facts``, so the result is the same on any CPU.
    """
    k = check_positive_int(k, "k")
    if k > len(facts):
        raise ValueError(f"k ({k}) must be at most the number of facts ({len(facts)})")
    S = bm25_scores([analyze(t.question) for t in tasks], [analyze(f.index_text) for f in facts]).double()
    idx = [sorted(range(len(facts)), key=lambda j, row=row: (-round(float(row[j]), 9), j))[:k] for row in S]
    return idx, torch.stack([S[q, ix] for q, ix in enumerate(idx)])


def answer_prompt(task: Task, passages: Sequence[str]) -> str:
    """The assistant's prompt: the passages as the notes, the question, and the turn begun with ``Act: answer``.

    No passages gives the closed-book prompt.
    """
    notes = "".join(" " + p for p in passages)
    t = Task(task.kind, task.question, task.answer, notes=notes)
    return render(t) + "<|assistant|>Act: answer"


def answer(generator, tasks: Sequence[Task], contexts: Sequence[Sequence[str]], max_new_tokens: int = 8) -> list[str]:
    """Greedy answers, each read from its context (a list of passages, all in one prompt)."""
    outs = generator.generate([answer_prompt(t, c) for t, c in zip(tasks, contexts, strict=True)],
                              max_new_tokens=max_new_tokens, stop=(_STOP,))
    return [o.text.strip() for o in outs]


def supported(fact: Fact, answer_text: str, passages: Sequence[str]) -> bool:
    """Whether ``passages`` state the answer's claim: the sentence "``fact.name``'s ``fact.field`` is the answer"."""
    return fact_sentence(fact.name, fact.field, answer_text.strip()) in passages


def rag_token_decode(assistant, tasks: Sequence[Task], contexts: Sequence[Sequence[str]], log_p_z,
                     max_new_tokens: int = 8) -> list[str]:
    r"""RAG-Token greedy decoding: each token is :math:`\arg\max_y\sum_z p_\eta(z\mid x)\,p_\theta(y\mid x,z,y_{<i})`.

    ``contexts`` ``Q`` lists of ``k`` passages, one context each; ``log_p_z`` ``(Q, k)`` the retriever's
    :math:`\log p_\eta(z\mid x)`. ``assistant`` needs :meth:`~llmbook.lm.assistant.Assistant.stepper`. Every
    passage's row is fed the chosen token; a row stops at ``<|end|>``.
    """
    log_p_z = torch.as_tensor(log_p_z, dtype=torch.float64)
    Q, k = len(tasks), len(contexts[0]) if contexts else 0
    if tuple(log_p_z.shape) != (Q, k) or any(len(c) != k for c in contexts):
        raise ValueError(f"contexts must be Q = {Q} lists of k passages and log_p_z (Q, k); got "
                         f"{[len(c) for c in contexts][:5]} and {tuple(log_p_z.shape)}")
    prompts = [answer_prompt(t, [p]) for t, c in zip(tasks, contexts, strict=True) for p in c]
    step = assistant.stepper(prompts, max_new_tokens)
    end = assistant.tok.special_tokens[_STOP]
    out: list[list[int]] = [[] for _ in range(Q)]
    done = [False] * Q
    z = step(None)
    for _ in range(max_new_tokens):
        mix = torch.logsumexp(log_p_z[:, :, None] + torch.log_softmax(z.double(), -1).view(Q, k, -1), dim=1)
        nxt = mix.argmax(-1)
        for q in range(Q):
            if not done[q]:
                done[q] = int(nxt[q]) == end
                if not done[q]:
                    out[q].append(int(nxt[q]))
        if all(done):
            break
        z = step(nxt.repeat_interleave(k))
    return [assistant.tok.decode(o).strip() for o in out]


def rag_sequence_decode(assistant, tasks: Sequence[Task], contexts: Sequence[Sequence[str]], log_p_z,
                        max_new_tokens: int = 8, thorough: bool = True) -> list[str]:
    r"""RAG-Sequence decoding: candidates from each passage, ranked by :math:`\log p(y\mid x)` (29.01).

    Each passage's greedy answer is a candidate, and :func:`~llmbook.rag.rag_objectives.rag_sequence_log_likelihood`
    combines its log-likelihoods under the :math:`k` passages with ``log_p_z`` ``(Q, k)``; the best candidate wins
    (ties: the earlier passage's). ``thorough=True`` scores every candidate (with its ``<|end|>``) under every
    passage (Lewis et al.'s thorough decoding, one extra forward pass per candidate and passage);
    ``thorough=False`` is their fast decoding: :math:`p_\theta(y\mid x,z)` is taken as 0 for a passage whose
    greedy answer was not :math:`y`, so no extra pass is needed.
    """
    log_p_z = torch.as_tensor(log_p_z, dtype=torch.float64)
    k = len(contexts[0]) if contexts else 0
    outs = assistant.generate([answer_prompt(t, [p]) for t, c in zip(tasks, contexts, strict=True) for p in c],
                              max_new_tokens=max_new_tokens, stop=(_STOP,))
    texts = [o.text.strip() for o in outs]
    cands = [list(dict.fromkeys(a for a in texts[q * k:(q + 1) * k] if a)) for q in range(len(tasks))]
    if thorough:
        rows = [(q, a, p) for q, c in enumerate(contexts) for a in cands[q] for p in c]
        lps = iter(assistant.token_log_probs([answer_prompt(tasks[q], [p]) for q, _, p in rows],
                                             [f" {a}{_STOP}" for _, a, _ in rows]))  # one batch for all
    best = []
    for q in range(len(tasks)):
        scores = []
        for a in cands[q]:
            if thorough:
                lp = torch.stack([next(lps) for _ in range(k)])
            else:  # each passage's own greedy answer keeps its log-probability, any other answer gets -inf
                own = [sum(outs[q * k + z].logprobs) if texts[q * k + z] == a else -torch.inf for z in range(k)]
                lp = torch.tensor(own, dtype=torch.float64)[:, None]
            scores.append(float(rag_sequence_log_likelihood(log_p_z[q:q + 1], lp[None])))
        best.append(cands[q][max(range(len(scores)), key=lambda i: (scores[i], -i))] if scores else "")
    return best
