"""Chapter 1 (ids 01.01-01.16) against independent oracles, plus claims C01, C02 and C19.

Tolerances, stated once:

* float32 against a torch oracle: ``rtol = atol = 1e-5`` (``F32``);
* float64 against torch or scipy: ``rtol = 1e-12, atol = 1e-12`` (``F64``), or ``1e-10`` where a
  sum of many terms is compared (enumeration over all sequences);
* "exact" identities in float64 (chain rule, BPB under two tokenisations): relative ``1e-12``.
"""

import itertools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributions import Categorical

from llmbook.data import corpus
from llmbook.lm.ngram import NGramLM, byte_tokens, chunk_log_probs, chunk_tokens
from llmbook.lm.probability import (
    bits_per_byte,
    conditional_log_likelihood,
    cross_entropy,
    cross_entropy_decomposition,
    cross_entropy_loss,
    entropy,
    kl_divergence,
    length_normalized_score,
    log_softmax,
    logsumexp,
    logsumexp_naive,
    nll,
    perplexity,
    reverse_kl_divergence,
    sequence_log_likelihood,
    shift_labels,
    softmax,
    teacher_forcing_loss,
    token_log_probs,
)
from tests.try_it import assert_states

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-12, atol=1e-12)
NEG_INF = float("-inf")
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True)


def random_dist(*shape, zeros=False):
    """Random float64 distributions on the last axis (optionally with some exact zeros)."""
    x = torch.rand(*shape, dtype=torch.float64) ** 3 + 1e-3
    if zeros:
        x = x * (torch.rand(*shape) > 0.3)
        x[..., 0] += 0.5  # keep every row non-empty
    return x / x.sum(-1, keepdim=True)


def masked_logits(*shape, dtype=torch.float32):
    """Random logits with some masked (-inf) entries, never a fully masked row."""
    z = torch.randn(*shape, dtype=dtype) * 3
    mask = torch.rand(*shape) < 0.3
    mask[..., 0] = False
    return z.masked_fill(mask, NEG_INF)


# ================================================================= 01.03-01.05 softmax family


@pytest.mark.equation("01.03", oracle="torch.softmax; scipy.special.softmax (float64)")
@pytest.mark.parametrize("shape, dim", [((7,), -1), ((4, 11), -1), ((2, 3, 50), -1), ((5, 6), 0), ((2, 3, 4), 1)])
def test_softmax_matches_torch_and_scipy(shape, dim):
    z = torch.randn(*shape) * 4
    torch.testing.assert_close(softmax(z, dim=dim), torch.softmax(z, dim=dim), **F32)
    z64 = z.double()
    np.testing.assert_allclose(softmax(z64, dim=dim).numpy(), scipy.special.softmax(z64.numpy(), axis=dim), **F64)
    # masked (-inf) entries get exactly zero probability
    zm = masked_logits(3, 9)
    pm = softmax(zm)
    torch.testing.assert_close(pm, torch.softmax(zm, -1), **F32)
    assert (pm[torch.isinf(zm)] == 0).all()


@pytest.mark.equation("01.03", oracle="torch.softmax; math.fsum of the probabilities")
@SETTINGS
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_softmax_sums_to_one(values):
    z = torch.tensor(values, dtype=torch.float64)
    p = softmax(z)
    assert (p >= 0).all() and (p <= 1).all()
    assert math.fsum(p.tolist()) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(p, torch.softmax(z, -1), **F64)


@pytest.mark.equation("01.04", oracle="torch.log_softmax; scipy.special.log_softmax (float64)")
@pytest.mark.parametrize("shape, dim", [((7,), -1), ((4, 11), -1), ((2, 3, 50), -1), ((5, 6), 0)])
def test_log_softmax_matches_torch_and_scipy(shape, dim):
    z = torch.randn(*shape) * 4
    torch.testing.assert_close(log_softmax(z, dim=dim), torch.log_softmax(z, dim=dim), **F32)
    z64 = z.double()
    np.testing.assert_allclose(log_softmax(z64, dim=dim).numpy(),
                               scipy.special.log_softmax(z64.numpy(), axis=dim), **F64)
    zm = masked_logits(3, 9)
    torch.testing.assert_close(log_softmax(zm), torch.log_softmax(zm, -1), **F32)
    # stable for huge logits, where exp would overflow
    big = torch.tensor([1e4, 1e4 - 1.0, -1e4])
    torch.testing.assert_close(log_softmax(big), torch.log_softmax(big, -1), **F32)


@pytest.mark.equation("01.05", oracle="torch.logsumexp; scipy.special.logsumexp (float64)")
@pytest.mark.parametrize("shape, dim", [((7,), -1), ((4, 11), -1), ((2, 3, 50), -1), ((5, 6), 0)])
def test_logsumexp_matches_torch_and_scipy(shape, dim):
    z = torch.randn(*shape) * 4
    torch.testing.assert_close(logsumexp(z, dim=dim), torch.logsumexp(z, dim=dim), **F32)
    z64 = z.double()
    np.testing.assert_allclose(logsumexp(z64, dim=dim).numpy(), scipy.special.logsumexp(z64.numpy(), axis=dim), **F64)
    # masked entries contribute nothing; a fully masked row gives -inf, like torch
    zm = masked_logits(3, 9)
    zm[1] = NEG_INF
    out = logsumexp(zm)
    torch.testing.assert_close(out, torch.logsumexp(zm, -1), **F32)
    assert out[1].item() == NEG_INF


