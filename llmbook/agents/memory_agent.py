r"""Chapter 42's agent over the book: a retrieval-augmented policy whose memory is the book's own prose.

The agent reads Part II's corpus one passage per step, in book order, stores passages by one of the rules of
:mod:`llmbook.agents.memory` (everything, :func:`~llmbook.agents.memory.write_stream`, or that plus forgetting by
:func:`~llmbook.agents.memory.exponential_decay`), and answers the labelled questions of Part II
(:func:`llmbook.rag.corpus.load_queries`, all 100, dev and test) by citing a passage chosen by
:func:`~llmbook.agents.memory.retrieval_augmented_policy` over Part II's hybrid retriever
(:func:`llmbook.rag.pipeline.hybrid_scores`). :func:`citation_accuracy` scores the citations.

Nothing here is fitted, but the defaults of :func:`book_agent` (``tau_n``, ``tau_i``, the half-life, the forgetting
threshold, ``lag_max``, ``k``) were set by hand by people who had seen the first 56 of these questions (before the
dev/test split existed), so its numbers describe the book's questions, they do not estimate accuracy on new ones.
They also move a little whenever the corpus snapshot changes (BM25's statistics and the z-scores of the hybrid run
cover every passage), which is why the chapter's prose states no number from it.

The helpers of the chapter's experiment are kept here, apart from the registered equations, because they need the
book's data (:func:`llmbook.rag.pipeline.book_data`, cached embeddings; no model is loaded).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_int, check_range
from llmbook.agents.memory import exponential_decay, retrieval_augmented_policy, write_stream

__all__ = ["MEMORIES", "book_agent", "citation_accuracy", "prior_passage"]

#: The memories :func:`book_agent` knows, from none to the most selective.
MEMORIES = ("none", "all", "write", "decay")


def citation_accuracy(pi, labels, groups=None) -> dict:
    r"""How often the greedy action of ``pi`` ``(B, N)`` cites a relevant item, and the expected rate under ``pi``.

    ``labels`` ``(B, N)``: relevance grades (> 0 = relevant). With ``groups`` ``(N,)`` integer ids (a passage's
    chapter), an action counts as correct when its group holds a relevant item. Returns
    ``{"greedy": ..., "expected": ...}`` as floats.

    >>> citation_accuracy(torch.tensor([[0.9, 0.1]]), torch.tensor([[0.0, 1.0]]))
    {'greedy': 0.0, 'expected': 0.1}
    """
    pi, labels = as_tensor(pi, "pi"), as_tensor(labels, "labels")
    check_dim(pi, "pi", "(B, N)", min_dim=2, max_dim=2)
    if pi.shape != labels.shape:
        raise ValueError(f"pi {tuple(pi.shape)} and labels {tuple(labels.shape)} must have the same (B, N)")
    hit = (labels > 0).double()
    if groups is not None:
        g = torch.as_tensor(groups).long()
        G = int(g.max()) + 1
        in_group = torch.zeros(hit.shape[0], G, dtype=torch.float64).scatter_reduce(1, g.expand_as(hit), hit, "amax")
        hit = in_group[:, g]
    greedy = hit.gather(1, pi.argmax(-1, keepdim=True)).mean().item()
    expected = (pi.double() * hit).sum(-1).mean().item()
    return {"greedy": round(greedy, 6), "expected": round(expected, 6)}


def prior_passage() -> int:
    """The passage the agent without memory cites: the first passage of the corpus' longest chapter.

    A fixed action that ignores the question (the policy :math:`\\pi(a \\mid s, \\varnothing)`); which chapter that
    is depends on the corpus snapshot.
    """
    ch = _book()[2]
    return int(torch.nonzero(ch == torch.mode(ch).values).min())


def book_agent(*, memory: str = "all", tau_n: float = 0.3, tau_i: float = 0.5, half_life_steps: float = 50.0,
               forget_below: float = 0.25, lag_max: int = 200, k: int = 5, seed: int = 0) -> dict:
    r"""Chapter 42's agent on the book: it reads the passages in order and answers the book's labelled questions.

    The agent reads one passage per step (:math:`t_i = i`, Part II's corpus in book order). Question ``q`` arrives a
    random ``0..lag_max`` steps (``seed``) after the agent has read the last chapter it is about. The state is the
    question, the actions are the passages to cite, scored by Part II's retriever
    (:func:`llmbook.rag.pipeline.hybrid_scores`, embeddings from the package cache), and the policy is
    :func:`~llmbook.agents.memory.retrieval_augmented_policy` over the memory ``memory``:

    * ``"none"``: nothing stored; the fixed prior cites :func:`prior_passage` whatever the question;
    * ``"all"``: every passage read so far;
    * ``"write"``: the passages :func:`~llmbook.agents.memory.write_stream` kept (novelty of the MiniLM embedding
      over ``tau_n``, importance ``min(1, words / 120)`` over ``tau_i``);
    * ``"decay"``: ``"write"``, then forgotten once :func:`~llmbook.agents.memory.exponential_decay` with half-life
      ``half_life_steps`` falls below ``forget_below``.

    Correct means the greedy citation is a passage labelled relevant (grade 1 or 2) to the question
    (``"passage"``), or lies in a chapter that holds one (``"chapter"``). Returns ``{"passage": ..., "chapter":
    ..., "size": ...}``, the last being the mean number of items in memory when the questions arrive. The defaults
    were chosen by hand with the first 56 questions in view (see the module docstring).
    """
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    half_life_steps = check_range(half_life_steps, "half_life_steps", 0.0, low_open=True)
    forget_below = check_range(forget_below, "forget_below", 0.0, 1.0)
    lag_max, seed = check_int(lag_max, "lag_max", low=0), check_int(seed, "seed", low=0)
    d, s, ch = _book()
    N, B = len(d.passages), len(d.queries)
    T = torch.arange(N, dtype=torch.float64)
    last = {int(c): int(torch.nonzero(ch == c).max()) for c in ch.unique()}
    lag = torch.randint(0, lag_max + 1, (B,), generator=torch.Generator().manual_seed(seed))
    t_q = torch.tensor([float(min(N, 1 + max(last[int(c)] for c in ch[d.labels[b] > 0]) + int(lag[b])))
                        for b in range(B)], dtype=torch.float64)
    stored = T[None, :] < t_q[:, None]
    if memory in ("write", "decay"):
        stored = stored & _book_written(float(tau_n), float(tau_i))
    if memory == "decay":
        strength = exponential_decay(t_q[:, None], torch.minimum(T[None, :], t_q[:, None]),
                                     math.log(2) / half_life_steps)
        stored = stored & (strength >= forget_below)
    if memory == "none":
        stored = torch.zeros(N, dtype=torch.bool)
    prior = torch.zeros(N, dtype=torch.float64)
    prior[prior_passage()] = 1.0
    pi = retrieval_augmented_policy(s, stored, k=k, prior=prior)
    return {"passage": citation_accuracy(pi, d.labels)["greedy"],
            "chapter": citation_accuracy(pi, d.labels, groups=ch)["greedy"],
            "size": float(stored.expand(B, N).sum(-1).double().mean())}


@lru_cache(maxsize=1)
def _book():
    """Part II's book data, hybrid scores and each passage's chapter (computed once per process)."""
    from llmbook.rag import pipeline

    d = pipeline.book_data()
    return d, pipeline.hybrid_scores(d), torch.tensor([p.chapter for p in d.passages])


@lru_cache(maxsize=8)
def _book_written(tau_n: float, tau_i: float) -> Tensor:
    """:func:`write_stream` over the book's passages in order, importance ``min(1, words / 120)``."""
    d = _book()[0]
    importance = torch.tensor([min(1.0, len(p.text.split()) / 120) for p in d.passages], dtype=torch.float64)
    return write_stream(d.doc_emb.double(), importance, tau_n=tau_n, tau_i=tau_i)
