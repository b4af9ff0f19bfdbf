r"""Intrinsic rewards for exploration: random network distillation and the intrinsic curiosity module.

When the environment's reward is sparse (Montezuma's Revenge, a maze, a FrozenLake whose only reward
is the goal), an agent can be paid for *novelty*. Both modules here measure novelty as the error of
a predictor that is trained on the states the agent has seen: the error is large on new states and
falls as a state is visited again.

* **RND** (36.08, :class:`RND`, Burda et al. 2019): a fixed random *target* network
  :math:`f_{target}` and a trained *predictor* :math:`f_\theta`; the reward is the squared error
  :math:`\|f_\theta(s) - f_{target}(s)\|_2^2`.
* **ICM** (36.09, :class:`ICM`, Pathak et al. 2017): features :math:`\phi` trained by an *inverse*
  model (which action led from :math:`s_t` to :math:`s_{t+1}`?), and a *forward* model that predicts
  :math:`\phi(s_{t+1})` from :math:`\phi(s_t)` and :math:`a_t`; the reward is its squared error.

:func:`frozenlake_one_hot` turns gymnasium's FrozenLake states into one-hot inputs (gymnasium is
imported lazily). Modules take ``generator`` and ``dtype`` for reproducible initialisation.

>>> rnd = RND(4, generator=torch.Generator().manual_seed(0))
>>> rnd(torch.eye(4)).shape
torch.Size([4])
"""

from __future__ import annotations

import torch
from torch import nn

from llmbook._checks import check_finite, check_module_input, check_positive_int, check_token_ids
from llmbook.registry import implements

__all__ = ["mlp", "RND", "ICM", "frozenlake_one_hot", "frozenlake_env"]


def mlp(d_in: int, hidden: int, d_out: int, generator=None, dtype=None) -> nn.Sequential:
    """``Linear(d_in, hidden) -> ReLU -> Linear(hidden, d_out)``, initialised from ``generator``."""
    net = nn.Sequential(nn.Linear(d_in, hidden, dtype=dtype), nn.ReLU(), nn.Linear(hidden, d_out, dtype=dtype))
    if generator is not None:
        with torch.no_grad():
            for lin in (net[0], net[2]):
                bound = lin.in_features ** -0.5 if lin.in_features else 0.0
                for p in (lin.weight, lin.bias):  # nn.Linear's default U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                    p.copy_((torch.rand(p.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound)
    return net


@implements("36.08")
class RND(nn.Module):
    r"""Random network distillation: novelty as the error of predicting a fixed random network.

    .. math:: r^{int}_t = \|f_\theta(s_t) - f_{target}(s_t)\|_2^2

    Symbols: ``d_in`` the state size, ``d_out`` the embedding size of both networks, ``hidden`` their
    width. ``forward(s)``: ``s`` ``(..., d_in)`` -> reward ``(...,)``. Train the predictor by
    minimising ``forward(s).mean()`` on visited states; the target never changes (``requires_grad``
    is off). Burda et al. also normalise the inputs and the reward's scale; that is left to the caller.
    """

    def __init__(self, d_in: int, d_out: int = 8, hidden: int = 32, generator=None, dtype=None):
        super().__init__()
        self.d_in = check_positive_int(d_in, "d_in")
        check_positive_int(d_out, "d_out")
        check_positive_int(hidden, "hidden")
        self.target = mlp(d_in, hidden, d_out, generator, dtype)
        self.predictor = mlp(d_in, hidden, d_out, generator, dtype)
        self.target.requires_grad_(False)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        s = check_module_input(self, s, "s", d=self.d_in, symbol="d_in", contract="(..., d_in)")
        check_finite(s, "s")
        err = self.predictor(s) - self.target(s)
        return (err * err).sum(-1)


