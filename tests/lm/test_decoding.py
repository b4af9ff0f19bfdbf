"""Chapter 9 warpers and samplers against transformers' logits warpers, torch/numpy and hand computations."""

import math

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from llmbook.lm.decoding import (
    apply_temperature,
    greedy,
    min_p_filter,
    mirostat_filter,
    mirostat_step,
    sample,
    top_k_filter,
    top_p_filter,
    typical_filter,
)
from tests.try_it import assert_states

SEEDS = range(5)
B, V = 8, 50


def logit_cases(seed):
    """Random logits (B, V): mild, peaked, very peaked, and integer-valued (many ties)."""
    g = torch.Generator().manual_seed(seed)
    yield "mild", 0.5 * torch.randn(B, V, generator=g)
    yield "peaked", 3.0 * torch.randn(B, V, generator=g)
    yield "very peaked", 10.0 * torch.randn(B, V, generator=g)
    yield "ties", torch.randint(0, 4, (B, V), generator=g).float()
    masked = 2.0 * torch.randn(B, V, generator=g)
    masked[torch.rand(B, V, generator=g) < 0.3] = -math.inf  # already-filtered entries, as after a warper
    masked[:, 0] = 0.0
    yield "masked", masked


def hf(warper, scores):
    """Apply a transformers warper to scores (B, V); input_ids are not used by these warpers."""
    return warper(torch.zeros(scores.shape[0], 1, dtype=torch.long), scores.clone())


def assert_same_logits(ours, theirs, msg=""):
    """Same kept set (finite entries), same values there (atol 1e-6)."""
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), msg
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0, msg=msg)


# --------------------------------------------------------------------------- 09.01 greedy


@pytest.mark.equation("09.01", oracle="torch.argmax and numpy.argmax (first index on ties)")
@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_matches_argmax(seed):
    for name, z in logit_cases(seed):
        got = greedy(z)
        assert torch.equal(got, torch.argmax(z, dim=-1)), name
        assert np.array_equal(got.numpy(), np.argmax(z.numpy(), axis=-1)), name
    z = torch.randn(2, 3, 7)  # any leading dims
    assert greedy(z).shape == (2, 3)
    assert torch.equal(greedy(z), torch.argmax(z, -1))


# --------------------------------------------------------------------------- 09.02 temperature + sampling


@pytest.mark.equation("09.02", oracle="transformers.TemperatureLogitsWarper")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tau", [0.05, 0.3, 1.0, 2.5, 10.0])
def test_temperature_matches_transformers(seed, tau):
    for name, z in logit_cases(seed):
        assert_same_logits(apply_temperature(z, tau), hf(TemperatureLogitsWarper(tau), z), f"{name} tau={tau}")


@pytest.mark.equation("09.02", oracle="torch.argmax (tau = 0 is greedy, claim C17)")
@pytest.mark.parametrize("seed", SEEDS)
def test_tau_zero_sampling_is_argmax_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    for name, z in logit_cases(seed):
        for _ in range(20):
            assert torch.equal(sample(z, tau=0, generator=g), torch.argmax(z, -1)), name
        # the warped logits keep exactly one finite entry, the (first) argmax, with its value unchanged
        w = apply_temperature(z, 0)
        assert torch.equal(torch.isfinite(w).sum(-1), torch.ones(B, dtype=torch.long)), name
        assert torch.equal(torch.argmax(w, -1), torch.argmax(z, -1)), name
        assert torch.equal(w.amax(-1), z.amax(-1)), name
    # tau = 0 with truncation arguments is still greedy
    z = torch.randn(4, 9)
    assert torch.equal(sample(z, tau=0, top_k=3, top_p=0.5, min_p=0.2, typical_p=0.5), torch.argmax(z, -1))