@pytest.mark.equation("01.05", oracle="scipy.special.logsumexp (float64); closed form m + log V")
@pytest.mark.parametrize("scale", [1e4, -1e4])
def test_logsumexp_stable_where_naive_fails(scale):
    """The naive pair overflows to +inf at logits of 1e4 (and underflows to -inf at -1e4); the trick does not."""
    V = 5
    z = torch.full((V,), scale)
    stable = logsumexp(z)
    assert torch.isfinite(stable)
    assert stable.item() == pytest.approx(scale + math.log(V), rel=1e-6)
    naive = logsumexp_naive(z)
    assert naive.item() == (math.inf if scale > 0 else -math.inf)
    mixed = torch.tensor([scale, 0.0, 3.0, scale - 2.0], dtype=torch.float32)
    assert logsumexp(mixed).item() == pytest.approx(scipy.special.logsumexp(mixed.double().numpy()), rel=1e-6)


def test_logsumexp_naive_agrees_for_moderate_logits():
    z = torch.randn(4, 9) * 5
    torch.testing.assert_close(logsumexp_naive(z), torch.logsumexp(z, -1), **F32)


# ================================================================= 01.01, 01.02, 01.12 chain rule (C01)

V3, T4 = 3, 4


def bigram_model():
    """A fixed random bigram table over V = 3, used as logits: row ``x_{t-1}`` scores ``x_t``."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randn(V3, generator=g, dtype=torch.float64)
    table = torch.randn(V3, V3, generator=g, dtype=torch.float64) * 2

    def logits(x):  # (B, T) -> (B, T, V): position 0 uses the start row, position t uses table[x_{t-1}]
        first = start.expand(x.shape[0], 1, V3)
        return torch.cat([first, table[x[:, :-1]]], dim=1)

    return start, table, logits


def markov_joint(start, table, seq):
    """Oracle: P(x) of a Markov chain built with scipy's float64 softmax, as a plain product."""
    pi = scipy.special.softmax(start.numpy())
    M = scipy.special.softmax(table.numpy(), axis=1)
    p = pi[seq[0]]
    for a, b in itertools.pairwise(seq):
        p *= M[a, b]
    return p


@pytest.mark.equation("01.01", "01.12", oracle="brute-force enumeration of all V^T sequences (numpy, scipy softmax)")
def test_chain_rule_equals_enumerated_joint_bigram():
    """C01: the summed log-conditionals are the log of the joint; the enumerated joint sums to one."""
    start, table, logits = bigram_model()
    seqs = torch.tensor(list(itertools.product(range(V3), repeat=T4)))  # (81, 4)
    ll = sequence_log_likelihood(logits(seqs), seqs)  # (81,)
    joint = np.array([markov_joint(start, table, s.tolist()) for s in seqs])
    assert math.fsum(joint) == pytest.approx(1.0, abs=1e-12)
    joint = joint / joint.sum()  # normalised over all V^T sequences
    np.testing.assert_allclose(ll.numpy(), np.log(joint), rtol=1e-10, atol=1e-10)
    assert math.fsum(ll.exp().tolist()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.equation("01.01", "01.12",
                      oracle="brute-force enumeration: arbitrary joint table and its marginals (numpy)")
def test_chain_rule_is_exact_for_any_joint():
    """C01, strongest form: take *any* joint over V^T, build each conditional from its marginals,
    and the chain rule gives back the joint exactly. Logits are log prefix-marginals (unnormalised)."""
    rng = np.random.default_rng(7)
    P = rng.random((V3,) * T4) ** 2
    P /= P.sum()
    marg = [P.sum(axis=tuple(range(t + 1, T4))) for t in range(T4)]  # marg[t] has shape (V,)*(t+1)
    seqs = list(itertools.product(range(V3), repeat=T4))
    logits = torch.tensor(np.array([[np.log(marg[t][s[:t]]) for t in range(T4)] for s in seqs]))  # (81, T, V)
    targets = torch.tensor(seqs)
    ll = sequence_log_likelihood(logits, targets)
    np.testing.assert_allclose(ll.numpy(), np.log([P[s] for s in seqs]), rtol=1e-10, atol=1e-10)


@pytest.mark.equation("01.12", oracle="torch.distributions.Categorical.log_prob")
def test_token_and_sequence_log_probs_match_categorical():
    logits = masked_logits(3, 6, 10, dtype=torch.float64)
    targets = Categorical(logits=logits).sample()  # never a masked token
    ref = Categorical(logits=logits).log_prob(targets)
    torch.testing.assert_close(token_log_probs(logits, targets), ref, **F64)
    torch.testing.assert_close(sequence_log_likelihood(logits, targets), ref.sum(-1), **F64)


@pytest.mark.equation("01.02", oracle="brute-force enumeration: P(x, y) / sum_y' P(x, y') (numpy, scipy softmax)")
def test_conditional_log_likelihood_by_enumeration():
    start, table, logits = bigram_model()
    prompt, R = [2, 0], 3
    responses = list(itertools.product(range(V3), repeat=R))
    seqs = torch.tensor([prompt + list(r) for r in responses])
    cll = conditional_log_likelihood(logits(seqs), seqs, prompt_length=len(prompt))
    joint = np.array([markov_joint(start, table, s.tolist()) for s in seqs])
    np.testing.assert_allclose(cll.numpy(), np.log(joint / joint.sum()), rtol=1e-10, atol=1e-10)
    assert math.fsum(cll.exp().tolist()) == pytest.approx(1.0, abs=1e-12)  # a distribution over responses


@pytest.mark.equation("01.02", oracle="torch.distributions.Categorical.log_prob summed over response positions")
def test_conditional_log_likelihood_matches_categorical():
    logits = torch.randn(4, 9, 12, dtype=torch.float64)
    targets = torch.randint(0, 12, (4, 9))
    ref = Categorical(logits=logits).log_prob(targets)
    for S in (0, 1, 5, 8):
        torch.testing.assert_close(conditional_log_likelihood(logits, targets, S), ref[:, S:].sum(-1), **F64)


def test_shift_labels_labels_are_inputs_shifted():
    """C01: next-token labels need no annotation; they are the input shifted by one."""
    x = torch.randint(0, 100, (3, 12))
    inputs, labels = shift_labels(x)
    assert torch.equal(labels, x[:, 1:]) and torch.equal(inputs, x[:, :-1])
    assert torch.equal(labels[:, :-1], inputs[:, 1:])


# ================================================================= 01.06 NLL, 01.14 teacher forcing


@pytest.mark.equation("01.06", oracle="torch.nn.functional.nll_loss / cross_entropy (ignore_index, reduction)")
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("ignore", [None, -100, 0])
def test_nll_matches_torch(reduction, ignore):
    B, T, V = 3, 7, 11
    logits = torch.randn(B, T, V, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T))
    if ignore == -100:
        targets[0, 4:] = -100  # padding
        targets[2, 6] = -100
    ours = nll(logits, targets, reduction=reduction, ignore_index=ignore)
    ii = -100 if ignore is None else ignore
    ref = F.nll_loss(torch.log_softmax(logits, -1).transpose(1, 2), targets, reduction=reduction, ignore_index=ii)
    torch.testing.assert_close(ours, ref, **F64)
    ref2 = F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction, ignore_index=ii)
    torch.testing.assert_close(ours, ref2, **F64)


