"""Fuzz cases of chapter 26 (retrieval metrics).

Each metric takes ``scores`` and ``labels`` of shape ``(B, N)``; ``N`` (the candidate documents of a
query) is read from the size symbol ``T``. Labels are integer grades 0-3 (``real_ok``: real grades
such as 0.5 are valid too, as in sklearn). Outputs are float64 in every input dtype: fp16/bf16 scores
are upcast before ranking, so they rank exactly as their float64 upcast.
"""

from __future__ import annotations

from .cases import POS_INT, Choice, add

RM = "llmbook.rag.metrics:"


def _pair(m):
    return dict(scores=m.f(m.s.B, m.s.T), labels=m.ids(m.s.B, m.s.T, high=4))


for _f in ("precision_at_k", "recall_at_k", "hit_rate_at_k"):
    add(RM + _f, lambda m: dict(**_pair(m), k=3), scalars=dict(k=POS_INT), real_ok=("labels",))
add(RM + "mean_reciprocal_rank", lambda m: dict(**_pair(m), k=3, reduction="none"),
    scalars=dict(k=POS_INT, reduction=Choice()), real_ok=("labels",))
for _f in ("average_precision", "mean_average_precision"):
    add(RM + _f, lambda m: dict(**_pair(m), k=4), scalars=dict(k=POS_INT), real_ok=("labels",))
for _f in ("dcg", "ndcg"):
    add(RM + _f, lambda m: dict(**_pair(m), k=4, gain="exponential"),
        scalars=dict(k=POS_INT, gain=Choice()), real_ok=("labels",))
add(RM + "r_precision", lambda m: dict(**_pair(m)), real_ok=("labels",))