@pytest.mark.equation("09.02", oracle="scipy.stats.entropy of softmax(z / tau) (claim C17: monotone in tau)")
@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_increases_with_temperature(seed):
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(V, generator=g, dtype=torch.float64)
    taus = np.geomspace(0.01, 100.0, 60)
    H = np.array([scipy.stats.entropy(torch.softmax(apply_temperature(z, float(t)), -1).numpy()) for t in taus])
    assert np.all(np.diff(H) > -1e-12), "entropy must be non-decreasing in tau (atol 1e-12)"
    assert H[0] < 0.05 and H[-1] > math.log(V) - 0.01  # near one-hot at 0.01, near uniform at 100


@pytest.mark.equation("09.02", oracle="torch.softmax (tau = 1 is the identity; large tau -> uniform 1/V)")
@pytest.mark.parametrize("seed", SEEDS)
def test_temperature_one_and_large(seed):
    for name, z in logit_cases(seed):
        torch.testing.assert_close(torch.softmax(apply_temperature(z, 1.0), -1), torch.softmax(z, -1),
                                   atol=1e-6, rtol=0, msg=name)
        p = torch.softmax(apply_temperature(z.double(), 1e7), -1)  # uniform over the unmasked tokens
        finite = torch.isfinite(z)
        uniform = finite / finite.sum(-1, keepdim=True)
        torch.testing.assert_close(p, uniform.double(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.equation("09.02", oracle="scipy.stats.chisquare against torch.softmax(z / tau) frequencies")
def test_sample_frequencies_match_softmax():
    z = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    g = torch.Generator().manual_seed(1)
    n, tau = 40_000, 0.7
    draws = sample(z.expand(n, -1), tau=tau, generator=g)
    assert draws.shape == (n,)
    counts = np.bincount(draws.numpy(), minlength=5)
    expected = n * torch.softmax(z.double() / tau, -1).numpy()
    assert scipy.stats.chisquare(counts, expected).pvalue > 1e-3


@pytest.mark.equation("09.02", oracle="transformers warpers chained in generate()'s order, then torch.multinomial")
def test_sample_applies_warpers_in_transformers_order():
    g = torch.Generator().manual_seed(3)
    z = 2.0 * torch.randn(B, V, generator=g)
    theirs = z
    for w in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(20, filter_value=-math.inf, min_tokens_to_keep=1),
              TopPLogitsWarper(0.9, filter_value=-math.inf, min_tokens_to_keep=1),
              MinPLogitsWarper(0.05, filter_value=-math.inf, min_tokens_to_keep=1),
              TypicalLogitsWarper(0.95, filter_value=-math.inf, min_tokens_to_keep=1)):
        theirs = hf(w, theirs)
    draws = torch.stack([sample(z, tau=0.8, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95, generator=g)
                         for _ in range(300)])
    allowed = torch.isfinite(theirs)
    assert allowed.gather(1, draws.T).all(), "every draw must lie in transformers' kept set"
    # the same seed gives the same draws as multinomial on transformers' warped distribution
    ours = sample(z, tau=0.8, top_k=20, top_p=0.9, min_p=0.05, typical_p=0.95,
                  generator=torch.Generator().manual_seed(7))
    ref = torch.multinomial(torch.softmax(theirs, -1), 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    assert torch.equal(ours, ref)


# --------------------------------------------------------------------------- 09.03-09.06 truncation warpers


@pytest.mark.equation("09.03", oracle="transformers.TopKLogitsWarper (keeps every tie of the k-th value)")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 2, 5, 17, V])
def test_top_k_matches_transformers(seed, k):
    for name, z in logit_cases(seed):
        theirs = hf(TopKLogitsWarper(k, filter_value=-math.inf, min_tokens_to_keep=1), z)
        assert_same_logits(top_k_filter(z, k), theirs, f"{name} k={k}")


