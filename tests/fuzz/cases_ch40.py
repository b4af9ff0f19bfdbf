"""Fuzz cases of chapter 40 (LLM agents): ``llmbook.agents.llm_agents`` and ``llmbook.agents.agent_decisions``."""

import torch

from .cases import NONNEG, POS, Float, add

LA = "llmbook.agents.llm_agents:"
AD = "llmbook.agents.agent_decisions:"

add(LA + "tool_policy", lambda m: dict(f=m.f(m.s.B, m.s.K), tau=1.0), scalars=dict(tau=POS))
add(LA + "argument_log_likelihood",
    lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V), labels=m.ids(m.s.B, m.s.T, high=m.s.V)))
add(LA + "expected_utility", lambda m: dict(p=m.probs(m.s.B, m.s.K, m.s.C), R=m.f(m.s.C), cost=m.f(m.s.K).abs(),
                                            lam=1.0), scalars=dict(lam=NONNEG))
add(LA + "react_log_prob", lambda m: dict(log_pi=-m.f(m.s.B, m.s.T).abs(), log_obs=-m.f(m.s.B, m.s.T).abs()))
add(LA + "tot_path_score", lambda m: dict(v=m.f(m.s.B, m.s.T)))
add(AD + "majority_vote", lambda m: dict(y=torch.arange(m.s.B * m.s.K).reshape(m.s.B, m.s.K) % 3))
add(AD + "weighted_vote", lambda m: dict(y=torch.arange(m.s.B * m.s.K).reshape(m.s.B, m.s.K) % 3,
                                         w=m.f(m.s.B, m.s.K).abs()))
add(AD + "verifier_guided_choice", lambda m: dict(log_p=-m.f(m.s.B, m.s.K).abs(), v=m.f(m.s.B, m.s.K), lam=1.0),
    scalars=dict(lam=NONNEG))
add(AD + "reflexion_update", lambda m: dict(M=torch.arange(m.s.B * m.s.K).reshape(m.s.B, m.s.K) % 2 == 0,
                                            rho=torch.arange(m.s.B) % max(m.s.K, 1) - int(m.s.K == 0)))
add(AD + "retry_decision", lambda m: dict(p_success=m.probs(m.s.B, m.s.K)[..., 0] if m.s.K else torch.zeros(m.s.B),
                                          V=1.0, C_retry=0.1), scalars=dict(V=NONNEG, C_retry=NONNEG))
add(AD + "failure_probability", lambda m: dict(phi=m.f(m.s.B, m.s.D), w=m.f(m.s.D), b=0.0), scalars=dict(b=Float()))
