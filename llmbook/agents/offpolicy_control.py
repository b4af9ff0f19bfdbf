r"""DDPG, TD3 and SAC on Pendulum-v1 (chapter 34), ``K`` seeds trained at once in batched networks.

The targets and losses are the chapter's (:mod:`llmbook.agents.continuous_control`) plus the pieces that make
them learn: Polyak-averaged target networks (:func:`polyak_update`), the reparameterised tanh-Gaussian actor of
SAC (:func:`tanh_gaussian_sample`, :func:`sac_actor_loss`), its soft critic target with the minimum over two
critics (:func:`sac_critic_target`) and its temperature loss (:func:`sac_temperature_loss`). Actions live in
:math:`[-1, 1]` (the torque is :math:`2a`). Tensors carry a leading seed axis ``K``; each loss is a sum over
seeds of per-seed means. ``python -m llmbook train --recipe pendulum`` runs :func:`main`, which writes
``llmbook/data/pendulum_log.json``.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from llmbook.agents import continuous_control as cc
from llmbook.agents.batched_control import MAX_TORQUE, PENDULUM_STEPS, BatchedPendulum, SeedMLP

__all__ = ["polyak_update", "tanh_gaussian_sample", "sac_critic_target", "sac_actor_loss", "sac_temperature_loss",
           "evaluate", "train_pendulum", "main", "LOG_NAME", "ALGOS"]

LOG_NAME = "pendulum_log.json"
ALGOS = ("ddpg", "td3", "sac")


def polyak_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    r"""Polyak averaging of target networks, in place: :math:`\phi'\leftarrow\tau\phi+(1-\tau)\phi'` for every
    parameter (DDPG, TD3 and SAC use :math:`\tau = 0.005`). ``tau`` in [0, 1]; 1 copies ``online``.

    >>> a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    >>> with torch.no_grad():
    ...     _ = a.weight.fill_(0.0), b.weight.fill_(1.0)
    >>> polyak_update(a, b, 0.25); round(a.weight.item(), 4)
    0.25
    """
    if not 0.0 <= float(tau) <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")
    with torch.no_grad():
        for p_t, p in zip(target.parameters(), online.parameters(), strict=True):
            p_t.mul_(1 - tau).add_(p, alpha=tau)


def tanh_gaussian_sample(mu: Tensor, log_std: Tensor, xi: Tensor) -> tuple[Tensor, Tensor]:
    r"""SAC's reparameterised squashed-Gaussian action and its log-probability:

    .. math:: u=\mu+\sigma\odot\xi,\quad a=\tanh u,\qquad
              \log\pi(a\mid s)=\sum_i\big[\log\mathcal N(u_i;\mu_i,\sigma_i)-\log(1-\tanh^2u_i)\big]

    ``xi`` the standard-normal draws (passed in), so :math:`a` is a differentiable function of :math:`\mu` and
    :math:`\sigma`: the actor's gradient flows through the sample (the reparameterisation trick), and the
    log-det term :math:`-\log(1-\tanh^2u)` is :func:`llmbook.agents.continuous_control.tanh_gaussian_log_prob`'s.
    ``mu``, ``log_std``, ``xi`` ``(..., d_a)`` -> ``(a (..., d_a), logp (...))``.

    >>> a, logp = tanh_gaussian_sample(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1))
    >>> a.item(), round(logp.item(), 4)   # the density of N(0, 1) at 0, log(1 / sqrt(2 pi))
    (0.0, -0.9189)
    """
    u = mu + log_std.exp() * xi
    return torch.tanh(u), cc.tanh_gaussian_log_prob(u, mu, log_std)


def sac_critic_target(r: Tensor, Q1_next: Tensor, Q2_next: Tensor, logp_next: Tensor, alpha, gamma: float = 0.99,
                      dones=None) -> Tensor:
    r"""SAC's critic target (Haarnoja et al., 2018b), with the next action sampled from the *current* policy:

    .. math:: y=r+\gamma(1-d)\Big(\min_{i=1,2}Q_{\phi_i'}(s',a')-\alpha\log\pi_\theta(a'\mid s')\Big),
              \qquad a'\sim\pi_\theta(\cdot\mid s')

    the soft value of :func:`llmbook.agents.continuous_control.sac_soft_value` with one sample and TD3's minimum.
    ``r``, ``Q1_next``, ``Q2_next``, ``logp_next`` ``(..., B)``, ``alpha`` a number or a tensor broadcasting
    against them (one temperature per seed: ``(K, 1)``) -> ``(..., B)``, detached.

    >>> sac_critic_target(torch.tensor([1.0]), torch.tensor([4.0]), torch.tensor([2.0]), torch.tensor([-1.0]),
    ...                   alpha=0.5, gamma=0.5)
    tensor([2.2500])
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not (r.shape == Q1_next.shape == Q2_next.shape == logp_next.shape):
        raise ValueError(f"r, Q1_next, Q2_next and logp_next must share one shape, got {tuple(r.shape)}, "
                         f"{tuple(Q1_next.shape)}, {tuple(Q2_next.shape)}, {tuple(logp_next.shape)}")
    not_done = 1.0 if dones is None else 1.0 - torch.as_tensor(dones).to(r.dtype)
    V_next = torch.minimum(Q1_next, Q2_next) - alpha * logp_next
    return (r + gamma * not_done * V_next).detach()


def sac_actor_loss(Q1: Tensor, Q2: Tensor, logp: Tensor, alpha) -> Tensor:
    r"""SAC's actor loss, per seed a mean over the batch, summed over seeds:

    .. math:: \mathcal L_\pi=\mathbb E_{s,\xi}\Big[\alpha\log\pi_\theta(a_\theta(s,\xi)\mid s)
              -\min_{i=1,2}Q_{\phi_i}(s,a_\theta(s,\xi))\Big]

    with :math:`a_\theta` from :func:`tanh_gaussian_sample` (so ``Q1``, ``Q2`` and ``logp`` carry the actor's
    graph) and ``alpha`` held fixed. ``(K, B)`` each, ``alpha`` a number or ``(K, 1)`` -> scalar.

    >>> sac_actor_loss(torch.tensor([[1.0, 3.0]]), torch.tensor([[2.0, 1.0]]), torch.tensor([[0.0, -2.0]]), 0.5)
    tensor(-1.5000)
    """
    if Q1.dim() != 2 or Q1.shape != Q2.shape or Q1.shape != logp.shape:
        raise ValueError(f"Q1, Q2 and logp must be (K, B) of one shape, got {tuple(Q1.shape)}, {tuple(Q2.shape)}, "
                         f"{tuple(logp.shape)}")
    alpha = alpha.detach() if isinstance(alpha, Tensor) else alpha
    return (alpha * logp - torch.minimum(Q1, Q2)).mean(-1).sum()


def sac_temperature_loss(log_alpha: Tensor, logp: Tensor, target_entropy: float) -> Tensor:
    r"""SAC's automatic temperature (Haarnoja et al., 2018b, eq. 18), per seed, summed over seeds:

    .. math:: J(\alpha)=\mathbb E_{a\sim\pi}\big[-\alpha\log\pi(a\mid s)-\alpha\bar{\mathcal H}\big],
              \qquad \alpha=e^{\log\alpha}

    Its gradient :math:`\partial J/\partial\alpha=\mathcal H(\pi)-\bar{\mathcal H}` (with the entropy estimated by
    :math:`-\log\pi`) raises :math:`\alpha` when the policy's entropy is below the target :math:`\bar{\mathcal H}`
    (SAC takes :math:`-d_a`) and lowers it above. ``log_alpha`` ``(K, 1)`` (the parameter), ``logp`` ``(K, B)``
    (detached) -> scalar.

    >>> sac_temperature_loss(torch.zeros(1, 1), torch.tensor([[1.5, 2.5]]), target_entropy=-1.0)
    tensor(-1.)
    """
    if log_alpha.dim() != 2 or logp.dim() != 2 or log_alpha.shape[0] != logp.shape[0]:
        raise ValueError(f"log_alpha must be (K, 1) and logp (K, B), got {tuple(log_alpha.shape)} and "
                         f"{tuple(logp.shape)}")
    return (-log_alpha.exp() * (logp.detach() + target_entropy)).mean(-1).sum()


def _actor_mean(actor: SeedMLP, algo: str, obs: Tensor) -> tuple[Tensor, Tensor | None]:
    out = actor(obs)
    if algo == "sac":
        return out[..., :1], out[..., 1:].clamp(-5.0, 2.0)
    return torch.tanh(out), None


def evaluate(actor: SeedMLP, algo: str, episodes: int = 4, seed: int = 12345) -> Tensor:
    """Mean undiscounted return of the deterministic policy (``tanh(mu)`` for SAC) over ``episodes`` Pendulum
    episodes per seed, from the same start states every time (generator ``seed``) -> ``(K,)``."""
    env = BatchedPendulum((actor.K, episodes), torch.Generator().manual_seed(seed))
    obs, total = env.reset(), torch.zeros(actor.K, episodes, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(PENDULUM_STEPS):
            mu, _ = _actor_mean(actor, algo, obs)
            obs, r = env.step(MAX_TORQUE * torch.tanh(mu[..., 0]) if algo == "sac" else MAX_TORQUE * mu[..., 0])
            total += r
    return total.mean(-1)


def train_pendulum(algo: str, K: int = 10, steps: int = 5000, start_steps: int = 500, batch: int = 128,
                   hidden: int = 64, lr: float = 1e-3, tau: float = 0.005, gamma: float = 0.99,
                   sigma_explore: float = 0.1, policy_delay: int = 2, target_sigma: float = 0.2,
                   noise_clip: float = 0.5, eval_every: int = 1000, seed: int = 0) -> dict:
    r"""Train ``K`` agents of ``algo`` (``"ddpg"``, ``"td3"`` or ``"sac"``) on Pendulum-v1, one environment each,
    one gradient step per environment step after ``start_steps`` uniformly random ones.

    - DDPG: critic :func:`llmbook.agents.continuous_control.ddpg_critic_loss`; actor :math:`-Q_1(s,\mu(s))`;
      exploration :math:`\mathrm{clip}(\mu(s)+\mathcal N(0,\sigma^2),-1,1)`; Polyak targets every step.
    - TD3: two critics on :func:`~llmbook.agents.continuous_control.td3_target` at the smoothed action
      :func:`~llmbook.agents.continuous_control.td3_target_action`; actor and targets every ``policy_delay`` steps.
    - SAC: :func:`sac_critic_target`, :func:`sac_actor_loss`, :func:`sac_temperature_loss` (target entropy -1),
      Polyak critic targets, no actor target; exploration is the policy's own sampling.

    Returns ``{"steps": [...], "eval": [[K returns], ...]}`` (:func:`evaluate` at step 0 and every
    ``eval_every`` steps) and ``"alpha"`` (SAC's temperatures at those steps).
    """
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    gen, env_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    actor = SeedMLP(K, (3, hidden, hidden, 2 if algo == "sac" else 1), gen, act="relu")
    Q1, Q2 = (SeedMLP(K, (4, hidden, hidden, 1), gen, act="relu") for _ in range(2))
    actor_t, Q1_t, Q2_t = copy.deepcopy(actor), copy.deepcopy(Q1), copy.deepcopy(Q2)
    opt_pi = torch.optim.Adam(actor.parameters(), lr=lr)
    opt_Q = torch.optim.Adam([*Q1.parameters(), *Q2.parameters()] if algo != "ddpg" else Q1.parameters(), lr=lr)
    log_alpha = nn.Parameter(torch.full((K, 1), math.log(0.2), dtype=torch.float64))
    opt_alpha = torch.optim.Adam([log_alpha], lr=lr)
    buf_s, buf_s2 = torch.zeros(K, steps, 3, dtype=torch.float64), torch.zeros(K, steps, 3, dtype=torch.float64)
    buf_a, buf_r = torch.zeros(K, steps, 1, dtype=torch.float64), torch.zeros(K, steps, dtype=torch.float64)
    env = BatchedPendulum((K,), env_gen)
    obs, rows = env.reset(), torch.arange(K)[:, None]
    log = {"steps": [0], "eval": [evaluate(actor, algo).tolist()], "alpha": [[0.2] * K]}

    def Q(net, s, a):
        return net(torch.cat([s, a], -1))[..., 0]

    for t in range(steps):
        with torch.no_grad():
            if t < start_steps:
                a = torch.rand(K, 1, generator=gen, dtype=torch.float64) * 2 - 1
            elif algo == "sac":
                mu, log_std = _actor_mean(actor, algo, obs[:, None])
                xi = torch.randn(mu.shape, generator=gen, dtype=torch.float64)
                a = tanh_gaussian_sample(mu, log_std, xi)[0][:, 0]
            else:
                a = _actor_mean(actor, algo, obs[:, None])[0][:, 0]
                a = (a + sigma_explore * torch.randn(a.shape, generator=gen, dtype=torch.float64)).clamp(-1, 1)
        obs2, r = env.step(MAX_TORQUE * a[:, 0])
        buf_s[:, t], buf_a[:, t], buf_r[:, t], buf_s2[:, t] = obs, a, r, obs2
        obs = env.reset() if env.t >= PENDULUM_STEPS else obs2  # time limit: s' is kept, not terminal
        if t + 1 >= start_steps:
            idx = torch.randint(0, t + 1, (K, batch), generator=gen)
            s, a_b, r_b, s2 = buf_s[rows, idx], buf_a[rows, idx], buf_r[rows, idx], buf_s2[rows, idx]
            with torch.no_grad():
                if algo == "ddpg":
                    Q_next = Q(Q1_t, s2, _actor_mean(actor_t, algo, s2)[0])
                elif algo == "td3":
                    xi = torch.randn(K, batch, 1, generator=gen, dtype=torch.float64)
                    a2 = cc.td3_target_action(_actor_mean(actor_t, algo, s2)[0], xi, target_sigma, noise_clip)
                    y = cc.td3_target(r_b.flatten(), Q(Q1_t, s2, a2).flatten(), Q(Q2_t, s2, a2).flatten(),
                                      gamma).reshape(K, batch)
                else:
                    mu2, ls2 = _actor_mean(actor, algo, s2)
                    a2, logp2 = tanh_gaussian_sample(mu2, ls2, torch.randn(mu2.shape, generator=gen,
                                                                           dtype=torch.float64))
                    y = sac_critic_target(r_b, Q(Q1_t, s2, a2), Q(Q2_t, s2, a2), logp2, log_alpha.exp(), gamma)
            if algo == "ddpg":  # K times the mean over K * batch = the sum over seeds of per-seed means
                loss_Q = K * cc.ddpg_critic_loss(Q(Q1, s, a_b).flatten(), r_b.flatten(), Q_next.flatten(), gamma)
            else:
                loss_Q = ((Q(Q1, s, a_b) - y) ** 2 + (Q(Q2, s, a_b) - y) ** 2).mean(-1).sum()
            opt_Q.zero_grad()
            loss_Q.backward()
            opt_Q.step()
            if algo == "sac":
                mu, ls = _actor_mean(actor, algo, s)
                a_pi, logp = tanh_gaussian_sample(mu, ls, torch.randn(mu.shape, generator=gen, dtype=torch.float64))
                loss_pi = sac_actor_loss(Q(Q1, s, a_pi), Q(Q2, s, a_pi), logp, log_alpha.exp())
                opt_pi.zero_grad()
                loss_pi.backward()
                opt_pi.step()
                opt_alpha.zero_grad()
                sac_temperature_loss(log_alpha, logp, target_entropy=-1.0).backward()
                opt_alpha.step()
                polyak_update(Q1_t, Q1, tau)
                polyak_update(Q2_t, Q2, tau)
            elif algo == "ddpg" or (t + 1) % policy_delay == 0:
                loss_pi = -Q(Q1, s, _actor_mean(actor, algo, s)[0]).mean(-1).sum()
                opt_pi.zero_grad()
                loss_pi.backward()
                opt_pi.step()
                for tgt, net in ((actor_t, actor), (Q1_t, Q1), (Q2_t, Q2)):
                    polyak_update(tgt, net, tau)
        if (t + 1) % eval_every == 0:
            log["steps"].append(t + 1)
            log["eval"].append(evaluate(actor, algo).tolist())
            log["alpha"].append(log_alpha.exp()[:, 0].tolist())
    if algo != "sac":
        del log["alpha"]
    return log


def main(out_dir=None, **config) -> int:
    """The recipe: :func:`train_pendulum` for DDPG, TD3 and SAC with the defaults (overridable by ``config``),
    written as JSON (4 significant digits) to ``out_dir/pendulum_log.json`` (default: the package data folder)."""
    from llmbook.agents.ppo_control import _round

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    logs = {}
    for algo in ALGOS:
        logs[algo] = train_pendulum(algo, **config)
        final = torch.tensor(logs[algo]["eval"][-1])
        print(f"{algo}: final evaluation return over {final.numel()} seeds, mean {final.mean():.1f} "
              f"({time.perf_counter() - start:.1f} s)")
    out = Path(out_dir) if out_dir else Path(__file__).resolve().parents[1] / "data"
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOG_NAME
    path.write_text(json.dumps({"recipe": "pendulum", "config": config or "defaults", "log": _round(logs)},
                               separators=(",", ":")) + "\n")
    print(f"wrote {path}")
    return 0
