"""Chapter 28's diversity metrics: alpha-nDCG (Clarke et al. 2008) and subtopic recall (Zhai et al. 2003).

Oracles, with tolerances:

* a hand computation from the paper's definition (closed form with log2(3), exact to 1e-12);
* a plain-Python transcription of the definition (nested loops over ranks and subtopics, float64, 1e-12);
* the ideal ranking: the greedy ideal equals the brute-force best permutation where greedy is optimal, and
  never exceeds it (brute force over all orders of up to 6 documents);
* alpha = 0 is NDCG with the linear gain "number of subtopics covered": ``sklearn.metrics.ndcg_score``
  (1e-12; scores without ties, where sklearn's tie averaging does not apply);
* subtopic recall against Python sets.
"""

import itertools
import math
import random

import pytest
import torch
from sklearn.metrics import ndcg_score

from llmbook.rag.diversity_metrics import alpha_dcg, alpha_ndcg, subtopic_recall

L3 = math.log2(3)


def test_hand_computed_example():
    # d0 covers subtopics {0, 1}, d1 {0}, d2 {2}; ranking d0, d1, d2; alpha = 0.5
    J = torch.tensor([[[1, 1, 0], [1, 0, 0], [0, 0, 1]]])
    s = torch.tensor([[3.0, 2.0, 1.0]])
    # gains: d0: 1 + 1 = 2; d1: subtopic 0 already seen once: 0.5; d2: 1
    dcg = 2 / 1 + 0.5 / L3 + 1 / 2
    # greedy ideal: d0 (2), then d2 (1) beats d1 (0.5), then d1 (0.5)
    ideal = 2 / 1 + 1 / L3 + 0.5 / 2
    assert alpha_dcg(s, J, k=3, alpha=0.5).item() == pytest.approx(dcg, abs=1e-12)
    assert alpha_ndcg(s, J, k=3, alpha=0.5).item() == pytest.approx(dcg / ideal, abs=1e-12)
    assert alpha_ndcg(s, J, k=1, alpha=0.5).item() == pytest.approx(1.0, abs=1e-12)
    # alpha = 1: a repeated subtopic is worth nothing; d1 then gains 0
    assert alpha_dcg(s, J, k=3, alpha=1.0).item() == pytest.approx(2 + 0 + 1 / 2, abs=1e-12)
    assert subtopic_recall(s, J, k=1).item() == pytest.approx(2 / 3)
    assert subtopic_recall(s, J, k=2).item() == pytest.approx(2 / 3)
    assert subtopic_recall(s, J, k=3).item() == pytest.approx(1.0)


def _loop_alpha_dcg(order, J, k, alpha):
    """The definition, word for word: G_i = sum_s J(d_i, s) (1 - alpha)^(r_{s,i-1}), discounted by log2(i+1)."""
    seen = [0] * len(J[0])
    total = 0.0
    for i, d in enumerate(order[:k], start=1):
        g = sum(J[d][s] * (1 - alpha) ** seen[s] for s in range(len(seen)))
        total += g / math.log2(i + 1)
        for s in range(len(seen)):
            seen[s] += J[d][s]
    return total


def _random_case(rnd, N, S):
    J = [[int(rnd.random() < 0.35) for _ in range(S)] for _ in range(N)]
    scores = rnd.sample(range(100), N)  # distinct
    return J, [float(x) for x in scores]


def test_alpha_dcg_matches_a_loop_over_the_definition():
    rnd = random.Random(0)
    for _ in range(50):
        N, S, k, alpha = rnd.randint(1, 9), rnd.randint(1, 5), rnd.randint(1, 10), rnd.choice([0.0, 0.3, 0.5, 0.9])
        J, scores = _random_case(rnd, N, S)
        order = sorted(range(N), key=lambda i: -scores[i])
        ours = alpha_dcg(torch.tensor([scores]), torch.tensor([J]), k=k, alpha=alpha).item()
        assert ours == pytest.approx(_loop_alpha_dcg(order, J, k, alpha), abs=1e-12)


