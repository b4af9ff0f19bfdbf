"""Tests of llmbook.agents.reward_models.

Oracles: brute-force enumeration with ``itertools.permutations`` and a Python-float product (Plackett-Luce),
``torch.nn.functional.margin_ranking_loss`` (margin loss), ``torch.nn.functional.binary_cross_entropy_with_logits``
and ``torch.nn.BCELoss`` (process and outcome losses), ``ast``-free string arithmetic with Python ints (trace
labels), numpy per-row loops (aggregation).
"""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.agents import reward_models as RM
from llmbook.lm import preference


def _pl_python(s, pi):
    p = 1.0
    for i in range(len(pi)):
        p *= math.exp(s[pi[i]]) / sum(math.exp(s[j]) for j in pi[i:])
    return p


@pytest.mark.equation("41.01", oracle="itertools.permutations enumeration and a Python-float product")
def test_plackett_luce_sums_to_one_over_all_permutations():
    g = torch.Generator().manual_seed(0)
    for K in (2, 3, 4, 5):
        s = torch.randn(3, K, generator=g, dtype=torch.float64) * 2
        perms = torch.tensor(list(itertools.permutations(range(K))))
        P = RM.plackett_luce_probability(s[:, None].expand(-1, len(perms), -1).reshape(-1, K),
                                         perms.repeat(3, 1)).reshape(3, -1)
        assert P.sum(-1).tolist() == pytest.approx([1.0] * 3, abs=1e-12)
        ref = [[_pl_python(row, p) for p in perms.tolist()] for row in s.tolist()]
        np.testing.assert_allclose(P.numpy(), np.array(ref), rtol=1e-12, atol=0)
    # K = 2 is Bradley-Terry (chapter 10)
    s = torch.tensor([[1.3, -0.4]], dtype=torch.float64)
    bt = preference.bradley_terry(s[:, 0], s[:, 1])
    assert RM.plackett_luce_probability(s, torch.tensor([[0, 1]])).item() == pytest.approx(bt.item(), abs=1e-15)


def test_plackett_luce_pairwise_marginal_is_bradley_terry():
    s = torch.tensor([0.5, -1.0, 2.0, 0.1], dtype=torch.float64)
    perms = torch.tensor(list(itertools.permutations(range(4))))
    P = RM.plackett_luce_probability(s.expand(len(perms), 4), perms)
    pos = perms.argsort(-1)  # pos[k, i]: the rank of item i
    for i, j in itertools.permutations(range(4), 2):
        marg = P[pos[:, i] < pos[:, j]].sum().item()
        assert marg == pytest.approx(1 / (1 + math.exp(s[j] - s[i])), abs=1e-12)


def test_ranking_pairs_and_rejects():
    w, l = RM.ranking_pairs(torch.tensor([[3, 1, 0, 2]]))
    ref = [(a, b) for a, b in itertools.combinations([3, 1, 0, 2], 2)]
    assert list(zip(w[0].tolist(), l[0].tolist(), strict=True)) == ref
    with pytest.raises(ValueError, match="permutation"):
        RM.ranking_pairs(torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="permutation"):
        RM.plackett_luce_probability(torch.zeros(1, 3), torch.tensor([[0, 2, 2]]))


@pytest.mark.equation("41.02", oracle="torch.nn.functional.margin_ranking_loss (target +1)")
def test_pairwise_margin_loss_matches_margin_ranking_loss():
    g = torch.Generator().manual_seed(1)
    r_w, r_l = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    for m in (0.0, 0.5, 2.0):
        for red in ("mean", "sum", "none"):
            ours = RM.pairwise_margin_loss(r_w, r_l, margin=m, reduction=red)
            ref = F.margin_ranking_loss(r_w, r_l, torch.ones(50, dtype=torch.float64), margin=m, reduction=red)
            torch.testing.assert_close(ours, ref, atol=1e-14, rtol=0)
    # zero once the chosen response wins by the margin; the Bradley-Terry loss never is
    assert RM.pairwise_margin_loss(torch.tensor([3.0]), torch.tensor([0.0]), margin=1.0).item() == 0.0
    assert preference.reward_model_loss(torch.tensor([3.0]), torch.tensor([0.0])).item() > 0.04


