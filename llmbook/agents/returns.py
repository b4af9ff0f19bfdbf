r"""Returns and advantage estimation (chapter 35): the advantage, Monte Carlo, n-step and λ-returns.

Layout (batch-first, as a vectorised environment produces it). A rollout of ``B`` rows and ``T`` steps:

* ``r`` ``(B, T)``: ``r[:, t]`` is the reward received after acting in state :math:`s_t`, the
  :math:`r_{t+1}` of Sutton and Barto (the catalogue's :math:`r_k` with :math:`k = t` is the same number,
  indexed by the step that emits it);
* ``V`` ``(B, T + 1)``: ``V[:, t]`` the value estimate :math:`V(s_t)`; the last column is the value of the
  state reached after the last step, used to *bootstrap* a row that stops mid-episode;
* ``dones`` ``(B, T)``, optional (bool, or 0/1 numbers): ``dones[:, t]`` is True when the episode
  *terminated* with step :math:`t` (:math:`s_{t+1}` is terminal, worth 0). The row may go on with the
  next episode (an auto-reset environment): then ``V[:, t + 1]`` is the value of the *new* episode's
  first state and is never used for step :math:`t` or earlier. Nothing crosses a done: every return
  is cut there, with no bootstrap.

A row that ends without ``dones[:, T - 1]`` is a rollout cut by the *collector* (its length ``T``): the
n-step and λ-returns bootstrap from ``V[:, T]`` there, the Monte Carlo return (which has no ``V``) counts
only the rewards it saw. A *time-limit truncation* inside a row (gymnasium's ``truncated``) is not a
termination: the correct bootstrap needs the value of the pre-reset state, which a ``(B, T + 1)`` value
array does not hold. Split the row there, or accept the bias of treating it as a done.

Such rows come from any vectorised environment; :func:`gymnasium_rollout` records them from gymnasium's
toy-text environments. ``gamma`` :math:`\gamma \in [0, 1]`. fp16 / bf16 inputs are computed in float32 and
rounded back once.
The advantage form of the λ-return, :math:`G^\lambda_t - V(s_t)`, is generalised advantage
estimation: :func:`llmbook.lm.rlhf.gae` of chapter 10 (which has no ``dones``: one episode per row).
"""

from __future__ import annotations

import importlib

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import (
    as_tensor,
    check_dim,
    check_finite,
    check_int,
    check_positive_int,
    check_probability,
    check_shape,
    check_unit_interval,
)
from llmbook._precision import compute_dtype, restore_half
from llmbook.registry import implements

__all__ = ["advantage", "monte_carlo_return", "n_step_return", "lambda_return", "gymnasium_rollout"]


# ----------------------------------------------------------------------------------------------
# shared argument handling


def _rewards(r) -> Tensor:
    r = as_tensor(r, "r")
    check_dim(r, "r", "(B, T)", min_dim=2, max_dim=2)
    check_finite(r, "r")
    return r


def _values(V, r: Tensor) -> Tensor:
    V = as_tensor(V, "V")
    check_dim(V, "V", "(B, T + 1)", min_dim=2, max_dim=2)
    check_shape(V, (r.shape[0], r.shape[1] + 1), "V", "r of shape (B, T) = "
                f"{tuple(r.shape)}: (B, T + 1), the last column bootstraps")
    check_finite(V, "V")
    return V


