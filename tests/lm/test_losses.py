"""Chapter 7, classification losses (07.01 label smoothing, 07.02 focal loss) and the Try-it solutions.

Tolerances, stated once:

* float64 against torch.nn.functional or a float64 closed form: ``rtol = atol = 1e-12`` (``F64``);
* float32 against a float64 closed form: relative ``1e-5`` (``F32``);
* the sizes of smoothed targets: exact.
"""

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.losses import (
    focal_loss,
    label_smoothing_loss,
    reduce_loss,
    sigmoid_focal_loss,
    smoothed_targets,
    z_loss,
)
from tests.try_it import assert_states

F64 = dict(rtol=1e-12, atol=1e-12)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def batch(shape=(4, 6), V=10, seed=0, ignore=True):
    logits = 2 * torch.randn(*shape, V, generator=gen(seed), dtype=torch.float64)
    targets = torch.randint(0, V, shape, generator=gen(seed + 1))
    if ignore:
        targets.view(-1)[::5] = -100
    return logits, targets


def torch_layout(logits):
    """torch wants the classes on axis 1: (N, V, d1, ...)."""
    return logits if logits.ndim == 2 else logits.movedim(-1, 1)


# ================================================================= 07.01 label smoothing


@pytest.mark.equation("07.01", oracle="torch.nn.functional.cross_entropy(label_smoothing=eps)")
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(12,), (4, 6)])
def test_torch_convention_matches_torch_cross_entropy(eps, reduction, shape):
    logits, targets = batch(shape)
    ours = label_smoothing_loss(logits, targets, eps, reduction=reduction)
    ref = F.cross_entropy(torch_layout(logits), targets, label_smoothing=eps, reduction=reduction)
    torch.testing.assert_close(ours, ref, **F64)


def fairseq_label_smoothed_nll_loss(logits, targets, eps, ignore_index=-100):
    """fairseq's ``label_smoothed_nll_loss`` transcribed in numpy float64 (sum over non-ignored positions)."""
    lprobs = scipy.special.log_softmax(logits.numpy(), axis=-1)
    t = targets.numpy()
    keep = t != ignore_index
    nll = -np.take_along_axis(lprobs, np.where(keep, t, 0)[..., None], -1)[..., 0]
    smooth = -lprobs.sum(-1)
    eps_i = eps / (lprobs.shape[-1] - 1)
    loss = (1.0 - eps - eps_i) * nll + eps_i * smooth
    return np.where(keep, loss, 0.0)


@pytest.mark.equation("07.01", oracle="fairseq label_smoothed_nll_loss, transcribed in float64 numpy")
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fairseq_convention_matches_its_closed_form(eps):
    logits, targets = batch((5, 7), V=9)
    ref = fairseq_label_smoothed_nll_loss(logits, targets, eps)
    ours = label_smoothing_loss(logits, targets, eps, convention="fairseq", reduction="none")
    np.testing.assert_allclose(ours.numpy(), ref, **F64)
    n = int((targets != -100).sum())
    np.testing.assert_allclose(label_smoothing_loss(logits, targets, eps, convention="fairseq").item(),
                               ref.sum() / n, **F64)


@pytest.mark.equation("07.01", oracle="numpy: the distribution written out per convention; F.cross_entropy")
def test_smoothed_targets_of_each_convention():
    V, eps = 5, 0.2
    y = torch.tensor([0, 3])
    t = smoothed_targets(y, V, eps, dtype=torch.float64)
    f = smoothed_targets(y, V, eps, convention="fairseq", dtype=torch.float64)
    expected_t = np.full((2, V), eps / V)
    expected_t[[0, 1], [0, 3]] = 1 - eps + eps / V
    expected_f = np.full((2, V), eps / (V - 1))
    expected_f[[0, 1], [0, 3]] = 1 - eps
    np.testing.assert_allclose(t.numpy(), expected_t, **F64)
    np.testing.assert_allclose(f.numpy(), expected_f, **F64)
    # the loss is the cross-entropy against these targets: soft-label F.cross_entropy agrees
    logits = torch.randn(2, V, generator=gen(3), dtype=torch.float64)
    for conv, target in (("torch", t), ("fairseq", f)):
        torch.testing.assert_close(label_smoothing_loss(logits, y, eps, convention=conv, reduction="none"),
                                   F.cross_entropy(logits, target, reduction="none"), **F64)