@pytest.mark.equation("41.03", oracle="torch.nn.functional.binary_cross_entropy_with_logits with a 0/1 weight")
def test_process_reward_loss_matches_bce_with_logits():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64) * 3
    y = (torch.rand(6, 5, generator=g) < 0.7).double()
    y[0] = torch.rand(5, generator=g, dtype=torch.float64)  # soft labels
    mask = torch.rand(6, 5, generator=g) < 0.8
    per = F.binary_cross_entropy_with_logits(z, y, weight=mask.double(), reduction="none").sum(-1)
    torch.testing.assert_close(RM.process_reward_loss(z, y, mask, reduction="none"), per, atol=1e-13, rtol=0)
    torch.testing.assert_close(RM.process_reward_loss(z, y, mask), per.mean(), atol=1e-13, rtol=0)
    torch.testing.assert_close(RM.process_reward_loss(z, y, mask, reduction="sum"), per.sum(), atol=1e-13, rtol=0)
    # large logits stay finite (softplus, not log(sigmoid))
    big = RM.process_reward_loss(torch.tensor([[200.0, -200.0]]), torch.tensor([[0.0, 1.0]]))
    assert big.item() == pytest.approx(400.0, rel=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        RM.process_reward_loss(z, y * 2, mask)
    with pytest.raises(TypeError, match="mask"):
        RM.process_reward_loss(z, y, mask.double())


@pytest.mark.equation("41.04", oracle="torch.nn.BCELoss on sigmoid probabilities in float64")
def test_outcome_reward_loss_matches_bce():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(40, generator=g, dtype=torch.float64)
    y = (torch.rand(40, generator=g) < 0.5).double()
    torch.testing.assert_close(RM.outcome_reward_loss(z, y), torch.nn.BCELoss()(torch.sigmoid(z), y),
                               atol=1e-13, rtol=0)
    torch.testing.assert_close(RM.outcome_reward_loss(z, y, reduction="none"),
                               torch.nn.BCELoss(reduction="none")(torch.sigmoid(z), y), atol=1e-13, rtol=0)


def test_process_loss_with_the_outcome_spread_over_steps_is_the_token_level_verifier():
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    spread = RM.process_reward_loss(z, y[:, None].expand(-1, 3), reduction="none")
    per_step = sum(RM.outcome_reward_loss(z[:, t], y, reduction="none") for t in range(3))
    torch.testing.assert_close(spread, per_step, atol=1e-13, rtol=0)


def test_aggregate_step_scores_against_numpy():
    z = torch.randn(5, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 1, 1]]).bool()
    p = 1 / (1 + np.exp(-z.numpy()))
    for how, f in (("prod", np.prod), ("min", np.min), ("last", lambda v: v[-1])):
        ref = [f(p[b][mask[b].numpy()]) for b in range(5)]
        np.testing.assert_allclose(RM.aggregate_step_scores(z, mask, how=how).numpy(), ref, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="at least one"):
        RM.aggregate_step_scores(z, torch.zeros(5, 4, dtype=torch.bool))


def test_sum_traces_labels_are_exact_arithmetic_of_the_printed_text():
    tr = RM.sum_traces(20, 8, n_terms=5, p_error=0.3, generator=torch.Generator().manual_seed(6))
    n_bad = 0
    for p in range(20):
        truth = sum(tr.terms[p].tolist())
        for n in range(8):
            steps = [s.split("=") for s in tr.text(p, n).split(", ")]
            ok = [int(lhs.split("+")[0]) + int(lhs.split("+")[1]) == int(rhs) for lhs, rhs in steps]
            assert ok == tr.step_ok[p, n].tolist()
            assert (int(steps[-1][1]) == truth) == tr.outcome[p, n].item()
            n_bad += not all(ok)
    assert 0 < n_bad < 160  # the policy slips, but not always


def test_step_features_without_noise_are_digit_checks():
    a, b = torch.arange(0, 500, 7), torch.arange(0, 500, 7).flip(0) % 100
    for delta, expect in ((0, [1, 1, 1]), (1, None), (10, None)):
        x = RM.step_features(a, b, a + b + delta, noise=0.0)
        if expect:
            assert (x == 1).all()
        else:  # a slip of 1 always breaks the units digit; a slip of 10 keeps it and breaks the tens digit
            col = 0 if delta == 1 else 1
            assert (x[:, col] == -1).all() and ((x[:, 0] == 1).all() if delta == 10 else True)
    noisy = RM.step_features(a.repeat(50), b.repeat(50), (a + b).repeat(50), noise=0.2)
    assert abs((noisy == -1).double().mean().item() - 0.2) < 0.02


def test_try_it_numbers():
    from tests.try_it import assert_states, markdown_text

    p = RM.plackett_luce_probability(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[0, 1, 2]])).item()
    rev = RM.plackett_luce_probability(torch.tensor([[2.0, 1.0, 0.0]]), torch.tensor([[2, 1, 0]])).item()
    e = math.e  # the closed forms the solution writes (float32 inputs: 1e-6)
    assert abs(p - e**2 / (e**2 + e + 1) * e / (e + 1)) < 1e-6
    assert abs(rev - 1 / (e**2 + e + 1) * 1 / (e + 1)) < 1e-6
    hinge = RM.pairwise_margin_loss(torch.tensor([0.3]), torch.tensor([0.0]), margin=1.0).item()
    bt = preference.reward_model_loss(torch.tensor([0.3]), torch.tensor([0.0])).item()
    z = torch.tensor([[3.0, 3.0, -1.0, 3.0]])
    agg = [RM.aggregate_step_scores(z, how=h).item() for h in ("prod", "min", "last")]
    bt3 = preference.reward_model_loss(torch.tensor([3.0]), torch.tensor([0.0])).item()
    assert f"{bt3:.3f}" == "0.049" and f"{torch.sigmoid(torch.tensor(-3.0)).item():.3f}" == "0.047"
    w, l = RM.ranking_pairs(torch.arange(9)[None])
    per_response = torch.bincount(torch.cat([w[0], l[0]]), minlength=9)
    assert per_response.tolist() == [8] * 9
    assert_states("41-reward-models.ipynb", [f"{p:.4f}", f"{rev:.4f}", f"{hinge:.2f}", f"{bt:.4f}",
                                             *(f"{v:.4f}" for v in agg), f"= {w.shape[1]}$ pairs",
                                             "each response in 8 of them", f"is `{tuple(w.shape)}`",
                                             r"\frac{1}{e^2+e+1}\cdot\frac{1}{e+1}"])
    text = markdown_text("41-reward-models.ipynb")  # the reverse's second factor is 1/(e+1), not e/(e+1)
    assert text is None or r"\frac{1}{e^2+e+1}\cdot\frac{e}{e+1}" not in text
