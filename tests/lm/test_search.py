"""Chapter 9 search and model-pair decoding: exhaustive enumeration, closed forms, numpy, exact laws."""

import itertools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from llmbook.lm.search import (
    beam_search,
    contrastive_decode_step,
    contrastive_decoding_scores,
    length_penalty,
    residual_distribution,
    speculative_accept_prob,
    speculative_decode,
    speculative_sample,
)


def bigram_table(V, seed, concentration=1.0):
    """A fixed random next-token log-prob table: row = last token, float64 (V, V)."""
    rng = np.random.default_rng(seed)
    return np.log(rng.dirichlet(np.full(V, concentration), size=V))


def step_fn_of(table):
    t = torch.from_numpy(table)
    return lambda seq: t[seq[-1]]


def gnmt(log_prob, length, alpha):
    return log_prob / ((5 + length) / 6) ** alpha


def exhaustive(table, prefix, L, eos_id=None, alpha=0.0):
    """Every complete continuation of ``prefix`` up to L tokens, scored, best first (numpy float64)."""
    V = table.shape[0]
    out = {}
    for n in range(1, L + 1):
        for ys in itertools.product(range(V), repeat=n):
            if eos_id is not None and eos_id in ys[:-1]:
                continue  # nothing follows eos
            if n < L and (eos_id is None or ys[-1] != eos_id):
                continue  # shorter than L only if it ended
            seq = (prefix[-1],) + ys
            lp = sum(table[a, b] for a, b in zip(seq[:-1], seq[1:], strict=True))
            out[tuple(prefix) + ys] = (lp, gnmt(lp, n, alpha))
    return sorted(out.items(), key=lambda kv: -kv[1][1])


# --------------------------------------------------------------------------- 09.07 beam search


@pytest.mark.equation("09.07", oracle="exhaustive enumeration of all V^L sequences (itertools.product, numpy)")
@pytest.mark.parametrize("V, L", [(3, 3), (3, 4), (4, 3)])
@pytest.mark.parametrize("seed", range(4))
def test_full_width_beam_finds_exhaustive_optimum(V, L, seed):
    table = bigram_table(V, seed)
    width = V ** (L - 1)
    hyps = beam_search(step_fn_of(table), torch.tensor([0]), beam_width=width, max_len=L)
    truth = exhaustive(table, (0,), L)
    lookup = dict(truth)
    assert len(hyps) == width and len({tuple(h.tokens.tolist()) for h in hyps}) == width
    # a bigram model has exact ties (0->2->0->0 and 0->0->2->0 use the same transitions), so compare the
    # top-B *scores* in order, and check each returned sequence's own score (atol 1e-12)
    np.testing.assert_allclose([h.log_prob for h in hyps], [lp for _, (lp, _) in truth[:width]], atol=1e-12, rtol=0)
    for h in hyps:
        assert abs(h.log_prob - lookup[tuple(h.tokens.tolist())][0]) < 1e-12 and h.length == L


@pytest.mark.equation("09.07", oracle="exhaustive enumeration with eos and GNMT length penalty (numpy)")
@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_full_width_beam_with_eos_and_length_penalty(alpha, seed):
    V, L, eos = 4, 4, 3
    table = bigram_table(V, seed)
    width = V ** (L - 1)
    hyps = beam_search(step_fn_of(table), torch.tensor([1, 0]), beam_width=width, max_len=L, eos_id=eos, alpha=alpha)
    truth = exhaustive(table, (1, 0), L, eos_id=eos, alpha=alpha)
    lookup = dict(truth)
    for h in hyps:  # every returned hypothesis is a complete sequence with its exact GNMT score
        lp, score = lookup[tuple(h.tokens.tolist())]
        assert abs(h.log_prob - lp) < 1e-12 and abs(h.score - score) < 1e-12
        assert abs(h.score - gnmt(h.log_prob, h.length, alpha)) < 1e-12
    k = 10  # the best score and the top-k scores agree with enumeration (ties may swap equal-score sequences)
    assert abs(hyps[0].score - truth[0][1][1]) < 1e-12
    np.testing.assert_allclose([h.score for h in hyps[:k]], [sc for _, (_, sc) in truth[:k]], atol=1e-12, rtol=0)


