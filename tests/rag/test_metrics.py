"""Chapter 26 retrieval metrics against scikit-learn, pytrec_eval (trec_eval) and float64 brute force.

Tolerances: every oracle computes in float64 over the same ranking, so values agree to 1e-12
(pytrec_eval: 1e-12 as well; trec_eval accumulates in C doubles). Rankings are drawn without ties
(continuous scores) except where a test is about ties.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, dcg_score, ndcg_score

from llmbook.rag import metrics as M
from tests.try_it import assert_states

NB = "26-retrieval-metrics.ipynb"
INF = float("inf")


def _random_batch(seed: int, B: int = 6, N: int = 12, grades: int = 4, p_missing: float = 0.0):
    """Tie-free scores, graded labels, and (optionally) some documents not retrieved (score -inf)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(B, N, generator=g, dtype=torch.float64)
    labels = torch.randint(0, grades, (B, N), generator=g)
    if p_missing:
        scores = scores.masked_fill(torch.rand(B, N, generator=g) < p_missing, -INF)
    return scores, labels


# --------------------------------------------------------------------------- brute force (plain Python, float64)


def _ranked(scores_row, labels_row):
    """Labels of the retrieved documents in rank order; R counts every relevant document."""
    pairs = [(s, j, y) for j, (s, y) in enumerate(zip(scores_row, labels_row, strict=True)) if s > -INF]
    pairs.sort(key=lambda t: (-t[0], t[1]))
    return [1 if y > 0 else 0 for _, _, y in pairs], sum(1 for y in labels_row if y > 0)


def _bf_precision(rel, k):
    return sum(rel[:k]) / k


def _bf_recall(rel, R, k):
    return sum(rel[:k]) / R if R else 0.0


def _bf_rr(rel):
    for i, r in enumerate(rel, start=1):
        if r:
            return 1.0 / i
    return 0.0


def _bf_ap(rel, R):
    total, hits = 0.0, 0
    for i, r in enumerate(rel, start=1):
        if r:
            hits += 1
            total += hits / i
    return total / R if R else 0.0


def _rows(scores, labels):
    return [_ranked(s, y) for s, y in zip(scores.tolist(), labels.tolist(), strict=True)]


@pytest.mark.equation("26.01", oracle="float64 brute force over ranked Python lists")
def test_precision_at_k_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, p_missing=0.3 * (seed % 2))
        for k in (1, 3, 5, 12, 20):
            expected = [_bf_precision(rel, k) for rel, _ in _rows(scores, labels)]
            assert M.precision_at_k(scores, labels, k).tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.equation("26.02", oracle="float64 brute force over ranked Python lists")
def test_recall_at_k_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, p_missing=0.3 * (seed % 2))
        for k in (1, 3, 5, 12, 20):
            expected = [_bf_recall(rel, R, k) for rel, R in _rows(scores, labels)]
            assert M.recall_at_k(scores, labels, k).tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.equation("26.03", oracle="float64 brute force over ranked Python lists")
def test_hit_rate_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, grades=2, p_missing=0.3)
        for k in (1, 2, 5):
            expected = [float(any(rel[:k])) for rel, _ in _rows(scores, labels)]
            assert M.hit_rate_at_k(scores, labels, k).tolist() == expected


@pytest.mark.equation("26.04", oracle="float64 brute force: first relevant rank by a Python loop")
def test_mrr_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, grades=2, p_missing=0.3 * (seed % 2))
        rr = [_bf_rr(rel) for rel, _ in _rows(scores, labels)]
        assert M.mean_reciprocal_rank(scores, labels, reduction="none").tolist() == pytest.approx(rr, abs=1e-12)
        assert M.mean_reciprocal_rank(scores, labels).item() == pytest.approx(sum(rr) / len(rr), abs=1e-12)
        rr3 = [_bf_rr(rel[:3]) for rel, _ in _rows(scores, labels)]
        assert M.mean_reciprocal_rank(scores, labels, k=3, reduction="none").tolist() == pytest.approx(rr3, abs=1e-12)