@pytest.mark.equation("09.04", oracle="transformers.TopPLogitsWarper")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.95, 1.0])
def test_top_p_matches_transformers(seed, p):
    for name, z in logit_cases(seed):
        ours = top_p_filter(z, p)
        theirs = hf(TopPLogitsWarper(p, filter_value=-math.inf, min_tokens_to_keep=1), z)
        if name != "ties":
            assert_same_logits(ours, theirs, f"{name} p={p}")
            continue
        # ties at the boundary may keep different members of a tied group: same count, same kept mass
        assert torch.equal(torch.isfinite(ours).sum(-1), torch.isfinite(theirs).sum(-1)), f"p={p}"
        probs = torch.softmax(z, -1)
        torch.testing.assert_close((probs * torch.isfinite(ours)).sum(-1), (probs * torch.isfinite(theirs)).sum(-1),
                                   atol=1e-6, rtol=0)


@pytest.mark.equation("09.04", oracle="hand-built distributions with dyadic probabilities")
def test_top_p_boundaries():
    z = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64))
    kept = lambda p: torch.isfinite(top_p_filter(z, p)).tolist()  # noqa: E731
    # smallest set reaching p; 1e-9 either side of the cumulative masses 0.5 and 0.75 (float64 rounding ~1e-16)
    assert kept(0.5 - 1e-9) == [True, False, False, False]
    assert kept(0.5 + 1e-9) == [True, True, False, False]
    assert kept(0.75 - 1e-9) == [True, True, False, False]
    assert kept(0.75 + 1e-9) == [True, True, True, False]
    assert kept(1.0) == [True] * 4
    assert kept(1e-9) == [True, False, False, False]  # at least one token
    zinf = torch.tensor([0.0, -math.inf, 1.0])
    assert torch.isfinite(top_p_filter(zinf, 1.0)).tolist() == [True, False, True]


@pytest.mark.equation("09.05", oracle="transformers.TypicalLogitsWarper")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mass", [0.05, 0.2, 0.5, 0.9, 0.99])
def test_typical_matches_transformers(seed, mass):
    for name, z in logit_cases(seed):
        theirs = hf(TypicalLogitsWarper(mass, filter_value=-math.inf, min_tokens_to_keep=1), z)
        assert_same_logits(typical_filter(z, mass), theirs, f"{name} mass={mass}")


@pytest.mark.equation("09.05", oracle="direct numpy computation of |-log p - H(p)| and the mass rule")
@pytest.mark.parametrize("seed", SEEDS)
def test_typical_against_numpy_definition(seed):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(12))
    H = -(p * np.log(p)).sum()
    d = np.abs(-np.log(p) - H)
    order = np.argsort(d, kind="stable")
    mass = 0.6
    n = int(np.searchsorted(np.cumsum(p[order]), mass)) + 1  # smallest prefix with mass >= 0.6
    want = np.zeros(12, bool)
    want[order[:n]] = True
    got = torch.isfinite(typical_filter(torch.from_numpy(np.log(p)), mass)).numpy()
    assert np.array_equal(got, want)
    # the catalogue's form: the kept set is {i : d_i <= tau} with tau the distance of the last kept token
    tau = d[order[n - 1]]
    assert np.array_equal(got, d <= tau)
    assert torch.isfinite(typical_filter(torch.from_numpy(np.log(p)), 1.0)).all()


@pytest.mark.equation("09.05", oracle="transformers.TypicalLogitsWarper on a case where the argmax is atypical")
def test_typical_can_drop_the_argmax():
    z = torch.log(torch.tensor([[0.4] + [0.06] * 10]))
    ours = typical_filter(z, 0.25)
    theirs = hf(TypicalLogitsWarper(0.25, filter_value=-math.inf, min_tokens_to_keep=1), z)
    assert_same_logits(ours, theirs)
    assert torch.isinf(ours[0, 0]) and torch.isfinite(ours[0, 1:]).all()