@pytest.mark.equation("09.07", oracle="greedy loop with numpy.argmax (beam width 1)")
@pytest.mark.parametrize("seed", range(6))
def test_width_one_is_greedy(seed):
    V, L = 5, 6
    table = bigram_table(V, seed, concentration=0.5)
    seq, lp = [2], 0.0
    for _ in range(L):
        nxt = int(np.argmax(table[seq[-1]]))
        lp += table[seq[-1], nxt]
        seq.append(nxt)
    hyps = beam_search(step_fn_of(table), torch.tensor([2]), beam_width=1, max_len=L)
    assert len(hyps) == 1 and hyps[0].tokens.tolist() == seq and abs(hyps[0].log_prob - lp) < 1e-12


@pytest.mark.equation("09.07", oracle="hand-built table where greedy is suboptimal (exact product 0.4 vs 0.3)")
def test_beam_beats_greedy():
    table = np.log(np.array([[0.1, 0.5, 0.4], [0.6, 0.2, 0.2], [1e-9, 1e-9, 1 - 2e-9]]))
    greedy_hyp = beam_search(step_fn_of(table), [0], beam_width=1, max_len=2)[0]
    beam_hyp = beam_search(step_fn_of(table), [0], beam_width=2, max_len=2)[0]
    assert greedy_hyp.tokens.tolist() == [0, 1, 0] and math.isclose(greedy_hyp.log_prob, math.log(0.3))
    assert beam_hyp.tokens.tolist() == [0, 2, 2] and abs(beam_hyp.log_prob - math.log(0.4)) < 1e-8


def test_beam_search_stops_when_all_finished_and_skips_impossible():
    with np.errstate(divide="ignore"):
        table = np.log(np.array([[0.0, 0.3, 0.7], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]))  # eos = 0
    hyps = beam_search(step_fn_of(table), [2], beam_width=5, max_len=10, eos_id=0)
    assert [h.tokens.tolist() for h in hyps] == [[2, 0]]  # the only finite continuation; search stops at once
    assert hyps[0].log_prob == 0.0 and hyps[0].length == 1


# --------------------------------------------------------------------------- 09.08 length penalty