@pytest.mark.equation("01.06", oracle="torch.nn.functional.cross_entropy(ignore_index=-100)")
def test_nll_ignores_masked_padding_without_nan():
    """A padded position whose logits are masked must not turn the loss into NaN (-inf * 0)."""
    logits = torch.randn(2, 4, 5)
    logits[1, 3, :] = torch.tensor([NEG_INF, 0.0, 0.0, NEG_INF, 0.0])
    targets = torch.tensor([[1, 2, 3, 4], [0, 1, 2, -100]])
    ours = nll(logits, targets, reduction="mean", ignore_index=-100)
    assert torch.isfinite(ours)
    torch.testing.assert_close(ours, F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1)), **F32)


class _Lookup(nn.Module):
    """A bigram model: embedding then linear, so logits at t depend on token t only."""

    def __init__(self, V, d=8):
        super().__init__()
        self.emb, self.out = nn.Embedding(V, d), nn.Linear(d, V)

    def forward(self, x):
        return self.out(self.emb(x))


class _PrefixMean(_Lookup):
    """A causal model: logits at t depend on the mean embedding of the whole prefix x_{<=t}."""

    def forward(self, x):
        h = self.emb(x).cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=torch.float64)[:, None]
        return self.out(h)


@pytest.mark.equation("01.14", oracle="torch.nn.functional.cross_entropy on the concatenated sequence; "
                                      "incremental re-run on each reference prefix")
@pytest.mark.parametrize("cls", [_Lookup, _PrefixMean])
def test_teacher_forcing_loss(cls):
    V, B, S, T = 13, 3, 4, 5
    model = cls(V).double()
    x = torch.randint(0, V, (B, S))
    y = torch.randint(0, V, (B, T))
    loss = teacher_forcing_loss(model, x, y)

    seq = torch.cat([x, y], 1)
    logits = model(seq[:, :-1])  # position i predicts seq[:, i + 1]
    by_hand = F.cross_entropy(logits[:, S - 1:].reshape(-1, V), seq[:, S:].reshape(-1), reduction="sum")
    torch.testing.assert_close(loss, by_hand, **F64)

    # the same loss, one reference prefix at a time (the model always sees y*_{<t}, never its samples)
    inc = sum(F.cross_entropy(model(seq[:, :S + t])[:, -1], y[:, t], reduction="sum") for t in range(T))
    torch.testing.assert_close(loss, inc, **F64)

    # gradients agree too
    g_ours = torch.autograd.grad(loss, list(model.parameters()))
    g_ref = torch.autograd.grad(by_hand, list(model.parameters()))
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, **F64)


# ================================================================= 01.07-01.11 information theory


@pytest.mark.equation("01.07", oracle="torch.nn.functional.cross_entropy (class and probability targets); "
                                      "scipy.stats.entropy(y) + scipy.stats.entropy(y, p)")
def test_cross_entropy_matches_torch_and_scipy():
    V = 9
    p = random_dist(5, V)
    y_soft = random_dist(5, V, zeros=True)
    labels = torch.randint(0, V, (5,))
    y_hard = F.one_hot(labels, V).double()
    # one-hot targets: the NLL of the labelled token
    torch.testing.assert_close(cross_entropy(y_hard, p), F.cross_entropy(p.log(), labels, reduction="none"), **F64)
    # soft targets
    torch.testing.assert_close(cross_entropy(y_soft, p), F.cross_entropy(p.log(), y_soft, reduction="none"), **F64)
    ref = scipy.stats.entropy(y_soft.numpy(), axis=-1) + scipy.stats.entropy(y_soft.numpy(), p.numpy(), axis=-1)
    np.testing.assert_allclose(cross_entropy(y_soft, p).numpy(), ref, **F64)
    # p = 0 where y > 0: infinite
    assert cross_entropy(torch.tensor([0.5, 0.5, 0.0]), torch.tensor([1.0, 0.0, 0.0])).item() == math.inf


