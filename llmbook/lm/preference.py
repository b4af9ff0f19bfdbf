r"""Preference optimisation (chapter 10): Bradley-Terry, the reward-model loss, DPO and its relatives.

Every loss here takes **sequence log-probabilities**, one number per response: :math:`\log\pi(y\mid x)`,
the sum of the token log-probabilities of the response given the prompt (the prompt's own tokens do
not count). :func:`sequence_log_probs` computes them from a model's token logits, with the prompt
and padding marked by ``ignore_index`` in the labels, as in ``transformers`` and ``trl``. Shapes
are batch-first: ``(B,)`` for ``B`` preference pairs (``w`` the chosen, ``l`` the rejected response),
and the reductions are ``"mean"`` over pairs (the expectation of the equations), ``"sum"`` or
``"none"``. fp16 and bf16 inputs are computed in float32 and the result is rounded back once.

The policy-gradient side of alignment (SFT, the KL-regularised objective, PPO, GAE, GRPO, RLOO,
rejection sampling) is in :mod:`llmbook.lm.rlhf`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_range,
    check_real,
    check_same_shape,
)
from llmbook._precision import compute_dtype, restore_half
from llmbook.lm.losses import reduce_loss
from llmbook.lm.probability import token_log_probs
from llmbook.registry import implements

__all__ = [
    "sequence_log_probs",
    "bradley_terry",
    "reward_model_loss",
    "dpo_implicit_reward",
    "dpo_loss",
    "ipo_loss",
    "kto_loss",
    "orpo_loss",
    "simpo_loss",
]


def sequence_log_probs(logits: Float[Tensor, "B T V"], labels: Int[Tensor, "B T"], ignore_index: int = -100,
                       average: bool = False) -> Float[Tensor, " B"]:
    r"""Sequence log-probabilities :math:`\log\pi(y\mid x) = \sum_t \log\pi(y_t\mid x, y_{<t})` from token logits.

    ``logits[b, t]`` is the model's prediction for ``labels[b, t]`` (shift the labels one step left
    of the input ids first, as :func:`~llmbook.lm.probability.token_log_probs`). Positions whose
    label is ``ignore_index`` (the prompt :math:`x` and padding) are left out. ``average=True`` divides
    by the number of counted tokens :math:`|y|` (the length-normalised form of ORPO and SimPO).
    Shapes ``(B, T, V), (B, T) -> (B,)``; a row with no counted token raises ``ValueError`` when
    averaging.

    >>> logits = torch.zeros(1, 3, 4)  # uniform over V = 4
    >>> round(sequence_log_probs(logits, torch.tensor([[-100, 2, 3]])).item(), 4)  # 2 log(1/4)
    -2.7726
    """
    ignore_index = check_int(ignore_index, "ignore_index")
    labels = as_tensor(labels, "labels", floating=False)
    keep = labels != ignore_index
    lp = token_log_probs(logits, torch.where(keep, labels, torch.zeros_like(labels)))
    total = torch.where(keep, lp, torch.zeros_like(lp)).sum(-1)  # not lp * keep: -inf * 0 is NaN
    if not average:
        return total
    n = keep.sum(-1)
    if (n == 0).any():
        raise ValueError("average=True needs at least one counted label per row; a row is all ignore_index")
    return total / n


def _pairs(names: tuple[str, ...], tensors: tuple, *, allow_neg_inf: bool = True) -> tuple[list[Tensor], torch.dtype]:
    """Checked same-shape tensors of shape ``(B,)`` (or any shape), computed in float32 for fp16/bf16.

    Returns the tensors in their common compute dtype and the dtype the result is returned in."""
    ts = [as_tensor(t, n) for n, t in zip(names, tensors, strict=True)]
    for n, t in zip(names, ts, strict=True):
        check_dim(t, n, "(B,)", min_dim=0)
        check_finite(t, n, allow_neg_inf=allow_neg_inf)
        check_same_shape(ts[0], t, names[0], n)
    out = ts[0].dtype
    for t in ts[1:]:
        out = torch.promote_types(out, t.dtype)
    return [t.to(compute_dtype(out)) for t in ts], out


@implements("10.02")
def bradley_terry(r_w: Float[Tensor, " B"], r_l: Float[Tensor, " B"]) -> Float[Tensor, " B"]:
    r"""Bradley-Terry probability that response ``w`` is preferred to ``l``.

    .. math:: P(y_w \succ y_l \mid x) = \sigma\big(r_\phi(x, y_w) - r_\phi(x, y_l)\big)

    ``r_w``, ``r_l``: the rewards :math:`r_\phi(x, y_w)`, :math:`r_\phi(x, y_l)` (any real numbers,
    same shape). Only the difference matters: adding a constant to every reward of a prompt changes
    nothing. Shapes ``(B,), (B,) -> (B,)``.

    >>> bradley_terry(torch.tensor([1.0]), torch.tensor([0.0]))
    tensor([0.7311])
    """
    (r_w, r_l), out = _pairs(("r_w", "r_l"), (r_w, r_l), allow_neg_inf=False)
    return restore_half(torch.sigmoid(r_w - r_l), out)


@implements("10.03")
def reward_model_loss(r_w: Float[Tensor, " B"], r_l: Float[Tensor, " B"], margin: float = 0.0,
                      reduction: str = "mean") -> Tensor:
    r"""The reward model's loss: the negative log-likelihood of the observed preferences under Bradley-Terry.

    .. math:: L_{RM} = -\mathbb{E}\big[\log\sigma\big(r_\phi(x, y_w) - r_\phi(x, y_l) - m\big)\big]

    ``r_w``, ``r_l``: rewards of the chosen and rejected responses, ``(B,)``. ``margin`` :math:`m`
    (Llama 2's variant, 0 in the equation) asks the chosen reward to win by at least that much.
    Computed as ``-logsigmoid``, so a large wrong-way gap costs its size instead of overflowing.

    >>> round(reward_model_loss(torch.tensor([0.0]), torch.tensor([0.0])).item(), 4)  # log 2
    0.6931
    """
    margin = check_real(margin, "margin")
    (r_w, r_l), out = _pairs(("r_w", "r_l"), (r_w, r_l), allow_neg_inf=False)
    loss = -F.logsigmoid(r_w - r_l - margin)
    return restore_half(reduce_loss(loss, None, reduction, "pair"), out)


def _beta(beta) -> float:
    return check_range(beta, "beta", 0.0, low_open=True)


@implements("10.08")
def dpo_implicit_reward(logp: Float[Tensor, " B"], ref_logp: Float[Tensor, " B"], beta: float = 0.1
                        ) -> Float[Tensor, " B"]:
    r"""DPO's implicit reward: the policy's log-ratio to the reference, scaled by :math:`\beta`.

    .. math:: r_\theta(x, y) = \beta \log\frac{\pi_\theta(y\mid x)}{\pi_{ref}(y\mid x)} + C(x)

    ``logp`` :math:`\log\pi_\theta(y\mid x)`, ``ref_logp`` :math:`\log\pi_{ref}(y\mid x)` (sequence
    log-probabilities, same shape), ``beta`` :math:`\beta > 0`. The prompt-only constant
    :math:`C(x) = \beta\log Z(x)` is not returned: it cancels in every comparison of two responses
    to the same prompt. Shapes ``(B,), (B,) -> (B,)``.

    >>> dpo_implicit_reward(torch.tensor([-3.0]), torch.tensor([-5.0]), beta=0.5)
    tensor([1.])
    """
    beta = _beta(beta)
    (logp, ref_logp), out = _pairs(("logp", "ref_logp"), (logp, ref_logp))
    return restore_half(beta * (logp - ref_logp), out)


def _margin(logp_w, logp_l, ref_logp_w, ref_logp_l):
    """The log-ratio margin h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l), and the output dtype."""
    (lw, ll, rw, rl), out = _pairs(("logp_w", "logp_l", "ref_logp_w", "ref_logp_l"),
                                   (logp_w, logp_l, ref_logp_w, ref_logp_l))
    return (lw - rw) - (ll - rl), out


@implements("10.09")
def dpo_loss(logp_w: Float[Tensor, " B"], logp_l: Float[Tensor, " B"], ref_logp_w: Float[Tensor, " B"],
             ref_logp_l: Float[Tensor, " B"], beta: float = 0.1, reduction: str = "mean") -> Tensor:
    r"""Direct preference optimisation: the reward-model loss with the implicit reward in place of :math:`r_\phi`.

    .. math:: L_{DPO} = -\mathbb{E}\log\sigma\Big(\beta\log\frac{\pi_\theta(y_w\mid x)}{\pi_{ref}(y_w\mid x)}
              - \beta\log\frac{\pi_\theta(y_l\mid x)}{\pi_{ref}(y_l\mid x)}\Big)

    ``logp_w``, ``logp_l``: sequence log-probabilities of the chosen and rejected responses under the
    policy :math:`\pi_\theta`; ``ref_logp_w``, ``ref_logp_l``: the same under the frozen reference
    (computed without gradient); ``beta`` :math:`\beta > 0` (0.1 is common). Shapes ``(B,)`` each;
    ``reduction`` over pairs. At initialisation (:math:`\pi_\theta = \pi_{ref}`) the loss is
    :math:`\log 2`.

    >>> lw, ll = torch.tensor([-4.0]), torch.tensor([-6.0])
    >>> round(dpo_loss(lw, ll, lw, ll).item(), 4)  # policy = reference
    0.6931
    """
    beta = _beta(beta)
    h, out = _margin(logp_w, logp_l, ref_logp_w, ref_logp_l)
    return restore_half(reduce_loss(-F.logsigmoid(beta * h), None, reduction, "pair"), out)


@implements("10.10")
def ipo_loss(logp_w: Float[Tensor, " B"], logp_l: Float[Tensor, " B"], ref_logp_w: Float[Tensor, " B"],
             ref_logp_l: Float[Tensor, " B"], beta: float = 0.1, reduction: str = "mean") -> Tensor:
    r"""Identity preference optimisation: regress the log-ratio margin onto :math:`1/(2\beta)`.

    .. math:: L_{IPO} = \mathbb{E}\Big[\Big(\log\frac{\pi_\theta(y_w\mid x)\,\pi_{ref}(y_l\mid x)}
              {\pi_\theta(y_l\mid x)\,\pi_{ref}(y_w\mid x)} - \frac{1}{2\beta}\Big)^2\Big]

    Arguments as :func:`dpo_loss` (here :math:`\beta` is the paper's :math:`\tau`). DPO's loss keeps
    falling as the margin grows, so with deterministic preferences it pushes :math:`\pi(y_l)` to zero;
    the square stops at a finite target margin. ``trl``'s ``loss_type="ipo"`` divides each
    log-ratio by its response length first: pass length-averaged log-probabilities for that variant.

    >>> lw, ll = torch.tensor([-4.0]), torch.tensor([-6.0])
    >>> ipo_loss(lw, ll, lw, ll, beta=0.5).item()  # margin 0, target 1
    1.0
    """
    beta = _beta(beta)
    h, out = _margin(logp_w, logp_l, ref_logp_w, ref_logp_l)
    return restore_half(reduce_loss((h - 1.0 / (2.0 * beta)) ** 2, None, reduction, "pair"), out)


@implements("10.11")
def kto_loss(logp: Float[Tensor, " B"], ref_logp: Float[Tensor, " B"], desirable: Bool[Tensor, " B"],
             z_ref: float = 0.0, beta: float = 0.1, lambda_D: float = 1.0, lambda_U: float = 1.0,
             reduction: str = "mean") -> Tensor:
    r"""Kahneman-Tversky optimisation: unpaired responses, each labelled desirable or undesirable.

    .. math:: v(x, y) = \beta\log\frac{\pi_\theta(y\mid x)}{\pi_{ref}(y\mid x)}, \qquad
              L_{KTO} = \mathbb{E}\big[\lambda_y - \lambda_y\,\sigma\big(\pm(v(x, y) - \beta z_{ref})\big)\big]

    with :math:`+` and :math:`\lambda_D` for a desirable response, :math:`-` and :math:`\lambda_U`
    for an undesirable one. The utility :math:`v` is DPO's implicit reward; :math:`z_{ref} \ge 0` is
    the reference point, an estimate of :math:`\mathrm{KL}(\pi_\theta\|\pi_{ref})` (the batch mean of
    :math:`\log\pi_\theta - \log\pi_{ref}` on mismatched prompt-response pairs, clamped at 0 and
    detached, in ``trl``). ``logp``, ``ref_logp`` ``(B,)``; ``desirable`` a bool tensor ``(B,)``.

    >>> lp = torch.tensor([-4.0, -4.0])
    >>> kto_loss(lp, lp, torch.tensor([True, False])).item()  # sigma(0) = 1/2 for both
    0.5
    """
    beta = _beta(beta)
    z_ref = check_range(z_ref, "z_ref", 0.0)
    lambda_D = check_range(lambda_D, "lambda_D", 0.0)
    lambda_U = check_range(lambda_U, "lambda_U", 0.0)
    (logp, ref_logp), out = _pairs(("logp", "ref_logp"), (logp, ref_logp))
    if not isinstance(desirable, torch.Tensor) or desirable.dtype != torch.bool:
        got = desirable.dtype if isinstance(desirable, torch.Tensor) else type(desirable).__name__
        raise TypeError(f"desirable must be a bool tensor (True for a desirable response), got {got}")
    check_same_shape(logp, desirable, "logp", "desirable")
    x = beta * ((logp - ref_logp) - z_ref)  # v - beta z_ref
    lam = torch.where(desirable, torch.full_like(x, lambda_D), torch.full_like(x, lambda_U))
    sign = torch.where(desirable, torch.ones_like(x), -torch.ones_like(x))
    loss = lam * torch.sigmoid(-sign * x)  # lambda (1 - sigma(+-x)) = lambda sigma(-+x), without cancellation
    return restore_half(reduce_loss(loss, None, reduction, "response"), out)


def _log_odds(logp: Tensor) -> Tensor:
    """log(p / (1 - p)) from log p <= 0, with log(1 - p) computed without cancellation (two branches)."""
    log1m = torch.where(logp < -0.6931471805599453, torch.log1p(-torch.exp(logp)), torch.log(-torch.expm1(logp)))
    return logp - log1m.clamp_min(torch.finfo(logp.dtype).min)  # p = 1: odds finfo.max, not inf - inf later


@implements("10.12")
def orpo_loss(logp_w: Float[Tensor, " B"], logp_l: Float[Tensor, " B"], nll_w: Float[Tensor, " B"],
              lam: float = 0.1, reduction: str = "mean") -> Tensor:
    r"""Odds-ratio preference optimisation: SFT on the chosen response plus an odds-ratio penalty, no reference.

    .. math:: L_{ORPO} = L_{SFT} - \lambda\log\sigma\Big(\log\frac{\pi_\theta(y_w\mid x)}{1-\pi_\theta(y_w\mid x)}
              - \log\frac{\pi_\theta(y_l\mid x)}{1-\pi_\theta(y_l\mid x)}\Big)

    ``logp_w``, ``logp_l``: log-probabilities of the chosen and rejected responses, which must be
    :math:`\le 0`; the paper (and ``trl``) use the length-averaged ones (``sequence_log_probs(...,
    average=True)``), a whole sequence's probability being too small for its odds to differ from it.
    ``nll_w``: the SFT loss of each chosen response (``(B,)``); ``lam`` :math:`\lambda \ge 0`.
    :math:`\log(1 - p)` is computed as ``log1p(-exp)`` or ``log(-expm1)``, whichever is accurate.

    >>> lw = torch.log(torch.tensor([0.5]))
    >>> round(orpo_loss(lw, lw, -lw, lam=1.0).item(), 4)  # nll log 2 + log 2
    1.3863
    """
    lam = check_range(lam, "lam", 0.0)
    (lw, ll, nll), out = _pairs(("logp_w", "logp_l", "nll_w"), (logp_w, logp_l, nll_w))
    for name, t in (("logp_w", lw), ("logp_l", ll)):
        if (t > 0).any():
            raise ValueError(f"{name} must hold log-probabilities <= 0, got a maximum of {t.max().item():.4g}")
    loss = nll - lam * F.logsigmoid(_log_odds(lw) - _log_odds(ll))
    return restore_half(reduce_loss(loss, None, reduction, "pair"), out)


@implements("10.13")
def simpo_loss(logp_w: Float[Tensor, " B"], logp_l: Float[Tensor, " B"], len_w: Float[Tensor, " B"],
               len_l: Float[Tensor, " B"], beta: float = 2.0, gamma: float = 0.5, reduction: str = "mean") -> Tensor:
    r"""Simple preference optimisation: DPO with the length-averaged log-probability as reward and no reference.

    .. math:: L_{SimPO} = -\log\sigma\Big(\frac{\beta}{|y_w|}\log\pi_\theta(y_w\mid x)
              - \frac{\beta}{|y_l|}\log\pi_\theta(y_l\mid x) - \gamma\Big)

    ``logp_w``, ``logp_l``: summed sequence log-probabilities; ``len_w``, ``len_l``: the response
    lengths :math:`|y|` in tokens (positive, int or float tensors); ``beta`` :math:`\beta > 0` (2 to
    10 in the paper), ``gamma`` :math:`\gamma \ge 0` the target reward margin. Averaging removes the
    bias towards long responses that a summed log-probability rewards.

    >>> round(simpo_loss(torch.tensor([-2.0]), torch.tensor([-6.0]), torch.tensor([2]), torch.tensor([3])).item(), 4)
    0.2014
    """
    beta = _beta(beta)
    gamma = check_range(gamma, "gamma", 0.0)
    (lw, ll, nw, nl), out = _pairs(("logp_w", "logp_l", "len_w", "len_l"), (logp_w, logp_l, len_w, len_l))
    for name, t in (("len_w", nw), ("len_l", nl)):
        if not torch.isfinite(t).all() or (t <= 0).any():
            raise ValueError(f"{name} must hold positive finite response lengths |y|")
    loss = -F.logsigmoid(beta * (lw / nw) - beta * (ll / nl) - gamma)
    return restore_half(reduce_loss(loss, None, reduction, "pair"), out)