@pytest.mark.equation("09.08", oracle="GNMT closed form log p / ((5 + |y|) / 6)^alpha in float64 (Wu et al. 2016)")
def test_length_penalty_closed_form():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lp, n, a = -rng.exponential(10), int(rng.integers(0, 60)), float(rng.uniform(0, 2))
        assert abs(length_penalty(lp, n, a) - lp / ((5.0 + n) / 6.0) ** a) < 1e-12
    assert length_penalty(-3.0, 10, 0.0) == -3.0  # alpha = 0: raw log-prob
    assert length_penalty(-6.0, 1, 1.0) == -6.0  # |y| = 1: factor (5 + 1) / 6 = 1
    lps, ns = torch.tensor([-1.0, -2.0], dtype=torch.float64), torch.tensor([1, 7])
    torch.testing.assert_close(length_penalty(lps, ns, 0.7), lps / ((5 + ns.double()) / 6) ** 0.7, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------- 09.09 contrastive decoding


def numpy_contrastive(e, a, alpha, beta):
    lpe, lpa = scipy.special.log_softmax(e, -1), scipy.special.log_softmax(a, -1)
    pe = np.exp(lpe)
    plausible = pe >= beta * pe.max(-1, keepdims=True)
    return np.where(plausible, lpe - alpha * lpa, -np.inf)


@pytest.mark.equation("09.09", oracle="direct numpy/scipy computation of log p_exp - alpha log p_ama on V_head")
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed", range(3))
def test_contrastive_against_numpy(alpha, beta, seed):
    rng = np.random.default_rng(seed)
    e, a = 2 * rng.standard_normal((6, 30)), 2 * rng.standard_normal((6, 30))
    got = contrastive_decoding_scores(torch.from_numpy(e), torch.from_numpy(a), alpha, beta).numpy()
    want = numpy_contrastive(e, a, alpha, beta)
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
    step = contrastive_decode_step(torch.from_numpy(e), torch.from_numpy(a), alpha, beta).numpy()
    np.testing.assert_array_equal(step, np.argmax(want, -1))
    if alpha == 0:  # no amateur: plain greedy on the expert
        np.testing.assert_array_equal(step, np.argmax(e, -1))


# --------------------------------------------------------------------------- 09.10 speculative decoding


def pq_cases():
    rng = np.random.default_rng(0)
    for _ in range(20):
        V = int(rng.integers(2, 9))
        yield rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    yield np.array([0.2, 0.8]), np.array([0.5, 0.5])
    yield np.array([0.0, 0.5, 0.5]), np.array([0.6, 0.4, 0.0])  # disjoint supports in part
    yield np.array([0.3, 0.7]), np.array([0.3, 0.7])  # p == q: always accepted
    yield np.array([0.0, 1.0]), np.array([1.0, 0.0])  # never accepted


@pytest.mark.equation("09.10", oracle="exact law q min(1, p/q) + (1 - beta) residual equals the target p (float64)")
def test_speculative_output_law_is_exactly_p():
    for p_np, q_np in pq_cases():
        p, q = torch.from_numpy(p_np), torch.from_numpy(q_np)
        V = p.numel()
        xs = q_np > 0
        a = speculative_accept_prob(p, q, torch.arange(V)).numpy()  # every token at once (broadcast)
        np.testing.assert_allclose(a[xs], np.minimum(1, p_np[xs] / q_np[xs]), atol=1e-15, rtol=0)
        assert np.all(a[~xs] == 1)  # never proposed: convention min(1, p/0) = 1
        batched = speculative_accept_prob(p.expand(V, V), q.expand(V, V), torch.arange(V)).numpy()
        np.testing.assert_array_equal(batched, a)
        beta = float((q_np * a).sum())
        assert abs(beta - np.minimum(p_np, q_np).sum()) < 1e-12  # acceptance rate = sum min(p, q)
        res = residual_distribution(p, q).numpy()
        if beta < 1 - 1e-12:
            np.testing.assert_allclose(res, np.maximum(p_np - q_np, 0) / np.maximum(p_np - q_np, 0).sum(), atol=1e-15)
        law = q_np * a + (1 - beta) * res
        np.testing.assert_allclose(law, p_np, atol=1e-12, rtol=0)


@pytest.mark.equation("09.10", oracle="scipy.stats.chisquare of 200k draws against the target p")
@pytest.mark.parametrize("case", range(3))
def test_speculative_sample_frequencies(case):
    p_np, q_np = [(np.array([0.1, 0.2, 0.3, 0.25, 0.15]), np.array([0.3, 0.3, 0.1, 0.1, 0.2])),
                  (np.array([0.05, 0.05, 0.9]), np.array([0.6, 0.3, 0.1])),
                  (np.array([0.5, 0.5, 0.0]), np.array([0.0, 0.5, 0.5]))][case]
    n = 200_000
    g = torch.Generator().manual_seed(case)
    p, q = torch.from_numpy(p_np).expand(n, -1), torch.from_numpy(q_np).expand(n, -1)
    tokens, accepted = speculative_sample(p, q, generator=g)
    counts = np.bincount(tokens.numpy(), minlength=len(p_np))
    support = p_np > 0
    assert counts[~support].sum() == 0
    assert scipy.stats.chisquare(counts[support], n * p_np[support]).pvalue > 1e-3
    beta = np.minimum(p_np, q_np).sum()  # acceptance rate, within 5 binomial standard deviations
    assert abs(accepted.double().mean().item() - beta) < 5 * math.sqrt(beta * (1 - beta) / n) + 1e-12


@pytest.mark.equation("09.10", oracle="scipy.stats.chisquare against the target model's exact joint law (numpy)")
def test_speculative_decode_sequences_follow_target():
    V, n_new, runs = 3, 3, 3000
    target, draft = bigram_table(V, 1, concentration=4.0), bigram_table(V, 2, concentration=1.0)
    g = torch.Generator().manual_seed(0)
    counts, drafted, accepted = {}, 0, 0
    for _ in range(runs):
        r = speculative_decode(step_fn_of(target), step_fn_of(draft), torch.tensor([0]), n_draft=2,
                               max_new_tokens=n_new, generator=g)
        assert r.tokens.numel() == 1 + n_new
        key = tuple(r.tokens[1:].tolist())
        counts[key] = counts.get(key, 0) + 1
        drafted, accepted = drafted + r.n_drafted, accepted + r.n_accepted
    seqs = list(itertools.product(range(V), repeat=n_new))
    probs = np.array([np.exp(sum(target[a, b] for a, b in zip((0,) + s[:-1], s, strict=True))) for s in seqs])
    assert abs(probs.sum() - 1) < 1e-12
    observed = np.array([counts.get(s, 0) for s in seqs])
    assert scipy.stats.chisquare(observed, runs * probs).pvalue > 1e-3
    assert 0 < accepted <= drafted


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: beam_search(lambda s: torch.zeros(3), [0], 0, 3), ValueError,
         "beam_width must be a positive int, got 0"),
        (lambda: beam_search(lambda s: torch.zeros(3), [0], 2, 0), ValueError, "max_len must be a positive int, got 0"),
        (lambda: beam_search(lambda s: torch.zeros(3), [0], 2.0, 3), TypeError,
         r"beam_width must be a positive int, got 2.0 \(float\)"),
        (lambda: beam_search(lambda s: torch.zeros(3), [[0]], 2, 3), ValueError, "prefix must be a non-empty 1-D"),
        (lambda: beam_search(lambda s: torch.zeros(3), [], 2, 3), ValueError, "prefix must be a non-empty 1-D"),
        (lambda: beam_search(lambda s: torch.zeros(2, 3), [0], 2, 3), ValueError, r"shape \(V,\)"),
        (lambda: beam_search(lambda s: torch.full((3,), math.nan), [0], 2, 3), ValueError, "NaN"),
        (lambda: beam_search(lambda s: torch.zeros(3), [0], 2, 3, alpha=-1.0), ValueError, "alpha"),
        (lambda: beam_search(lambda s: torch.zeros(3), [0], 2, 3, eos_id=-1), ValueError, "eos_id"),
        (lambda: length_penalty(-1.0, -1, 0.5), ValueError, "length"),
        (lambda: length_penalty(-1.0, 3, -0.5), ValueError, "alpha"),
        (lambda: contrastive_decoding_scores(torch.zeros(3), torch.zeros(4)), ValueError, "same shape"),
        (lambda: contrastive_decoding_scores(torch.zeros(3), torch.zeros(3), alpha=-1.0), ValueError, "alpha"),
        (lambda: contrastive_decoding_scores(torch.zeros(3), torch.zeros(3), plausibility=2.0), ValueError,
         "plausibility"),
        (lambda: contrastive_decoding_scores(torch.tensor([0.0, math.nan]), torch.zeros(2)), ValueError, "NaN"),
        (lambda: speculative_accept_prob(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]), torch.tensor(0.0)),
         TypeError, "integer token ids"),
        (lambda: speculative_accept_prob(torch.ones(2, 2) / 2, torch.ones(2, 2) / 2, torch.zeros(3, dtype=torch.long)),
         ValueError, "must broadcast"),
        (lambda: speculative_accept_prob(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]), torch.tensor(2)),
         ValueError, r"\[0, V\) = \[0, 2\)"),
        (lambda: speculative_sample(torch.tensor([0.5, 0.6]), torch.tensor([0.5, 0.5])), ValueError, "sum to 1"),
        (lambda: speculative_sample(torch.tensor([0.5, 0.5]), torch.tensor([1.0])), ValueError, "same shape"),
        (lambda: residual_distribution(torch.tensor([1.5, -0.5]), torch.tensor([0.5, 0.5])), ValueError,
         "non-negative"),
        (lambda: speculative_decode(lambda s: torch.zeros(3), lambda s: torch.zeros(4), [0], 2, 3), ValueError,
         r"shape \(V,\) = \(4,\), got \(3,\)"),
        (lambda: speculative_decode(lambda s: torch.zeros(3), lambda s: torch.zeros(3), [0], 0, 3), ValueError,
         "n_draft"),
    ],
)
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_length_penalty_kinds_and_overflow():
    """Issue 11: length 2.5 / True / NaN and a bool log_prob passed silently, a list failed in float();
    alpha = 1e30 raised OverflowError (in beam_search too)."""
    for bad, text in [(True, r"got True \(bool\)"), (2.5, r"got 2.5 \(float\)"), ("0.5", r"got '0.5' \(str\)"),
                      (math.nan, r"got nan \(float\)")]:
        with pytest.raises(TypeError, match="length must be a non-negative int, " + text):
            length_penalty(-1.0, bad, 1.0)
    with pytest.raises(TypeError, match=r"length must be an integer tensor of token counts, got dtype torch.float32"):
        length_penalty(torch.tensor([-1.0]), torch.tensor([2.5]), 1.0)
    with pytest.raises(TypeError, match="log_prob must be a real floating-point tensor, got dtype torch.bool"):
        length_penalty(torch.tensor([True]), 3, 1.0)
    torch.testing.assert_close(length_penalty([-6.0, -12.0], 7, 1.0), torch.tensor([-3.0, -6.0]), rtol=0, atol=0)
    assert length_penalty(-6.0, 0, 1.0) == -6.0 / (5 / 6)  # |y| = 0 is allowed: factor (5/6)^alpha
    # alpha = 1e30: the factor ((5 + n) / 6)^alpha exceeds any float, so the score is log p / inf = -0.0 for n > 1
    assert length_penalty(-6.0, 7, 1e30) == 0.0 and length_penalty(-6.0, 1, 1e30) == -6.0
    table = torch.log(torch.tensor([[0.1, 0.5, 0.4], [0.6, 0.2, 0.2], [0.0, 0.0, 1.0]]))
    hyps = beam_search(lambda seq: table[seq[-1]], torch.tensor([0]), beam_width=2, max_len=3, eos_id=0, alpha=1e30)
    assert all(math.isfinite(h.score) for h in hyps)


