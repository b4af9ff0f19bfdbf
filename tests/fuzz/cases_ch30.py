"""Fuzz cases of chapter 30 (query expansion): ``llmbook.rag.expansion``."""

from .cases import NONNEG, PROB, add

QE = "llmbook.rag.expansion:"


def _rocchio(m):
    return dict(q=m.f(m.s.B, m.s.D), D_r=m.f(m.s.B, m.s.K, m.s.D), D_nr=m.f(m.s.B, m.s.T, m.s.D),
                alpha=1.0, beta=0.75, gamma=0.15)


add(QE + "rocchio", _rocchio, scalars=dict(alpha=NONNEG, beta=NONNEG, gamma=NONNEG))
add(QE + "relevance_model", lambda m: dict(P_w_d=m.pos(m.s.B, m.s.K, m.s.V), P_d_q=m.pos(m.s.B, m.s.K)))
add(QE + "rm3_interpolate", lambda m: dict(P_w_q=m.probs(m.s.B, m.s.V), P_w_R=m.probs(m.s.B, m.s.V), lam=0.5),
    scalars=dict(lam=PROB))
add(QE + "hyde", lambda m: dict(h=m.f(m.s.B, m.s.K, m.s.D), g=m.f(m.s.T, m.s.D), q=m.f(m.s.B, m.s.D)),
    lowp_int_reason="best is an argmax over cosines: two near-tied documents may swap under fp16/bf16 rounding")
