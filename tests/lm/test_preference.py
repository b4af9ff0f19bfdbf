"""Chapter 10, preference losses (10.02, 10.03, 10.08-10.13), claim C14, and the sequence log-prob helper.

Oracles: ``torch.nn.functional`` (``logsigmoid``, ``binary_cross_entropy_with_logits``), trl 1.16's own
loss code (``DPOTrainer.compute_loss`` on a trainer skeleton, ``ORPOTrainer.odds_ratio_loss``,
``CPOTrainer.cpo_loss`` with ``loss_type="simpo"``, ``ORPOTrainer.get_batch_logps``), float64 closed
forms written from the papers, and autograd.

Tolerances, stated once: float64 against an oracle ``rtol = atol = 1e-12`` (``F64``); float32
against a float64 reference relative ``1e-6`` (``F32``).
"""

import copy
import math
import os
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from llmbook.lm import preference as pf
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.rlhf import kl_regularized_objective, optimal_policy

F64 = dict(rtol=1e-12, atol=1e-12)
F32 = dict(rtol=1e-6, atol=1e-6)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def logps(B=16, seed=0, scale=20.0):
    """Four (B,) tensors of negative sequence log-probabilities: policy w, l, reference w, l (float64)."""
    g = gen(seed)
    return [-scale * torch.rand(B, generator=g, dtype=torch.float64) for _ in range(4)]


def quiet_trl(name):
    """Import a trl trainer (it prints a harmless notice about an optional kernels package on CPU)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import
    trl = pytest.importorskip("trl")
    if name == "ORPOTrainer":
        from trl.experimental.orpo import ORPOTrainer
        return ORPOTrainer
    if name == "CPOTrainer":
        from trl.experimental.cpo import CPOTrainer
        return CPOTrainer
    return getattr(trl, name)


# --------------------------------------------------------------------------- the helper


def test_sequence_log_probs_matches_trl_get_batch_logps():
    """trl shifts inside (labels[:, 1:], logits[:, :-1]); ours takes them aligned. Sum and average."""
    ORPOTrainer = quiet_trl("ORPOTrainer")
    g = gen(1)
    logits = 3 * torch.randn(4, 9, 13, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 13, (4, 9), generator=g)
    labels[:, :3] = -100  # prompt
    labels[1, -2:] = -100  # padding
    for average in (False, True):
        theirs = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
        ours = pf.sequence_log_probs(logits[:, :-1], labels[:, 1:], average=average)
        torch.testing.assert_close(ours, theirs, **F64)


def test_sequence_log_probs_against_cross_entropy_and_errors():
    g = gen(2)
    logits = torch.randn(3, 6, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 6), generator=g)
    labels[:, :2] = -100
    ref = -F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100).sum(-1)
    torch.testing.assert_close(pf.sequence_log_probs(logits, labels), ref, **F64)
    labels[0] = -100
    assert pf.sequence_log_probs(logits, labels)[0] == 0  # nothing counted: log 1
    with pytest.raises(ValueError, match="counted label"):
        pf.sequence_log_probs(logits, labels, average=True)
    with pytest.raises(TypeError):
        pf.sequence_log_probs(logits, labels.double())


# --------------------------------------------------------------------------- 10.02, 10.03


@pytest.mark.equation("10.02", oracle="exp(-F.binary_cross_entropy_with_logits(r_w - r_l, 1)); float64 1/(1+e^-x)")
def test_bradley_terry():
    g = gen(3)
    r_w, r_l = (5 * torch.randn(50, generator=g, dtype=torch.float64) for _ in range(2))
    P = pf.bradley_terry(r_w, r_l)
    bce = F.binary_cross_entropy_with_logits(r_w - r_l, torch.ones(50, dtype=torch.float64), reduction="none")
    torch.testing.assert_close(P, torch.exp(-bce), **F64)
    torch.testing.assert_close(P, 1 / (1 + torch.exp(-(r_w - r_l))), **F64)
    torch.testing.assert_close(P + pf.bradley_terry(r_l, r_w), torch.ones(50, dtype=torch.float64), **F64)
    torch.testing.assert_close(pf.bradley_terry(r_w + 7.0, r_l + 7.0), P, **F64)  # a per-prompt shift cancels
    assert pf.bradley_terry(torch.tensor([200.0]), torch.tensor([-200.0])).item() == 1.0  # no overflow
    with pytest.raises(ValueError, match="same shape"):
        pf.bradley_terry(r_w, r_l[:3])


@pytest.mark.equation("10.03", oracle="F.binary_cross_entropy_with_logits(r_w - r_l - m, ones); -F.logsigmoid")
def test_reward_model_loss():
    g = gen(4)
    r_w, r_l = (3 * torch.randn(40, generator=g, dtype=torch.float64) for _ in range(2))
    ones = torch.ones(40, dtype=torch.float64)
    for m in (0.0, 1.5):
        ref = F.binary_cross_entropy_with_logits(r_w - r_l - m, ones)
        torch.testing.assert_close(pf.reward_model_loss(r_w, r_l, margin=m), ref, **F64)
    torch.testing.assert_close(pf.reward_model_loss(r_w, r_l, reduction="none"), -F.logsigmoid(r_w - r_l), **F64)
    assert pf.reward_model_loss(torch.tensor([-1e4]), torch.tensor([1e4])).item() == pytest.approx(2e4)
    with pytest.raises(ValueError, match="reduction"):
        pf.reward_model_loss(r_w, r_l, reduction="avg")


# --------------------------------------------------------------------------- 10.08, 10.09 and the trl cross-check


class _FusedHeadLM(torch.nn.Module):
    """Stands in for a causal LM wrapped by trl's fused head: returns per-token log-probs of the labels."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, use_cache=False):
        lp = torch.log_softmax(self.logits[:, :-1], -1)  # torch's own log-softmax, not llmbook's
        target = labels[:, 1:]
        tok = lp.gather(-1, target.clamp_min(0)[..., None])[..., 0] * (target != -100)
        zeros = torch.zeros_like(tok)
        return types.SimpleNamespace(log_probs=tok, entropy=zeros, mean_logits=zeros,
                                     is_top1=torch.zeros_like(tok, dtype=torch.bool))