@pytest.mark.equation("26.05", oracle="float64 brute force (precision at each relevant rank, divided by R)")
def test_average_precision_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, p_missing=0.3 * (seed % 2))
        expected = [_bf_ap(rel, R) for rel, R in _rows(scores, labels)]
        assert M.average_precision(scores, labels).tolist() == pytest.approx(expected, abs=1e-12)


@pytest.mark.equation("26.05", oracle="sklearn.metrics.average_precision_score")
def test_average_precision_matches_sklearn_when_everything_is_ranked():
    for seed in range(20):
        scores, labels = _random_batch(seed, grades=2)
        for b in range(scores.shape[0]):
            y = (labels[b] > 0).numpy()
            if not y.any():
                continue
            ref = average_precision_score(y, scores[b].numpy())
            assert M.average_precision(scores[b], labels[b]).item() == pytest.approx(ref, abs=1e-12)


def test_sklearn_ap_ignores_relevant_documents_that_were_not_retrieved():
    """The worked example of the chapter: 3 relevant documents, only 2 retrieved (at ranks 1 and 3)."""
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, -INF], dtype=torch.float64)
    labels = torch.tensor([1, 0, 1, 0, 1])
    ours = M.average_precision(scores, labels).item()
    assert ours == pytest.approx((1 / 1 + 2 / 3) / 3, abs=1e-15)  # IR: divide by all R = 3
    retrieved = scores > -INF
    skl = average_precision_score(labels[retrieved].numpy(), scores[retrieved].numpy())
    assert skl == pytest.approx((1 / 1 + 2 / 3) / 2, abs=1e-15)  # sklearn: only the 2 relevant it was given
    # the general relation: sklearn's AP = ours * R / (relevant retrieved)
    assert skl == pytest.approx(ours * 3 / 2, abs=1e-15)
    assert M.average_precision(scores[retrieved], labels[retrieved]).item() == pytest.approx(skl, abs=1e-15)
    assert_states(NB, [f"{ours:.4f}", f"{skl:.4f}"], section="all")


@pytest.mark.equation("26.06", oracle="float64 brute force mean of per-query AP")
def test_map_brute_force_and_sklearn():
    for seed in range(10):
        scores, labels = _random_batch(seed, B=8, grades=2, p_missing=0.2)
        expected = sum(_bf_ap(rel, R) for rel, R in _rows(scores, labels)) / 8
        assert M.mean_average_precision(scores, labels).item() == pytest.approx(expected, abs=1e-12)
        k_expected = sum(_bf_ap(rel[:4], R) for rel, R in _rows(scores, labels)) / 8
        assert M.mean_average_precision(scores, labels, k=4).item() == pytest.approx(k_expected, abs=1e-12)


@pytest.mark.equation("26.07", oracle="sklearn.metrics.dcg_score (linear gain; 2**rel-1 passed as y_true)")
def test_dcg_matches_sklearn():
    for seed in range(10):
        scores, labels = _random_batch(seed)
        y, s = labels.numpy().astype(float), scores.numpy()
        for k in (None, 1, 3, 10):
            for ties in (False, True):  # no ties in these scores: both of sklearn's modes agree
                lin = [dcg_score(y[b:b + 1], s[b:b + 1], k=k, ignore_ties=ties) for b in range(len(y))]
                exp = [dcg_score(2.0 ** y[b:b + 1] - 1, s[b:b + 1], k=k, ignore_ties=ties) for b in range(len(y))]
                assert M.dcg(scores, labels, k=k, gain="linear").tolist() == pytest.approx(lin, abs=1e-12)
                assert M.dcg(scores, labels, k=k).tolist() == pytest.approx(exp, abs=1e-12)