@pytest.mark.equation("09.06", oracle="transformers.MinPLogitsWarper")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alpha", [0.0, 0.01, 0.1, 0.3, 0.9, 1.0])
def test_min_p_matches_transformers(seed, alpha):
    for name, z in logit_cases(seed):
        theirs = hf(MinPLogitsWarper(alpha, filter_value=-math.inf, min_tokens_to_keep=1), z)
        assert_same_logits(min_p_filter(z, alpha), theirs, f"{name} alpha={alpha}")


@given(
    z=st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=1, max_size=40),
    k=st.integers(1, 40),
    p=st.floats(1e-6, 1.0),
    frac=st.floats(0.0, 1.0),
)
@example(z=[0.0, 2.220446049250313e-16], k=1, p=0.5, frac=0.0)  # typical: a tie in distance at 1e-16
@settings(max_examples=200, deadline=None)
def test_warpers_keep_argmax_and_renormalise(z, k, p, frac):
    z = torch.tensor(z, dtype=torch.float64)
    probs = torch.softmax(z, -1)
    k = min(k, z.numel())
    outs = {
        "temperature": apply_temperature(z, 0.5 + frac),
        "greedy-temperature": apply_temperature(z, 0),
        "top_k": top_k_filter(z, k),
        "top_p": top_p_filter(z, p),
        "typical": typical_filter(z, p),
        "min_p": min_p_filter(z, frac),
        "mirostat": mirostat_filter(z, 10 * frac),
    }
    for name, w in outs.items():
        assert w.shape == z.shape
        if name == "typical":  # keeps a most *typical* token, which need not be the argmax
            H = -(probs * torch.log_softmax(z, -1)).sum()
            d = (-torch.log_softmax(z, -1) - H).abs()
            # Distances tied to within float64 rounding (|log p| <= 60: about 1e-14) have no reliable order: for
            # z = [0, 2.2e-16] the two exact distances differ by 2.5e-32 and this oracle's H rounds the other way
            # than the filter's. So: some kept token must be as typical as the most typical one, up to 1e-12.
            assert (d[torch.isfinite(w)] <= d.min() + 1e-12).any(), "typical dropped every most typical token"
        else:
            assert torch.isfinite(w[torch.argmax(z)]), f"{name} dropped the argmax"
        kept = torch.isfinite(w)
        if name != "temperature":
            assert torch.equal(w[kept], z[kept]), f"{name} changed a kept logit"
        assert abs(torch.softmax(w, -1).sum().item() - 1) < 1e-12, name
    assert torch.isfinite(outs["top_k"]).sum() >= k
    assert (probs * torch.isfinite(outs["top_p"])).sum() >= p - 1e-9
    assert (probs * torch.isfinite(outs["typical"])).sum() >= p - 1e-9 or torch.isfinite(outs["typical"]).all()
    kept = torch.isfinite(outs["min_p"])
    assert torch.all(probs[kept] >= frac * probs.max() * (1 - 1e-12))


def test_warpers_accept_leading_batch_dims():
    z = torch.randn(2, 3, 11)
    for warp in (lambda t: apply_temperature(t, 0), lambda t: top_k_filter(t, 3), lambda t: top_p_filter(t, 0.7),
                 lambda t: typical_filter(t, 0.7), lambda t: min_p_filter(t, 0.2), lambda t: mirostat_filter(t, 3.0)):
        rows = torch.stack([warp(r) for r in z.reshape(-1, 11)]).reshape(z.shape)
        assert torch.equal(warp(z), rows)
    assert greedy(z).shape == sample(z).shape == (2, 3)


# --------------------------------------------------------------------------- 09.11 Mirostat