def trl_dpo_loss(logits, input_ids, completion_mask, ref_w, ref_l, beta, loss_type="sigmoid"):
    """trl 1.16's ``DPOTrainer.compute_loss`` on a trainer skeleton (no ``__init__``: that would need a Hub model).

    Only the attributes ``_compute_loss`` reads are set; reference log-probs are passed precomputed
    (``precompute_ref_logps``), as trl does when the reference is evaluated once before training."""
    DPOTrainer = quiet_trl("DPOTrainer")
    trainer = DPOTrainer.__new__(DPOTrainer)
    acc = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer.__dict__.update(model=_FusedHeadLM(logits), accelerator=acc, aux_loss_enabled=False, ld_alpha=None,
                            precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
                            loss_weights=[1.0], beta=beta, use_weighting=False, _total_train_tokens=0, _tp_size=1,
                            _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=completion_mask,
                  ref_chosen_logps=ref_w, ref_rejected_logps=ref_l)
    return trainer.compute_loss(trainer.model, inputs), trainer._metrics["train"]


def dpo_batch(B=3, T=10, V=11, seed=5):
    g = gen(seed)
    ids = torch.randint(0, V, (2 * B, T), generator=g)  # rows: B chosen, then B rejected
    logits = 2 * torch.randn(2 * B, T, V, generator=g, dtype=torch.float64)
    completion = torch.zeros(2 * B, T, dtype=torch.long)
    completion[:, 4:] = 1
    completion[0, -2:] = 0  # a padded chosen response
    ref = -10 * torch.rand(2 * B, generator=g, dtype=torch.float64)
    labels = ids.masked_fill(completion == 0, -100)[:, 1:]
    lp = pf.sequence_log_probs(logits[:, :-1], labels)
    return ids, logits, completion, ref, lp


