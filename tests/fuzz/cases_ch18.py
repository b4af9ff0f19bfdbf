"""Fuzz cases of chapter 18 (non-transformer sequence models): ``llmbook.lm.ssm`` and ``llmbook.lm.recurrent``."""

from .cases import POS_INT, Choice, Float, add

SS = "llmbook.lm.ssm:"
RC = "llmbook.lm.recurrent:"


def _lti(m, scale=1.0):
    """(A, B, C, D) with N = D states, P = H inputs, Q = K outputs; ``scale`` keeps A's powers bounded."""
    s = m.s
    return dict(A=m.f(s.D, s.D, scale=scale), B=m.f(s.D, s.H), C=m.f(s.K, s.D), D=m.f(s.K, s.H))


def _discrete(m):
    lti = _lti(m, scale=0.3)
    return dict(A_bar=lti["A"], B_bar=lti["B"], C=lti["C"], D=lti["D"], u=m.f(m.s.B, m.s.T, m.s.H))


add(SS + "continuous_ssm", lambda m: dict(**_lti(m), x=m.f(m.s.B, m.s.D), u=m.f(m.s.B, m.s.H)))
UNSTABLE = dict(overflow="square", nan_reason="A_bar multiplies the state once per step, so entries of 1e30 reach "
                                               "1e60 after two steps and overflow float32; C x then adds inf and -inf. "
                                               "A usable SSM keeps every |eigenvalue of A_bar| <= 1")
add(SS + "ssm_scan", _discrete, **UNSTABLE)
add(SS + "ssm_convolution", _discrete, **UNSTABLE)
add(SS + "selective_scan", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), delta=m.pos(m.s.B, m.s.T, m.s.D),
                                          A=-m.pos(m.s.D, m.s.E), B=m.f(m.s.B, m.s.T, m.s.E),
                                          C=m.f(m.s.B, m.s.T, m.s.E), D=m.f(m.s.D), z=m.f(m.s.B, m.s.T, m.s.D)))

add(RC + "wkv", lambda m: dict(k=m.f(m.s.B, m.s.T, m.s.C), v=m.f(m.s.B, m.s.T, m.s.C), w=m.pos(m.s.C),
                               u=m.f(m.s.C)))
add(RC + "retention", lambda m: dict(q=m.f(m.s.B, m.s.H, m.s.T, m.s.D), k=m.f(m.s.B, m.s.H, m.s.T, m.s.D),
                                     v=m.f(m.s.B, m.s.H, m.s.T, m.s.D), gamma=0.9, form="chunkwise", chunk_size=2),
    scalars=dict(gamma=Float(0, 1, lo_open=True), form=Choice(), chunk_size=POS_INT))
add(RC + "long_convolution", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.C), h=m.f(m.s.T, m.s.C), D=m.f(m.s.C)))
