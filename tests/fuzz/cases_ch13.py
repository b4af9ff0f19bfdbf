"""Fuzz cases of chapter 13 (scaling laws): ``llmbook.lm.scaling``."""

from .cases import NONNEG, POS, Float, add

SL = "llmbook.lm.scaling:"
LAW = dict(E=NONNEG, A=NONNEG, B=NONNEG, alpha=POS, beta=POS)

add(SL + "parametric_loss", lambda m: dict(N=m.pos(m.s.B, m.s.T), D=m.pos(m.s.T)), scalars=LAW)
add(SL + "training_flops", lambda m: dict(N=m.pos(m.s.B), D=m.pos(m.s.B)))
add(SL + "chinchilla_optimal", lambda m: dict(C=m.pos(m.s.B)), scalars=LAW)
add(SL + "loss_vs_compute", lambda m: dict(C=m.pos(m.s.B), L_inf=1.7, A=400.0, alpha=0.15),
    scalars=dict(L_inf=NONNEG, A=NONNEG, alpha=POS))
add(SL + "emergence_probability", lambda m: dict(C=m.pos(m.s.B), a=2.0, b=0.5), scalars=dict(a=Float(), b=Float()))