@pytest.mark.equation("09.11", oracle="hand-computed float64 surprise update mu - eta (s - tau)")
@pytest.mark.parametrize("seed", SEEDS)
def test_mirostat_update_by_hand(seed):
    z = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    by_hand = {0: (1.0, 2.5 - 0.2 * (1.0 - 3.0)), 1: (2.0, 2.5 - 0.2 * (2.0 - 3.0))}  # surprises -log2 0.5, 0.25
    seen = set()
    for _ in range(50):
        tok, mu, s = mirostat_step(z, mu=2.5, tau_target=3.0, eta=0.2, generator=g)
        assert tok in by_hand, "tokens with surprise 3 bits > mu = 2.5 must be truncated"
        assert abs(s - by_hand[tok][0]) < 1e-12 and abs(mu - by_hand[tok][1]) < 1e-12
        seen.add(tok)
    assert seen == {0, 1}
    assert mirostat_step(z, mu=-1.0, tau_target=3.0, eta=0.2, generator=g)[0] == 0  # mu below everything: argmax


@pytest.mark.equation("09.11", oracle="numpy surprise -log2 p <= mu on a Zipf distribution")
def test_mirostat_filter_against_numpy():
    p = 1 / np.arange(1, 101) ** 1.1
    p /= p.sum()
    for mu in (0.5, 2.0, 4.0, 7.5, 20.0):
        want = -np.log2(p) <= mu
        want[0] = True
        got = torch.isfinite(mirostat_filter(torch.from_numpy(np.log(p)), mu)).numpy()
        assert np.array_equal(got, want), mu


@pytest.mark.equation("09.11", oracle="simulation: running mean of observed surprise vs the target tau (0.05 bits)")
@pytest.mark.parametrize("tau_target", [2.5, 4.0])
def test_mirostat_average_surprise_reaches_target(tau_target):
    p = 1 / np.arange(1, 201) ** 1.1  # Zipf: argmax surprise ~2.3 bits, entropy ~5 bits
    p /= p.sum()
    z = torch.from_numpy(np.log(p))
    g = torch.Generator().manual_seed(0)
    mu, eta, surprises, mus = 2 * tau_target, 0.1, [], []
    for _ in range(3000):
        _, mu, s = mirostat_step(z, mu, tau_target, eta, generator=g)
        surprises.append(s)
        mus.append(mu)
    mean = np.mean(surprises[500:])
    assert abs(mean - tau_target) < 0.05, f"mean observed surprise {mean:.4f} vs target {tau_target} (tol 0.05 bits)"
    assert max(mus) - min(mus) < 5, "mu must stay bounded"


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: greedy(torch.tensor([0.0, math.nan])), ValueError, "NaN"),
        (lambda: greedy(torch.tensor(1.0)), ValueError, r"shape \(\.\.\., V\)"),
        (lambda: greedy(torch.zeros(2, 0)), ValueError, "empty"),
        (lambda: greedy(torch.tensor([-math.inf, -math.inf])), ValueError, "entirely -inf"),
        (lambda: greedy(torch.tensor([0.0, math.inf])), ValueError, r"\+inf"),
        (lambda: greedy(torch.tensor([True, False])), TypeError, "floating-point"),
        (lambda: apply_temperature(torch.zeros(3), -0.5), ValueError, r"tau must lie in \[0"),
        (lambda: apply_temperature(torch.zeros(3), math.nan), ValueError, "tau must lie in .* got nan"),
        (lambda: apply_temperature(torch.zeros(3), math.inf), ValueError, "tau must lie in"),
        (lambda: apply_temperature(torch.tensor([0.0, math.nan]), 1.0), ValueError, "NaN"),
        (lambda: sample(torch.zeros(3), tau=-1.0), ValueError, "tau"),
        (lambda: sample(torch.zeros(3), top_k=4), ValueError, r"\[1, V\] = \[1, 3\]"),
        (lambda: top_k_filter(torch.zeros(2, 5), 0), ValueError,
         r"k must be an int in \[1, V\] = \[1, 5\] \(V is the vocabulary size\), got 0"),
        (lambda: top_k_filter(torch.zeros(2, 5), 6), ValueError, r"\[1, V\] = \[1, 5\]"),
        (lambda: top_k_filter(torch.zeros(5), 2.0), TypeError, r"k must be an int in \[1, V\] .*, got 2.0 \(float\)"),
        (lambda: top_p_filter(torch.zeros(5), 0.0), ValueError, r"p must lie in \(0.0, 1.0\]"),
        (lambda: top_p_filter(torch.zeros(5), 1.5), ValueError, "p must lie in"),
        (lambda: top_p_filter(torch.zeros(0), 0.5), ValueError, "empty"),
        (lambda: typical_filter(torch.zeros(5), 0.0), ValueError, "mass must lie in"),
        (lambda: typical_filter(torch.zeros(5), 2.0), ValueError, "mass must lie in"),
        (lambda: min_p_filter(torch.zeros(5), -0.1), ValueError, r"alpha must lie in \[0.0, 1.0\]"),
        (lambda: min_p_filter(torch.zeros(5), 1.1), ValueError, "alpha must lie in"),
        (lambda: min_p_filter("abc", 0.5), TypeError, "logits must be"),
        (lambda: mirostat_step(torch.zeros(2, 3), 1.0, 3.0, 0.1), ValueError, r"shape \(V,\)"),
        (lambda: mirostat_step(torch.zeros(3), 1.0, 0.0, 0.1), ValueError, "tau_target"),
        (lambda: mirostat_step(torch.zeros(3), 1.0, 3.0, -0.1), ValueError, "eta"),
    ],
)
def test_bad_input_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ================================================================= temperature overflow, fp16 / bf16 typical (issue 11)