@pytest.mark.equation("26.08", oracle="sklearn.metrics.ndcg_score (linear gain; 2**rel-1 passed as y_true)")
def test_ndcg_matches_sklearn():
    for seed in range(10):
        scores, labels = _random_batch(seed)
        y, s = labels.numpy().astype(float), scores.numpy()
        for k in (None, 1, 3, 10):
            lin = [ndcg_score(y[b:b + 1], s[b:b + 1], k=k) for b in range(len(y))]
            exp = [ndcg_score(2.0 ** y[b:b + 1] - 1, s[b:b + 1], k=k) for b in range(len(y))]
            assert M.ndcg(scores, labels, k=k, gain="linear").tolist() == pytest.approx(lin, abs=1e-12)
            assert M.ndcg(scores, labels, k=k).tolist() == pytest.approx(exp, abs=1e-12)
            # sklearn's batch mean is the mean of ours
            assert M.ndcg(scores, labels, k=k, gain="linear").mean().item() == pytest.approx(
                ndcg_score(y, s, k=k), abs=1e-12)


def test_ndcg_ties_differ_from_sklearn_default_and_match_a_tie_break():
    """sklearn averages gains over tied scores (ignore_ties=False); we keep column order among ties."""
    scores = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([[0, 0, 3, 1]])
    ours = M.ndcg(scores, labels, k=2, gain="linear").item()
    y = labels.numpy().astype(float)
    averaged = ndcg_score(y, scores.numpy(), k=2)
    assert ours == pytest.approx(0.0, abs=1e-15)  # the two top slots go to the first two (non-relevant) columns
    assert averaged == pytest.approx((1 / 1 + 1 / math.log2(3)) / (3 + 1 / math.log2(3)), abs=1e-12)
    assert abs(ours - averaged) > 0.1
    broken = scores - 1e-9 * torch.arange(4)  # our order made explicit: earlier columns first
    assert ours == pytest.approx(ndcg_score(y, broken.numpy(), k=2, ignore_ties=True), abs=1e-12)


@pytest.mark.equation("26.09", oracle="float64 brute force (precision at rank R)")
def test_r_precision_brute_force():
    for seed in range(20):
        scores, labels = _random_batch(seed, p_missing=0.3 * (seed % 2))
        expected = [_bf_precision(rel + [0] * R, R) if R else 0.0 for rel, R in _rows(scores, labels)]
        assert M.r_precision(scores, labels).tolist() == pytest.approx(expected, abs=1e-12)


# --------------------------------------------------------------------------- pytrec_eval (trec_eval)

MEASURES = {"P_5", "P_10", "recall_5", "recall_10", "recip_rank", "map", "map_cut_5", "ndcg", "ndcg_cut_5",
            "ndcg_cut_10", "Rprec", "success_1", "success_5"}


def _random_run(seed: int, n_queries: int = 8, n_docs: int = 30):
    rnd = random.Random(seed)
    run, qrels = {}, {}
    for q in range(n_queries):
        docs = [f"d{i}" for i in range(n_docs)]
        qrels[f"q{q}"] = {d: rnd.choice([0, 0, 1, 2, 3]) for d in rnd.sample(docs, 12)}
        if q == 0:
            qrels["q0"] = {d: 0 for d in qrels["q0"]} | {"d0": 2}
        run[f"q{q}"] = rnd.sample(docs, rnd.randint(1, 15))
    return run, qrels