@pytest.mark.equation("10.09", oracle="trl 1.16 DPOTrainer.compute_loss (loss_type='sigmoid') on the same logits")
def test_dpo_loss_matches_trl_dpo_trainer():
    B = 3
    ids, logits, completion, ref, lp = dpo_batch(B)
    for beta in (0.1, 0.5):
        theirs, metrics = trl_dpo_loss(logits, ids, completion, ref[:B], ref[B:], beta)
        ours = pf.dpo_loss(lp[:B], lp[B:], ref[:B], ref[B:], beta=beta)
        torch.testing.assert_close(ours, theirs, **F64)
        margin = (pf.dpo_implicit_reward(lp[:B], ref[:B], beta) - pf.dpo_implicit_reward(lp[B:], ref[B:], beta))
        assert margin.mean().item() == pytest.approx(metrics["rewards/margins"][-1], abs=1e-12)


@pytest.mark.equation("10.08", oracle="trl DPOTrainer's logged rewards/chosen; float64 beta (log pi - log pi_ref)")
def test_dpo_implicit_reward():
    B = 3
    ids, logits, completion, ref, lp = dpo_batch(B)
    _, metrics = trl_dpo_loss(logits, ids, completion, ref[:B], ref[B:], 0.2)
    r = pf.dpo_implicit_reward(lp[:B], ref[:B], beta=0.2)
    assert r.mean().item() == pytest.approx(metrics["rewards/chosen"][-1], abs=1e-12)
    lw, _, rw, _ = logps()
    torch.testing.assert_close(pf.dpo_implicit_reward(lw, rw, 0.3), 0.3 * (lw - rw), **F64)
    with pytest.raises(ValueError, match="beta"):
        pf.dpo_implicit_reward(lw, rw, 0.0)


@pytest.mark.equation("10.09", oracle="float64 closed form log(1 + exp(-beta h)); autograd: no grad to reference")
def test_dpo_loss_closed_form_and_gradient():
    lw, ll, rw, rl = logps()
    h = (lw - rw) - (ll - rl)
    torch.testing.assert_close(pf.dpo_loss(lw, ll, rw, rl, beta=0.2, reduction="none"),
                               torch.log1p(torch.exp(-0.2 * h)), **F64)
    torch.testing.assert_close(pf.dpo_loss(lw, ll, lw, ll), torch.tensor(math.log(2), dtype=torch.float64), **F64)
    # the gradient: d/d logp_w = -beta sigma(-beta h) / B (by hand), and d/d logp_l its negative
    lw_, ll_ = lw.clone().requires_grad_(), ll.clone().requires_grad_()
    pf.dpo_loss(lw_, ll_, rw, rl, beta=0.2).backward()
    torch.testing.assert_close(lw_.grad, -0.2 * torch.sigmoid(-0.2 * h) / len(h), **F64)
    torch.testing.assert_close(ll_.grad, -lw_.grad, **F64)
    # float32 agrees with float64
    torch.testing.assert_close(pf.dpo_loss(*(t.float() for t in (lw, ll, rw, rl))).double(),
                               pf.dpo_loss(lw, ll, rw, rl), **F32)


# --------------------------------------------------------------------------- 10.10 - 10.13


@pytest.mark.equation("10.10", oracle="trl DPOTrainer.compute_loss loss_type='ipo' (per-token); float64 closed form")
def test_ipo_loss():
    B = 3
    ids, logits, completion, ref, lp = dpo_batch(B, seed=6)
    n = completion[:, 1:].sum(-1).double()  # response lengths, as trl counts them
    theirs, _ = trl_dpo_loss(logits, ids, completion, ref[:B], ref[B:], 0.4, loss_type="ipo")
    ours = pf.ipo_loss(lp[:B] / n[:B], lp[B:] / n[B:], ref[:B] / n[:B], ref[B:] / n[B:], beta=0.4)
    torch.testing.assert_close(ours, theirs, **F64)
    lw, ll, rw, rl = logps()
    h = torch.log(torch.exp(lw) * torch.exp(rl) / (torch.exp(ll) * torch.exp(rw)))  # the equation as written
    torch.testing.assert_close(pf.ipo_loss(lw, ll, rw, rl, beta=0.25), ((h - 2.0) ** 2).mean(), rtol=1e-10, atol=1e-10)
    # the minimum sits at the target margin 1 / (2 beta), where DPO's loss keeps falling
    assert pf.ipo_loss(torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                       beta=0.25).item() == 0.0