@pytest.mark.parametrize("dtype, tau", [(torch.float16, 1e-3), (torch.bfloat16, 1e-38), (torch.float32, 1e-40)])
def test_tiny_temperature_keeps_the_argmax_instead_of_a_false_tie(dtype, tau):
    # z / tau overflows the dtype ([inf, inf, 3000] in fp16): the top two tied. Oracle: the float64
    # distribution softmax(z / tau), which puts all its mass on token 0
    z = torch.tensor([100.0, 99.0, 3.0], dtype=dtype)
    w = apply_temperature(z, tau)
    assert w.dtype == dtype and not torch.isnan(w).any() and not torch.isposinf(w).any()
    assert w.argmax().item() == 0 and torch.isfinite(w[0])
    ref = torch.softmax(z.double() / tau, -1)
    torch.testing.assert_close(torch.softmax(w.double(), -1), ref, rtol=0, atol=1e-12)
    g = torch.Generator().manual_seed(0)
    assert all(sample(z, tau=tau, generator=g).item() == 0 for _ in range(20))
    assert sample(z.expand(3, 3), tau=tau, generator=g).tolist() == [0, 0, 0]


def test_temperature_in_half_precision_divides_in_float32():
    z = torch.tensor([[1.0, 2.0, 4.0], [3.3, -1.7, 0.1]], dtype=torch.float16)
    w = apply_temperature(z, 0.3)
    assert w.dtype == torch.float16
    torch.testing.assert_close(w, (z.double() / 0.3).half(), rtol=0, atol=0)  # one rounding, as float64 then fp16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_typical_filter_and_sample_on_half_precision_logits(dtype):
    # used to raise "p must sum to 1" about an internal fp16 softmax; oracle: transformers'
    # TypicalLogitsWarper on the float32 upcast of the same logits (same kept set)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(4, 200, generator=g) * 3).to(dtype)
    for mass in (0.2, 0.9, 0.95):
        ours = typical_filter(z, mass)
        assert ours.dtype == dtype
        theirs = hf(TypicalLogitsWarper(mass, filter_value=-math.inf, min_tokens_to_keep=1), z.float())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), mass
        assert torch.equal(ours[torch.isfinite(ours)], z[torch.isfinite(ours)])
    tokens = sample(z, typical_p=0.9, generator=g)
    kept = torch.isfinite(typical_filter(z, 0.9))
    assert kept.gather(-1, tokens.unsqueeze(-1)).all()