@SETTINGS
@given(V=st.integers(2, 12), eps=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_torch_eps_is_fairseq_eps_times_v_minus_1_over_v(V, eps, seed):
    """Both conventions are one family: torch's eps equals fairseq's eps (V-1)/V."""
    logits, targets = batch((6,), V=V, seed=seed)
    torch.testing.assert_close(label_smoothing_loss(logits, targets, eps),
                               label_smoothing_loss(logits, targets, eps * (V - 1) / V, convention="fairseq"), **F64)


@SETTINGS
@given(V=st.integers(2, 9), eps=st.floats(0.01, 0.99), conv=st.sampled_from(["torch", "fairseq"]),
       seed=st.integers(0, 1000))
def test_the_loss_is_smallest_at_the_smoothed_targets_where_it_equals_their_entropy(V, eps, conv, seed):
    """Gibbs: H(y_LS, p) >= H(y_LS), with equality at p = y_LS (scipy.stats.entropy as the reference)."""
    y = torch.randint(0, V, (3,), generator=gen(seed))
    target = smoothed_targets(y, V, eps, conv, dtype=torch.float64)
    at_best = label_smoothing_loss(target.log(), y, eps, conv, reduction="none")
    np.testing.assert_allclose(at_best.numpy(), scipy.stats.entropy(target.numpy(), axis=-1), rtol=1e-10, atol=1e-10)
    moved = target.log() + 0.3 * torch.randn(3, V, generator=gen(seed + 1), dtype=torch.float64)
    assert bool((label_smoothing_loss(moved, y, eps, conv, reduction="none") >= at_best - 1e-12).all())


def test_label_smoothing_rejects_bad_input():
    logits, targets = batch((3,), V=4, ignore=False)
    with pytest.raises(ValueError, match=r"eps must lie in \[0.0, 1.0\]"):
        label_smoothing_loss(logits, targets, eps=1.5)
    with pytest.raises(ValueError, match="convention must be one of"):
        label_smoothing_loss(logits, targets, convention="tf")
    with pytest.raises(ValueError, match="needs V >= 2"):
        label_smoothing_loss(logits[:, :1], torch.zeros(3, dtype=torch.long), convention="fairseq")
    with pytest.raises(TypeError, match="integer tensor of class ids"):
        label_smoothing_loss(logits, targets.double())
    with pytest.raises(ValueError, match=r"class ids in \[0, V\) = \[0, 4\)"):
        label_smoothing_loss(logits, torch.tensor([0, 4, 1]))
    with pytest.raises(ValueError, match="disagree"):
        label_smoothing_loss(logits, targets[:2])
    with pytest.raises(ValueError, match="NaN"):
        label_smoothing_loss(torch.full((2, 3), math.nan), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="over no counted position"):
        label_smoothing_loss(logits, torch.full((3,), -100))
    with pytest.raises(ValueError, match="reduction must be one of"):
        reduce_loss(torch.ones(2), None, "avg")


# ================================================================= 07.02 focal loss


def focal_closed_form(logits, targets, gamma, alpha=None, ignore_index=-100):
    """-alpha_t (1 - p_t)^gamma log p_t in float64 numpy, per position (0 where ignored)."""
    p = scipy.special.softmax(logits.numpy().astype(np.float64), axis=-1)
    t = targets.numpy()
    keep = t != ignore_index
    p_t = np.take_along_axis(p, np.where(keep, t, 0)[..., None], -1)[..., 0]
    a_t = 1.0 if alpha is None else alpha.numpy()[np.where(keep, t, 0)]
    return np.where(keep, -a_t * (1 - p_t) ** gamma * np.log(p_t), 0.0)


@pytest.mark.equation("07.02", oracle="torch.nn.functional.cross_entropy(weight=alpha) at gamma = 0")
@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_focal_loss_at_gamma_0_is_weighted_cross_entropy(reduction, weighted):
    logits, targets = batch((4, 6), V=7)
    alpha = torch.rand(7, generator=gen(5), dtype=torch.float64) if weighted else None
    ours = focal_loss(logits, targets, gamma=0.0, alpha=alpha, reduction=reduction)
    ref = F.cross_entropy(torch_layout(logits), targets, weight=alpha, reduction=reduction)
    torch.testing.assert_close(ours, ref, **F64)
    # "mean" averages over counted positions; unweighted, that is torch's mean
    torch.testing.assert_close(focal_loss(logits, targets, gamma=0.0),
                               F.cross_entropy(torch_layout(logits), targets), **F64)


@pytest.mark.equation("07.02", oracle="float64 numpy closed form -alpha_t (1-p_t)^gamma log p_t")
@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0, 5.0])
def test_focal_loss_matches_the_closed_form(gamma):
    logits, targets = batch((5, 4), V=6, seed=int(gamma * 10))
    alpha = torch.rand(6, generator=gen(7), dtype=torch.float64) + 0.1
    ref = focal_closed_form(logits, targets, gamma, alpha)
    np.testing.assert_allclose(focal_loss(logits, targets, gamma, alpha, reduction="none").numpy(), ref, **F64)
    np.testing.assert_allclose(focal_loss(logits, targets, gamma, alpha).item(),
                               ref.sum() / (targets != -100).sum().item(), **F64)


