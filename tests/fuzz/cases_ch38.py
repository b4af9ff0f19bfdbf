"""Fuzz cases of chapter 38 (offline RL and imitation learning): ``llmbook.agents.offline_rl``.

``N = B`` logged pairs over ``A = K`` actions; ``n = B`` logged episodes of ``T`` steps for the
importance-sampling estimators (probabilities of the logged actions: ``pi_a`` in (0, 1), ``mu_a`` in
[1/3, 1), so the ratios stay moderate in fp16).
"""

from __future__ import annotations

from .cases import NONNEG, POS, PROB, Choice, add

OR = "llmbook.agents.offline_rl:"


def _pairs(m):
    return dict(logits=m.f(m.s.B, m.s.K), a=m.ids(m.s.B, high=m.s.K))


def _episodes(m):
    return dict(pi_a=m.probs(m.s.B, m.s.T), mu_a=m.pos(m.s.B, m.s.T) / 1.5, G=m.f(m.s.B))


add(OR + "behavior_cloning_loss", lambda m: dict(**_pairs(m), reduction="mean"), scalars=dict(reduction=Choice()))
add(OR + "ordinary_importance_sampling", _episodes, scaled="G")
add(OR + "weighted_importance_sampling", _episodes, scaled="G")
add(OR + "cql_loss", lambda m: dict(Q=m.f(m.s.B, m.s.K), a=m.ids(m.s.B, high=m.s.K), alpha=1.0, target=m.f(m.s.B)),
    scalars=dict(alpha=NONNEG))
add(OR + "iql_value_loss", lambda m: dict(Q=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T), tau=0.7, reduction="mean"),
    scalars=dict(tau=PROB, reduction=Choice()))
add(OR + "awr_loss", lambda m: dict(**_pairs(m), A=m.f(m.s.B), beta=1.0, w_max=20.0),
    scalars=dict(beta=POS, w_max=POS))