@pytest.mark.equation("26.01", oracle="pytrec_eval P_k")
@pytest.mark.equation("26.02", oracle="pytrec_eval recall_k")
@pytest.mark.equation("26.03", oracle="pytrec_eval success_k")
@pytest.mark.equation("26.04", oracle="pytrec_eval recip_rank")
@pytest.mark.equation("26.05", oracle="pytrec_eval map, map_cut_k")
@pytest.mark.equation("26.06", oracle="pytrec_eval map averaged over queries")
@pytest.mark.equation("26.07", oracle="pytrec_eval ndcg (IDCG x NDCG)")
@pytest.mark.equation("26.08", oracle="pytrec_eval ndcg, ndcg_cut_k (linear gain)")
@pytest.mark.equation("26.09", oracle="pytrec_eval Rprec")
def test_matches_pytrec_eval_on_runs_with_missing_relevant_documents():
    pytrec_eval = pytest.importorskip("pytrec_eval")
    for seed in range(5):
        run, qrels = _random_run(seed)
        trec_run = {q: {d: float(len(docs) - i) for i, d in enumerate(docs)} for q, docs in run.items()}
        ref = pytrec_eval.RelevanceEvaluator(qrels, MEASURES).evaluate(trec_run)
        ours = M.evaluate(run, qrels, reduction="none", gain="linear",
                          metrics=("p@5", "p@10", "recall@5", "recall@10", "mrr", "map", "map@5", "ndcg", "ndcg@5",
                                   "ndcg@10", "rprec", "hit@1", "hit@5"))
        names = {"P_5": "p@5", "P_10": "p@10", "recall_5": "recall@5", "recall_10": "recall@10", "recip_rank": "mrr",
                 "map": "map", "map_cut_5": "map@5", "ndcg": "ndcg", "ndcg_cut_5": "ndcg@5", "ndcg_cut_10": "ndcg@10",
                 "Rprec": "rprec", "success_1": "hit@1", "success_5": "hit@5"}
        for b, q in enumerate(qrels):
            for trec, mine in names.items():
                assert ours[mine][b].item() == pytest.approx(ref[q][trec], abs=1e-12), (q, trec)
        scores, labels = M.run_to_tensors(run, qrels)
        mean_ap = np.mean([ref[q]["map"] for q in qrels])
        assert M.mean_average_precision(scores, labels).item() == pytest.approx(mean_ap, abs=1e-12)
        # DCG = NDCG x IDCG, with IDCG from the judged grades sorted
        for b, q in enumerate(qrels):
            grades = sorted(qrels[q].values(), reverse=True)
            idcg = sum(gr / math.log2(i + 2) for i, gr in enumerate(grades))
            assert M.dcg(scores[b], labels[b], gain="linear").item() == pytest.approx(ref[q]["ndcg"] * idcg, abs=1e-12)