@SETTINGS
@given(seed=st.integers(0, 1000), g1=st.floats(0.0, 3.0), dg=st.floats(0.01, 2.0))
def test_focal_loss_is_at_most_cross_entropy_and_decreases_with_gamma(seed, g1, dg):
    logits, targets = batch((8,), V=5, seed=seed)
    ce = F.cross_entropy(logits, targets, reduction="none", ignore_index=-100)
    f1 = focal_loss(logits, targets, g1, reduction="none")
    f2 = focal_loss(logits, targets, g1 + dg, reduction="none")
    assert bool((f1 <= ce + 1e-12).all()) and bool((f2 <= f1 + 1e-12).all())


@pytest.mark.equation("07.02", oracle="torch.nn.functional.binary_cross_entropy_with_logits; float64 closed form")
@pytest.mark.parametrize("gamma, alpha", [(0.0, None), (2.0, 0.25), (1.5, 0.6), (3.0, None)])
def test_sigmoid_focal_loss_matches_bce_and_the_retinanet_closed_form(gamma, alpha):
    x = 3 * torch.randn(6, 5, generator=gen(11), dtype=torch.float64)
    y = torch.rand(6, 5, generator=gen(12), dtype=torch.float64)
    y[:3] = (y[:3] > 0.5).double()  # hard labels in the first rows, soft ones after
    ours = sigmoid_focal_loss(x, y, gamma, alpha, reduction="none")
    p = 1 / (1 + np.exp(-x.numpy()))
    p_t = p * y.numpy() + (1 - p) * (1 - y.numpy())
    ce = -(y.numpy() * np.log(p) + (1 - y.numpy()) * np.log(1 - p))
    a_t = 1.0 if alpha is None else alpha * y.numpy() + (1 - alpha) * (1 - y.numpy())
    np.testing.assert_allclose(ours.numpy(), a_t * ce * (1 - p_t) ** gamma, rtol=1e-10, atol=1e-12)
    if gamma == 0 and alpha is None:
        torch.testing.assert_close(sigmoid_focal_loss(x, y, 0.0, None),
                                   F.binary_cross_entropy_with_logits(x, y), **F64)


def test_focal_losses_reject_bad_input():
    logits, targets = batch((3,), V=4, ignore=False)
    with pytest.raises(ValueError, match="gamma must lie in"):
        focal_loss(logits, targets, gamma=-1.0)
    with pytest.raises(ValueError, match=r"alpha must have shape \(4,\)"):
        focal_loss(logits, targets, alpha=torch.ones(3))
    with pytest.raises(ValueError, match="non-negative class weights"):
        focal_loss(logits, targets, alpha=-torch.ones(4))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 1\]"):
        sigmoid_focal_loss(torch.zeros(3), torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        sigmoid_focal_loss(torch.zeros(3), torch.zeros(3), alpha=1.5)
    with pytest.raises(ValueError, match="same shape"):
        sigmoid_focal_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="inf"):
        sigmoid_focal_loss(torch.tensor([math.inf]), torch.zeros(1))


# ================================================================= the chapter's Try-it solutions



@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("masked", [False, True])
def test_z_loss_matches_scipy_logsumexp_squared(reduction, masked):
    """Oracle: c (log Z)^2 with scipy.special.logsumexp in float64; mean over counted positions."""
    z = 8 * torch.randn(3, 5, 7, generator=gen(3), dtype=torch.float64) + 20  # log Z far from 0
    mask = torch.rand(3, 5, generator=gen(4)) < 0.6 if masked else None
    per = 1e-4 * scipy.special.logsumexp(z.numpy(), axis=-1) ** 2
    if masked:
        per = per * mask.numpy()
    expected = {"none": per, "sum": per.sum(), "mean": per.sum() / (mask.sum().item() if masked else per.size)}
    torch.testing.assert_close(z_loss(z, 1e-4, mask=mask, reduction=reduction),
                               torch.as_tensor(expected[reduction], dtype=torch.float64), **F64)


