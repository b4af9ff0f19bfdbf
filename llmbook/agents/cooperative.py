r"""Cooperative multi-agent RL: value decomposition (VDN, QMIX) and MADDPG's centralised critic.

* **VDN** (39.03, :func:`vdn`): :math:`Q_{tot}=\sum_i Q_i(\tau_i,a_i)`; its greedy joint action is the
  per-agent greedy actions.
* **QMIX** (39.04, :class:`QMixer`): a state-conditioned mixing network whose hypernetwork weights pass
  through ``abs`` so that :math:`\partial Q_{tot}/\partial Q_i\ge 0`.
* **MADDPG** (39.05, :func:`maddpg_actor_loss`): the actor loss through a centralised critic
  :math:`Q_i(x,a_1,\dots,a_N)` whose autograd gradient is the deterministic policy gradient.

Centralised training, decentralised execution: all three use global information (the joint value, the
state s, the joint action) only while training; each agent acts on its own observation.
The games of the chapter (Nash, minimax, shaping) are in :mod:`llmbook.agents.multi_agent`.

>>> vdn(torch.tensor([[[1., 3.], [2., 0.]]]))[0].tolist()
[5.0]
"""

from __future__ import annotations

import torch
from torch import nn

from llmbook._checks import as_tensor, check_choice, check_dim, check_int, check_positive_int, check_range
from llmbook._precision import compute_dtype
from llmbook.registry import implements

__all__ = ["vdn", "QMixer", "maddpg_actor_loss", "monotonic_mix", "train_matrix_game"]