def test_trec_eval_breaks_ties_by_descending_docno():
    """trec_eval sorts tied scores by document id, descending (strcmp); ours by column: order the columns to match."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    rnd = random.Random(3)
    ids = [f"d{i}" for i in range(12)]  # "d9" > "d11" > "d10" > "d1" lexicographically
    for _ in range(20):
        scores = [float(rnd.choice([1, 2, 3])) for _ in ids]  # many ties
        grades = [rnd.choice([0, 0, 1, 2]) for _ in ids]
        if not any(grades):
            grades[0] = 1
        qrels = {"q": {d: g for d, g in zip(ids, grades, strict=True) if g}}
        ref = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank", "ndcg_cut_5", "P_3"}).evaluate(
            {"q": dict(zip(ids, scores, strict=True))})["q"]
        desc = sorted(range(len(ids)), key=lambda j: ids[j], reverse=True)
        s, y = torch.tensor(scores)[desc], torch.tensor(grades)[desc]
        assert M.mean_reciprocal_rank(s, y).item() == pytest.approx(ref["recip_rank"], abs=1e-12)
        assert M.ndcg(s, y, k=5, gain="linear").item() == pytest.approx(ref["ndcg_cut_5"], abs=1e-12)
        assert M.precision_at_k(s, y, 3).item() == pytest.approx(ref["P_3"], abs=1e-12)
    # and column order is a different rule: the relevant "d1" first in column order, last among ties for trec_eval
    ref = pytrec_eval.RelevanceEvaluator({"q": {"d1": 1}}, {"recip_rank"}).evaluate(
        {"q": {"d1": 1.0, "d2": 1.0, "d3": 1.0}})["q"]
    assert ref["recip_rank"] == pytest.approx(1 / 3)
    assert M.mean_reciprocal_rank(torch.ones(3), torch.tensor([1, 0, 0])).item() == 1.0


# --------------------------------------------------------------------------- conventions and errors


def test_run_to_tensors_and_evaluate_forms_agree():
    run = [["a", "b", "c"], ["x"]]
    qrels = [{"b": 1, "z": 2}, {}]
    scores, labels = M.run_to_tensors(run, qrels)
    assert scores.tolist() == [[-1.0, -2.0, -3.0, -INF], [-1.0, -INF, -INF, -INF]]
    assert labels.tolist() == [[0.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0]]
    by_dict = M.evaluate({"q1": run[0], "q2": run[1]}, {"q1": qrels[0], "q2": qrels[1]}, metrics=("map", "p@2"))
    assert by_dict == M.evaluate(scores, labels, metrics=("map", "p@2")) == {"map": 0.125, "p@2": 0.25}


def test_unretrieved_documents_take_no_rank_and_lists_read_in_float64():
    labels = torch.tensor([1, 0, 1])
    assert M.precision_at_k([-INF, -INF, -INF], labels, 2).item() == 0.0
    assert M.ndcg([-INF, 0.5, -INF], labels).item() == 0.0
    assert M.recall_at_k([0.3, 0.1, -INF], labels, 3).item() == 0.5
    # 0.1 + 2e-9 and 0.1 would tie in float32
    assert M.mean_reciprocal_rank([0.1, 0.1 + 2e-9, 0.0], [0, 1, 0]).item() == 1.0


def test_degenerate_inputs():
    empty = torch.zeros(0, 5)
    assert M.ndcg(empty, empty.long()).shape == (0,)
    with pytest.raises(ValueError, match="B >= 1"):
        M.mean_average_precision(empty, empty.long())
    no_docs = torch.zeros(2, 0)
    assert M.average_precision(no_docs, no_docs).tolist() == [0.0, 0.0]
    assert M.mean_reciprocal_rank(no_docs, no_docs).item() == 0.0


@pytest.mark.parametrize("call, err, match", [
    (lambda: M.ndcg(torch.rand(3), torch.tensor([True, False, True])), TypeError, "bool"),
    (lambda: M.ndcg(torch.rand(3), torch.tensor([1, -1, 0])), ValueError, ">= 0"),
    (lambda: M.ndcg(torch.tensor([0.1, math.nan, 0.2]), torch.ones(3)), ValueError, "scores"),
    (lambda: M.ndcg(torch.rand(3), torch.ones(4)), ValueError, "shape"),
    (lambda: M.ndcg(torch.rand(2, 2, 3), torch.ones(2, 2, 3)), ValueError, r"\(B, N\)"),
    (lambda: M.ndcg(torch.rand(3), torch.tensor([2000, 0, 0])), ValueError, "linear"),
    (lambda: M.ndcg(torch.rand(3), torch.ones(3), gain="log"), ValueError, "gain"),
    (lambda: M.precision_at_k(torch.rand(3), torch.ones(3), 0), ValueError, "k"),
    (lambda: M.precision_at_k(torch.rand(3), torch.ones(3), 2.0), TypeError, "k"),
    (lambda: M.run_to_tensors([["a", "a"]], [{}]), ValueError, "twice"),
    (lambda: M.run_to_tensors([["a"]], [{"a": -1}]), ValueError, "grade"),
    (lambda: M.run_to_tensors([["a"]], [{}, {}]), ValueError, "queries"),
    (lambda: M.evaluate([["a"]], [{}], metrics=("p",)), ValueError, "cut-off"),
    (lambda: M.evaluate([["a"]], [{}], metrics=("f1@3",)), ValueError, "unknown"),
])
def test_bad_input_raises_clear_errors(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_try_it_numbers():
    """Every number of the chapter's Try-it solutions, computed with our functions and checked by sklearn."""
    labels = torch.zeros(11)
    labels[[1, 2, 6, 10]] = 1
    scores = torch.tensor([-float(i + 1) for i in range(10)] + [-INF])
    p5, r5 = M.precision_at_k(scores, labels, 5).item(), M.recall_at_k(scores, labels, 5).item()
    rr, ap, rp = (M.mean_reciprocal_rank(scores, labels).item(), M.average_precision(scores, labels).item(),
                  M.r_precision(scores, labels).item())
    assert (p5, r5, rr, rp) == (0.4, 0.5, 0.5, 0.5)
    assert ap == pytest.approx((1 / 2 + 2 / 3 + 3 / 7) / 4, abs=1e-12)
    skl = average_precision_score(labels[:10].numpy(), scores[:10].numpy())
    assert skl == pytest.approx(ap * 4 / 3, abs=1e-12)
    stated = ["P@5 = 2/5 = 0.4", "recall@5 = 2/4 = 0.5", f"= {ap:.4f}", f"{skl:.4f}"]

    s = torch.tensor([4.0, 3, 2, 1, -INF])
    y = torch.tensor([3, 0, 2, 1, 3])
    with_missed = [M.ndcg(s, y, k=4, gain=gn).item() for gn in ("exponential", "linear")]
    without = [M.ndcg(s[:4], y[:4], k=4, gain=gn).item() for gn in ("exponential", "linear")]
    assert without[1] == pytest.approx(ndcg_score(y[None, :4].numpy(), s[None, :4].numpy(), k=4), abs=1e-12)
    stated += [f"{with_missed[0]:.4f} (exponential) and {with_missed[1]:.4f} (linear)",
               f"{without[0]:.4f} and {without[1]:.4f}"]

    s, y = torch.zeros(4), torch.tensor([0, 0, 0, 1])
    ours, reversed_ = M.ndcg(s, y).item(), M.ndcg(s, y.flip(0)).item()
    averaged = ndcg_score(y[None].numpy(), s[None].numpy())
    assert ours == pytest.approx(1 / math.log2(5), abs=1e-12) and reversed_ == 1.0
    assert averaged == pytest.approx(0.25 * sum(1 / math.log2(i + 1) for i in range(1, 5)) / 1.0, abs=1e-12)
    stated += [f"= {ours:.4f}", "scores 1.0", f"{averaged:.4f} in both orders"]
    assert_states(NB, stated)