def test_z_loss_gradient_is_2c_logZ_softmax():
    """Oracle: the closed-form gradient 2 c log Z softmax(z) (scipy), against autograd through z_loss."""
    z = (3 * torch.randn(6, 9, generator=gen(5), dtype=torch.float64) + 4).requires_grad_(True)
    z_loss(z, coef=1e-4, reduction="sum").backward()
    zn = z.detach().numpy()
    grad = 2e-4 * scipy.special.logsumexp(zn, axis=-1, keepdims=True) * scipy.special.softmax(zn, axis=-1)
    torch.testing.assert_close(z.grad, torch.from_numpy(grad), **F64)
    # float32 and bf16 inputs: computed in float32, against the float64 closed form
    z32 = torch.randn(4, 50, generator=gen(6)) * 5
    ref = 1e-4 * torch.logsumexp(z32.double(), -1).square().mean()
    torch.testing.assert_close(z_loss(z32).double(), ref, rtol=1e-5, atol=0)
    assert z_loss(z32.bfloat16()).dtype == torch.bfloat16


def test_z_loss_rejects_bad_input():
    with pytest.raises(ValueError, match="coef"):
        z_loss(torch.zeros(2, 3), coef=-1.0)
    with pytest.raises(ValueError, match="mask"):
        z_loss(torch.zeros(2, 3), mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        z_loss(torch.zeros(2, 3), mask=torch.ones(2))
    with pytest.raises(ValueError, match="reduction"):
        z_loss(torch.zeros(2, 3), reduction="avg")
    with pytest.raises(ValueError):
        z_loss(torch.zeros(2, 3), mask=torch.zeros(2, dtype=torch.bool))  # mean over nothing
    with pytest.raises(ValueError):
        z_loss(torch.tensor([[0.0, float("nan")]]))


def test_try_it_solutions_of_chapter_7():
    """Every number of the chapter's Try-it solutions, computed here; the notebook must state them."""
    from llmbook.lm.contrastive import info_nce
    from llmbook.lm.objectives import random_spans_noise_mask, span_corruption

    stated = []
    # 1. label smoothing with V = 32000, eps = 0.1
    V, eps = 32000, 0.1
    t = smoothed_targets(torch.tensor([0]), V, eps, dtype=torch.float64)[0]
    f = smoothed_targets(torch.tensor([0]), V, eps, "fairseq", dtype=torch.float64)[0]
    assert t[0].item() == pytest.approx(0.900003125, abs=1e-15) and f[0].item() == pytest.approx(0.9, abs=1e-15)
    eps_fairseq = eps * (V - 1) / V
    z = torch.randn(3, V, generator=gen(0), dtype=torch.float64)
    y = torch.tensor([0, 5, 7])
    torch.testing.assert_close(label_smoothing_loss(z, y, eps), label_smoothing_loss(z, y, eps_fairseq, "fairseq"),
                               **F64)
    gap = math.log(t[0].item() / t[1].item())
    optimum = torch.full((1, V), 0.0, dtype=torch.float64)
    optimum[0, 0] = gap
    optimum.requires_grad_(True)
    label_smoothing_loss(optimum, y[:1], eps).backward()
    assert optimum.grad.abs().max().item() < 1e-12  # the smoothed loss is stationary at this gap
    stated += ["0.900003125", f"{eps_fairseq:.9f}", f"{gap:.4f}", "288001"]
    assert round(t[0].item() / t[1].item()) == 288001
    # 2. focal loss factors at p_t = 0.5, 0.9, 0.99
    for p_t, factor in ((0.5, "4"), (0.9, "100"), (0.99, "10,000")):
        z2 = torch.tensor([[math.log(p_t), math.log(1 - p_t)]], dtype=torch.float64)
        ratio = (focal_loss(z2, torch.tensor([0]), 0.0) / focal_loss(z2, torch.tensor([0]), 2.0)).item()
        assert f"{round(ratio):,}" == factor and ratio == pytest.approx(round(ratio), rel=1e-9)
        stated.append(factor)
    # 3. T5: 568 raw tokens give 512 encoder inputs and 114 decoder targets, with EOS
    mask = random_spans_noise_mask(568, generator=gen(1))
    x, y3 = span_corruption(torch.arange(568) + 100, mask, sentinel_start=99, eos_id=1)
    assert (len(x), len(y3), int(mask.sum())) == (512, 114, 85)
    for L in (567, 569):  # one raw token fewer or more misses 512
        x_L, _ = span_corruption(torch.arange(L) + 100, random_spans_noise_mask(L, generator=gen(1)), 99, 1)
        assert len(x_L) != 512
    stated += ["568", "512", "114", "85", "28"]
    # 4. a collapsed encoder scores log B
    for B, text in ((256, "5.5452"), (32768, "10.3972")):
        if B <= 256:
            loss = info_nce(torch.ones(B, 8), torch.ones(B, 8), tau=0.07).item()
            assert loss == pytest.approx(math.log(B), rel=1e-6)
        assert f"{math.log(B):.4f}" == text
        stated.append(text)
    assert_states("07-losses.ipynb", stated)
