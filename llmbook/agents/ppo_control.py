r"""PPO with GAE on CartPole-v1 (chapter 34), ``K`` seeds trained at once in batched networks.

The update is PPO's (Schulman et al., 2017) with the clipped surrogate of :func:`llmbook.lm.rlhf.ppo_clip_objective`,
a value loss, an entropy bonus and GAE advantages (:func:`gae_advantages`), on
:class:`llmbook.agents.batched_control.BatchedCartPole`. Every tensor carries a leading seed axis ``K``; the
losses are sums over seeds of per-seed means, so the seeds never mix. ``python -m llmbook train --recipe
pg-cartpole`` runs :func:`main`, which writes ``llmbook/data/pg_cartpole_log.json``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from llmbook.agents import returns as _ret
from llmbook.agents.batched_control import CARTPOLE_MAX_STEPS, BatchedCartPole, SeedMLP, cartpole_step
from llmbook.lm import rlhf

__all__ = ["seed_mean_interval", "gae_advantages", "ppo_losses", "evaluate_cartpole", "train_ppo_cartpole", "main",
           "LOG_NAME"]

LOG_NAME = "pg_cartpole_log.json"


def seed_mean_interval(x, confidence: float = 0.95) -> tuple[float, float, float]:
    r"""Mean over ``n`` seeds and its Student-t interval, :math:`\bar x\pm t_{n-1,(1+c)/2}\,s/\sqrt n` (``s`` the
    sample standard deviation): ``(mean, low, high)`` for a 1-D sequence of per-seed results, ``n >= 2``.

    >>> [round(v, 3) for v in seed_mean_interval([1.0, 2.0, 3.0])]
    [2.0, -0.484, 4.484]
    """
    from scipy.special import stdtrit

    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size < 2 or not np.isfinite(x).all():
        raise ValueError(f"x must be a 1-D finite sequence of at least 2 per-seed results, got shape {x.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n, m = x.size, float(x.mean())
    half = float(stdtrit(n - 1, (1 + confidence) / 2)) * float(x.std(ddof=1)) / math.sqrt(n)
    return m, m - half, m + half


def gae_advantages(r: Tensor, V: Tensor, dones: Tensor, gamma: float = 0.99, lam: float = 0.95) -> Tensor:
    r"""GAE (Schulman et al., 2016) over a rollout that may cross episode ends:

    .. math:: \hat A_t=\sum_{l\ge0}(\gamma\lambda)^l\Big(\prod_{j=0}^{l-1}(1-d_{t+j})\Big)\delta_{t+l},\qquad
              \delta_t=r_{t+1}+\gamma(1-d_t)V(s_{t+1})-V(s_t)

    (``r[:, t]`` is :math:`r_{t+1}`; :math:`d_t` marks that the episode ended with step :math:`t`, so neither
    the bootstrap nor the trace crosses into the next episode). It is the λ-return minus the value,
    :func:`llmbook.agents.returns.lambda_return` ``- V[:, :T]``. ``r``, ``dones`` ``(B, T)``, ``V`` ``(B, T + 1)``
    -> ``(B, T)``.

    >>> gae_advantages(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0, 5.0]]), torch.tensor([[True, False]]),
    ...                gamma=0.5, lam=1.0)
    tensor([[1.0000, 2.5000]])
    """
    dones = torch.as_tensor(dones)
    if dones.dtype != torch.bool:
        raise TypeError(f"dones must be a bool tensor (B, T), got {dones.dtype}")
    G = _ret.lambda_return(r, V, lam=lam, gamma=gamma, dones=dones)
    return G - torch.as_tensor(V)[:, :-1].to(G.dtype)


def ppo_losses(logp: Tensor, logp_old: Tensor, A: Tensor, V: Tensor, R: Tensor, H: Tensor, eps: float = 0.2,
               c_v: float = 0.5, c_H: float = 0.01) -> dict[str, Tensor]:
    r"""PPO's loss for ``K`` seeds at once, and its two diagnostics, per seed:

    .. math:: \mathcal L=-L^{CLIP}+c_v\,\mathbb E_t[(V(s_t)-R_t)^2]-c_H\,\mathbb E_t[\mathcal H(\pi(\cdot\mid s_t))],
              \qquad \rho_t=e^{\log\pi_\theta(a_t\mid s_t)-\log\pi_{old}(a_t\mid s_t)}

    with :math:`L^{CLIP}` from :func:`llmbook.lm.rlhf.ppo_clip_objective`. The *clip fraction* is the share of
    samples with :math:`|\rho_t-1|>\epsilon` (where the clip can act), the *approximate KL* the estimator
    :math:`\mathbb E_t[(\rho_t-1)-\log\rho_t]\approx D_{KL}(\pi_{old}\Vert\pi_\theta)` (non-negative, unbiased).
    All inputs ``(K, M)`` (``M`` samples per seed; ``R`` the returns :math:`\hat A+V_{old}`, ``H`` the entropies)
    -> ``{"loss": scalar (sum over seeds of the per-seed losses), "clip_frac": (K,), "approx_kl": (K,)}``.

    >>> z = torch.zeros(1, 2)
    >>> out = ppo_losses(z, z, torch.tensor([[1.0, -1.0]]), z, z, z)
    >>> round(out["loss"].item(), 4), out["clip_frac"].tolist()
    (0.0, [0.0])
    """
    if logp.dim() != 2:
        raise ValueError(f"logp must be (K, M): seeds by samples, got {tuple(logp.shape)}")
    K = logp.shape[0]
    surrogate = rlhf.ppo_clip_objective(logp, logp_old.detach(), A.detach(), eps=eps)  # mean over K * M
    value = rlhf.value_loss(V, R.detach())
    loss = K * (-surrogate + c_v * value - c_H * H.mean())
    with torch.no_grad():
        log_rho = logp - logp_old
        clip_frac = ((log_rho.exp() - 1).abs() > eps).double().mean(-1)
        approx_kl = (log_rho.exp() - 1 - log_rho).mean(-1)
    return {"loss": loss, "clip_frac": clip_frac, "approx_kl": approx_kl}


def evaluate_cartpole(actor: SeedMLP, episodes: int = 8, seed: int = 12345) -> Tensor:
    """Mean return of the greedy policy (the likelier action) over ``episodes`` CartPole episodes per seed, from
    the same start states every time (generator ``seed``), each run to its end or 500 steps -> ``(K,)``."""
    state = BatchedCartPole((actor.K, episodes), torch.Generator().manual_seed(seed)).state
    alive = torch.ones(actor.K, episodes, dtype=torch.bool)
    total = torch.zeros(actor.K, episodes, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(CARTPOLE_MAX_STEPS):
            logits = actor(state)
            state, term = cartpole_step(state, (logits[..., 1] > logits[..., 0]).long())
            total += alive.double()
            alive &= ~term
            if not alive.any():
                break
    return total.mean(-1)


def train_ppo_cartpole(K: int = 10, n_envs: int = 8, T: int = 128, iters: int = 100, epochs: int = 4,
                       minibatches: int = 4, lr: float = 1e-3, gamma: float = 0.99, lam: float = 0.95,
                       eps: float = 0.2, hidden: int = 64, eval_every: int = 10, seed: int = 0) -> dict:
    r"""Train ``K`` PPO agents (seeds ``0 .. K-1`` of one generator) on CartPole-v1 for ``iters`` iterations of
    ``n_envs * T`` environment steps each. Each iteration: a rollout with the current policy, GAE
    (:func:`gae_advantages`; a truncation at 500 steps is treated as an end), then ``epochs`` passes over the
    rollout in ``minibatches`` shuffled minibatches, with advantages normalised per seed and minibatch and the
    step size annealed linearly to 0. Returns a dict of per-iteration, per-seed lists: ``return`` (mean return of
    the episodes finished in the iteration, the previous value if none finished), ``clip_frac`` and
    ``approx_kl`` (means over the iteration's minibatches), and ``steps`` (environment steps per seed); and
    ``eval_steps``, ``eval`` (:func:`evaluate_cartpole` before training and every ``eval_every`` iterations).
    """
    gen = torch.Generator().manual_seed(seed)
    actor = SeedMLP(K, (4, hidden, hidden, 2), gen, out_scale=0.01)
    critic = SeedMLP(K, (4, hidden, hidden, 1), gen)
    opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=lr, eps=1e-5)
    env = BatchedCartPole((K, n_envs), gen)
    obs = env.obs()
    last = torch.zeros(K, dtype=torch.float64)
    log = {"steps": [], "return": [], "clip_frac": [], "approx_kl": [], "eval_steps": [0],
           "eval": [evaluate_cartpole(actor).tolist()]}
    M = n_envs * T
    for it in range(iters):
        for group in opt.param_groups:
            group["lr"] = lr * (1 - it / iters)
        S, Acts, Rw, D, LP, Vs, ends = [], [], [], [], [], [], []
        with torch.no_grad():
            for _ in range(T):
                logits = actor(obs)
                logp_all = torch.log_softmax(logits, -1)
                a = (torch.rand(K, n_envs, generator=gen, dtype=torch.float64) < logp_all[..., 1].exp()).long()
                S.append(obs), Acts.append(a), LP.append(logp_all.gather(-1, a[..., None])[..., 0])
                Vs.append(critic(obs)[..., 0])
                obs, r, term, trunc, ep_ret = env.step(a)
                Rw.append(r), D.append(term | trunc), ends.append(ep_ret)
            Vs.append(critic(obs)[..., 0])
            # (K, n_envs, T) -> rows (K * n_envs, T) for GAE
            r_, V_, d_ = (torch.stack(x, -1).reshape(K * n_envs, -1) for x in (Rw, Vs, D))
            A = gae_advantages(r_, V_, d_, gamma, lam).reshape(K, M)
            R = A + V_[:, :-1].reshape(K, M)
        S_, A_act, LP_old = torch.stack(S, 2).reshape(K, M, 4), torch.stack(Acts, -1).reshape(K, M), \
            torch.stack(LP, -1).reshape(K, M)
        fracs, kls = [], []
        for _ in range(epochs):
            perm = torch.randperm(M, generator=gen)
            for idx in perm.chunk(minibatches):
                logp_all = torch.log_softmax(actor(S_[:, idx]), -1)
                logp = logp_all.gather(-1, A_act[:, idx, None])[..., 0]
                H = -(logp_all.exp() * logp_all).sum(-1)
                A_mb = A[:, idx]
                A_mb = (A_mb - A_mb.mean(-1, keepdim=True)) / (A_mb.std(-1, keepdim=True) + 1e-8)
                out = ppo_losses(logp, LP_old[:, idx], A_mb, critic(S_[:, idx])[..., 0], R[:, idx], H, eps)
                opt.zero_grad()
                out["loss"].backward()
                opt.step()
                fracs.append(out["clip_frac"]), kls.append(out["approx_kl"])
        finished = torch.stack(ends, -1).reshape(K, -1)
        n_fin = (~finished.isnan()).sum(-1)
        mean_ret = torch.where(n_fin > 0, torch.nan_to_num(finished, nan=0.0).sum(-1) / n_fin.clamp(min=1), last)
        last = mean_ret
        log["steps"].append((it + 1) * M)
        log["return"].append(mean_ret.tolist())
        log["clip_frac"].append(torch.stack(fracs).mean(0).tolist())
        log["approx_kl"].append(torch.stack(kls).mean(0).tolist())
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            log["eval_steps"].append((it + 1) * M)
            log["eval"].append(evaluate_cartpole(actor).tolist())
    return log


def _round(x, digits: int = 4):
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    return float(f"{x:.{digits}g}") if isinstance(x, float) else x


def main(out_dir=None, **config) -> int:
    """The recipe: :func:`train_ppo_cartpole` with its defaults (overridable by ``config``), written as JSON
    (numbers to 4 significant digits) to ``out_dir/pg_cartpole_log.json`` (default: the package data folder)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    log = train_ppo_cartpole(**config)
    out = Path(out_dir) if out_dir else Path(__file__).resolve().parents[1] / "data"
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOG_NAME
    payload = {"recipe": "pg-cartpole", "config": config or "defaults", "log": _round(log)}
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    final = torch.tensor(log["eval"][-1])
    print(f"wrote {path}: final greedy return over {final.numel()} seeds, mean {final.mean():.1f}, "
          f"min {final.min():.1f} ({time.perf_counter() - start:.1f} s)")
    return 0