@pytest.mark.equation("01.11", oracle="torch.distributions.Categorical.entropy; scipy.stats.entropy")
def test_entropy_matches_torch_and_scipy():
    p = random_dist(6, 10, zeros=True)
    np.testing.assert_allclose(entropy(p).numpy(), scipy.stats.entropy(p.numpy(), axis=-1), **F64)
    torch.testing.assert_close(entropy(p), Categorical(probs=p).entropy(), **F64)
    for V in (1, 2, 8, 256):  # uniform: log V, the maximum
        assert entropy(torch.full((V,), 1 / V, dtype=torch.float64)).item() == pytest.approx(math.log(V), abs=1e-12)
    assert entropy(torch.tensor([0.0, 1.0, 0.0])).item() == 0.0  # 0 log 0 = 0


@pytest.mark.equation("01.09", oracle="torch.distributions.kl_divergence; scipy.stats.entropy(p, q); "
                                      "scipy.special.rel_entr")
def test_kl_divergence_matches_torch_and_scipy():
    p, q = random_dist(6, 10, zeros=True), random_dist(6, 10)
    ours = kl_divergence(p, q)
    ref = torch.distributions.kl_divergence(Categorical(probs=p), Categorical(probs=q))
    torch.testing.assert_close(ours, ref, **F64)
    np.testing.assert_allclose(ours.numpy(), scipy.stats.entropy(p.numpy(), q.numpy(), axis=-1), **F64)
    np.testing.assert_allclose(ours.numpy(), scipy.special.rel_entr(p.numpy(), q.numpy()).sum(-1), **F64)
    assert (ours >= 0).all()
    torch.testing.assert_close(kl_divergence(q, q), torch.zeros(6, dtype=torch.float64), **F64)
    # mass where q has none: infinite, as scipy says
    a, b = np.array([0.5, 0.5, 0.0]), np.array([1.0, 0.0, 0.0])
    assert kl_divergence(torch.tensor(a), torch.tensor(b)).item() == scipy.stats.entropy(a, b) == math.inf
    assert kl_divergence(torch.tensor(b), torch.tensor(a)).item() == pytest.approx(scipy.stats.entropy(b, a), abs=1e-15)


@pytest.mark.equation("01.10", oracle="scipy.stats.entropy(q, p); torch.distributions.kl_divergence(Q, P)")
def test_reverse_kl_divergence_matches_scipy():
    p, q = random_dist(6, 10), random_dist(6, 10, zeros=True)
    ours = reverse_kl_divergence(p, q)
    np.testing.assert_allclose(ours.numpy(), scipy.stats.entropy(q.numpy(), p.numpy(), axis=-1), **F64)
    ref = torch.distributions.kl_divergence(Categorical(probs=q), Categorical(probs=p))
    torch.testing.assert_close(ours, ref, **F64)
    # not symmetric: the forward KL is infinite here (p puts mass where q has none), the reverse is finite
    assert torch.isinf(kl_divergence(p, q)).any() and torch.isfinite(ours).all()


@pytest.mark.equation("01.08", oracle="scipy.stats.entropy(p), scipy.stats.entropy(p, q); "
                                      "torch.nn.functional.cross_entropy with probability targets")
def test_cross_entropy_decomposition():
    p, q = random_dist(6, 10, zeros=True), random_dist(6, 10)
    h, kl = cross_entropy_decomposition(p, q)
    np.testing.assert_allclose(h.numpy(), scipy.stats.entropy(p.numpy(), axis=-1), **F64)
    np.testing.assert_allclose(kl.numpy(), scipy.stats.entropy(p.numpy(), q.numpy(), axis=-1), **F64)
    torch.testing.assert_close(h + kl, F.cross_entropy(q.log(), p, reduction="none"), **F64)


dists = st.integers(2, 12).flatmap(
    lambda V: st.tuples(
        st.lists(st.floats(0.0, 10.0), min_size=V, max_size=V).filter(lambda w: sum(w) > 1e-3),
        st.lists(st.floats(1e-3, 10.0), min_size=V, max_size=V),
    )
)


@pytest.mark.equation("01.07", "01.11", oracle="scipy.stats.entropy; Gibbs' inequality")
@SETTINGS
@given(dists)
def test_cross_entropy_floor_is_entropy(pq):
    """C02: CE(p, p) = H(p), and CE(p, q) >= H(p) for every q (the gap is the KL)."""
    p = torch.tensor(pq[0], dtype=torch.float64)
    q = torch.tensor(pq[1], dtype=torch.float64)
    p, q = p / p.sum(), q / q.sum()
    h = entropy(p).item()
    assert h == pytest.approx(scipy.stats.entropy(p.numpy()), rel=1e-12, abs=1e-12)
    assert cross_entropy(p, p).item() == pytest.approx(h, rel=1e-12, abs=1e-12)
    ce = cross_entropy(p, q).item()
    assert ce >= h - 1e-12
    assert ce - h == pytest.approx(scipy.stats.entropy(p.numpy(), q.numpy()), rel=1e-9, abs=1e-12)


# ================================================================= 01.13 length normalisation


@pytest.mark.equation("01.13", oracle="float64 closed form sum / T**alpha (numpy)")
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 1.5])
def test_length_normalized_score(alpha):
    lp = -torch.rand(4, 6, dtype=torch.float64) * 3
    lengths = [6, 3, 1, 5]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    lp_padded = lp.masked_fill(~mask, NEG_INF)  # padding may hold -inf; it must not leak in
    ours = length_normalized_score(lp_padded, alpha=alpha, mask=mask)
    ref = np.array([math.fsum(lp[b, :n].tolist()) / n ** alpha for b, n in enumerate(lengths)])
    np.testing.assert_allclose(ours.numpy(), ref, **F64)
    full = length_normalized_score(lp, alpha=alpha)
    np.testing.assert_allclose(full.numpy(), lp.numpy().sum(-1) / 6 ** alpha, **F64)
    if alpha == 0:
        torch.testing.assert_close(full, lp.sum(-1), **F64)
    if alpha == 1:
        torch.testing.assert_close(full, lp.mean(-1), **F64)


