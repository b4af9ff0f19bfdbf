"""Chapter 7, language-modelling objectives: 07.06 masked LM, 07.07 causal LM, 07.08 span corruption.

Tolerances, stated once:

* float32 against transformers' loss functions and a tiny T5 (which compute in float32):
  ``rtol = atol = 1e-6`` (``F32``);
* float64 against a brute-force sum of log-probabilities (scipy): ``rtol = atol = 1e-12`` (``F64``);
* masks, ids and counts: exact; frequencies of random masks: within 5 standard errors of the exact
  probability (``SIGMAS``).
"""

import math

import numpy as np
import pytest
import scipy.special
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import T5Config, T5ForConditionalGeneration
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss

from llmbook.lm.objectives import (
    causal_lm_loss,
    masked_lm_loss,
    mlm_mask,
    random_spans_noise_mask,
    span_corruption,
    span_corruption_loss,
)

F32 = dict(rtol=1e-6, atol=1e-6)
F64 = dict(rtol=1e-12, atol=1e-12)
SIGMAS = 5.0
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def within(observed, p, n):
    """The observed frequency lies within SIGMAS binomial standard errors of p."""
    return abs(observed - p) <= SIGMAS * math.sqrt(p * (1 - p) / n) + 1e-12


def brute_force_nll(logits, labels, ignore_index=-100):
    """-sum of log p(label) over the labelled positions, scipy float64."""
    lp = scipy.special.log_softmax(logits.double().numpy(), axis=-1)
    y = labels.numpy()
    return -sum(lp[idx][y[idx]] for idx in np.ndindex(*y.shape) if y[idx] != ignore_index)


# ================================================================= 07.06 masked LM


@pytest.mark.equation("07.06", oracle="transformers.loss.loss_utils.ForMaskedLMLoss")
def test_masked_lm_loss_matches_transformers():
    B, T, V = 3, 16, 30
    ids = torch.randint(4, V, (B, T), generator=gen(0))
    inputs, labels = mlm_mask(ids, mask_id=3, V=V, p=0.3, generator=gen(1))
    logits = torch.randn(B, T, V, generator=gen(2))
    torch.testing.assert_close(masked_lm_loss(logits, labels), ForMaskedLMLoss(logits, labels, V), **F32)
    n = torch.tensor(40)  # e.g. the masked tokens of the whole accumulated batch
    torch.testing.assert_close(masked_lm_loss(logits, labels, num_items_in_batch=n),
                               ForMaskedLMLoss(logits, labels, V, num_items_in_batch=n), **F32)


@pytest.mark.equation("07.06", oracle="float64 brute force -sum_{i in M} log p(x_i) with scipy.special.log_softmax")
def test_masked_lm_loss_sum_is_the_equation():
    logits = torch.randn(2, 7, 11, generator=gen(3), dtype=torch.float64)
    labels = torch.full((2, 7), -100)
    labels[0, 2], labels[1, 0], labels[1, 5] = 4, 10, 0
    assert masked_lm_loss(logits, labels, reduction="sum").item() == pytest.approx(
        brute_force_nll(logits, labels), rel=1e-12)
    assert masked_lm_loss(logits, labels).item() == pytest.approx(brute_force_nll(logits, labels) / 3, rel=1e-12)


def test_mlm_mask_statistics_follow_bert():
    """15 % picked; of those 80 % [MASK], 10 % random (which may redraw the original), 10 % kept."""
    V, p, mask_id = 50, 0.15, 49
    ids = torch.randint(0, V - 1, (400, 500), generator=gen(4))  # never the mask id itself
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = True  # a [CLS] column that must never be picked
    inputs, labels = mlm_mask(ids, mask_id, V, p, generator=gen(5), special=special)
    picked = labels != -100
    n_free, n_picked = int((~special).sum()), int(picked.sum())
    assert not picked[:, 0].any()
    assert torch.equal(labels[picked], ids[picked]) and torch.equal(inputs[~picked], ids[~picked])
    assert within(n_picked / n_free, p, n_free)
    masked = (inputs == mask_id) & picked
    kept = (inputs == ids) & picked
    assert within(int(masked.sum()) / n_picked, 0.8 + 0.1 / V, n_picked)  # a random draw can be the mask id
    assert within(int(kept.sum()) / n_picked, 0.1 + 0.1 / V, n_picked)  # or the original token


# ================================================================= 07.07 causal LM


@pytest.mark.equation("07.07", oracle="transformers.loss.loss_utils.ForCausalLMLoss")
def test_causal_lm_loss_matches_transformers():
    B, T, V = 3, 12, 20
    labels = torch.randint(0, V, (B, T), generator=gen(6))
    labels[0, 8:] = -100  # padding
    labels[1, :3] = -100  # an unscored prompt
    logits = torch.randn(B, T, V, generator=gen(7))
    torch.testing.assert_close(causal_lm_loss(logits, labels), ForCausalLMLoss(logits, labels, V), **F32)
    n = torch.tensor(50)
    torch.testing.assert_close(causal_lm_loss(logits, labels, num_items_in_batch=n),
                               ForCausalLMLoss(logits, labels, V, num_items_in_batch=n), **F32)