@pytest.mark.equation("10.11", oracle="float64 closed form of KTO (Ethayarajh 2024, eq. 7-8) as trl writes it")
def test_kto_loss():
    g = gen(7)
    lp, ref = (-20 * torch.rand(30, generator=g, dtype=torch.float64) for _ in range(2))
    d = torch.rand(30, generator=g) < 0.5
    beta, z, lD, lU = 0.3, 0.7, 1.0, 1.33
    logratio = lp - ref
    ref_loss = torch.where(d, lD * (1 - torch.sigmoid(beta * (logratio - z))),
                           lU * (1 - torch.sigmoid(beta * (z - logratio))))
    ours = pf.kto_loss(lp, ref, d, z_ref=z, beta=beta, lambda_D=lD, lambda_U=lU, reduction="none")
    torch.testing.assert_close(ours, ref_loss, **F64)
    v = pf.dpo_implicit_reward(lp, ref, beta)  # the utility is the implicit reward
    torch.testing.assert_close(ours, torch.where(d, lD - lD * torch.sigmoid(v - beta * z),
                                                 lU - lU * torch.sigmoid(beta * z - v)), **F64)
    with pytest.raises(TypeError, match="bool"):
        pf.kto_loss(lp, ref, d.long())
    with pytest.raises(ValueError, match="z_ref"):
        pf.kto_loss(lp, ref, d, z_ref=-1.0)


@pytest.mark.equation("10.12", oracle="trl 1.16 ORPOTrainer.odds_ratio_loss; float64 log(p/(1-p)) closed form")
def test_orpo_loss():
    ORPOTrainer = quiet_trl("ORPOTrainer")
    g = gen(8)
    lw, ll = (-3 * torch.rand(25, generator=g, dtype=torch.float64) for _ in range(2))
    lw[0], ll[1] = -1e-9, -40.0  # p near 1 and near 0: the two branches of log(1 - p)
    nll = torch.rand(25, generator=g, dtype=torch.float64)
    lam = 0.25
    skeleton = types.SimpleNamespace(beta=lam, accelerator=types.SimpleNamespace(device="cpu"))
    trl_losses, *_ = ORPOTrainer.odds_ratio_loss(skeleton, lw, ll)  # lam * logsigmoid(log odds ratio), float32
    ours = pf.orpo_loss(lw, ll, nll, lam=lam, reduction="none")
    torch.testing.assert_close(ours, nll - trl_losses.double(), rtol=1e-6, atol=1e-6)  # trl computes in float32
    pw, pl = torch.exp(lw), torch.exp(ll)
    closed = nll - lam * F.logsigmoid(torch.log(pw / (1 - pw)) - torch.log(pl / (1 - pl)))
    torch.testing.assert_close(ours[1:], closed[1:], **F64)  # 1 - p at p = 1 - 1e-9 loses digits in the closed form
    with pytest.raises(ValueError, match="<= 0"):
        pf.orpo_loss(-lw, ll, nll)


@pytest.mark.equation("10.13", oracle="trl 1.16 CPOTrainer.cpo_loss (loss_type='simpo'); float64 closed form")
def test_simpo_loss():
    CPOTrainer = quiet_trl("CPOTrainer")
    g = gen(9)
    lw, ll = (-30 * torch.rand(20, generator=g, dtype=torch.float64) for _ in range(2))
    nw, nl = (torch.randint(1, 40, (20,), generator=g) for _ in range(2))
    beta, gamma = 2.5, 1.4
    skeleton = types.SimpleNamespace(alpha=0.0, beta=beta, loss_type="simpo", simpo_gamma=gamma, label_smoothing=0.0,
                                     accelerator=types.SimpleNamespace(device="cpu"))
    theirs, *_ = CPOTrainer.cpo_loss(skeleton, lw / nw, ll / nl)  # trl passes length-averaged log-probs
    ours = pf.simpo_loss(lw, ll, nw, nl, beta=beta, gamma=gamma, reduction="none")
    torch.testing.assert_close(ours, theirs, **F64)
    closed = torch.log1p(torch.exp(-(beta * lw / nw - beta * ll / nl - gamma)))
    torch.testing.assert_close(ours, closed, **F64)
    with pytest.raises(ValueError, match="len_w"):
        pf.simpo_loss(lw, ll, nw * 0, nl)