# ================================================================= 01.15 perplexity, 01.16 bits per byte (C02)


@pytest.mark.equation("01.15", oracle="exp(torch.nn.functional.cross_entropy(reduction='mean', ignore_index))")
def test_perplexity_matches_exp_cross_entropy():
    logits = torch.randn(3, 8, 20, dtype=torch.float64)
    targets = torch.randint(0, 20, (3, 8))
    torch.testing.assert_close(perplexity(logits, targets), F.cross_entropy(logits.transpose(1, 2), targets).exp(),
                               **F64)
    targets[1, 5:] = -100
    ref = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100).exp()
    torch.testing.assert_close(perplexity(logits, targets, ignore_index=-100), ref, **F64)


@pytest.mark.equation("01.15", oracle="closed form: a uniform model over V has perplexity V")
@pytest.mark.parametrize("V", [2, 3, 10, 256, 50257])
def test_perplexity_of_uniform_logits_is_V(V):
    """C02: uniform logits give perplexity exactly V (float32, relative 1e-5), whatever the targets."""
    targets = torch.randint(0, V, (2, 5))
    assert perplexity(torch.zeros(2, 5, V), targets).item() == pytest.approx(V, rel=1e-5)
    assert perplexity(torch.full((2, 5, V), 3.7), targets).item() == pytest.approx(V, rel=1e-5)


@pytest.mark.equation("01.16", oracle="float64 closed form total_nll / (n_bytes * ln 2)")
def test_bits_per_byte_closed_form():
    for total, n in [(0.0, 1), (1.0, 1), (1234.5, 1000), (math.log(2) * 7, 7)]:
        assert bits_per_byte(total, n) == pytest.approx(np.float64(total) / (n * np.log(2)), rel=1e-15)
    assert bits_per_byte(torch.tensor(10.0, dtype=torch.float64), 5) == pytest.approx(10 / (5 * math.log(2)), rel=1e-15)


@pytest.mark.equation("01.16", oracle="closed form: a uniform byte model costs log2(256) = 8 bits per byte")
def test_bits_per_byte_of_uniform_byte_model_is_8():
    text = corpus()[:5000]
    b = byte_tokens(text)
    total = -NGramLM(0, 256).score(b).sum().item()
    assert bits_per_byte(total, len(b)) == pytest.approx(8.0, rel=1e-12)
    # the same through uniform logits and torch's cross-entropy (float32)
    t = torch.tensor(b)[None]
    total32 = F.cross_entropy(torch.zeros(1, 256, len(b)), t, reduction="sum").item()
    assert bits_per_byte(total32, len(b)) == pytest.approx(8.0, rel=1e-5)


@pytest.mark.equation("01.15", "01.16", oracle="chain rule: a chunk's log-prob is the math.fsum of its bytes'; "
                                              "closed forms exp(mean NLL) and total / (n_bytes ln 2)")
def test_bits_per_byte_is_tokeniser_fair_perplexity_is_not():
    """C02: one model, one text, two tokenisations: per-token perplexity differs, bits per byte agrees."""
    text = corpus()
    train, held = text[:-6000], text[-6000:]
    lm = NGramLM(4, 256).fit(byte_tokens(train))
    n_bytes = len(held.encode("utf-8"))

    per_byte = lm.score(byte_tokens(held))
    assert per_byte.shape == (n_bytes,)
    results = {}
    for size in (1, 2, 4):
        per_chunk = chunk_log_probs(lm, held, size)
        assert per_chunk.shape == (len(chunk_tokens(held, size)),)
        total = -math.fsum(per_chunk.tolist())
        ppl = math.exp(total / len(per_chunk))
        bpb = bits_per_byte(total, n_bytes)
        assert bpb == pytest.approx(total / (n_bytes * math.log(2)), rel=1e-15)
        results[size] = (ppl, bpb)
    (p1, b1), (p2, b2), (p4, b4) = results[1], results[2], results[4]
    # same model, same probability of the text: identical bits per byte (to float rounding)
    assert b2 == pytest.approx(b1, rel=1e-12) and b4 == pytest.approx(b1, rel=1e-12)
    assert b1 == pytest.approx(-math.fsum(per_byte.tolist()) / (n_bytes * math.log(2)), rel=1e-12)
    # ... but per-token perplexity grows with the chunk size: PPL_k = PPL_1 ** (n_bytes / n_chunks)
    assert p1 < p2 < p4 and p2 > 1.5 * p1
    assert math.log(p2) == pytest.approx(math.log(p1) * n_bytes / math.ceil(n_bytes / 2), rel=1e-12)
    # and bits per byte equals the per-token cross-entropy in bits, rescaled by tokens per byte
    assert b1 == pytest.approx(math.log2(p1), rel=1e-12)


# ================================================================= C19 gradient of softmax cross-entropy


@pytest.mark.equation("01.03", "01.06", "01.07",
                      oracle="torch.autograd of F.cross_entropy; closed form torch.softmax(z) - one_hot(y)")
