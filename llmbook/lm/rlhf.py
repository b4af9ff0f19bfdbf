r"""Reinforcement learning from feedback (chapter 10): SFT, the KL-regularised objective, PPO, GAE, GRPO, RLOO.

A response :math:`y` to a prompt :math:`x` is an episode whose actions are its tokens. Objectives
that an optimiser should *maximise* are named ``*_objective`` (negate them for a loss); losses are
named ``*_loss``. Per-token tensors are ``(B, T)`` with an optional bool ``mask`` (True at response
tokens); per-response tensors are ``(B,)``; a group of :math:`G` responses to one prompt lies on the
last axis, ``(..., G)``. fp16 and bf16 inputs are computed in float32 and rounded back once.

The pairwise preference losses (Bradley-Terry, reward model, DPO, IPO, KTO, ORPO, SimPO) are in
:mod:`llmbook.lm.preference`.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_broadcastable_to,
    check_dim,
    check_finite,
    check_nonempty,
    check_range,
    check_same_shape,
    check_unit_interval,
)
from llmbook._precision import compute_dtype, restore_half
from llmbook.lm.losses import reduce_loss
from llmbook.lm.preference import _pairs, sequence_log_probs
from llmbook.registry import implements

__all__ = [
    "sft_loss",
    "kl_regularized_objective",
    "optimal_policy",
    "kl_penalized_reward",
    "ppo_clip_objective",
    "value_loss",
    "gae",
    "grpo_advantages",
    "grpo_objective",
    "rloo_advantages",
    "rejection_sampling_loss",
]


@implements("10.01")
def sft_loss(logits: Float[Tensor, "B T V"], labels: Int[Tensor, "B T"], ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    r"""Supervised fine-tuning: the negative log-likelihood of demonstration responses, given their prompts.

    .. math:: L_{SFT}(\theta) = -\mathbb{E}_{(x, y)\sim D}\sum_t \log\pi_\theta(y_t\mid x, y_{1:t-1})

    ``logits`` ``(B, T, V)`` predict ``labels`` ``(B, T)`` (already shifted, as
    :func:`~llmbook.lm.preference.sequence_log_probs`); the prompt and padding carry ``ignore_index``
    so only response tokens count. The sum runs over each response; ``reduction`` ``"mean"`` averages
    over the ``B`` examples (the expectation), ``"sum"`` adds them, ``"none"`` returns ``(B,)``.
    Trainers often average per *token* instead (:func:`~llmbook.lm.objectives.causal_lm_loss`),
    which weights long responses less.

    >>> labels = torch.tensor([[-100, 1, 2]])  # one prompt token, two response tokens
    >>> round(sft_loss(torch.zeros(1, 3, 4), labels).item(), 4)  # 2 log 4
    2.7726
    """
    return reduce_loss(-sequence_log_probs(logits, labels, ignore_index), None, reduction, "example")


def _beta(beta) -> float:
    return check_range(beta, "beta", 0.0, low_open=True)


def _log_dist(x, name: str) -> Tensor:
    x = as_tensor(x, name)
    check_dim(x, name, "(..., Y)")
    check_finite(x, name, allow_neg_inf=True)
    return x


@implements("10.04")
def kl_regularized_objective(r: Float[Tensor, "... Y"], log_pi: Float[Tensor, "... Y"],
                             log_pi_ref: Float[Tensor, "... Y"], beta: float = 0.1) -> Float[Tensor, "..."]:
    r"""The RLHF objective, exactly, for a policy over an enumerable set of responses.

    .. math:: J(\pi) = \mathbb{E}_{y\sim\pi(\cdot\mid x)}\big[r(x, y)\big]
              - \beta\,D_{KL}\big(\pi(\cdot\mid x)\,\|\,\pi_{ref}(\cdot\mid x)\big)

    ``r`` the rewards of the ``Y`` responses of each prompt, ``log_pi`` and ``log_pi_ref`` log-probabilities
    over them (normalised on the last axis), ``beta`` :math:`\beta > 0`. Shapes ``(..., Y) -> (...)``.
    A language model's responses cannot be enumerated: there the expectation is estimated from samples
    with :func:`kl_penalized_reward`. The maximiser is :func:`optimal_policy`, with value
    :math:`\beta\log Z(x)`. A response the policy never produces (:math:`\log\pi = -\infty`) adds 0.

    >>> r = torch.tensor([1.0, 0.0]); lp = torch.log(torch.tensor([0.5, 0.5]))
    >>> kl_regularized_objective(r, lp, lp).item()  # E[r] = 0.5, KL = 0
    0.5
    """
    beta = _beta(beta)
    (r, log_pi, log_pi_ref), out = _pairs(("r", "log_pi", "log_pi_ref"),
                                          (_log_dist(r, "r"), _log_dist(log_pi, "log_pi"),
                                           _log_dist(log_pi_ref, "log_pi_ref")))
    pi = log_pi.exp()
    term = torch.where(pi > 0, pi * (r - beta * (log_pi - log_pi_ref)), torch.zeros_like(pi))  # 0 log 0 = 0
    return restore_half(term.sum(-1), out)


def optimal_policy(log_pi_ref: Float[Tensor, "... Y"], r: Float[Tensor, "... Y"], beta: float = 0.1
                   ) -> Float[Tensor, "... Y"]:
    r"""Log-probabilities of the maximiser of the KL-regularised objective: :math:`\pi^* \propto \pi_{ref}e^{r/\beta}`.

    .. math:: \pi^*(y\mid x) = \frac{\pi_{ref}(y\mid x)\exp(r(x, y)/\beta)}{Z(x)}, \qquad
              \beta\log\frac{\pi^*(y\mid x)}{\pi_{ref}(y\mid x)} = r(x, y) - \beta\log Z(x)

    The second identity is DPO's starting point: the reward is a policy log-ratio plus a prompt-only
    term. Shapes ``(..., Y), (..., Y) -> (..., Y)``.

    >>> optimal_policy(torch.log(torch.tensor([0.5, 0.5])), torch.tensor([0.0, 1.0]), beta=1.0).exp()
    tensor([0.2689, 0.7311])
    """
    beta = _beta(beta)
    (log_pi_ref, r), out = _pairs(("log_pi_ref", "r"), (_log_dist(log_pi_ref, "log_pi_ref"), _log_dist(r, "r")))
    return restore_half(torch.log_softmax(log_pi_ref + r / beta, dim=-1), out)


def kl_penalized_reward(r: Float[Tensor, " B"], logp: Float[Tensor, " B"], ref_logp: Float[Tensor, " B"],
                        beta: float = 0.1) -> Float[Tensor, " B"]:
    r"""The sampled reward PPO maximises, :math:`r(x, y) - \beta(\log\pi_\theta(y\mid x) - \log\pi_{ref}(y\mid x))`.

    For :math:`y \sim \pi_\theta` its expectation is :func:`kl_regularized_objective`, because
    :math:`\mathbb{E}_\pi[\log\pi - \log\pi_{ref}] = D_{KL}(\pi\|\pi_{ref})`. InstructGPT applies the
    penalty per token and adds the reward model's score at the last token. Shapes ``(B,) -> (B,)``.

    >>> kl_penalized_reward(torch.tensor([1.0]), torch.tensor([-2.0]), torch.tensor([-3.0]), beta=0.5)
    tensor([0.5000])
    """
    beta = _beta(beta)
    (r, logp, ref_logp), out = _pairs(("r", "logp", "ref_logp"), (r, logp, ref_logp))
    return restore_half(r - beta * (logp - ref_logp), out)


def _surrogate(logp, logp_old, A, eps):
    r"""Per-token :math:`\min(\rho A, \mathrm{clip}(\rho, 1-\epsilon, 1+\epsilon)A)`, :math:`\rho = \pi/\pi_{old}`."""
    rho = torch.exp(logp - logp_old)
    term = torch.minimum(rho * A, torch.clamp(rho, 1.0 - eps, 1.0 + eps) * A)
    return torch.where(A == 0, torch.zeros_like(term), term)  # rho = inf with A = 0: no signal, not NaN


def _masked_mean(term: Tensor, mask, dim=None) -> Tensor:
    """Mean of ``term`` over the True entries of ``mask`` (all when None), along ``dim`` (all axes when None)."""
    if mask is None:
        mask = torch.ones_like(term, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True at response tokens), got "
                        f"{mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    check_same_shape(term, mask, "the per-token terms", "mask")
    n = mask.sum() if dim is None else mask.sum(dim)
    if (n == 0).any():
        raise ValueError("mask selects no token (of the batch, or of a response)")
    total = torch.where(mask, term, torch.zeros_like(term))
    return (total.sum() if dim is None else total.sum(dim)) / n


@implements("10.05")
def ppo_clip_objective(logp: Float[Tensor, "B T"], logp_old: Float[Tensor, "B T"], A: Float[Tensor, "B T"],
                       eps: float = 0.2, mask: Bool[Tensor, "B T"] | None = None) -> Tensor:
    r"""PPO's clipped surrogate objective (to maximise), averaged over the response tokens.

    .. math:: L^{CLIP}(\theta) = \mathbb{E}_t\big[\min\big(\rho_t(\theta)A_t,\;
              \mathrm{clip}(\rho_t(\theta), 1-\epsilon, 1+\epsilon)A_t\big)\big], \qquad
              \rho_t = \frac{\pi_\theta(a_t\mid s_t)}{\pi_{\theta_{old}}(a_t\mid s_t)}

    ``logp`` token log-probabilities under the current policy (with gradient), ``logp_old`` under the
    policy that sampled the tokens (detached), ``A`` the advantages :math:`A_t` (e.g. :func:`gae`),
    all ``(B, T)``; ``eps`` :math:`\epsilon` in ``[0, 1]``; ``mask`` bool ``(B, T)``, True at counted
    tokens. The ratio is :math:`e^{\log\pi - \log\pi_{old}}`. The minimum takes the pessimistic side:
    once :math:`\rho` leaves :math:`[1-\epsilon, 1+\epsilon]` in the direction the advantage favours,
    the gradient is zero, so one batch cannot move the policy far.

    >>> z = torch.zeros(1, 2)
    >>> round(ppo_clip_objective(z + 1.0, z, torch.tensor([[1.0, -1.0]])).item(), 4)  # (1.2 - e) / 2
    -0.7591
    """
    eps = check_unit_interval(eps, "eps")
    (logp, logp_old, A), out = _pairs(("logp", "logp_old", "A"), (logp, logp_old, A))
    return restore_half(_masked_mean(_surrogate(logp, logp_old, A, eps), mask), out)


@implements("10.06")
def value_loss(V: Float[Tensor, "B T"], R: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"] | None = None,
               V_old: Float[Tensor, "B T"] | None = None, eps_v: float = 0.2) -> Tensor:
    r"""The critic's regression loss towards the returns, averaged over the counted tokens.

    .. math:: L_V = \mathbb{E}_t\big[(V_\psi(s_t) - R_t)^2\big]

    ``V`` the value head's predictions, ``R`` the returns :math:`R_t = \hat A_t + V_{old}(s_t)` (targets,
    detached), ``(B, T)``. With ``V_old`` (the values when the batch was sampled) the loss is PPO2's
    clipped form :math:`\max\big((V - R)^2, (V_{old} + \mathrm{clip}(V - V_{old}, \pm\epsilon_v) - R)^2\big)`
    (``trl`` multiplies it by 1/2, as its ``vf_coef`` convention).

    >>> value_loss(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 0.0]])).item()
    2.5
    """
    eps_v = check_range(eps_v, "eps_v", 0.0)
    names, ts = ("V", "R"), (V, R)
    if V_old is not None:
        names, ts = (*names, "V_old"), (*ts, V_old)
    vals, out = _pairs(names, ts, allow_neg_inf=False)
    loss = (vals[0] - vals[1]) ** 2
    if V_old is not None:
        V_clip = vals[2] + torch.clamp(vals[0] - vals[2], -eps_v, eps_v)
        loss = torch.maximum(loss, (V_clip - vals[1]) ** 2)
    return restore_half(_masked_mean(loss, mask), out)


@implements("10.07")
def gae(r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"], gamma: float = 1.0, lam: float = 0.95
        ) -> Float[Tensor, "B T"]:
    r"""Generalised advantage estimation: an exponentially weighted sum of TD errors.

    .. math:: \hat A_t = \sum_{l=0}^{T-t-1}(\gamma\lambda)^l\,\delta_{t+l}, \qquad
              \delta_t = r_t + \gamma V(s_{t+1}) - V(s_t)

    ``r`` the per-token rewards ``(B, T)``; ``V`` the values ``(B, T + 1)``, whose last column is the
    bootstrap value of the state after the last token (0 when the episode ended, as a finished
    response does); ``gamma`` :math:`\gamma` and ``lam`` :math:`\lambda` in ``[0, 1]``. Computed
    backwards in one pass: :math:`\hat A_t = \delta_t + \gamma\lambda\hat A_{t+1}`. :math:`\lambda = 0`
    gives the one-step TD error (low variance, biased by :math:`V`), :math:`\lambda = 1` the Monte-Carlo
    return minus :math:`V(s_t)` (unbiased, high variance). The returns for :func:`value_loss` are
    :math:`\hat A_t + V(s_t)`. RLHF codes usually take :math:`\gamma = 1`. Responses of different
    lengths: pad ``r`` and ``V`` with zeros after each end; :math:`\delta` is 0 there, and the last
    real token bootstraps from :math:`V = 0`, as a finished episode should.

    >>> gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 3), gamma=1.0, lam=1.0)
    tensor([[1., 1.]])
    """
    gamma = check_unit_interval(gamma, "gamma")
    lam = check_unit_interval(lam, "lam")
    r, V = as_tensor(r, "r"), as_tensor(V, "V")
    check_dim(r, "r", "(B, T)", min_dim=2, max_dim=2)
    check_dim(V, "V", "(B, T + 1)", min_dim=2, max_dim=2)
    if V.shape != (r.shape[0], r.shape[1] + 1):
        raise ValueError(f"V must have shape (B, T + 1) = {(r.shape[0], r.shape[1] + 1)} for r of shape "
                         f"(B, T) = {tuple(r.shape)} (the last column bootstraps), got {tuple(V.shape)}")
    for name, t in (("r", r), ("V", V)):
        check_finite(t, name)
    out = torch.promote_types(r.dtype, V.dtype)
    r, V = r.to(compute_dtype(out)), V.to(compute_dtype(out))
    delta = r + gamma * V[:, 1:] - V[:, :-1]
    A = torch.zeros_like(delta)
    running = torch.zeros_like(V[:, 0])  # (B,); T = 0 returns an empty (B, 0)
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running
        A[:, t] = running
    return restore_half(A, out)


def _group(r, name="r", min_G: int = 2) -> tuple[Tensor, torch.dtype]:
    r = as_tensor(r, name)
    check_dim(r, name, "(..., G)")
    check_finite(r, name)
    if r.shape[-1] < min_G:
        raise ValueError(f"{name} must hold a group of G >= {min_G} responses on its last axis, got shape "
                         f"{tuple(r.shape)}")
    return r.to(compute_dtype(r.dtype)), r.dtype


@implements("10.14")
def grpo_advantages(r: Float[Tensor, "... G"], eps: float = 1e-4) -> Float[Tensor, "... G"]:
    r"""GRPO's group-relative advantage: each response's reward standardised within its group.

    .. math:: \hat A_i = \frac{r_i - \mathrm{mean}(r_{1:G})}{\mathrm{std}(r_{1:G})}

    ``r`` the rewards of :math:`G \ge 2` responses to the same prompt, on the last axis ``(..., G)``.
    ``std`` is the sample standard deviation (Bessel's :math:`G - 1`, as ``torch.std`` in DeepSeekMath's
    and ``trl``'s code), ``eps`` is added to it; a group of equal rewards gets :math:`\hat A = 0` (no signal).
    The advantages of a group sum to zero: the group is its own baseline, and no value network is
    needed. Every token of response :math:`i` gets :math:`\hat A_i`.

    >>> grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    tensor([ 0.8660, -0.8660, -0.8660,  0.8660])
    """
    eps = check_range(eps, "eps", 0.0)
    r, out = _group(r)
    centred = r - r.mean(-1, keepdim=True)
    std = ((centred**2).sum(-1, keepdim=True) / (r.shape[-1] - 1)).sqrt()  # Bessel's G - 1, as torch.std
    A = centred / (std + eps)
    return restore_half(torch.where(centred == 0, torch.zeros_like(A), A), out)  # equal rewards: 0, even at eps = 0


@implements("10.15")
def grpo_objective(logp: Float[Tensor, "G T"], logp_old: Float[Tensor, "G T"], logp_ref: Float[Tensor, "G T"],
                   A: Float[Tensor, " G"], eps: float = 0.2, beta: float = 0.04,
                   mask: Bool[Tensor, "G T"] | None = None) -> Tensor:
    r"""GRPO's objective (to maximise): PPO's clipped surrogate with group advantages, minus a KL penalty.

    .. math:: J_{GRPO} = \mathbb{E}\Big[\frac{1}{G}\sum_{i=1}^{G}\frac{1}{|o_i|}\sum_t\Big(\min\big(\rho_{i,t}\hat A_i,
              \mathrm{clip}(\rho_{i,t}, 1-\epsilon, 1+\epsilon)\hat A_i\big)
              - \beta\,\hat D_{KL}\big(\pi_\theta\|\pi_{ref}\big)_{i,t}\Big)\Big]

    ``logp``, ``logp_old``, ``logp_ref``: token log-probabilities ``(G, T)`` of the :math:`G` responses
    under the policy, the sampling policy and the frozen reference; ``A`` ``(G,)`` from
    :func:`grpo_advantages`; ``mask`` bool ``(G, T)`` (response tokens). The KL term is the per-token
    estimator :math:`\pi_{ref}/\pi_\theta - \log(\pi_{ref}/\pi_\theta) - 1 \ge 0` of DeepSeekMath; the
    clipped term is the same code as :func:`ppo_clip_objective`. Each response's tokens are averaged
    first, then the group (the paper's :math:`1/|o_i|`); ``beta = 0`` drops the penalty, as recent
    recipes do.

    >>> z = torch.zeros(2, 3)
    >>> grpo_objective(z, z, z, torch.tensor([1.0, -1.0])).item()  # rho = 1, KL = 0: mean advantage
    0.0
    """
    eps = check_unit_interval(eps, "eps")
    beta = check_range(beta, "beta", 0.0)
    (logp, logp_old, logp_ref), out = _pairs(("logp", "logp_old", "logp_ref"), (logp, logp_old, logp_ref))
    check_dim(logp, "logp", "(G, T)", min_dim=2, max_dim=2)
    check_nonempty(logp, "logp", dim=0)  # a group of no response has no mean
    (A,), out_a = _pairs(("A",), (A,), allow_neg_inf=False)
    if A.shape != logp.shape[:1]:
        raise ValueError(f"A must have shape (G,) = {tuple(logp.shape[:1])}, one advantage per response, "
                         f"got {tuple(A.shape)}")
    out = torch.promote_types(out, out_a)
    logp, logp_old, logp_ref, A = (t.to(compute_dtype(out)) for t in (logp, logp_old, logp_ref, A))
    term = _surrogate(logp, logp_old, A[:, None], eps)
    if beta > 0:
        log_ratio = logp_ref - logp
        term = term - beta * (torch.exp(log_ratio) - log_ratio - 1.0)
    return restore_half(_masked_mean(term, mask, dim=-1).mean(), out)


@implements("10.16")
def rloo_advantages(r: Float[Tensor, "... k"]) -> Float[Tensor, "... k"]:
    r"""REINFORCE leave-one-out: each sample's baseline is the mean reward of the *other* samples.

    .. math:: \hat A_i = r_i - \frac{1}{k-1}\sum_{j\ne i} r_j = \frac{k}{k-1}\,(r_i - \bar r)

    ``r`` the rewards of :math:`k \ge 2` responses to one prompt, on the last axis ``(..., k)``. The
    baseline does not depend on :math:`r_i`, so the policy gradient stays unbiased; unlike GRPO there is
    no division by a standard deviation. The advantage multiplies the whole response's log-probability.

    >>> rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    tensor([ 0.6667, -0.6667, -0.6667,  0.6667])
    """
    r, out = _group(r)
    k = r.shape[-1]
    others = (r.sum(-1, keepdim=True) - r) / (k - 1)
    return restore_half(r - others, out)


@implements("10.17")
def rejection_sampling_loss(logp: Float[Tensor, " N"], r: Float[Tensor, " N"], tau, reduction: str = "mean") -> Tensor:
    r"""Rejection-sampling fine-tuning: SFT on the sampled responses whose reward reaches a threshold.

    .. math:: D' = \{(x, y): r_\phi(x, y) \ge \tau\}, \qquad L = -\mathbb{E}_{(x, y)\in D'}\log\pi_\theta(y\mid x)

    ``logp`` the sequence log-probabilities :math:`\log\pi_\theta(y\mid x)` of ``N`` sampled responses,
    ``r`` their rewards, both ``(N,)``; ``tau`` a real threshold, or a tensor broadcastable to ``r``
    (best-of-:math:`n`: each prompt's highest reward, so one response per prompt is kept).
    ``reduction`` ``"mean"`` over the kept responses (``ValueError`` if none is kept), ``"sum"``, or
    ``"none"`` (``(N,)``, zero where rejected).

    >>> rejection_sampling_loss(torch.tensor([-1.0, -3.0]), torch.tensor([0.9, 0.2]), tau=0.5).item()
    1.0
    """
    (logp, r), out = _pairs(("logp", "r"), (logp, r))
    if isinstance(tau, torch.Tensor):
        tau = as_tensor(tau, "tau").to(r.dtype)  # a bool tensor is rejected, not read as 0 / 1
        check_finite(tau, "tau", allow_neg_inf=True)
        check_broadcastable_to(tau, r.shape, "tau", "r")
    else:
        tau = check_range(tau, "tau")
    keep = r >= tau
    loss = torch.where(keep, -logp, torch.zeros_like(logp))
    return restore_half(reduce_loss(loss, keep, reduction, "kept response (no reward reaches tau)"), out)
