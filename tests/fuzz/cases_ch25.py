"""Fuzz cases of chapter 25 (reranking and learning to rank): ``llmbook.rag.ranking``.

Lists are ``(B, N)`` with ``N`` read from the size symbol ``T``; relevance grades are integer tensors in
[0, 4) (graded labels; a real-valued grade is valid too, hence ``real_ok``).
"""

from .cases import NONNEG, NONNEG_INT, POS, Choice, Float, Int, add

RK = "llmbook.rag.ranking:"
REDUCTION = dict(reduction=Choice())


def _lists(m):
    return dict(s=m.f(m.s.B, m.s.T), y=m.ids(m.s.B, m.s.T, high=4))


add(RK + "cross_encoder_score", lambda m: dict(h_cls=m.f(m.s.B, m.s.T, m.s.D), w=m.f(m.s.D), b=0.5),
    scalars=dict(b=Float()))
add(RK + "monot5_score", lambda m: dict(logits=m.f(m.s.B, m.s.V), true_id=0, false_id=1),
    scalars=dict(true_id=NONNEG_INT, false_id=NONNEG_INT))
add(RK + "pointwise_loss", lambda m: dict(s=m.f(m.s.B, m.s.T), y=m.ids(m.s.B, m.s.T, high=2)),
    scalars=dict(kind=Choice(), **REDUCTION), real_ok=("y",))
add(RK + "pairwise_hinge_loss", _lists, scalars=dict(margin=NONNEG, kind=Choice(), **REDUCTION), real_ok=("y",))
add(RK + "ranknet_loss", _lists, scalars=dict(sigma=POS, **REDUCTION), real_ok=("y",))
add(RK + "listmle_loss", _lists, scalars=REDUCTION, real_ok=("y",))
add(RK + "listnet_loss", _lists, scalars=REDUCTION, real_ok=("y",))
add(RK + "lambdarank_lambdas", lambda m: dict(**_lists(m), k=3),
    scalars=dict(sigma=POS, k=Int(lo=1), gain=Choice()), real_ok=("y",))