def test_cross_entropy_gradient_is_p_minus_y():
    """C19: d/dz CE(softmax(z), y) = softmax(z) - onehot(y), by autograd, for torch and for our functions."""
    N, V = 16, 7
    z = (torch.randn(N, V, dtype=torch.float64) * 3).requires_grad_()
    y = torch.randint(0, V, (N,))
    expected = torch.softmax(z.detach(), -1) - F.one_hot(y, V).double()

    (g_torch,) = torch.autograd.grad(F.cross_entropy(z, y, reduction="sum"), z)
    torch.testing.assert_close(g_torch, expected, **F64)

    (g_nll,) = torch.autograd.grad(nll(z[None], y[None], reduction="sum"), z)
    torch.testing.assert_close(g_nll, expected, **F64)

    (g_ce,) = torch.autograd.grad(cross_entropy(F.one_hot(y, V).double(), softmax(z)).sum(), z)
    torch.testing.assert_close(g_ce, expected, **F64)

    (g_lsm,) = torch.autograd.grad(-log_softmax(z).gather(-1, y[:, None]).sum(), z)
    torch.testing.assert_close(g_lsm, expected, **F64)
    # each row of the gradient sums to zero (probabilities minus a one-hot)
    torch.testing.assert_close(g_nll.sum(-1), torch.zeros(N, dtype=torch.float64), **F64)


# ================================================================= bad input


def _tf_model(x):
    return torch.zeros(*x.shape, 5)


L = torch.long
BAD = [
    # logits
    (lambda: softmax(torch.tensor([0.0, float("nan")])), ValueError, "z contains NaN"),
    (lambda: log_softmax(torch.tensor([0.0, float("inf")])), ValueError, r"z contains \+inf"),
    (lambda: logsumexp(torch.tensor([[1.0, float("nan")]])), ValueError, "NaN"),
    (lambda: log_softmax(torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]])), ValueError, "fully masked row"),
    (lambda: softmax(torch.tensor([NEG_INF, NEG_INF])), ValueError, "fully masked row"),
    (lambda: softmax(torch.tensor(1.0)), ValueError, r"must have shape \(\.\.\., V\)"),
    (lambda: softmax(torch.zeros(2, 0)), ValueError, "must not be empty"),
    (lambda: softmax("abc"), TypeError, "tensor or array-like"),
    (lambda: softmax(torch.tensor([True, False])), TypeError, "real floating-point"),
    # log-likelihoods
    (lambda: token_log_probs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=L)), ValueError, r"disagree on \(B, T\)"),
    (lambda: sequence_log_likelihood(torch.zeros(2, 3, 5), torch.zeros(3, dtype=L)), ValueError, "disagree"),
    (lambda: sequence_log_likelihood(torch.zeros(1, 3, 5), torch.tensor([[0, 5, 1]])), ValueError,
     r"targets must be token ids in \[0, V\) = \[0, 5\)"),
    (lambda: sequence_log_likelihood(torch.zeros(1, 3, 5), torch.tensor([[0, -1, 1]])), ValueError, r"\[0, V\)"),
    (lambda: sequence_log_likelihood(torch.zeros(1, 2, 5), torch.tensor([[0.0, 1.0]])), TypeError, "integer token"),
    (lambda: sequence_log_likelihood(torch.full((1, 2, 5), float("nan")), torch.tensor([[0, 1]])), ValueError,
     "logits contains NaN"),
    (lambda: conditional_log_likelihood(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=L), 3), ValueError,
     "prompt_length must be an int in"),
    (lambda: nll(torch.zeros(1, 3, 5), torch.zeros(1, 3, dtype=L), reduction="avg"), ValueError, "reduction must be"),
    (lambda: nll(torch.zeros(1, 2, 5), torch.full((1, 2), -100), reduction="mean", ignore_index=-100), ValueError,
     "no counted token"),
    (lambda: nll(torch.zeros(1, 2, 5), torch.tensor([[7, -100]]), ignore_index=-100), ValueError, r"\[0, V\)"),
    (lambda: perplexity(torch.full((1, 2, 5), float("inf")), torch.zeros(1, 2, dtype=L)), ValueError, r"\+inf"),
    # distributions
    (lambda: entropy(torch.tensor([0.5, 0.6])), ValueError, "must sum to 1"),
    (lambda: entropy(torch.tensor([1.5, -0.5])), ValueError, "non-negative"),
    (lambda: entropy(torch.tensor([0.5, float("nan")])), ValueError, "NaN"),
    (lambda: kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([0.3, 0.3, 0.4])), ValueError,
     "must have the same shape"),
    (lambda: kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.9])), ValueError, "q must sum to 1"),
    (lambda: reverse_kl_divergence(torch.tensor([0.5, 0.5]), torch.tensor([-0.1, 1.1])), ValueError, "non-negative"),
    (lambda: cross_entropy(torch.tensor([2.0, 0.0]), torch.tensor([0.5, 0.5])), ValueError, "y must sum to 1"),
    (lambda: cross_entropy_decomposition(torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.2])), ValueError,
     "q must sum to 1"),
    # length normalisation
    (lambda: length_normalized_score(torch.zeros(3), 1.0), ValueError, r"must have shape \(B, T\)"),
    (lambda: length_normalized_score(torch.zeros(2, 3), -1.0), ValueError, "alpha must lie in"),
    (lambda: length_normalized_score(torch.zeros(2, 3), 1.0, mask=torch.ones(2, 4)), ValueError,
     "mask .* must have the shape"),
    (lambda: length_normalized_score(torch.zeros(2, 3), 1.0, mask=torch.tensor([[1, 0, 0], [0, 0, 0]])), ValueError,
     "at least one unmasked token"),
    (lambda: length_normalized_score(torch.tensor([[-1.0, float("nan")]]), 1.0), ValueError, "log_probs contains NaN"),
    # bits per byte
    (lambda: bits_per_byte(10.0, 0), ValueError, "n_bytes must be a positive int"),
    (lambda: bits_per_byte(10.0, -3), ValueError, "n_bytes must be a positive int"),
    (lambda: bits_per_byte(10.0, 2.5), TypeError, r"n_bytes must be a positive int, got 2.5 \(float\)"),
    (lambda: bits_per_byte(10.0, True), TypeError, r"n_bytes must be a positive int, got True \(bool\)"),
    (lambda: bits_per_byte(-1.0, 10), ValueError, r"total_nll_nats must lie in \[0.0, inf\], got -1.0"),
    (lambda: bits_per_byte(float("nan"), 10), ValueError, "total_nll_nats must be a real number, got nan"),
    # shifting and teacher forcing
    (lambda: shift_labels(torch.zeros(2, 3)), ValueError, "integer tensor of shape"),
    (lambda: shift_labels(torch.zeros(3, dtype=L)), ValueError, r"shape \(B, T\)"),
    (lambda: shift_labels(torch.zeros(2, 1, dtype=L)), ValueError, "at least T = 2"),
    (lambda: teacher_forcing_loss(_tf_model, torch.zeros(2, 1, dtype=L), torch.zeros(3, 2, dtype=L)), ValueError,
     "equal B"),
    (lambda: teacher_forcing_loss(_tf_model, torch.zeros(2, 0, dtype=L), torch.zeros(2, 2, dtype=L)), ValueError,
     "at least one token"),
]