@implements("36.09")
class ICM(nn.Module):
    r"""The intrinsic curiosity module: the forward model's error in a learned feature space.

    .. math:: r^{int}_t = \|\hat\phi(s_{t+1}) - \phi(s_{t+1})\|_2^2, \qquad
       \hat\phi(s_{t+1}) = f\big(\phi(s_t), a_t\big)

    Symbols: ``d_in`` state size, ``n_actions``, ``d_feat`` the size of :math:`\phi`, ``hidden`` the
    width of the encoder :math:`\phi`, the forward model :math:`f` and the inverse model :math:`g`.
    ``forward(s, a, s_next)``: ``s``, ``s_next`` ``(B, d_in)``, ``a`` ``(B,)`` int -> reward ``(B,)``.
    Pathak et al. scale the reward by :math:`\eta/2`; here :math:`\eta = 2`, the equation as written.
    :meth:`losses` gives the two training losses: the forward loss (the reward's mean, with the target
    :math:`\phi(s_{t+1})` detached, so the forward loss cannot shrink its own target; its gradient still
    reaches the encoder through :math:`\phi(s_t)`) and the inverse model's cross-entropy of :math:`a_t`,
    which is what spreads the features apart.
    """

    def __init__(self, d_in: int, n_actions: int, d_feat: int = 8, hidden: int = 32, generator=None, dtype=None):
        super().__init__()
        self.d_in = check_positive_int(d_in, "d_in")
        self.n_actions = check_positive_int(n_actions, "n_actions")
        check_positive_int(d_feat, "d_feat")
        check_positive_int(hidden, "hidden")
        self.phi = mlp(d_in, hidden, d_feat, generator, dtype)
        self.forward_model = mlp(d_feat + n_actions, hidden, d_feat, generator, dtype)
        self.inverse_model = mlp(2 * d_feat, hidden, n_actions, generator, dtype)

    def _inputs(self, s, a, s_next):
        s = check_module_input(self, s, "s", d=self.d_in, symbol="d_in", ndim=2, contract="(B, d_in)")
        s_next = check_module_input(self, s_next, "s_next", d=self.d_in, symbol="d_in", ndim=2, contract="(B, d_in)")
        check_finite(s, "s")
        check_finite(s_next, "s_next")
        a = check_token_ids(a, self.n_actions, "a")
        if a.shape != s.shape[:1] or s_next.shape != s.shape:
            raise ValueError(f"s {tuple(s.shape)}, a {tuple(a.shape)} and s_next {tuple(s_next.shape)} "
                             "must be (B, d_in), (B,) and (B, d_in)")
        return s, a, s_next

    def _predict(self, s, a, s_next):
        phi_s, phi_next = self.phi(s), self.phi(s_next)
        onehot = nn.functional.one_hot(a, self.n_actions).to(phi_s.dtype)
        return self.forward_model(torch.cat([phi_s, onehot], -1)), phi_s, phi_next

    def forward(self, s: torch.Tensor, a: torch.Tensor, s_next: torch.Tensor) -> torch.Tensor:
        s, a, s_next = self._inputs(s, a, s_next)
        pred, _, phi_next = self._predict(s, a, s_next)
        err = pred - phi_next
        return (err * err).sum(-1)

    def losses(self, s, a, s_next) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward_loss, inverse_loss)`` for a batch of transitions (weight them as you like)."""
        s, a, s_next = self._inputs(s, a, s_next)
        pred, phi_s, phi_next = self._predict(s, a, s_next)
        forward_loss = ((pred - phi_next.detach()) ** 2).sum(-1).mean()
        logits = self.inverse_model(torch.cat([phi_s, phi_next], -1))
        return forward_loss, nn.functional.cross_entropy(logits, a)


def frozenlake_one_hot(n_states: int = 16) -> torch.Tensor:
    """The identity ``(n_states, n_states)``: row ``s`` is FrozenLake state ``s`` as a one-hot input."""
    return torch.eye(check_positive_int(n_states, "n_states"))


def frozenlake_env(map_name: str = "4x4", is_slippery: bool = True):
    """gymnasium's ``FrozenLake-v1`` (imported lazily; install the ``book`` extra for gymnasium)."""
    try:
        import gymnasium as gym
    except ImportError as err:  # pragma: no cover - gymnasium is in the book extra
        raise ImportError("frozenlake_env needs gymnasium: pip install 'llmbook[book]'") from err
    return gym.make("FrozenLake-v1", map_name=map_name, is_slippery=is_slippery)