# ================================================================= the chapter's Try-it solutions



def test_try_it_solutions_of_chapter_9():
    """Every number of the chapter's Try-it solutions, computed here on the tiny GPT; the notebook must state them."""
    from llmbook.lm import search
    from llmbook.lm.ngram import NGramLM
    from llmbook.lm.training import corpus_tokens
    from llmbook.widgets import temperature as tw

    model, tok = tw.tiny_gpt()
    stated = []
    # 1. the explorer: top-p 0.9 against min-p 0.1 at tau = 1, 2, 3; draws of characters the model gives < 1 %
    p1 = torch.softmax(tw.next_logits().double(), -1)
    junk = {{" ": "␣", "\n": "⏎"}.get(c, c) for c, p in zip(tok.chars, p1.tolist(), strict=True) if p < 0.01}
    views = {(t, f): tw.temperature_view(t, f) for t in (1.0, 2.0, 3.0) for f in ("top-p 0.9", "min-p 0.1")}
    kept = {k: v.kept for k, v in views.items()}
    n_junk = {k: sum(c in junk for c in v.draws) for k, v in views.items()}
    for k, v in views.items():  # the kept counts against transformers' warpers on the same logits
        warper = TopPLogitsWarper(0.9) if k[1] == "top-p 0.9" else MinPLogitsWarper(0.1)
        assert kept[k] == int(torch.isfinite(warper(None, tw.next_logits()[None] / k[0])).sum())
        assert len(v.draws) == 40
    assert kept[1.0, "top-p 0.9"] <= kept[1.0, "min-p 0.1"] + 1  # they agree at tau = 1 ...
    assert kept[2.0, "top-p 0.9"] > 3 * kept[2.0, "min-p 0.1"]  # ... and part at tau = 2
    stated += [f"top-p 0.9 keeps {kept[1.0, 'top-p 0.9']} characters, min-p 0.1 keeps {kept[1.0, 'min-p 0.1']}",
               f"top-p keeps {kept[2.0, 'top-p 0.9']} of the 100 characters, min-p {kept[2.0, 'min-p 0.1']}",
               f"{kept[3.0, 'top-p 0.9']} against {kept[3.0, 'min-p 0.1']}",
               f"{n_junk[2.0, 'top-p 0.9']} of top-p's 40 draws", f"and {n_junk[2.0, 'min-p 0.1']} of",
               f"{n_junk[3.0, 'top-p 0.9']} against {n_junk[3.0, 'min-p 0.1']}."]
    # 2. beam search on the tiny GPT, widths 1 and 4, 30 characters
    context = torch.as_tensor(tok.encode(tw.PROMPT), dtype=torch.long)

    def step(seq):
        return torch.log_softmax(model(seq[None, -64:])[0, -1].double(), -1)

    with torch.no_grad():
        h1, h4 = (search.beam_search(step, context, beam_width=w, max_len=30)[0] for w in (1, 4))
        greedy_ids = context
        for _ in range(30):  # oracle for width 1: the argmax, step by step
            greedy_ids = torch.cat([greedy_ids, model(greedy_ids[None, -64:])[0, -1].argmax().reshape(1)])
        assert torch.equal(h1.tokens, greedy_ids)
        # oracle for the log-probabilities: the chain rule, one forward pass over the whole sequence
        for h in (h1, h4):
            logp = torch.log_softmax(model(h.tokens[None, :-1])[0].double(), -1)
            chain = logp[len(context) - 1:].gather(-1, h.tokens[len(context):, None]).sum().item()
            assert chain == pytest.approx(h.log_prob, abs=1e-4)
    assert h4.log_prob > h1.log_prob
    stated += [f"{h.log_prob:.2f}".replace("-", "−") for h in (h4, h1)]
    stated += [f"“{tok.decode(h.tokens[len(context):])}”" for h in (h1, h4)]
    # 3. speculative decoding with a uniform draft: acceptance sum_x min(p(x), 1/V), against the bigram draft
    _, train_ids, _ = corpus_tokens()
    q_bigram = NGramLM(order=2, vocab_size=100, alpha=0.5).fit(train_ids).next_distribution(context.tolist())
    V = 100
    for q in (q_bigram, torch.full((V,), 1 / V, dtype=torch.float64)):
        beta = float((q * search.speculative_accept_prob(p1.expand(V, V), q.expand(V, V), torch.arange(V))).sum())
        assert beta == pytest.approx(float(torch.minimum(p1, q).sum()), abs=1e-12)  # oracle: sum of min(p, q)
        stated.append(f"{beta:.3f}")
    assert_states("09-decoding.ipynb", stated)