@pytest.mark.parametrize("call, exc, match", BAD, ids=[f"bad{i:02d}" for i in range(len(BAD))])
def test_bad_input_raises_helpful_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ================================================================= the logits-and-targets loss (torch's cross_entropy)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_loss_matches_torch(reduction):
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(3, 6, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (3, 6), generator=g)
    targets[0, :4] = -100  # padding, torch's default ignore_index
    ref = F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction)  # torch: classes on dim 1
    torch.testing.assert_close(cross_entropy_loss(logits, targets, reduction=reduction), ref, **F64)
    # ignore_index=None counts every position, like a torch call whose ignore_index matches nothing
    full = targets.clamp(min=0)
    torch.testing.assert_close(cross_entropy_loss(logits, full, reduction=reduction, ignore_index=None),
                               F.cross_entropy(logits.transpose(1, 2), full, reduction=reduction), **F64)
    # flat (N, V) and a single (V,) row, as torch accepts them
    torch.testing.assert_close(cross_entropy_loss(logits[1], targets[1], reduction=reduction),
                               F.cross_entropy(logits[1], targets[1], reduction=reduction), **F64)
    torch.testing.assert_close(cross_entropy_loss(logits[1, 2], targets[1, 2]), F.cross_entropy(logits[1, 2],
                               targets[1, 2]), **F64)


def test_cross_entropy_loss_default_is_the_mean_and_distinct_from_cross_entropy():
    logits, targets = torch.randn(4, 7, dtype=torch.float64), torch.tensor([0, 3, 6, 2])
    mean = cross_entropy_loss(logits, targets)
    torch.testing.assert_close(mean, F.cross_entropy(logits, targets), **F64)
    torch.testing.assert_close(mean * 4, F.cross_entropy(logits, targets, reduction="sum"), **F64)
    # H(y, p) of the distributions: one-hot y against softmax(z), per row
    torch.testing.assert_close(cross_entropy(F.one_hot(targets, 7).double(), logits.softmax(-1)),
                               cross_entropy_loss(logits, targets, reduction="none"), **F64)


