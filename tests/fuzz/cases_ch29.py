"""Fuzz cases of chapter 29 (RAG objectives and RAGAS-style metrics).

RAG-Sequence/RAG-Token take retrieval ``scores`` ``(B, k)`` (any reals; log-softmaxed over ``k``) and
``token_log_probs`` ``(B, k, N)`` (log-probabilities, ``<= 0``); ``k`` is the size symbol ``K`` and ``N``
is ``T``. The RAGAS metrics take 0/1 judgements as integer tensors ``(B, C)`` (``C`` read from ``T``);
a real judgement such as 0.5 is rejected, so they are not ``real_ok``. ``answer_relevance`` takes
embeddings ``(B, D)`` and ``(B, m, D)`` (``m`` read from ``K``).
"""

from __future__ import annotations

from .cases import POS_INT, add

RO = "llmbook.rag.rag_objectives:"
RG = "llmbook.rag.ragas:"


def _rag(m):
    s = m.s
    return dict(scores=m.f(s.B, s.K), token_log_probs=m.probs(s.B, s.K, s.T).log())


add(RO + "rag_sequence_log_likelihood", _rag)
add(RO + "rag_token_log_likelihood", _rag)


def _judged(m):
    return m.ids(m.s.B, m.s.T, high=2)


add(RG + "context_precision", lambda m: dict(verdicts=_judged(m), k=3), scalars=dict(k=POS_INT))
add(RG + "context_recall", lambda m: dict(covered=_judged(m), mask=_judged(m)))
add(RG + "faithfulness", lambda m: dict(supported=_judged(m), mask=_judged(m)))
add(RG + "attribution_precision", lambda m: dict(cited=_judged(m), supported_by_citation=_judged(m)))
add(RG + "answer_relevance", lambda m: dict(e_q=m.f(m.s.B, m.s.D), e_gen=m.f(m.s.B, m.s.K, m.s.D)))