@implements("39.03")
def vdn(Q, actions=None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Value decomposition network: the joint value is the sum of per-agent values.

    .. math:: Q_{tot}(\tau,a)=\sum_{i=1}^{n}Q_i(\tau_i,a_i)

    Symbols: ``Q`` ``(B, N, A)`` agent i's utilities over its own A actions; ``actions`` ``(B, N)`` integer
    joint actions, or None for the greedy one. Returns ``(Q_tot, actions)`` with ``Q_tot`` ``(B,)``.
    Because the sum is monotone in every term, the greedy joint action is each agent's own argmax
    (decentralised execution): the N*A argmax replaces a search over :math:`A^N` joint actions.

    >>> vdn(torch.tensor([[[1., 3.], [2., 0.]]]))[1].tolist()
    [[1, 0]]
    """
    Q = as_tensor(Q, "Q")
    check_dim(Q, "Q", "(B, N, A)", min_dim=3, max_dim=3)
    if actions is None:
        if Q.shape[-1] == 0:
            raise ValueError(f"Q needs at least one action (A >= 1), got shape {tuple(Q.shape)}")
        actions = Q.argmax(-1)
    else:
        actions = torch.as_tensor(actions)
        if actions.dtype.is_floating_point or actions.dtype == torch.bool or actions.shape != Q.shape[:2]:
            raise ValueError(f"actions must be integer (B, N) = {tuple(Q.shape[:2])}, got {actions.dtype} "
                             f"{tuple(actions.shape)}")
        if actions.numel() and (actions.min() < 0 or actions.max() >= Q.shape[-1]):
            raise ValueError(f"actions must lie in [0, {Q.shape[-1] - 1}]")
    Q_a = Q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)  # (B, N)
    return Q_a.sum(-1), actions


@implements("39.04")
class QMixer(nn.Module):
    r"""QMIX's monotonic mixing network (Rashid et al. 2018).

    .. math:: Q_{tot}=W_2(s)^\top\,\mathrm{ELU}\big(W_1(s)^\top Q + b_1(s)\big)+b_2(s),\qquad
              \frac{\partial Q_{tot}}{\partial Q_i}\ge 0

    The weights :math:`W_1(s)` ``(N, E)`` and :math:`W_2(s)` ``(E,)`` come from hypernetworks fed with the
    global state s and pass through ``abs`` (``monotonic=True``), so every path from :math:`Q_i` to
    :math:`Q_{tot}` multiplies non-negative weights and the monotone ELU: :math:`Q_{tot}` is non-decreasing
    in each :math:`Q_i`, and the per-agent argmax is the joint argmax, as for VDN. ``monotonic=False``
    drops the ``abs`` (the counter-example). Biases are unconstrained.
    ``forward(Q, s)``: ``Q`` ``(B, N)``, ``s`` ``(B, d_s)`` -> ``(B,)``.
    """

    def __init__(self, n_agents: int, d_s: int, embed: int = 8, *, monotonic: bool = True, generator=None,
                 dtype=None):
        super().__init__()
        self.N = check_positive_int(n_agents, "n_agents")
        self.d_s = check_positive_int(d_s, "d_s")
        self.E = check_positive_int(embed, "embed")
        self.monotonic = bool(monotonic)
        self.hyper_w1 = nn.Linear(self.d_s, self.N * self.E, dtype=dtype)
        self.hyper_b1 = nn.Linear(self.d_s, self.E, dtype=dtype)
        self.hyper_w2 = nn.Linear(self.d_s, self.E, dtype=dtype)
        self.hyper_b2 = nn.Sequential(nn.Linear(self.d_s, self.E, dtype=dtype), nn.ReLU(),
                                      nn.Linear(self.E, 1, dtype=dtype))
        if generator is not None:
            with torch.no_grad():
                for p in self.parameters():
                    bound = 1.0 / max(p.shape[-1], 1) ** 0.5
                    u = torch.rand(p.shape, generator=generator, dtype=torch.float64)
                    p.copy_((u * 2 * bound - bound).to(p.dtype))

    def forward(self, Q, s) -> torch.Tensor:
        Q, s = as_tensor(Q, "Q"), as_tensor(s, "s")
        check_dim(Q, "Q", "(B, N)", min_dim=2, max_dim=2)
        check_dim(s, "s", "(B, d_s)", min_dim=2, max_dim=2)
        if Q.shape[1] != self.N or s.shape[1] != self.d_s or Q.shape[0] != s.shape[0]:
            raise ValueError(f"Q must be (B, N) = (B, {self.N}) and s (B, d_s) = (B, {self.d_s}) with the same B, "
                             f"got {tuple(Q.shape)} and {tuple(s.shape)}")
        dt = compute_dtype(Q.dtype)
        w = self.hyper_w1.weight.dtype
        s_w = s.to(w)
        W1 = self.hyper_w1(s_w).reshape(-1, self.N, self.E).to(dt)
        W2 = self.hyper_w2(s_w).to(dt)
        if self.monotonic:
            W1, W2 = W1.abs(), W2.abs()
        h = nn.functional.elu(torch.einsum("bn,bne->be", Q.to(dt), W1) + self.hyper_b1(s_w).to(dt))
        return ((h * W2).sum(-1) + self.hyper_b2(s_w).squeeze(-1).to(dt)).to(Q.dtype)


@implements("39.05")
def maddpg_actor_loss(critic, x, actions, a_i, i: int) -> torch.Tensor:
    r"""MADDPG's actor loss for agent i through its centralised critic (Lowe et al. 2017).

    .. math:: \nabla_{\theta_i}J\approx\mathbb{E}\big[\nabla_{\theta_i}\mu_i(o_i)\,
              \nabla_{a_i}Q_i(x,a_1,\dots,a_N)\big|_{a_i=\mu_i(o_i)}\big]

    Symbols: ``critic`` a callable :math:`Q_i(x, a)` mapping ``x`` ``(B, d_x)`` and the joint action
    ``(B, N, d_a)`` to ``(B,)``; ``actions`` ``(B, N, d_a)`` the other agents' actions (from the replay
    buffer); ``a_i`` ``(B, d_a)`` = :math:`\mu_i(o_i)`, the current policy's action with its graph; ``i``
    the agent. Returns the scalar :math:`-\frac1B\sum_b Q_i(x_b, a_{1..N})` with agent i's action replaced
    by ``a_i``: its autograd gradient w.r.t. :math:`\theta_i` is minus the deterministic policy gradient
    above (the chain rule through the critic), and only agent i's action carries a gradient.

    >>> crit = lambda x, a: -(a ** 2).sum((-1, -2))
    >>> maddpg_actor_loss(crit, torch.zeros(1, 2), torch.ones(1, 2, 1), torch.zeros(1, 1), 0).item()
    1.0
    """
    x, actions, a_i = as_tensor(x, "x"), as_tensor(actions, "actions"), as_tensor(a_i, "a_i")
    check_dim(x, "x", "(B, d_x)", min_dim=2, max_dim=2)
    check_dim(actions, "actions", "(B, N, d_a)", min_dim=3, max_dim=3)
    check_dim(a_i, "a_i", "(B, d_a)", min_dim=2, max_dim=2)
    B, N, d_a = actions.shape
    if N == 0:
        raise ValueError("actions must hold at least one agent (N >= 1)")
    i = check_int(i, "i", low=0, high=N - 1)
    if a_i.shape != (B, d_a) or x.shape[0] != B:
        raise ValueError(f"a_i must be (B, d_a) = ({B}, {d_a}) and x (B, d_x) with B = {B}, got "
                         f"{tuple(a_i.shape)} and {tuple(x.shape)}")
    if not callable(critic):
        raise TypeError(f"critic must be a callable Q_i(x, a), got {type(critic).__name__}")
    mask = torch.zeros(N, 1, dtype=a_i.dtype)
    mask[i] = 1.0
    joint = actions.detach().to(a_i.dtype) * (1 - mask) + a_i.unsqueeze(1) * mask  # (B, N, d_a)
    q = critic(x, joint)
    if q.shape != (B,):
        raise ValueError(f"critic must return (B,) = ({B},), got {tuple(q.shape)}")
    return -q.mean() if B else q.sum()


# ----------------------------------------------------------------------------- learning on a matrix game
_METHODS = ("independent", "vdn", "qmix")


def monotonic_mix(Q, W1, b1, W2, b2, *, monotonic: bool = True) -> torch.Tensor:
    r"""A state-independent QMIX mixer, batched over ``R`` independent runs (one-state games).

    .. math:: Q_{tot}=|W_2|^\top\,\mathrm{ELU}\big(|W_1|^\top Q+b_1\big)+b_2,\qquad
              \frac{\partial Q_{tot}}{\partial Q_i}=\sum_e|W_2|_e\,\mathrm{ELU}'(\cdot)_e\,|W_1|_{ie}\ge0

    :class:`QMixer` with its hypernetworks replaced by free parameters: a matrix game has one state, so
    :math:`W_1(s)` is a constant. Symbols: ``Q`` ``(R, B, N)`` the chosen agents' utilities, ``W1``
    ``(R, N, E)``, ``b1`` ``(R, E)``, ``W2`` ``(R, E)``, ``b2`` ``(R,)``; returns ``(R, B)``.
    ``monotonic=False`` drops the ``abs`` (the counter-example).

    >>> one = torch.ones(1, 1, 1)
    >>> monotonic_mix(torch.zeros(1, 1, 1), -one, torch.zeros(1, 1), -torch.ones(1, 1), torch.zeros(1)).tolist()
    [[0.0]]
    """
    Q, W1, b1, W2, b2 = (as_tensor(x, n) for x, n in ((Q, "Q"), (W1, "W1"), (b1, "b1"), (W2, "W2"), (b2, "b2")))
    check_dim(Q, "Q", "(R, B, N)", min_dim=3, max_dim=3)
    R, _, N = Q.shape
    E = W1.shape[-1] if W1.dim() == 3 else -1
    for x, name, shape in ((W1, "W1", (R, N, E)), (b1, "b1", (R, E)), (W2, "W2", (R, E)), (b2, "b2", (R,))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {shape} for Q of shape {tuple(Q.shape)} (R, B, N) and E = {E}, "
                             f"got {tuple(x.shape)}")
    if monotonic:
        W1, W2 = W1.abs(), W2.abs()
    h = nn.functional.elu(torch.einsum("rbn,rne->rbe", Q, W1) + b1[:, None])
    return (h * W2[:, None]).sum(-1) + b2[:, None]


def train_matrix_game(payoff, method: str, *, runs: int = 10, steps: int = 400, batch: int = 32,
                      eps_start: float = 1.0, eps_end: float = 0.05, lr: float = 0.05, embed: int = 8,
                      generator=None) -> dict:
    r"""Train ``runs`` independent teams on a cooperative N-player matrix game (one state, one step).

    Every agent keeps a utility table :math:`Q_i(a_i)` and plays :math:`\epsilon`-greedily on it (decentralised
    execution); :math:`\epsilon` falls linearly from ``eps_start`` to ``eps_end`` over the first half of the
    ``steps``. Each step draws ``batch`` joint plays, pays the team ``r = payoff[a_1, ..., a_N]`` and takes
    one Adam step (``lr``) on the squared error of the team's regression (the TD target of a one-step game
    is ``r``):

    * ``"independent"``: :math:`\sum_i\mathbb E(Q_i(a_i)-r)^2`, each agent alone (independent Q-learners);
    * ``"vdn"``: :math:`\mathbb E(\sum_iQ_i(a_i)-r)^2` (:func:`vdn`);
    * ``"qmix"``: :math:`\mathbb E(f(Q_1(a_1),\dots,Q_N(a_N))-r)^2` with the monotone :func:`monotonic_mix`
      (``embed`` hidden units).

    ``payoff`` ``(A_1, ..., A_N)``, N >= 2. Vectorised over the runs. Returns float64 tensors:
    ``"greedy"`` ``(steps, runs, N)`` each agent's greedy action after every step, ``"optimal"``
    ``(steps, runs)`` bool (the greedy joint action earns the payoff's maximum), ``"Q"`` a list of N
    ``(runs, A_i)`` tables, and ``"Q_tot"`` ``(runs, A_1, ..., A_N)`` the fitted team value of every joint
    action (None for ``"independent"``: each agent fits ``r`` alone, so no team value is fitted).
    ``generator`` seeds the initial tables and the exploration (default: seed 0).

    >>> out = train_matrix_game(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "vdn", runs=2, steps=50)
    >>> out["optimal"].shape, bool(out["optimal"][-1].all())
    (torch.Size([50, 2]), True)
    """
    check_choice(method, "method", _METHODS)
    payoff = as_tensor(payoff, "payoff").double()
    if payoff.dim() < 2 or payoff.numel() == 0 or not torch.isfinite(payoff).all():
        raise ValueError(f"payoff must be a finite (A_1, ..., A_N) table with N >= 2 agents, got shape "
                         f"{tuple(payoff.shape)}")
    R, steps, B = (check_positive_int(v, n) for v, n in ((runs, "runs"), (steps, "steps"), (batch, "batch")))
    eps_start, eps_end = check_range(eps_start, "eps_start", 0, 1), check_range(eps_end, "eps_end", 0, 1)
    lr = check_range(lr, "lr", 0.0, low_open=True)
    E = check_positive_int(embed, "embed")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    sizes, N = payoff.shape, payoff.dim()
    Qs = [(0.1 * torch.randn(R, A, generator=gen, dtype=torch.float64)).requires_grad_() for A in sizes]
    mix = [(0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()
           for shape in ((R, N, E), (R, E), (R, E), (R,))] if method == "qmix" else []
    opt = torch.optim.Adam(Qs + mix, lr=lr)
    greedy, optimal = [], []
    best = payoff.max()
    for step in range(steps):
        eps = eps_start + (eps_end - eps_start) * min(1.0, step / max(1, steps // 2))
        acts = []
        for Qi, A in zip(Qs, sizes, strict=True):
            explore = torch.rand(R, B, generator=gen) < eps
            rand_a = torch.randint(0, A, (R, B), generator=gen)
            acts.append(torch.where(explore, rand_a, Qi.detach().argmax(-1)[:, None]))
        r = payoff[tuple(acts)]  # (R, B)
        chosen = torch.stack([Qi.gather(1, a) for Qi, a in zip(Qs, acts, strict=True)], -1)  # (R, B, N)
        if method == "independent":
            loss = ((chosen - r[..., None]) ** 2).mean((0, 1)).sum()
        elif method == "vdn":
            loss = ((chosen.sum(-1) - r) ** 2).mean()
        else:
            loss = ((monotonic_mix(chosen, *mix) - r) ** 2).mean()
        opt.zero_grad()
        (loss * R).backward()  # the runs are independent: each gets its own mean squared error's gradient
        opt.step()
        g = torch.stack([Qi.detach().argmax(-1) for Qi in Qs], -1)  # (R, N)
        greedy.append(g)
        optimal.append(payoff[tuple(g.T)] == best)
    with torch.no_grad():
        grids = torch.meshgrid(*[torch.arange(A) for A in sizes], indexing="ij")
        chosen = torch.stack([Qi[:, g.reshape(-1)] for Qi, g in zip(Qs, grids, strict=True)], -1)  # (R, J, N)
        Q_tot = monotonic_mix(chosen, *mix) if method == "qmix" else chosen.sum(-1)
    return {"greedy": torch.stack(greedy), "optimal": torch.stack(optimal), "Q": [Qi.detach() for Qi in Qs],
            "Q_tot": None if method == "independent" else Q_tot.reshape(R, *sizes)}
