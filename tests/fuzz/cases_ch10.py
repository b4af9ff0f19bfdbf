"""Fuzz cases of chapter 10 (alignment and preference optimisation): llmbook.lm.preference and llmbook.lm.rlhf."""

from __future__ import annotations

import torch

from .cases import NONNEG, POS, PROB, Choice, Float, Int, add

PF = "llmbook.lm.preference:"
RL = "llmbook.lm.rlhf:"
_RED = Choice()


def _logps(m, *names):
    """Sequence log-probabilities (negative), one per pair: shape (B,)."""
    return {n: -m.pos(m.s.B) * m.s.T for n in names}


# --------------------------------------------------------------------------- preference losses

add(PF + "bradley_terry", lambda m: dict(r_w=m.f(m.s.B), r_l=m.f(m.s.B)))
add(PF + "reward_model_loss", lambda m: dict(r_w=m.f(m.s.B), r_l=m.f(m.s.B), margin=0.5),
    scalars=dict(margin=Float(), reduction=_RED))
add(PF + "dpo_implicit_reward", lambda m: dict(**_logps(m, "logp", "ref_logp"), beta=0.1), scalars=dict(beta=POS))
for _f in ("dpo_loss", "ipo_loss"):
    add(PF + _f, lambda m: dict(**_logps(m, "logp_w", "logp_l", "ref_logp_w", "ref_logp_l"), beta=0.1),
        scalars=dict(beta=POS, reduction=_RED))
add(PF + "kto_loss", lambda m: dict(**_logps(m, "logp", "ref_logp"), desirable=torch.arange(m.s.B) % 2 == 0,
                                    z_ref=0.1),
    scalars=dict(z_ref=NONNEG, beta=POS, lambda_D=NONNEG, lambda_U=NONNEG, reduction=_RED))
add(PF + "orpo_loss", lambda m: dict(logp_w=-m.pos(m.s.B), logp_l=-m.pos(m.s.B), nll_w=m.pos(m.s.B), lam=0.1),
    scalars=dict(lam=NONNEG, reduction=_RED))
add(PF + "simpo_loss", lambda m: dict(**_logps(m, "logp_w", "logp_l"), len_w=m.pos(m.s.B) * 4, len_l=m.pos(m.s.B) * 4),
    scalars=dict(beta=POS, gamma=NONNEG, reduction=_RED))

# --------------------------------------------------------------------------- RLHF


def _tokens(m, *names):
    return {n: m.f(m.s.B, m.s.T) for n in names}


add(RL + "sft_loss", lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V), labels=m.ids(m.s.B, m.s.T, high=m.s.V)),
    scalars=dict(ignore_index=Int(), reduction=_RED))
add(RL + "kl_regularized_objective",
    lambda m: dict(r=m.f(m.s.B, m.s.V), log_pi=m.probs(m.s.B, m.s.V).log(), log_pi_ref=m.probs(m.s.B, m.s.V).log(),
                   beta=0.1),
    scalars=dict(beta=POS))
add(RL + "ppo_clip_objective", lambda m: dict(**_tokens(m, "logp", "logp_old", "A"), eps=0.2,
                                              mask=torch.ones(m.s.B, m.s.T, dtype=torch.bool)),
    scalars=dict(eps=PROB))
add(RL + "value_loss", lambda m: dict(**_tokens(m, "V", "R", "V_old"), eps_v=0.2), scalars=dict(eps_v=NONNEG))
add(RL + "gae", lambda m: dict(r=m.f(m.s.B, m.s.T), V=m.f(m.s.B, m.s.T + 1), gamma=0.99, lam=0.95),
    scalars=dict(gamma=PROB, lam=PROB))
add(RL + "grpo_advantages", lambda m: dict(r=m.f(m.s.B, m.s.K + 2), eps=1e-4), scalars=dict(eps=NONNEG))
add(RL + "grpo_objective", lambda m: dict(**_tokens(m, "logp", "logp_old", "logp_ref"), A=m.f(m.s.B), eps=0.2,
                                          beta=0.04),
    scalars=dict(eps=PROB, beta=NONNEG))
add(RL + "rloo_advantages", lambda m: dict(r=m.f(m.s.B, m.s.K + 2)))
add(RL + "rejection_sampling_loss", lambda m: dict(logp=-m.pos(m.s.B) * m.s.T, r=m.f(m.s.B), tau=-10.0),
    scalars=dict(tau=Float(), reduction=_RED))
