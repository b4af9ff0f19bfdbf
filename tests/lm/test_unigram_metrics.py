"""METEOR (16.05) against nltk, exact match (16.07) and token F1 (16.08) against torchmetrics' SQuAD.

nltk's ``meteor_score`` needs WordNet, which cannot be downloaded offline: it gets a stub whose
``synsets`` returns no synsets, so only its exact and stemmed stages match (ours has no synonym
stage). Tolerances: METEOR ``abs = 1e-12`` (the same float64 arithmetic on the same counts);
SQuAD: exact per example (0/1 and ratios of small integers, ``abs = 1e-6`` for torchmetrics'
float32), and its corpus score (x100) within ``abs = 1e-4``.
"""

from __future__ import annotations

import random

import pytest
from nltk.stem.porter import PorterStemmer
from nltk.translate.meteor_score import meteor_score
from torchmetrics.text import SQuAD

from llmbook.lm import unigram_metrics as um

WORDS = ["the", "cat", "cats", "sat", "sitting", "on", "mat", "mats", "a", "dog", "runs", "running", "ran", "The",
         "Dog", "Cat"]


class NoWordNet:
    """WordNet stand-in: no synonyms (the corpus cannot be downloaded offline)."""

    def synsets(self, word):
        return []


class Identity:
    def stem(self, word):
        return word


def _cases(seed: int, n: int):
    rng = random.Random(seed)
    return [(" ".join(rng.choices(WORDS, k=rng.randint(0, 12))),
             [" ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 3))]) for _ in range(n)]


@pytest.mark.equation("16.05", oracle="nltk.translate.meteor_score.meteor_score (WordNet stub: no synonyms)")
@pytest.mark.parametrize("stem", [False, True])
def test_meteor_matches_nltk(stem):
    ps = PorterStemmer()
    for hyp, refs in _cases(int(stem), 800):
        ours = um.meteor(hyp, refs, stemmer=ps.stem if stem else None)
        theirs = meteor_score([r.split() for r in refs], hyp.split(), stemmer=ps if stem else Identity(),
                              wordnet=NoWordNet())
        assert ours == pytest.approx(theirs, abs=1e-12), (hyp, refs)


@pytest.mark.equation("16.05", oracle="nltk meteor_score with alpha, beta, gamma")
def test_meteor_parameters_match_nltk():
    ps = PorterStemmer()
    for (hyp, refs), (alpha, beta, gamma) in zip(_cases(5, 60), [(0.5, 2.0, 0.3), (0.85, 1.0, 1.0), (1.0, 3.0, 0.0),
                                                                  (0.0, 0.5, 0.5)] * 15, strict=True):
        ours = um.meteor(hyp, refs, alpha=alpha, beta=beta, gamma=gamma, stemmer=ps.stem)
        theirs = meteor_score([r.split() for r in refs], hyp.split(), stemmer=ps, wordnet=NoWordNet(),
                              alpha=alpha, beta=beta, gamma=gamma)
        assert ours == pytest.approx(theirs, abs=1e-12)


def test_meteor_penalises_fragmentation():
    # the same words: one chunk scores F_mean (1 - 0.5 / 6^3); scrambled into 6 chunks loses half
    assert um.meteor("a b c d e f", "a b c d e f") == pytest.approx(1 - 0.5 / 216, abs=1e-15)
    assert um.meteor("f e d c b a", "a b c d e f") == pytest.approx(0.5, abs=1e-15)
    assert um.meteor("", "a") == 0.0 and um.meteor("x", ["a", "b"]) == 0.0


def test_meteor_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        um.meteor("a", "a", alpha=1.5)
    with pytest.raises(TypeError, match="hypothesis"):
        um.meteor(["a"], "a")
    with pytest.raises(TypeError, match="stemmer"):
        um.meteor("a", "a", stemmer=3)


# --------------------------------------------------------------------------- SQuAD


QA = [("The Eiffel Tower", ["Eiffel Tower", "the tower"]), ("in Paris, France.", ["Paris"]),
      ("an apple a day", ["apple day"]), ("42", ["forty-two", "42"]), ("", ["nothing"]), ("the", ["a"]),
      ("New York City", ["new york", "NYC"]), ("the the cat", ["cat cat the"]), ("Dr. Who?", ["dr who"]),
      ("1,000 km", ["1000 km", "one thousand kilometres"])]


def _qa_random(seed: int, n: int):
    rng = random.Random(seed)
    vocab = ["Paris", "paris", "the", "a", "an", "France", "France.", "city", "of", "light", ",", "New", "york", "!"]
    return [(" ".join(rng.choices(vocab, k=rng.randint(0, 6))),
             [" ".join(rng.choices(vocab, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]) for _ in range(n)]


def _squad(pred: str, answers: list[str]) -> dict:
    metric = SQuAD()
    return metric([{"prediction_text": pred, "id": "q"}], [{"answers": {"text": answers, "answer_start": [0] * len(
        answers)}, "id": "q"}])


@pytest.mark.equation("16.07", oracle="torchmetrics.text.SQuAD exact_match")
def test_exact_match_matches_torchmetrics():
    for pred, answers in QA + _qa_random(0, 300):
        assert um.exact_match(pred, answers) == pytest.approx(_squad(pred, answers)["exact_match"].item() / 100,
                                                              abs=1e-6)


@pytest.mark.equation("16.08", oracle="torchmetrics.text.SQuAD f1")
def test_token_f1_matches_torchmetrics():
    for pred, answers in QA + _qa_random(1, 300):
        assert um.token_f1(pred, answers) == pytest.approx(_squad(pred, answers)["f1"].item() / 100, abs=1e-6)


@pytest.mark.equation("16.08", oracle="torchmetrics.text.SQuAD over a whole set (mean x 100)")
def test_squad_corpus_scores_match_torchmetrics():
    data = QA + _qa_random(2, 100)
    preds = [{"prediction_text": p, "id": str(i)} for i, (p, _) in enumerate(data)]
    target = [{"answers": {"text": a, "answer_start": [0] * len(a)}, "id": str(i)} for i, (_, a) in enumerate(data)]
    theirs = SQuAD()(preds, target)
    em = sum(um.exact_match(p, a) for p, a in data) / len(data)
    f1 = sum(um.token_f1(p, a) for p, a in data) / len(data)
    assert 100 * em == pytest.approx(theirs["exact_match"].item(), abs=1e-4)
    assert 100 * f1 == pytest.approx(theirs["f1"].item(), abs=1e-4)


def test_squad_normalisation_and_errors():
    assert um.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert um.normalize_answer("theater and a theme") == "theater and theme"  # only whole-word articles go
    with pytest.raises(TypeError, match="prediction"):
        um.exact_match(3, "a")
    with pytest.raises(ValueError, match="at least one"):
        um.token_f1("a", [])