@pytest.mark.equation("07.07", oracle="float64 brute force of the chain rule -sum_t log p(x_t | x_<t)")
def test_causal_lm_loss_sum_is_the_chain_rule():
    logits = torch.randn(2, 6, 9, generator=gen(8), dtype=torch.float64)
    x = torch.randint(0, 9, (2, 6), generator=gen(9))
    lp = scipy.special.log_softmax(logits.numpy(), axis=-1)
    ref = -sum(lp[b, t - 1, x[b, t]] for b in range(2) for t in range(1, 6))  # position t-1 predicts x_t
    assert causal_lm_loss(logits, x, reduction="sum").item() == pytest.approx(ref, rel=1e-12)
    assert causal_lm_loss(logits, x, reduction="none").shape == (2, 5)


def test_num_items_in_batch_makes_gradient_accumulation_exact():
    """Summing micro-batch losses divided by the total count gives the full-batch mean; averaging means does not."""
    V = 10
    logits = torch.randn(4, 9, V, generator=gen(10), dtype=torch.float64)
    labels = torch.randint(0, V, (4, 9), generator=gen(11))
    labels[:2, 3:] = -100  # the first micro-batch has far fewer targets
    full = causal_lm_loss(logits, labels)
    n = int((labels[:, 1:] != -100).sum())
    accumulated = sum(causal_lm_loss(logits[i:i + 2], labels[i:i + 2], num_items_in_batch=n) for i in (0, 2))
    naive = sum(causal_lm_loss(logits[i:i + 2], labels[i:i + 2]) for i in (0, 2)) / 2
    torch.testing.assert_close(accumulated, full, **F64)
    assert abs(naive.item() - full.item()) > 1e-3


def test_lm_losses_reject_bad_input():
    logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="disagree on"):
        masked_lm_loss(logits, labels[:, :2])
    with pytest.raises(TypeError, match="integer tensor of token ids"):
        causal_lm_loss(logits, labels.float())
    with pytest.raises(ValueError, match="token ids in"):
        masked_lm_loss(logits, torch.full((2, 3), 7))
    with pytest.raises(ValueError, match="over no labelled token"):
        causal_lm_loss(logits, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="num_items_in_batch must be a positive int"):
        masked_lm_loss(logits, labels, num_items_in_batch=0)
    with pytest.raises(ValueError, match="replaces the count of a 'mean'"):
        masked_lm_loss(logits, labels, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match=r"p must lie in \[0.0, 1.0\]"):
        mlm_mask(labels, 0, 5, p=1.5)


# ================================================================= 07.08 span corruption


def composition_pmf(n, k, j):
    """P(a given one of k non-empty segments of n items has length j), uniform over compositions."""
    if k == 1:
        return float(j == n)
    return math.comb(n - j - 1, k - 2) / math.comb(n - 1, k - 1)


def span_lengths(mask):
    """Lengths of the runs of True in each row of a bool matrix."""
    m = mask.to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(m, (1, 1)), dim=1)
    starts, ends = (edges == 1).nonzero(), (edges == -1).nonzero()
    return ends[:, 1] - starts[:, 1]


@pytest.mark.equation("07.08", oracle="T5's exact counts and the closed-form span-length law C(n-j-1,k-2)/C(n-1,k-1)")
def test_noise_mask_statistics_match_t5():
    L, draws, g = 512, 2000, gen(12)
    masks = torch.stack([random_spans_noise_mask(L, 0.15, 3.0, generator=g) for _ in range(draws)])
    n, k = round(L * 0.15), round(round(L * 0.15) / 3.0)  # 77 noise tokens in 26 spans
    assert (masks.sum(1) == n).all()
    starts = masks & ~torch.nn.functional.pad(masks[:, :-1], (1, 0))
    assert (starts.sum(1) == k).all()
    assert not masks[:, 0].any() and masks[:, -1].all()  # T5 starts with a kept span and ends with a noise span
    for lengths, n_items in ((span_lengths(masks), n), (span_lengths(~masks), L - n)):
        counts = torch.bincount(lengths, minlength=12).double()
        total = counts.sum().item()
        assert total == draws * k
        for j in range(1, 12):
            assert within(counts[j].item() / total, composition_pmf(n_items, k, j), total), j
    assert span_lengths(masks).double().mean().item() == pytest.approx(n / k, rel=1e-12)
    # away from the two ends, every position is noise about 15 % of the time
    middle = masks[:, 50:-50].double().mean().item()
    assert within(middle, n / L, draws * 50)


@SETTINGS
@given(L=st.integers(0, 300), density=st.sampled_from([0.0, 0.15, 0.3, 0.5, 0.9]), mu=st.sampled_from([1.0, 3.0, 8.0]))
def test_noise_mask_counts_for_any_length(L, density, mu):
    mask = random_spans_noise_mask(L, density, mu, generator=gen(L))
    assert mask.shape == (L,) and mask.dtype == torch.bool
    if L == 0 or density == 0:
        assert not mask.any()
        return
    L2 = max(L, 2)
    n = min(max(round(L2 * density), 1), L2 - 1)
    k = min(max(round(n / mu), 1), L2 - n)
    full = torch.cat([mask, torch.ones(L2 - L, dtype=torch.bool)])  # the length-1 case is cut from length 2
    assert int(full.sum()) == n and len(span_lengths(full[None])) == k