# ================================================================= measuring a warper (chapter 9's figure and crossing)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("floor", [0.01, 0.05])
def test_tail_mass_against_numpy(seed, floor):
    """numpy float64: softmax by hand, the model's own p below the floor, mass of the warped p' there (1e-12)."""
    from llmbook.lm.decoding import tail_mass

    rng = np.random.default_rng(seed)
    z = 3 * rng.standard_normal((B, V))
    w = z / 2.5  # temperature 2.5
    w[:, :10] = -np.inf  # and a truncation
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(w - w.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    want = (q * (p < floor)).sum(-1)
    got = tail_mass(torch.from_numpy(z), torch.from_numpy(w), floor).numpy()
    np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


def test_tail_mass_rejects_bad_input():
    from llmbook.lm.decoding import tail_mass

    with pytest.raises(ValueError, match="same shape"):
        tail_mass(torch.zeros(2, 5), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="floor"):
        tail_mass(torch.zeros(5), torch.zeros(5), floor=0.0)
    with pytest.raises(ValueError):
        tail_mass(torch.tensor([0.0, float("nan")]), torch.zeros(2))


@pytest.mark.parametrize("f, lo, hi", [
    (lambda t: t * t - 2.0, 0.0, 2.0),
    (math.cos, 0.0, 3.0),
    (lambda t: math.exp(t) - 5.0 + t, -1.0, 3.0),
    (lambda t: 1.0 - 3.0 * t, 0.0, 1.0),  # decreasing
])
def test_find_crossing_matches_scipy_brentq(f, lo, hi):
    """Bisection against scipy.optimize.brentq, both to 1e-12 in t (tolerance 1e-10)."""
    import scipy.optimize

    from llmbook.lm.decoding import find_crossing

    assert abs(find_crossing(f, lo, hi, tol=1e-12) - scipy.optimize.brentq(f, lo, hi, xtol=1e-13)) < 1e-10


def test_find_crossing_finds_a_jump_across_zero():
    """A step function has no root, only a sign change: at t = 0.3 (closed form), to the tolerance."""
    from llmbook.lm.decoding import find_crossing

    assert abs(find_crossing(lambda t: -1.0 if t < 0.3 else 2.0, 0.0, 1.0, tol=1e-9) - 0.3) < 1e-9
    assert find_crossing(lambda t: t, 0.0, 1.0) == 0.0  # a root at an end is returned as it is


def test_find_crossing_rejects_bad_brackets():
    from llmbook.lm.decoding import find_crossing

    with pytest.raises(ValueError, match="change sign"):
        find_crossing(lambda t: t * t + 1, -1.0, 1.0)
    with pytest.raises(ValueError, match="lo < hi"):
        find_crossing(lambda t: t, 1.0, -1.0)
    with pytest.raises(ValueError, match="NaN"):
        find_crossing(lambda t: float("nan"), 0.0, 1.0)
    with pytest.raises(ValueError, match="tol"):
        find_crossing(lambda t: t - 0.5, 0.0, 1.0, tol=0.0)