def test_greedy_ideal_against_brute_force():
    rnd = random.Random(1)
    below = 0
    for _ in range(60):
        N, S, k, alpha = rnd.randint(2, 6), rnd.randint(1, 4), rnd.randint(1, 6), 0.5
        J, scores = _random_case(rnd, N, S)
        if not any(map(any, J)):
            continue
        best = max(_loop_alpha_dcg(list(p), J, k, alpha) for p in itertools.permutations(range(N)))
        order = sorted(range(N), key=lambda i: -scores[i])
        ours = alpha_ndcg(torch.tensor([scores]), torch.tensor([J]), k=k, alpha=alpha).item()
        exact = _loop_alpha_dcg(order, J, k, alpha) / best
        assert ours >= exact - 1e-12  # the greedy ideal never exceeds the true one
        below += ours > exact + 1e-12
        # the best ordering scores 1 against the greedy ideal (clamped) and against the exact one
        best_order = max(itertools.permutations(range(N)), key=lambda p: _loop_alpha_dcg(list(p), J, k, alpha))
        s_best = torch.zeros(1, N, dtype=torch.float64)
        s_best[0, list(best_order)] = torch.arange(N, 0, -1, dtype=torch.float64)
        assert alpha_ndcg(s_best, torch.tensor([J]), k=k, alpha=alpha).item() == pytest.approx(1.0, abs=1e-12)
    assert below <= 6  # greedy is the ideal in almost every small case


def test_alpha_zero_is_ndcg_with_subtopic_counts_sklearn():
    rnd = random.Random(2)
    for _ in range(20):
        N, S, k = rnd.randint(3, 12), rnd.randint(1, 5), rnd.randint(1, 12)
        J, scores = _random_case(rnd, N, S)
        counts = [[sum(row) for row in J]]
        if not any(counts[0]):
            continue
        ours = alpha_ndcg(torch.tensor([scores]), torch.tensor([J]), k=k, alpha=0.0).item()
        assert ours == pytest.approx(ndcg_score(counts, [scores], k=k), abs=1e-12)


def test_subtopic_recall_against_sets_and_batching():
    rnd = random.Random(3)
    Js, Ss, expected = [], [], []
    for _ in range(8):
        J, scores = _random_case(rnd, 10, 4)
        order = sorted(range(10), key=lambda i: -scores[i])
        allsubs = {s for d in range(10) for s in range(4) if J[d][s]}
        top = {s for d in order[:4] for s in range(4) if J[d][s]}
        expected.append(len(top) / len(allsubs) if allsubs else 0.0)
        Js.append(J)
        Ss.append(scores)
    got = subtopic_recall(torch.tensor(Ss), torch.tensor(Js), k=4)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    # batched alpha-nDCG equals row-by-row
    batched = alpha_ndcg(torch.tensor(Ss), torch.tensor(Js), k=5)
    rows = torch.cat([alpha_ndcg(torch.tensor([s]), torch.tensor([j]), k=5) for s, j in zip(Ss, Js, strict=True)])
    torch.testing.assert_close(batched, rows, rtol=0, atol=1e-12)


def test_not_retrieved_and_ties():
    J = torch.tensor([[[1, 0], [0, 1], [1, 0]]])
    # the document covering subtopic 1 is not retrieved: it still counts in the ideal and in n_S
    s = torch.tensor([[2.0, -math.inf, 1.0]])
    assert subtopic_recall(s, J, k=3).item() == pytest.approx(0.5)
    ideal = 1 + 1 / L3 + 0.5 / 2
    assert alpha_ndcg(s, J, k=3).item() == pytest.approx((1 + 0.5 / L3) / ideal, abs=1e-12)
    # ties keep column order (as chapter 26's metrics)
    tie = torch.tensor([[1.0, 1.0, 1.0]])
    assert alpha_dcg(tie, J, k=2).item() == pytest.approx(1 + 1 / L3, abs=1e-12)
    # a query without any covered subtopic scores 0
    assert alpha_ndcg(tie, torch.zeros(1, 3, 2), k=2).item() == 0.0
    assert subtopic_recall(tie, torch.zeros(1, 3, 2), k=2).item() == 0.0


@pytest.mark.parametrize("call, err, match", [
    (lambda: alpha_ndcg(torch.rand(2, 3), torch.ones(2, 4, 2)), ValueError, r"\(B, N, S\)"),
    (lambda: alpha_ndcg(torch.rand(3), torch.ones(3, 2)), ValueError, r"\(B, N\)"),
    (lambda: alpha_ndcg(torch.rand(1, 3), 2 * torch.ones(1, 3, 2, dtype=torch.long)), ValueError, "0/1"),
    (lambda: alpha_ndcg(torch.rand(1, 3), torch.ones(1, 3, 2), alpha=1.5), ValueError, "alpha"),
    (lambda: alpha_ndcg(torch.rand(1, 3), torch.ones(1, 3, 2), k=0), ValueError, "k"),
    (lambda: alpha_ndcg(torch.tensor([[0.1, math.nan, 0.2]]), torch.ones(1, 3, 2)), ValueError, "scores"),
    (lambda: subtopic_recall(torch.rand(1, 3), torch.ones(1, 3, 2), k=None), ValueError, "cut-off"),
])
def test_bad_input(call, err, match):
    with pytest.raises(err, match=match):
        call()