def _alive(dones, r: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 - dones`` as a float ``(B, T)`` mask of ``dtype`` (all ones when ``dones`` is None)."""
    if dones is None:
        return torch.ones(r.shape, dtype=dtype)
    d = as_tensor(dones, "dones", floating=False)
    check_shape(d, r.shape, "dones", "r (one flag per step)")
    if d.dtype != torch.bool:
        if d.is_complex():
            raise TypeError(f"dones must be a bool (or 0/1) tensor, got dtype {d.dtype}")
        if not ((d == 0) | (d == 1)).all():
            raise ValueError("dones must hold only 0/1 (or True/False) flags, got values outside {0, 1}")
        d = d != 0
    return (~d).to(dtype)


def _backward(x: Tensor, c: Tensor, y_T: Tensor) -> Tensor:
    r"""The linear recursion :math:`y_t = x_t + c_t\,y_{t+1}` from :math:`y_T` backwards; ``(B, T)``."""
    y = torch.empty_like(x)
    running = y_T
    for t in range(x.shape[1] - 1, -1, -1):
        running = x[:, t] + c[:, t] * running
        y[:, t] = running
    return y


# ----------------------------------------------------------------------------------------------
# the equations


@implements("35.01")
def advantage(Q: Float[Tensor, "..."], V: Float[Tensor, "..."]) -> Float[Tensor, "..."]:
    r"""The advantage of an action: how much better it is than the policy's average in that state.

    .. math:: A^\pi(s,a)=Q^\pi(s,a)-V^\pi(s)

    Two layouts. *Per step*: ``Q`` and ``V`` of the same shape (e.g. ``(B, T)``: :math:`Q(s_t, a_t)` and
    :math:`V(s_t)` along a rollout). *Table*: ``Q`` ``(..., A)`` over all actions and ``V`` ``(...)`` (one
    fewer axis, e.g. ``Q`` ``(S, A)`` and ``V`` ``(S,)``), broadcast over the action axis. When
    :math:`V^\pi(s)=\sum_a\pi(a\mid s)Q^\pi(s,a)` the advantages average to zero under :math:`\pi` in every
    state: the policy's own actions are, on average, neither better nor worse than itself.

    >>> advantage(torch.tensor([[1.0, 3.0]]), torch.tensor([2.0]))
    tensor([[-1.,  1.]])
    """
    Q, V = as_tensor(Q, "Q"), as_tensor(V, "V")
    check_finite(Q, "Q")
    check_finite(V, "V")
    if Q.shape == V.shape:
        V_b = V
    elif Q.ndim >= 1 and V.shape == Q.shape[:-1]:
        V_b = V.unsqueeze(-1)
    else:
        raise ValueError(f"V must have the shape of Q (per step) or of Q without its action axis (table), "
                         f"got Q {tuple(Q.shape)} and V {tuple(V.shape)}")
    out = torch.promote_types(Q.dtype, V.dtype)
    dt = compute_dtype(out)
    return restore_half(Q.to(dt) - V_b.to(dt), out)


@implements("35.02")
def monte_carlo_return(r: Float[Tensor, "B T"], gamma: float = 0.99, dones=None) -> Float[Tensor, "B T"]:
    r"""The Monte Carlo return: the discounted sum of the rewards from step :math:`t` to the episode's end.

    .. math:: G_t=\sum_{k=t}^{T-1}\gamma^{k-t}r_k

    for an episode whose last step is :math:`T - 1` (the step into the terminal state :math:`s_T`, emitting
    :math:`r_{T-1}`). Computed backwards, :math:`G_t = r_t + \gamma(1 - d_t)\,G_{t+1}` with :math:`G_T = 0`: a done
    :math:`d_t` cuts the sum, so a row may hold several episodes. No value estimate is involved, so the
    estimate of :math:`V^\pi(s_t)` it gives is unbiased for complete episodes, and as noisy as the
    rewards of the whole remaining episode. ``r`` ``(B, T)`` -> ``(B, T)``; see the module docstring for the
    layout of ``dones`` and for rows that end mid-episode (counted as they are, with no bootstrap).

    >>> monte_carlo_return(torch.tensor([[1.0, 1.0, 1.0]]), gamma=0.5)
    tensor([[1.7500, 1.5000, 1.0000]])
    >>> monte_carlo_return(torch.tensor([[1.0, 1.0, 1.0]]), gamma=0.5, dones=torch.tensor([[True, False, True]]))
    tensor([[1.0000, 1.5000, 1.0000]])
    """
    gamma = check_unit_interval(gamma, "gamma")
    r = _rewards(r)
    dt = compute_dtype(r.dtype)
    alive = _alive(dones, r, dt)
    G = _backward(r.to(dt), gamma * alive, torch.zeros(r.shape[0], dtype=dt))
    return restore_half(G, r.dtype)


@implements("35.03")
def n_step_return(r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"], n: int, gamma: float = 0.99,
                  dones=None) -> Float[Tensor, "B T"]:
    r"""The n-step return: :math:`n` real rewards, then the value estimate of the state reached.

    .. math:: G_t^{(n)}=\sum_{i=0}^{n-1}\gamma^ir_{t+i+1}+\gamma^nV(s_{t+n})

    (rewards indexed as in Sutton and Barto: ``r[:, t + i]`` is :math:`r_{t+i+1}`). Near the ends the sum
    is shortened: an episode that terminates at step :math:`t + k - 1 < t + n - 1` contributes its
    :math:`k` rewards and no bootstrap, and a row that stops first bootstraps from ``V[:, T]`` with
    :math:`\gamma^{T-t}`. So :math:`n = 1` is the TD(0) target :math:`r_{t+1} + \gamma V(s_{t+1})`, and
    :math:`n \ge T` is the Monte Carlo return wherever the episode ends inside the row. ``r`` ``(B, T)``,
    ``V`` ``(B, T + 1)``, ``n`` a positive int -> ``(B, T)``. Cost :math:`O(BT\min(n, T))`.

    >>> n_step_return(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([[0.0, 10.0, 20.0, 30.0]]), n=2, gamma=0.5)
    tensor([[ 6.5000,  9.0000, 16.0000]])
    """
    n = check_positive_int(n, "n")
    gamma = check_unit_interval(gamma, "gamma")
    r = _rewards(r)
    V = _values(V, r)
    out = torch.promote_types(r.dtype, V.dtype)
    dt = compute_dtype(out)
    r, V = r.to(dt), V.to(dt)
    alive = _alive(dones, r, dt)
    B, T = r.shape
    G = torch.zeros(B, T, dtype=dt)
    still = torch.ones(B, T, dtype=dt)  # 1 while no done has occurred in [t, t + i)
    for i in range(min(n, T)):
        # step t + i for every t; beyond the row (t + i >= T) nothing is added
        r_i, a_i = torch.zeros(B, T, dtype=dt), torch.ones(B, T, dtype=dt)
        r_i[:, :T - i], a_i[:, :T - i] = r[:, i:], alive[:, i:]
        G = G + gamma**i * still * r_i
        still = still * a_i
    m = torch.clamp(torch.arange(T) + n, max=T)  # the bootstrap index min(t + n, T)
    G = G + gamma ** (m - torch.arange(T)).to(dt) * still * V[:, m]
    return restore_half(G, out)


@implements("35.04")
def lambda_return(r: Float[Tensor, "B T"], V: Float[Tensor, "B T+1"], lam: float = 0.95, gamma: float = 0.99,
                  dones=None) -> Float[Tensor, "B T"]:
    r"""The λ-return of TD(λ): every n-step return at once, weighted geometrically by :math:`\lambda^{n-1}`.

    .. math:: G_t^\lambda=(1-\lambda)\sum_{n=1}^{\infty}\lambda^{n-1}G_t^{(n)}

    Where the sum runs past an episode's end (or the row's), every remaining n-step return is the same
    number and the remaining weight :math:`\lambda^{N-1}` falls on it. Computed backwards in one pass by
    the equivalent recursion

    .. math:: G^\lambda_t = r_{t+1} + \gamma(1-d_t)\big[(1-\lambda)V(s_{t+1}) + \lambda G^\lambda_{t+1}\big],
              \qquad G^\lambda_T = V(s_T).

    :math:`\lambda = 0` is the TD(0) target, :math:`\lambda = 1` the Monte Carlo return (bootstrapped from
    ``V[:, T]`` when the row stops mid-episode). :math:`G^\lambda_t - V(s_t)` is GAE's advantage,
    :func:`llmbook.lm.rlhf.gae`, which chapter 10's PPO uses with :math:`\lambda = 0.95`. ``r`` ``(B, T)``,
    ``V`` ``(B, T + 1)``, ``lam`` in ``[0, 1]`` -> ``(B, T)``.

    >>> lambda_return(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 4.0, 8.0]]), lam=0.5, gamma=1.0)
    tensor([[7.5000, 9.0000]])
    """
    lam = check_unit_interval(lam, "lam")
    gamma = check_unit_interval(gamma, "gamma")
    r = _rewards(r)
    V = _values(V, r)
    out = torch.promote_types(r.dtype, V.dtype)
    dt = compute_dtype(out)
    r, V = r.to(dt), V.to(dt)
    alive = _alive(dones, r, dt)
    x = r + gamma * alive * (1.0 - lam) * V[:, 1:]
    G = _backward(x, gamma * lam * alive, V[:, -1])
    return restore_half(G, out)


# ----------------------------------------------------------------------------------------------
# data in this module's layout, from a real environment


def gymnasium_rollout(env_id: str, pi, B: int, T: int, seed: int = 0, **make_kwargs):
    r"""``B`` rows of ``T`` steps of the policy ``pi`` in a gymnasium toy-text environment, in this module's layout.

    The rows are gymnasium's synchronous vector environment with *same-step* auto-reset: when an episode
    terminates at step :math:`t`, ``dones[:, t]`` is True and the next state recorded, ``states[:, t + 1]``,
    is already the first state of a new episode. No episode can reach the environment's time limit (it is
    set above ``T``), so every done is a true termination and every row ends mid-episode or exactly at an
    end. ``pi`` ``(S, A)`` action probabilities (rows sum to 1); actions are drawn by inverse CDF from
    ``numpy.random.default_rng(seed)``, and the environments are reset with ``seed`` (row ``b`` gets
    ``seed + b``), so a call is reproducible. ``make_kwargs`` go to ``gymnasium.make_vec`` (e.g.
    ``is_slippery=True``). Returns ``states`` ``(B, T + 1)`` long, ``rewards`` ``(B, T)`` float64 and
    ``dones`` ``(B, T)`` bool: index a value table with ``states`` to get the ``V`` of the functions above.
    """
    try:
        gym = importlib.import_module("gymnasium")
    except ImportError as e:  # pragma: no cover - gymnasium is in the book extra
        raise ImportError("gymnasium_rollout needs gymnasium (pip install 'llmbook[book]' or gymnasium==1.4.0)") from e
    B, T = check_positive_int(B, "B"), check_int(T, "T", low=0)
    seed = check_int(seed, "seed", low=0)
    pi = as_tensor(pi, "pi").double()
    check_dim(pi, "pi", "(S, A)", min_dim=2, max_dim=2)
    check_probability(pi, "pi", atol=1e-9)
    venv = gym.make_vec(env_id, num_envs=B, vectorization_mode="sync", max_episode_steps=T + 1,
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}, **make_kwargs)
    S, A = int(venv.single_observation_space.n), int(venv.single_action_space.n)
    if tuple(pi.shape) != (S, A):
        raise ValueError(f"pi must have shape (S, A) = ({S}, {A}) for {env_id}, got {tuple(pi.shape)}")
    cdf = np.cumsum(pi.numpy(), axis=1)
    rng = np.random.default_rng(seed)
    states = np.zeros((B, T + 1), dtype=np.int64)
    rewards, dones = np.zeros((B, T)), np.zeros((B, T), dtype=bool)
    s, _ = venv.reset(seed=seed)
    for t in range(T):
        a = np.minimum((rng.random(B)[:, None] > cdf[s]).sum(1), A - 1)
        states[:, t] = s
        s, rewards[:, t], dones[:, t], truncated, _ = venv.step(a)
        if truncated.any():  # pragma: no cover - the time limit is above T
            raise RuntimeError(f"{env_id} truncated an episode inside a row of T = {T} steps")
    states[:, T] = s
    venv.close()
    return torch.from_numpy(states), torch.from_numpy(rewards), torch.from_numpy(dones)
