"""Fuzz cases of chapter 22 (dense retrieval): ``llmbook.rag.dense``.

Queries are ``(B, D)`` (or ``(B, T, D)`` token vectors), passages ``(E, D)`` (``(E, K, D)`` token
vectors for ColBERT, so that the degenerate sizes reach ``N`` and ``T_d``); hard negatives ``(B, K, D)``;
SPLADE logits ``(B, T, V)``. SPLADE weights are non-negative by contract (``m.pos``): a negative weight is
rejected with a ValueError.
"""

from .cases import POS, Choice, add

DN = "llmbook.rag.dense:"

add(DN + "dual_encoder_score", lambda m: dict(q=m.f(m.s.B, m.s.D), d=m.f(m.s.E, m.s.D)),
    scalars=dict(similarity=Choice()))
add(DN + "dpr_loss", lambda m: dict(q=m.f(m.s.B, m.s.D), d_pos=m.f(m.s.B, m.s.D), d_neg=m.f(m.s.B, m.s.K, m.s.D),
                                    tau=0.5),
    scalars=dict(tau=POS, similarity=Choice(), reduction=Choice()))
add(DN + "maxsim", lambda m: dict(E_q=m.f(m.s.B, m.s.T, m.s.D), E_d=m.f(m.s.E, m.s.K, m.s.D)))
add(DN + "splade_score", lambda m: dict(w_q=m.pos(m.s.B, m.s.V), w_d=m.pos(m.s.E, m.s.V)))
add(DN + "splade_weights", lambda m: dict(z=m.f(m.s.B, m.s.T, m.s.V, scale=3.0)), scalars=dict(pooling=Choice()))
add(DN + "flops_regularizer", lambda m: dict(w=m.pos(m.s.E, m.s.V)))