@pytest.mark.parametrize("beta", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("seed", range(4))
def test_contrastive_weighted_form_is_obrien_lewis_logit_form(beta, seed):
    """O'Brien & Lewis (2023) score (1 + beta) z_exp - beta z_ama in raw logits, masked where
    z_exp < log(plausibility) + max z_exp. Our log-probability form with alpha = beta / (1 + beta) is the
    same score divided by 1 + beta, up to a per-row constant: the plausible sets agree exactly and the
    scores agree to 1e-10 after removing each row's mean; the argmax is the same token."""
    rng = np.random.default_rng(seed)
    z_e, z_a = 2 * rng.standard_normal((6, 30)), 3 * rng.standard_normal((6, 30)) + 1.0
    plaus = 0.1
    theirs = (1 + beta) * z_e - beta * z_a
    theirs = np.where(z_e >= np.log(plaus) + z_e.max(-1, keepdims=True), theirs, -np.inf)
    ours = (1 + beta) * contrastive_decoding_scores(torch.from_numpy(z_e), torch.from_numpy(z_a), beta / (1 + beta),
                                                    plaus).numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    keep = np.isfinite(theirs)
    for o, t, k in zip(ours, theirs, keep, strict=True):
        np.testing.assert_allclose(o[k] - o[k].mean(), t[k] - t[k].mean(), atol=1e-10, rtol=0)
    np.testing.assert_array_equal(contrastive_decode_step(torch.from_numpy(z_e), torch.from_numpy(z_a),
                                                          beta / (1 + beta), plaus).numpy(), theirs.argmax(-1))
