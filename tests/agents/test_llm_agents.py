"""Tests of llmbook.agents.llm_agents.

Oracles: numpy softmax in float64 (40.01); a per-position Python loop over the tiny GPT's logits and the product of
probabilities in float64 (40.02); a Monte-Carlo estimate (40.03); enumeration of every trajectory of a small
branching environment, whose probabilities must sum to 1 (40.04); brute force over all paths (40.05);
collections.Counter and a Python loop (40.06-40.11: see test_agent_decisions.py).
"""

import itertools
import math

import numpy as np
import pytest
import torch

from llmbook.agents import llm_agents as LA
from llmbook.agents import tool_env as TE


@pytest.fixture(scope="module")
def tiny():
    from llmbook.lm.training import pretrained_tiny
    model, tok = pretrained_tiny()
    return model.eval(), tok


@pytest.mark.equation("40.01", oracle="numpy softmax in float64 of the tiny GPT's summed log-probs")
def test_tool_policy_matches_numpy(tiny):
    model, tok = tiny
    t = TE.make_tasks(3)[0]
    with torch.no_grad():
        f = LA.string_log_probs(model, tok, TE.prompt(t), [x + "(" for x in TE.TOOLS])
    pi = LA.tool_policy(f[None], tau=0.7)[0]
    z = f.numpy() / 0.7
    ref = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(pi.numpy(), ref, atol=1e-12)
    assert abs(pi.sum().item() - 1) < 1e-12
    with pytest.raises(ValueError):
        LA.tool_policy(torch.full((1, 2), -math.inf))


@pytest.mark.equation("40.02", oracle="per-position loop over the tiny GPT, and the float64 product of probabilities")
def test_argument_log_likelihood_per_position(tiny):
    model, tok = tiny
    ctx, arg = "Q: What is 3 plus 4?\nA: add(", "3,4)"
    ids = torch.as_tensor(tok.encode(ctx + arg), dtype=torch.long)
    with torch.no_grad():
        logits = model(ids[:-1][None]).double()
    labels = ids[1:].clone()
    labels[: len(ctx) - 1] = -100
    ours = LA.argument_log_likelihood(logits, labels[None])[0].item()
    loop, prod = 0.0, 1.0
    for t in range(len(ctx), len(ctx) + len(arg)):  # predict character t from the prefix ids[:t]
        with torch.no_grad():
            p = torch.softmax(model(ids[:t][None])[0, -1].double(), -1)[ids[t]].item()
        loop += math.log(p)
        prod *= p
    assert abs(ours - loop) < 1e-5
    assert abs(math.exp(ours) - prod) < 1e-5 * prod
    with torch.no_grad():  # and the helper through chapter 29's generator_log_probs agrees
        assert abs(LA.string_log_probs(model, tok, ctx, [arg])[0].item() - loop) < 1e-5


@pytest.mark.equation("40.03", oracle="Monte-Carlo average of sampled rewards minus the cost")
def test_expected_utility_monte_carlo():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 3, 4, generator=g, dtype=torch.float64), -1)
    R = torch.tensor([0.0, 1.0, 2.0, -1.0], dtype=torch.float64)
    cost = torch.tensor([0.1, 0.5, 0.0], dtype=torch.float64)
    U = LA.expected_utility(p, R, cost, lam=2.0)
    draws = torch.multinomial(p.reshape(-1, 4), 200_000, replacement=True, generator=g)
    mc = R[draws].mean(-1).reshape(2, 3) - 2.0 * cost
    assert (U - mc).abs().max() < 0.02


@pytest.mark.equation("40.04", oracle="enumeration of every trajectory: the probabilities sum to 1 and match a loop")
def test_react_trajectories_sum_to_one():
    pi = [0.2, 0.5, 0.3]  # the policy over the three tools, at each of T = 2 steps
    eps, total, n = 0.25, 0.0, 0
    for a1, a2 in itertools.product(range(3), repeat=2):
        for o1, o2 in itertools.product(*(TE.observation_probs(TE.TOOLS[a], "3,4", eps).items() for a in (a1, a2))):
            lp = LA.react_log_prob(torch.tensor([[math.log(pi[a1]), math.log(pi[a2])]], dtype=torch.float64),
                                   torch.tensor([[math.log(o1[1]), math.log(o2[1])]], dtype=torch.float64))
            assert abs(lp.exp().item() - pi[a1] * pi[a2] * o1[1] * o2[1]) < 1e-12
            total += lp.exp().item()
            n += 1
    assert n == 36  # 3 x 3 actions, 2 x 2 observations
    assert abs(total - 1) < 1e-12
    m = LA.react_log_prob(torch.tensor([[-1.0, -5.0]]), torch.tensor([[0.0, -5.0]]), torch.tensor([[True, False]]))
    assert m.item() == -1.0


@pytest.mark.equation("40.05", oracle="brute force over all b**T paths")
def test_tot_beam_exhaustive_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    b, T = 3, 3
    values = [torch.randn(*(b,) * (t + 1), generator=g, dtype=torch.float64) for t in range(T)]
    best = max(itertools.product(range(b), repeat=T), key=lambda p: sum(values[t][p[: t + 1]].item() for t in range(T)))
    path, score = LA.tot_beam_search(values, beam=b**T)
    assert path == best
    assert abs(score - sum(values[t][best[: t + 1]].item() for t in range(T))) < 1e-12
    v = torch.tensor([[values[t][best[: t + 1]].item() for t in range(T)]], dtype=torch.float64)
    assert abs(LA.tot_path_score(v).item() - score) < 1e-12
