"""Fuzz cases of chapter 12 (quantisation): ``llmbook.lm.quantization``, ``llmbook.lm.nf4``, ``llmbook.lm.gptq``."""

from __future__ import annotations

from .cases import POS, POS_INT, PROB, Float, Int, add

Q = "llmbook.lm.quantization:"
NF = "llmbook.lm.nf4:"
GQ = "llmbook.lm.gptq:"

BITS, DIM = Int(lo=2, hi=16), Int()
NEAR_TIE = ("the codes round x / s: for fp16 input s is formed in float32, for the reference in float64, so a value "
            "within rounding of a half step (or of a midpoint between two NF levels) may take the neighbouring code")
SEARCH = ("a sequence of roundings (GPTQ's columns, AWQ's grid argmin) whose inputs depend on earlier rounding: "
          "float32 round-off can send one weight to the neighbouring level and everything after it follows; the "
          "algorithms are checked in float32/float64 against their oracles in tests/lm/test_gptq.py")

add(Q + "affine_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), s=0.125, z=3, q_min=0, q_max=15),
    scalars=dict(s=POS, z=Int(0, 15), q_min=Int(hi=3), q_max=Int(lo=3)))
add(Q + "absmax_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), b=4, dim=-1),
    scalars=dict(b=BITS, dim=DIM), lowp_int_reason=NEAR_TIE)
add(Q + "asymmetric_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), b=4, dim=-1),
    scalars=dict(b=BITS, dim=DIM), lowp_int_reason=NEAR_TIE)
add(Q + "per_channel_quantize", lambda m: dict(W=m.f(m.s.C, m.s.D), b=4), scalars=dict(b=BITS),
    lowp_int_reason=NEAR_TIE)
add(Q + "quantize_kv", lambda m: dict(K=m.f(m.s.B, m.s.H, m.s.T, m.s.D), V=m.f(m.s.B, m.s.H, m.s.T, m.s.D), b=4),
    scalars=dict(b=BITS))
add(Q + "ste_fake_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), b=4, dim=-1), scalars=dict(b=BITS, dim=DIM))
add(NF + "nf4_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), block_size=8, b=4),
    scalars=dict(block_size=POS_INT, b=Int(lo=2, hi=8)), lowp_int_reason=NEAR_TIE)
add(NF + "double_quantize", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), block_size=8, block_size2=4, b2=8),
    scalars=dict(block_size=POS_INT, block_size2=POS_INT, b2=BITS), lowp_int_reason=NEAR_TIE)


def _gptq(m):
    X = m.f(m.s.F, m.s.D)
    return dict(W=m.f(m.s.C, m.s.D), H=2 * X.T @ X, b=4)


add(GQ + "gptq_quantize", _gptq, scalars=dict(b=BITS, block_size=POS_INT, damp=Float(0)), lowp_skip=SEARCH)
add(GQ + "awq_quantize", lambda m: dict(W=m.f(m.s.C, m.s.D), X=m.f(m.s.T, m.s.D), b=4, n_grid=4),
    scalars=dict(b=BITS, n_grid=POS_INT), lowp_skip=SEARCH)
add(GQ + "smooth_quant", lambda m: dict(X=m.f(m.s.B, m.s.T, m.s.D), W=m.f(m.s.C, m.s.D), alpha=0.5),
    scalars=dict(alpha=PROB))
add(GQ + "llm_int8_matmul", lambda m: dict(X=m.f(m.s.B, m.s.T, m.s.D), W=m.f(m.s.C, m.s.D), threshold=6.0),
    scalars=dict(threshold=Float(0, inf_ok=True)))
