r"""Batched classic control for chapter 34: gymnasium's CartPole-v1 and Pendulum-v1 dynamics in torch
(float64, ``N`` copies at once), and an MLP with a leading *seed* axis so that ``K`` independent agents train
in one set of batched matrix products.

The step functions reproduce gymnasium's ``step`` formulas (``cartpole.py``, Euler integrator; ``pendulum.py``)
to rounding (the tests step both side by side). Only the initial states are drawn from a
``torch.Generator`` instead of gymnasium's ``np_random``, so an episode is gymnasium's episode from that start.

:class:`SeedMLP` holds ``K`` networks: weights ``(K, d_in, d_out)`` and biases ``(K, 1, d_out)``; an input
``(K, N, d_in)`` gives ``(K, N, d_out)`` by ``torch.baddbmm``. Adam is element-wise, so one optimizer over the
stacked parameters is exactly ``K`` independent optimizers, provided the loss is a *sum* over seeds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["cartpole_step", "cartpole_obs", "pendulum_step", "pendulum_obs", "BatchedCartPole",
           "BatchedPendulum", "SeedMLP"]

# CartPole-v1 constants (gymnasium.envs.classic_control.cartpole)
GRAVITY, M_CART, M_POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
X_LIMIT, THETA_LIMIT, CARTPOLE_MAX_STEPS = 2.4, 12 * 2 * math.pi / 360, 500
# Pendulum-v1 constants (gymnasium.envs.classic_control.pendulum, g = 10)
PEND_G, PEND_M, PEND_L, PEND_DT, MAX_SPEED, MAX_TORQUE, PENDULUM_STEPS = 10.0, 1.0, 1.0, 0.05, 8.0, 2.0, 200


def _state(state: Tensor, d: int, name: str) -> Tensor:
    if not isinstance(state, Tensor) or state.dim() < 1 or state.shape[-1] != d:
        raise ValueError(f"{name} must be a tensor (..., {d}), got "
                         f"{tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__}")
    return state


def cartpole_step(state: Tensor, action: Tensor) -> tuple[Tensor, Tensor]:
    r"""One Euler step of the cart-pole (Barto, Sutton and Anderson, 1983; gymnasium's CartPole-v1):

    .. math:: \ddot\theta=\frac{g\sin\theta-\cos\theta\,\tau_F}{\ell\,(4/3-m_p\cos^2\theta/(m_c+m_p))},\qquad
              \tau_F=\frac{F+m_p\ell\dot\theta^2\sin\theta}{m_c+m_p},\qquad
              \ddot x=\tau_F-\frac{m_p\ell\ddot\theta\cos\theta}{m_c+m_p}

    then :math:`x\leftarrow x+\Delta t\,\dot x`, :math:`\dot x\leftarrow\dot x+\Delta t\,\ddot x` (and the same for
    :math:`\theta`), :math:`\Delta t = 0.02`, :math:`F=\pm10`. ``state`` ``(..., 4)`` :math:`(x,\dot x,\theta,
    \dot\theta)`, ``action`` ``(...)`` 0 (push left) or 1 (push right) -> ``(state', terminated)``, terminated
    when :math:`|x|>2.4` or :math:`|\theta|>12^\circ`. The reward is 1 for every step, the last included.

    >>> s, done = cartpole_step(torch.zeros(1, 4, dtype=torch.float64), torch.tensor([1]))
    >>> [round(v, 4) for v in s[0].tolist()], done.tolist()
    ([0.0, 0.1951, 0.0, -0.2927], [False])
    """
    state = _state(state, 4, "state")
    action = torch.as_tensor(action)
    if action.shape != state.shape[:-1]:
        raise ValueError(f"action must have shape {tuple(state.shape[:-1])} (one per state), got {tuple(action.shape)}")
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action == 1, FORCE, -FORCE).to(state.dtype)
    cos, sin = torch.cos(theta), torch.sin(theta)
    total = M_POLE + M_CART
    temp = (force + M_POLE * HALF_LENGTH * theta_dot**2 * sin) / total
    theta_acc = (GRAVITY * sin - cos * temp) / (HALF_LENGTH * (4.0 / 3.0 - M_POLE * cos**2 / total))
    x_acc = temp - M_POLE * HALF_LENGTH * theta_acc * cos / total
    new = torch.stack([x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc], -1)
    terminated = (new[..., 0].abs() > X_LIMIT) | (new[..., 2].abs() > THETA_LIMIT)
    return new, terminated


def cartpole_obs(state: Tensor) -> Tensor:
    """The observation is the state itself (gymnasium returns it as float32; here it stays float64)."""
    return _state(state, 4, "state").clone()


def pendulum_step(state: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    r"""One step of gymnasium's Pendulum-v1 (torque ``u`` clipped to :math:`[-2, 2]`):

    .. math:: r=-\big(\mathrm{wrap}(\theta)^2+0.1\dot\theta^2+0.001u^2\big),\qquad
              \dot\theta'=\mathrm{clip}\Big(\dot\theta+\big(\tfrac{3g}{2\ell}\sin\theta+\tfrac{3}{m\ell^2}u\big)
              \Delta t,\,-8,\,8\Big),\qquad \theta'=\theta+\dot\theta'\Delta t

    with :math:`\mathrm{wrap}(\theta)\in[-\pi,\pi)`, :math:`g=10`, :math:`m=\ell=1`, :math:`\Delta t=0.05`.
    ``state`` ``(..., 2)`` :math:`(\theta,\dot\theta)`, ``u`` ``(...)`` -> ``(state', r)``. Episodes are
    truncated at 200 steps; the best return is about -150 from a random start (0 at the top, at rest).

    >>> s, r = pendulum_step(torch.tensor([[math.pi, 0.0]], dtype=torch.float64), torch.tensor([0.0]))
    >>> round(r.item(), 4)
    -9.8696
    """
    state = _state(state, 2, "state")
    u = torch.as_tensor(u, dtype=state.dtype).clamp(-MAX_TORQUE, MAX_TORQUE)
    if u.shape != state.shape[:-1]:
        raise ValueError(f"u must have shape {tuple(state.shape[:-1])} (one torque per state), got {tuple(u.shape)}")
    th, thdot = state.unbind(-1)
    wrapped = torch.remainder(th + math.pi, 2 * math.pi) - math.pi
    r = -(wrapped**2 + 0.1 * thdot**2 + 0.001 * u**2)
    acc = 3 * PEND_G / (2 * PEND_L) * torch.sin(th) + 3.0 / (PEND_M * PEND_L**2) * u
    new_thdot = (thdot + acc * PEND_DT).clamp(-MAX_SPEED, MAX_SPEED)
    return torch.stack([th + new_thdot * PEND_DT, new_thdot], -1), r


def pendulum_obs(state: Tensor) -> Tensor:
    r"""Pendulum's observation :math:`(\cos\theta,\sin\theta,\dot\theta)`, ``(..., 2)`` -> ``(..., 3)``."""
    th, thdot = _state(state, 2, "state").unbind(-1)
    return torch.stack([torch.cos(th), torch.sin(th), thdot], -1)


class BatchedCartPole:
    """``shape`` (e.g. ``(K, N)``: seeds by environments) independent CartPole-v1 episodes with auto-reset.

    ``step()`` returns ``(obs, reward, terminated, truncated, episode_return)``; where an episode ends
    (pole down, or 500 steps) the returned ``obs`` is already the next episode's first, and ``episode_return``
    holds the finished episode's return (NaN elsewhere). Starts are uniform in :math:`[-0.05, 0.05]^4`.
    """

    def __init__(self, shape: tuple[int, ...], generator: torch.Generator):
        self.shape, self.gen = tuple(shape), generator
        self.state = self._draw(torch.ones(self.shape, dtype=torch.bool))
        self.t = torch.zeros(self.shape, dtype=torch.long)

    def _draw(self, mask: Tensor) -> Tensor:
        fresh = torch.rand(*self.shape, 4, generator=self.gen, dtype=torch.float64) * 0.1 - 0.05
        return torch.where(mask[..., None], fresh, self.state if hasattr(self, "state") else fresh)

    def obs(self) -> Tensor:
        return cartpole_obs(self.state)

    def step(self, action: Tensor):
        self.state, terminated = cartpole_step(self.state, action)
        self.t += 1
        truncated = (self.t >= CARTPOLE_MAX_STEPS) & ~terminated
        done = terminated | truncated
        episode_return = torch.where(done, self.t.double(), torch.nan)
        self.state = self._draw(done)
        self.t = torch.where(done, 0, self.t)
        return self.obs(), torch.ones(self.shape, dtype=torch.float64), terminated, truncated, episode_return


class BatchedPendulum:
    """``shape`` independent Pendulum-v1 episodes, all 200 steps long (so they reset together): ``reset()``
    draws :math:`\\theta\\sim U[-\\pi,\\pi]`, :math:`\\dot\\theta\\sim U[-1,1]`; ``step()`` returns
    ``(obs, reward)``."""

    def __init__(self, shape: tuple[int, ...], generator: torch.Generator):
        self.shape, self.gen = tuple(shape), generator
        self.reset()

    def reset(self) -> Tensor:
        U = torch.rand(*self.shape, 2, generator=self.gen, dtype=torch.float64) * 2 - 1
        self.state = U * torch.tensor([math.pi, 1.0], dtype=torch.float64)
        self.t = 0
        return pendulum_obs(self.state)

    def step(self, u: Tensor) -> tuple[Tensor, Tensor]:
        self.state, r = pendulum_step(self.state, u)
        self.t += 1
        return pendulum_obs(self.state), r


class SeedMLP(nn.Module):
    r"""``K`` independent MLPs ``sizes[0] -> ... -> sizes[-1]`` (tanh or ReLU between layers), one per seed:
    :math:`h_{l+1}=\phi(h_lW_l+b_l)` with :math:`W_l` ``(K, d_l, d_{l+1})``, computed by ``torch.baddbmm``.
    Initialised like ``nn.Linear`` (uniform :math:`\pm1/\sqrt{d_l}`) from ``generator``; ``out_scale``
    multiplies the last layer's initial weights (small for policy heads). ``x`` ``(K, N, d_0)`` -> ``(K, N, d_L)``.

    >>> net = SeedMLP(3, (2, 8, 1), torch.Generator().manual_seed(0))
    >>> tuple(net(torch.zeros(3, 5, 2, dtype=torch.float64)).shape)
    (3, 5, 1)
    """

    def __init__(self, K: int, sizes: tuple[int, ...], generator: torch.Generator, act: str = "tanh",
                 out_scale: float = 1.0):
        super().__init__()
        if K < 1 or len(sizes) < 2 or act not in ("tanh", "relu"):
            raise ValueError(f"SeedMLP needs K >= 1, at least two sizes and act in (tanh, relu); got K = {K}, "
                             f"sizes = {sizes}, act = {act!r}")
        self.K, self.sizes, self.act = K, tuple(sizes), act
        self.W, self.b = nn.ParameterList(), nn.ParameterList()
        for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            bound = 1 / math.sqrt(d_in)
            scale = out_scale if i == len(sizes) - 2 else 1.0
            W = (torch.rand(K, d_in, d_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound * scale
            b = (torch.rand(K, 1, d_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound * scale
            self.W.append(nn.Parameter(W))
            self.b.append(nn.Parameter(b))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[0] != self.K or x.shape[2] != self.sizes[0]:
            raise ValueError(f"x must be (K, N, d_in) = ({self.K}, N, {self.sizes[0]}), got {tuple(x.shape)}")
        phi = torch.tanh if self.act == "tanh" else torch.relu
        for i, (W, b) in enumerate(zip(self.W, self.b, strict=True)):
            x = torch.baddbmm(b, x, W)
            if i < len(self.W) - 1:
                x = phi(x)
        return x