def span_corruption_brute_force(ids, mask, s0):
    """One token at a time: a new noise span writes a sentinel into the input, a new kept span into the target."""
    x, y, n_noise, n_kept = [], [], 0, 0
    for i, (t, m) in enumerate(zip(ids.tolist(), mask.tolist(), strict=True)):
        new_span = i == 0 or mask[i - 1].item() != m
        if m:
            if new_span:
                x.append(s0 - n_noise)
                n_noise += 1
            y.append(t)
        else:
            if new_span:
                y.append(s0 - n_kept)
                n_kept += 1
            x.append(t)
    return x, y


@pytest.mark.equation("07.08", oracle="brute-force sentinel construction, token by token")
@SETTINGS
@given(bits=st.lists(st.booleans(), min_size=0, max_size=40), eos=st.sampled_from([None, 1]))
def test_span_corruption_matches_the_brute_force(bits, eos):
    mask = torch.tensor(bits, dtype=torch.bool)
    ids = torch.arange(10, 10 + len(bits))
    x, y = span_corruption(ids, mask, sentinel_start=99, eos_id=eos)
    bx, by = span_corruption_brute_force(ids, mask, 99)
    tail = [] if eos is None else [eos]
    assert x.tolist() == bx + tail and y.tolist() == by + tail


def test_span_corruption_reproduces_the_t5_paper_example():
    words = "Thank you for inviting me to your party last week .".split()
    vocab = {w: i for i, w in enumerate(words)}
    names = {99: "<X>", 98: "<Y>", 97: "<Z>", **{i: w for w, i in vocab.items()}}
    ids = torch.tensor([vocab[w] for w in words])
    mask = torch.tensor([w in ("for", "inviting", "last") for w in words])
    x, y = span_corruption(ids, mask, sentinel_start=99)
    assert " ".join(names[i] for i in x.tolist()) == "Thank you <X> me to your party <Y> week ."
    assert " ".join(names[i] for i in y.tolist()) == "<X> for inviting <Y> last <Z>"
    xb, yb = span_corruption(torch.stack([ids, ids]), torch.stack([mask, mask]), sentinel_start=99, eos_id=1)
    eos = torch.tensor([1])
    assert torch.equal(xb[1], torch.cat([x, eos])) and torch.equal(yb[0], torch.cat([y, eos]))


def tiny_t5(V=64):
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg).eval()


@pytest.mark.equation("07.08", oracle="transformers T5ForConditionalGeneration(input_ids, labels).loss")
def test_span_corruption_loss_matches_t5():
    t5 = tiny_t5()
    g = gen(13)
    ids = torch.randint(2, 50, (3, 24), generator=g)
    mask = torch.stack([random_spans_noise_mask(24, generator=g) for _ in range(3)])
    x, y = span_corruption(ids, mask, sentinel_start=63, eos_id=1)
    with torch.no_grad():
        ref = t5(input_ids=x, labels=y).loss
        ours = span_corruption_loss(lambda a, b: t5(input_ids=a, decoder_input_ids=b).logits, ids, mask, 63, eos_id=1)
        total = span_corruption_loss(lambda a, b: t5(input_ids=a, decoder_input_ids=b).logits, ids, mask, 63,
                                     eos_id=1, reduction="sum")
        logits = t5(input_ids=x, labels=y).logits
    torch.testing.assert_close(ours, ref, **F32)
    assert total.item() == pytest.approx(brute_force_nll(logits, y), rel=1e-5)


def test_span_corruption_rejects_bad_input():
    ids, mask = torch.arange(6), torch.tensor([0, 1, 0, 1, 0, 1]).bool()
    with pytest.raises(TypeError, match="noise_mask must be a bool mask"):
        span_corruption(ids, mask.long(), 99)
    with pytest.raises(ValueError, match="sentinel_start must be at least 2"):
        span_corruption(ids, mask, 1)
    with pytest.raises(ValueError, match="different lengths"):
        span_corruption(torch.stack([ids, ids]), torch.stack([mask, torch.zeros(6, dtype=torch.bool)]), 99)
    with pytest.raises(ValueError, match="non-negative token ids"):
        span_corruption(ids - 3, mask, 99)
    with pytest.raises(ValueError, match=r"mean_noise_span_length must lie in \[1.0, inf\)"):
        random_spans_noise_mask(10, 0.15, 0.5)
    with pytest.raises(ValueError, match=r"model must return logits of shape \(B, U, V\)"):
        span_corruption_loss(lambda a, b: torch.zeros(3), ids[None], mask[None], 99)
    with pytest.raises(ValueError, match="nothing to predict"):
        span_corruption_loss(lambda a, b: a, ids[None, :0], mask[None, :0], 99)