# --------------------------------------------------------------------------- claim C14


def discrete_problem(n_x=5, n_y=8, seed=10):
    g = gen(seed)
    log_pi_ref = torch.log_softmax(torch.randn(n_x, n_y, generator=g, dtype=torch.float64), -1)
    r = 2 * torch.randn(n_x, n_y, generator=g, dtype=torch.float64)
    return log_pi_ref, r


def test_claim_c14_closed_form_optimum_and_dpo():
    """pi* maximises the KL objective; beta log(pi*/pi_ref) = r - const(x); DPO loss at pi* = BT loss of r."""
    beta = 0.5
    log_pi_ref, r = discrete_problem()
    log_pi_star = optimal_policy(log_pi_ref, r, beta)
    # oracle 1: brute-force normalisation of pi_ref exp(r / beta), in float64
    unnorm = torch.exp(log_pi_ref) * torch.exp(r / beta)
    torch.testing.assert_close(log_pi_star.exp(), unnorm / unnorm.sum(-1, keepdim=True), **F64)
    # pi* is the maximiser: its value is beta log Z, and no random policy does better
    J_star = kl_regularized_objective(r, log_pi_star, log_pi_ref, beta)
    torch.testing.assert_close(J_star, beta * torch.log(unnorm.sum(-1)), **F64)
    g = gen(11)
    for _ in range(200):
        noise = 0.5 * torch.randn(log_pi_star.shape, generator=g, dtype=torch.float64)
        other = torch.log_softmax(log_pi_star + noise, -1)
        assert (kl_regularized_objective(r, other, log_pi_ref, beta) <= J_star + 1e-12).all()
    # the implicit reward recovers r up to a per-prompt constant (the same for every response of a prompt)
    implicit = pf.dpo_implicit_reward(log_pi_star, log_pi_ref, beta)
    offset = r - implicit
    torch.testing.assert_close(offset, offset[:, :1].expand_as(offset), **F64)
    torch.testing.assert_close(offset[:, 0], beta * torch.log(unnorm.sum(-1)), **F64)  # C(x) = beta log Z(x)
    # every ordered pair (w, l) of every prompt: DPO loss at pi* equals the Bradley-Terry loss of r
    x, w, l = torch.meshgrid(torch.arange(5), torch.arange(8), torch.arange(8), indexing="ij")
    x, w, l = x.flatten(), w.flatten(), l.flatten()
    dpo = pf.dpo_loss(log_pi_star[x, w], log_pi_star[x, l], log_pi_ref[x, w], log_pi_ref[x, l], beta=beta,
                      reduction="none")
    bt = -F.logsigmoid(r[x, w] - r[x, l])  # F.logsigmoid, not llmbook
    torch.testing.assert_close(dpo, bt, **F64)


def test_claim_c14_reference_stays_frozen_while_dpo_trains_the_policy():
    """Adam steps of DPO on a small TinyGPT: the loss starts at log 2 and falls, the policy's weights move,
    and the frozen deep copy that supplies the reference log-probabilities is bit-for-bit unchanged."""
    torch.manual_seed(0)
    policy = TinyGPT(GPTConfig(vocab_size=12, d_model=16, n_layers=1, n_heads=2, d_ff=32))
    reference = copy.deepcopy(policy).requires_grad_(False)
    ref_before = {k: v.clone() for k, v in reference.state_dict().items()}
    pol_before = {k: v.clone() for k, v in policy.state_dict().items()}
    g = gen(12)
    seq_w, seq_l = (torch.randint(0, 12, (8, 9), generator=g) for _ in range(2))

    def logp(model, seq):  # prompt of 4 tokens, response of 4: only the response's labels count
        labels = seq[:, 1:].clone()
        labels[:, :3] = -100
        return pf.sequence_log_probs(model(seq[:, :-1]), labels)

    with torch.no_grad():
        ref_w, ref_l = logp(reference, seq_w), logp(reference, seq_l)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = pf.dpo_loss(logp(policy, seq_w), logp(policy, seq_l), ref_w, ref_l, beta=0.5)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    assert losses[-1] < losses[0] - 0.01
    assert all(torch.equal(v, ref_before[k]) for k, v in reference.state_dict().items())
    assert all(p.grad is None for p in reference.parameters())
    assert not all(torch.equal(v, pol_before[k]) for k, v in policy.state_dict().items())


