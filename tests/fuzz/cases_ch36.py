"""Fuzz cases of chapter 36 (exploration and bandits): ``llmbook.agents`` bandits, regret, linucb, curiosity."""

import torch

from .cases import NONNEG, POS_INT, PROB, Float, add

BA = "llmbook.agents.bandits:"
LU = "llmbook.agents.linucb:"
RE = "llmbook.agents.regret:"
CU = "llmbook.agents.curiosity:"


def _counts(m, *shape):
    return m.f(*shape).abs().round()


add(BA + "epsilon_greedy", lambda m: dict(Q=m.f(m.s.B, m.s.K), epsilon=0.1), scalars=dict(epsilon=PROB))
add(BA + "boltzmann", lambda m: dict(Q=m.f(m.s.B, m.s.K), tau=0.5), scalars=dict(tau=NONNEG))
add(BA + "ucb1", lambda m: dict(mu_hat=m.f(m.s.B, m.s.K), N=_counts(m, m.s.B, m.s.K), t=7, c=1.4),
    scalars=dict(t=POS_INT, c=NONNEG))
add(RE + "cumulative_regret", lambda m: dict(mu=m.f(m.s.K), actions=m.ids(m.s.B, m.s.T, high=m.s.K)))
add(BA + "thompson_sampling", lambda m: dict(successes=_counts(m, m.s.B, m.s.K), failures=_counts(m, m.s.B, m.s.K),
                                             alpha0=1.0, beta0=1.0, generator=m.gen()),
    scalars=dict(alpha0=Float(0, lo_open=True), beta0=Float(0, lo_open=True)),
    lowp_skip="a random Beta draw: fp16 counts round differently, so the draws differ")
add(BA + "exp3_probabilities", lambda m: dict(log_w=m.f(m.s.B, m.s.K), gamma=0.1), scalars=dict(gamma=PROB))


def _linucb(m):
    K, d = m.s.K, m.s.D
    Z = m.f(K, d, d)
    A = torch.eye(d, dtype=Z.dtype) + Z @ Z.transpose(-1, -2) / max(d, 1)
    return dict(X=m.f(m.s.B, K, d), A=A, b=m.f(K, d), alpha=1.0)


add(LU + "linucb", _linucb, scalars=dict(alpha=NONNEG),
    reason="A is rebuilt as I + Z Z^T / d in the case dtype; the solve runs in float64")
add(CU + "RND", lambda m: dict(d_in=m.s.D, d_out=3, hidden=5, s=m.f(m.s.B, m.s.D)),
    init=("d_in", "d_out", "hidden", "generator", "dtype"),
    scalars=dict(d_in=POS_INT, d_out=POS_INT, hidden=POS_INT),
    overflow="square", nan_reason="the squared difference of two network outputs: beyond the square root of the "
                                  "dtype's range the square overflows to inf, and inf - inf inside the networks is NaN")
add(CU + "ICM", lambda m: dict(d_in=m.s.D, n_actions=3, d_feat=3, hidden=5, s=m.f(m.s.B, m.s.D),
                               a=m.ids(m.s.B, high=3), s_next=m.f(m.s.B, m.s.D)),
    init=("d_in", "n_actions", "d_feat", "hidden", "generator", "dtype"),
    scalars=dict(d_in=POS_INT, n_actions=POS_INT, d_feat=POS_INT, hidden=POS_INT),
    overflow="square", nan_reason="the squared error of the forward model: beyond the square root of the dtype's "
                                  "range it overflows, and inf - inf inside the networks is NaN")