def test_cross_entropy_loss_bad_input():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="reduction must be 'sum', 'mean' or 'none', got 'avg'"):
        cross_entropy_loss(logits, torch.zeros(2, 3, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match=r"disagree on \(B, T\)"):
        cross_entropy_loss(logits, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids in \[0, V\) = \[0, 5\)"):
        cross_entropy_loss(logits, torch.full((2, 3), 5))
    with pytest.raises(TypeError, match="integer token ids"):
        cross_entropy_loss(logits, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="ignore_index must be an int or None"):
        cross_entropy_loss(logits, torch.zeros(2, 3, dtype=torch.long), ignore_index=1.5)
    with pytest.raises(ValueError, match="no counted token"):
        cross_entropy_loss(logits, torch.full((2, 3), -100))


# ================================================================= issue 11: reduction axes (IndexError -> ValueError)


def test_reduction_axis_is_checked():
    with pytest.raises(ValueError, match=r"z must not be empty along dim 0, got shape \(0, 3\)"):
        logsumexp(torch.zeros(0, 3), dim=0)
    for fn in (softmax, log_softmax, logsumexp):
        with pytest.raises(ValueError, match=r"dim \(5\) must name an axis of z of shape \(2, 3\): an int in \[-2, 1"):
            fn(torch.zeros(2, 3), dim=5)
        with pytest.raises(TypeError, match=r"dim must be an int, got 1.5 \(float\)"):
            fn(torch.zeros(2, 3), dim=1.5)
    # reducing a non-empty axis of an empty batch is fine: oracle torch.logsumexp
    torch.testing.assert_close(logsumexp(torch.zeros(0, 3), dim=1), torch.logsumexp(torch.zeros(0, 3), dim=1))
    z = torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(softmax(z, dim=-3), torch.softmax(z, dim=0), rtol=1e-12, atol=1e-12)


def test_bool_targets_are_not_token_ids():
    """Issue 11: a bool target tensor was read as ids 0/1 by the whole cross-entropy family."""
    logits, ids = torch.randn(2, 3, 5), torch.tensor([[0, 1, 1], [1, 0, 1]])
    text = "targets must be a tensor of integer token ids, got dtype torch.bool"
    for call in (token_log_probs, sequence_log_likelihood, nll, perplexity, cross_entropy_loss,
                 lambda z, t: conditional_log_likelihood(z, t, 1)):
        with pytest.raises(TypeError, match=text):
            call(logits, ids.bool())
        call(logits, ids)  # the same values as ids are fine
    model = lambda tokens: torch.zeros(*tokens.shape, 5)  # noqa: E731 - a uniform language model
    with pytest.raises(TypeError, match="x must be a tensor of integer token ids, got dtype torch.bool"):
        teacher_forcing_loss(model, ids.bool(), ids)
    with pytest.raises(TypeError, match="y_star must be a tensor of integer token ids, got dtype torch.bool"):
        teacher_forcing_loss(model, ids, ids.bool())


@pytest.mark.parametrize("bad, text", [(True, r"got True \(bool\)"), ("0.5", r"got '0.5' \(str\)"),
                                       (torch.tensor(True), r"got True \(bool\)")])
def test_bits_per_byte_rejects_non_numbers(bad, text):
    """Issue 11: float(True) = 1 and float('0.5') = 0.5 were accepted as nats."""
    with pytest.raises(TypeError, match=r"total_nll_nats must be a real number, " + text):
        bits_per_byte(bad, 10)
    assert bits_per_byte(math.inf, 10) == math.inf  # a byte of probability 0 costs infinitely many bits


# ================================================================= the chapter's Try-it solutions and real models


def test_try_it_solutions_of_chapter_1():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    stated = []
    # 1. scaling the logits by s < 1 raises the entropy towards log V
    z = torch.tensor([2.0, 1.0, 0.1, -1.0], dtype=torch.float64)
    H1, H_half = (entropy(softmax(s * z)).item() for s in (1.0, 0.5))
    assert H1 < H_half < math.log(4)
    torch.testing.assert_close(softmax(z + 7.0), softmax(z), rtol=0, atol=1e-15)
    stated += [f"{H1:.4f}", f"{H_half:.4f}", f"{math.log(4):.4f}"]
    # 2. forward KL finite, reverse KL infinite (Q has mass where P has none); with a little mass, both finite
    P, Q = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), torch.tensor([0.98, 0.01, 0.01], dtype=torch.float64)
    forward, reverse = kl_divergence(P, Q).item(), reverse_kl_divergence(P, Q).item()
    assert forward == pytest.approx(scipy.stats.entropy(P.numpy(), Q.numpy()), rel=1e-12)
    assert reverse == math.inf and scipy.stats.entropy(Q.numpy(), P.numpy()) == math.inf
    P2 = torch.tensor([0.495, 0.495, 0.01], dtype=torch.float64)
    forward2, reverse2 = kl_divergence(P2, Q).item(), reverse_kl_divergence(P2, Q).item()
    assert reverse2 < forward2 < forward
    stated += [f"{forward:.4f}", f"{0.5 * math.log(50):.2f}", "**infinite**", f"{forward2:.4f}", f"{reverse2:.4f}"]
    # 3. smoothing of an order-3 byte model: held-out optimum in between, training fit best with the least smoothing
    text = corpus()
    split = int(0.9 * len(text))
    train_ids, heldout_text = byte_tokens(text[:split]), text[split:split + 20_000]
    heldout_ids, n_bytes = byte_tokens(heldout_text), len(heldout_text.encode("utf-8"))
    alphas = [0.05, 0.5, 1, 2, 3, 5, 8, 50]
    held, fit = {}, {}
    for alpha in alphas:
        m = NGramLM(order=3, vocab_size=256, alpha=alpha).fit(train_ids)
        held[alpha] = bits_per_byte(-m.score(heldout_ids).sum().item(), n_bytes)
        fit[alpha] = bits_per_byte(-m.score(train_ids[:20_000]).sum().item(), 20_000)
    assert held[5] < held[0.05] and min(held, key=held.get) == 3
    assert all(fit[a] < fit[b] for a, b in itertools.pairwise(alphas))
    stated += [f"{held[5]:.3f}", f"{held[0.05]:.3f}", f"{held[50]:.3f}", f"{held[3]:.3f}", r"\alpha = 3"]
    assert_states("01-probability.ipynb", stated)


def test_vocabulary_sizes_of_chapter_1_match_transformers_configs():
    """GPT-2's 50,257 and Llama (1, 2)'s 32,000 are transformers' config defaults; the chapter uses them."""
    import json
    from pathlib import Path

    from transformers import GPT2Config, LlamaConfig

    assert GPT2Config().vocab_size == 50_257 and LlamaConfig().vocab_size == 32_000
    for V in (50_257, 32_000, 128_256):  # the uniform model: log V nats, perplexity V
        logits, targets = torch.zeros(1, 3, V, dtype=torch.float64), torch.tensor([[0, V // 2, V - 1]])
        assert nll(logits, targets, reduction="mean").item() == pytest.approx(math.log(V), rel=1e-12)
        assert perplexity(logits, targets).item() == pytest.approx(V, rel=1e-12)
    path = Path(__file__).resolve().parents[2] / "book" / "01-probability.ipynb"
    if path.exists():
        source = "".join("".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"])
        for stated in ('("GPT-2", 50_257)', '("Llama 2", 32_000)', '("Llama 3", 128_256)', "50{,}257", "32{,}000",
                       "128{,}256"):
            assert stated in source, stated