def test_kl_objective_at_reference_is_expected_reward():
    log_pi_ref, r = discrete_problem()
    J = kl_regularized_objective(r, log_pi_ref, log_pi_ref, 0.3)
    torch.testing.assert_close(J, (log_pi_ref.exp() * r).sum(-1), **F64)


def test_try_it_dpo_gradient_weights():
    """Try it 3: the gradient of the DPO loss w.r.t. log pi(y_w) for margins +20 and -20 nats (beta = 0.1)."""
    from tests.try_it import assert_states

    logp_w = torch.tensor([20.0, -20.0], dtype=torch.float64, requires_grad=True)  # margins h = +20 and -20
    zero = torch.zeros(2, dtype=torch.float64)
    pf.dpo_loss(logp_w, zero, zero, zero, beta=0.1, reduction="sum").backward()
    torch.testing.assert_close(logp_w.grad, -0.1 * torch.sigmoid(-0.1 * logp_w.detach()), **F64)  # the closed form
    ratio = (logp_w.grad[1] / logp_w.grad[0]).item()
    assert ratio == pytest.approx(math.exp(2), rel=1e-12)
    stated = [f"{g:.4f}".replace("-", "−") for g in logp_w.grad.tolist()] + [f"{ratio:.2f}"]
    assert_states("10-alignment.ipynb", stated)


@pytest.mark.parametrize("call,err", [
    (lambda: pf.dpo_loss(*logps(4), beta=0.0), ValueError),
    (lambda: pf.dpo_loss(*logps(4)[:3], torch.zeros(5)), ValueError),
    (lambda: pf.dpo_loss(*logps(4)[:3], torch.tensor([0.0, math.nan, 0.0, 0.0])), ValueError),
    (lambda: pf.dpo_loss(*logps(4)[:3], torch.tensor([True, False, True, True])), TypeError),
    (lambda: pf.dpo_loss(*(torch.zeros(0) for _ in range(4))), ValueError),  # a mean over no pair
    (lambda: pf.ipo_loss(*logps(4), reduction="avg"), ValueError),
    (lambda: pf.kto_loss(torch.zeros(3), torch.zeros(3), torch.ones(4, dtype=torch.bool)), ValueError),
    (lambda: pf.orpo_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), lam=-0.1), ValueError),
    (lambda: pf.simpo_loss(*logps(4)[:2], torch.ones(4), torch.ones(4), gamma=-1.0), ValueError),
    (lambda: pf.bradley_terry(torch.tensor([math.inf]), torch.tensor([0.0])), ValueError),
    (lambda: pf.reward_model_loss(torch.zeros(2), torch.zeros(2), margin="1"), TypeError),
])
def test_preference_bad_input_raises_clearly(call, err):
    with pytest.raises(err):
        call()


def test_low_precision_is_computed_in_float32():
    """bf16 inputs: the loss is computed in float32 and rounded once (within bf16's epsilon of float64)."""
    lw, ll, rw, rl = logps(64, seed=20)
    ref = pf.dpo_loss(lw, ll, rw, rl)
    out = pf.dpo_loss(*(t.bfloat16() for t in (lw, ll, rw, rl)))
    assert out.dtype == torch.bfloat16
    ref_rounded = pf.dpo_loss(*(t.bfloat16().double() for t in (lw, ll, rw, rl)))  # same rounded inputs, float64
    assert abs(out.double() - ref_rounded).item() <= 2**-8 * abs(ref_rounded).item()
    assert abs(out.double() - ref).item() < 0.05
