"""Semantic entropy, self-consistency and P(True) (chapter 19) against hand counts, scipy and collections.Counter.

Oracles and tolerances: the discrete semantic entropy against ``scipy.stats.entropy`` of the cluster counts
(``abs_tol = 1e-12``); the probability-weighted one against a hand computation; self-consistency against
``collections.Counter`` over normalised answers; P(True) against ``scipy.special.expit`` and a two-way softmax
(``abs_tol = 1e-12``).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from llmbook.lm import answer_uncertainty as au


def test_clusters_by_normalised_meaning():
    assert au.semantic_clusters(["Velm", "Kesh", " velm.", "Velm", "KESH!"]) == [0, 1, 0, 0, 1]
    same_number = {"30": "30", "thirty": "30"}  # a custom equivalence (standing in for an NLI model)
    assert au.semantic_clusters(["30", "thirty", "31"], lambda a, b: same_number.get(a, a) == same_number.get(b, b)) \
        == [0, 0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_discrete_semantic_entropy_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    words = ["Velm", "velm", "Kesh", "Tarsk", " kesh.", "Orvada"]
    answers = [words[i] for i in rng.integers(0, len(words), 12)]
    counts = Counter(au.normalize_answer(a) for a in answers)
    ref = scipy.stats.entropy(list(counts.values()))
    assert math.isclose(au.semantic_entropy(answers), ref, abs_tol=1e-12)


def test_semantic_entropy_edge_cases_and_bounds():
    assert au.semantic_entropy(["Velm", "velm", "VELM."]) == 0.0  # one meaning, three wordings
    assert math.isclose(au.semantic_entropy(["a", "b", "c", "d"]), math.log(4), abs_tol=1e-12)  # log M at most


def test_weighted_semantic_entropy_by_hand():
    # distinct answers: "Velm" p=0.4, "velm." p=0.2 (same meaning), "Kesh" p=0.1; "Velm" sampled twice counts once
    answers = ["Velm", "velm.", "Kesh", "Velm"]
    lp = torch.log(torch.tensor([0.4, 0.2, 0.1, 0.4], dtype=torch.float64))
    pC = np.array([0.6, 0.1]) / 0.7  # renormalised over the clusters found
    assert math.isclose(au.semantic_entropy(answers, lp), -(pC * np.log(pC)).sum(), abs_tol=1e-12)


def test_self_consistency_matches_counter():
    rng = np.random.default_rng(4)
    for _ in range(20):
        answers = [str(x) for x in rng.integers(20, 25, 9)]
        counts = Counter(answers)
        top = max(counts.values())
        first = next(a for a in answers if counts[a] == top)  # ties: the one seen first
        assert au.self_consistency(answers) == (first, top / 9)


def test_p_true_against_expit_and_softmax():
    lt, lf = torch.randn(50, dtype=torch.float64) * 3, torch.randn(50, dtype=torch.float64) * 3
    ours = au.p_true(lt, lf)
    np.testing.assert_allclose(ours.numpy(), scipy.special.expit((lt - lf).numpy()), atol=1e-12, rtol=0)
    np.testing.assert_allclose(ours.numpy(), torch.softmax(torch.stack([lt, lf], 1), 1)[:, 0].numpy(), atol=1e-12)
    assert math.isclose(au.p_true(math.log(0.3), math.log(0.1)), 0.75, abs_tol=1e-12)


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        au.semantic_entropy([])
    with pytest.raises(TypeError, match="sequence of strings"):
        au.self_consistency("Velm")
    with pytest.raises(TypeError, match="str"):
        au.semantic_clusters(["Velm", 3])
    with pytest.raises(ValueError, match="shape"):
        au.semantic_entropy(["a", "b"], torch.zeros(3))
    with pytest.raises(ValueError, match="log-probabilities"):
        au.semantic_entropy(["a", "b"], torch.tensor([0.5, -1.0]))
    with pytest.raises(ValueError, match="one shape"):
        au.p_true(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError):
        au.p_true(float("nan"), 0.0)