def test_numbers_stated_in_the_chapter_text():
    """The prose of the side-by-side comparison (system C) and the MRR/AP contrast."""
    qrels = {"q1": {"rope": 3, "sinusoid": 3, "alibi": 2}, "q2": {"flash": 3, "sliding": 3, "kvcache": 2, "alibi": 1},
             "q3": {"qlora": 3, "lora": 2}, "q4": {"reppen": 3, "topp": 2, "temp": 1}}
    run_C = {q: ["rope", "flash", "lora", "kvcache", "temp"] for q in qrels}
    res = M.evaluate(run_C, qrels, metrics=("mrr", "map", "ndcg@5"))
    # oracle for MRR and MAP: the brute-force helpers on the id lists
    rr = [_bf_rr([int(qrels[q].get(d, 0) > 0) for d in run_C[q]]) for q in qrels]
    aps = [_bf_ap([int(qrels[q].get(d, 0) > 0) for d in run_C[q]], len(qrels[q])) for q in qrels]
    assert res["mrr"] == pytest.approx(sum(rr) / 4, abs=1e-12) and res["map"] == pytest.approx(sum(aps) / 4, abs=1e-12)
    assert_states(NB, [f"MRR ({res['mrr']:.4f})", f"MAP ({res['map']:.4f})", f"NDCG@5 ({res['ndcg@5']:.4f})"],
                  section="all")
