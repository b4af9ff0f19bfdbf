r"""DQN's training loop (Mnih et al. 2015), on a tabular environment with state features, many seeds at once.

The loop of the paper, step by step:

1. act ε-greedily in the online network's :math:`Q_\theta(s,\cdot)` (ε decays linearly from
   ``eps_start`` to ``eps_end`` over ``eps_decay`` steps);
2. store the transition :math:`(s,a,r,s',d)` in a **replay buffer** (:class:`ReplayBuffer`) that fills as
   the agent acts and, once full, overwrites its oldest entry;
3. every ``train_every`` steps, once ``learning_starts`` transitions are stored, draw a minibatch uniformly
   from the buffer and take one Adam step on the DQN loss (:func:`llmbook.agents.dqn.dqn_loss`) whose target
   :math:`r+\gamma(1-d)\max_{a'}Q_{\theta^-}(s',a')` comes from the **target network** :math:`\theta^-`;
4. every ``C`` gradient updates copy :math:`\theta\to\theta^-` (:func:`sync_target`).

``K`` independent agents (seeds) run side by side: each has its own environment copy, network
(:class:`EnsembleMLP`, ``K`` two-layer MLPs evaluated with one batched matrix product), buffer row and
minibatches; the loss is the sum of the ``K`` per-agent mean losses, so each agent's gradient is its own
(Adam is elementwise, so the ``K`` optimisers do not interact). An episode ends at a terminal state
(``d = 1``: no bootstrap) or after ``max_steps`` steps (a time-limit truncation: stored with ``d = 0``).

>>> buf = ReplayBuffer(capacity=3, K=1)
>>> for i in range(5):
...     buf.add(torch.tensor([i]), torch.tensor([0]), torch.tensor([float(i)]), torch.tensor([i]),
...             torch.tensor([False]))
>>> len(buf), sorted(buf.r[0].tolist())
(3, [2.0, 3.0, 4.0])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from llmbook._checks import as_tensor, check_choice, check_int, check_nonnegative_int, check_positive_int, check_range
from llmbook.agents.dqn import dqn_loss
from llmbook.agents.envs import TabularMDP

__all__ = ["ReplayBuffer", "EnsembleMLP", "sync_target", "run_dqn", "DQNRun"]


class ReplayBuffer:
    r"""A ring buffer of transitions for ``K`` agents: ``s``, ``a``, ``s_next`` long, ``r`` float64, ``done``
    bool, each ``(K, capacity)``. ``add`` writes one transition per agent (tensors ``(K,)``) at the write
    position, which then advances modulo ``capacity`` (so a full buffer forgets its oldest transition);
    :meth:`sample` draws ``batch`` indices per agent uniformly from the filled part, with replacement."""

    def __init__(self, capacity: int, K: int = 1):
        self.capacity, self.K = check_positive_int(capacity, "capacity"), check_positive_int(K, "K")
        self.s, self.a, self.s_next = (torch.zeros(K, capacity, dtype=torch.long) for _ in range(3))
        self.r = torch.zeros(K, capacity, dtype=torch.float64)
        self.done = torch.zeros(K, capacity, dtype=torch.bool)
        self.pos, self.size = 0, 0

    def __len__(self) -> int:
        return self.size

    def add(self, s, a, r, s_next, done) -> None:
        for name, x in (("s", s), ("a", a), ("r", r), ("s_next", s_next), ("done", done)):
            if torch.as_tensor(x).shape != (self.K,):
                raise ValueError(f"{name} must be one value per agent, shape ({self.K},), "
                                 f"got {tuple(torch.as_tensor(x).shape)}")
        i = self.pos
        self.s[:, i], self.a[:, i], self.r[:, i] = torch.as_tensor(s), torch.as_tensor(a), torch.as_tensor(r)
        self.s_next[:, i], self.done[:, i] = torch.as_tensor(s_next), torch.as_tensor(done)
        self.pos, self.size = (i + 1) % self.capacity, min(self.size + 1, self.capacity)

    def sample(self, batch: int, generator: torch.Generator):
        """``(s, a, r, s_next, done)``, each ``(K, batch)``: uniform indices in ``[0, len(self))`` per agent."""
        batch = check_positive_int(batch, "batch")
        if self.size == 0:
            raise ValueError("cannot sample from an empty replay buffer")
        idx = torch.randint(self.size, (self.K, batch), generator=generator)
        return tuple(x.gather(1, idx) for x in (self.s, self.a, self.r, self.s_next, self.done))


class EnsembleMLP(nn.Module):
    r"""``K`` independent two-layer MLPs :math:`Q_k(x)=W_{2,k}\,\mathrm{relu}(W_{1,k}x+b_{1,k})+b_{2,k}`.

    ``forward(x)``: ``x`` ``(K, B, d_in)`` -> ``(K, B, n_actions)`` (member ``k`` sees ``x[k]``). Weights are
    stored transposed (``W1`` ``(K, d_in, hidden)``) and initialised as ``nn.Linear`` does,
    :math:`U(-1/\sqrt{\text{fan\_in}}, 1/\sqrt{\text{fan\_in}})`, from ``generator``.

    >>> net = EnsembleMLP(3, 4, 8, 2, generator=torch.Generator().manual_seed(0))
    >>> tuple(net(torch.zeros(3, 5, 4)).shape)
    (3, 5, 2)
    """

    def __init__(self, K: int, d_in: int, hidden: int, n_actions: int, generator: torch.Generator | None = None):
        super().__init__()
        K, d_in = check_positive_int(K, "K"), check_positive_int(d_in, "d_in")
        hidden, n_actions = check_positive_int(hidden, "hidden"), check_positive_int(n_actions, "n_actions")
        g = generator if generator is not None else torch.Generator().manual_seed(0)

        def u(fan_in, *shape):
            return nn.Parameter((torch.rand(*shape, generator=g) * 2 - 1) / math.sqrt(fan_in))

        self.W1, self.b1 = u(d_in, K, d_in, hidden), u(d_in, K, 1, hidden)
        self.W2, self.b2 = u(hidden, K, hidden, n_actions), u(hidden, K, 1, n_actions)
        self.K, self.d_in = K, d_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[0] != self.K or x.shape[2] != self.d_in:
            raise ValueError(f"x must be (K, B, d_in) = ({self.K}, B, {self.d_in}), got {tuple(x.shape)}")
        h = torch.relu(torch.baddbmm(self.b1, x, self.W1))
        return torch.baddbmm(self.b2, h, self.W2)


def sync_target(target: nn.Module, online: nn.Module) -> None:
    r"""The target-network refresh :math:`\theta^-\leftarrow\theta`: copy every parameter of ``online`` into
    ``target`` (same architecture), in place, without gradients."""
    with torch.no_grad():
        for pt, po in zip(target.parameters(), online.parameters(), strict=True):
            pt.copy_(po)


class DQNRun(NamedTuple):
    """The result of :func:`run_dqn`: the online ``net`` and ``target`` (:class:`EnsembleMLP`), ``Q_history``
    ``(n_evals, K, S, A)`` float64 (``net(features)`` every ``eval_every`` steps, from step 0), ``eval_steps``
    ``(n_evals,)``, ``episode_returns`` (a list of ``K`` lists, undiscounted, while learning), ``n_updates``
    and ``n_syncs`` (gradient updates and target refreshes, the same for every agent)."""

    net: EnsembleMLP
    target: EnsembleMLP
    Q_history: torch.Tensor
    eval_steps: torch.Tensor
    episode_returns: list
    n_updates: int
    n_syncs: int


def run_dqn(mdp: TabularMDP, features, n_steps: int, *, K: int = 1, hidden: int = 64, lr: float = 1e-3,
            batch_size: int = 64, capacity: int = 10_000, C: int = 100, learning_starts: int = 200,
            train_every: int = 1, eps_start: float = 1.0, eps_end: float = 0.05, eps_decay: int = 1000,
            gamma: float | None = None, max_steps: int = 100, loss: str = "huber", eval_every: int = 100,
            seed: int = 0) -> DQNRun:
    r"""Train ``K`` DQN agents (seeds) for ``n_steps`` environment steps each on ``mdp``; see the module docstring.

    ``features`` ``(S, d_in)``: the network's input for each state (``torch.eye(S)``: one-hot). ``C``: the
    target refresh period in gradient updates. ``loss``: ``"mse"`` or ``"huber"`` (:func:`llmbook.agents.dqn.dqn_loss`).
    ``gamma`` defaults to ``mdp.gamma``. Networks, environment and minibatches draw from one
    ``torch.Generator`` seeded with ``seed``, so a call is reproducible. Returns :class:`DQNRun`.

    >>> from llmbook.agents.envs import from_gymnasium
    >>> run = run_dqn(from_gymnasium("FrozenLake-v1", is_slippery=False), torch.eye(16), 300, K=2, C=50)
    >>> tuple(run.Q_history.shape), run.n_updates, run.n_syncs
    ((4, 2, 16, 4), 101, 2)
    """
    X = as_tensor(features, "features").float()
    S, A = mdp.S, mdp.A
    if X.dim() != 2 or X.shape[0] != S:
        raise ValueError(f"features must be (S, d_in) = ({S}, d_in): one row per state, got {tuple(X.shape)}")
    n_steps, K = check_nonnegative_int(n_steps, "n_steps"), check_positive_int(K, "K")
    C, batch_size = check_positive_int(C, "C"), check_positive_int(batch_size, "batch_size")
    learning_starts, train_every = check_nonnegative_int(learning_starts, "learning_starts"), check_positive_int(
        train_every, "train_every")
    eps_start, eps_end = check_range(eps_start, "eps_start", 0.0, 1.0), check_range(eps_end, "eps_end", 0.0, 1.0)
    eps_decay, max_steps = check_positive_int(eps_decay, "eps_decay"), check_positive_int(max_steps, "max_steps")
    eval_every = check_positive_int(eval_every, "eval_every")
    lr = check_range(lr, "lr", 0.0, low_open=True)
    check_choice(loss, "loss", ("mse", "huber"))
    gamma = mdp.gamma if gamma is None else check_range(gamma, "gamma", 0.0, 1.0)
    g = torch.Generator().manual_seed(check_int(seed, "seed"))
    net = EnsembleMLP(K, X.shape[1], hidden, A, generator=g)
    target = EnsembleMLP(K, X.shape[1], hidden, A, generator=g)
    sync_target(target, net)
    opt = torch.optim.Adam(net.parameters(), lr=lr, foreach=True)
    buf = ReplayBuffer(capacity, K)
    cum, R, term = mdp.P.cumsum(-1).contiguous(), mdp.R, mdp.terminal
    mu_c = mdp.mu0.cumsum(0)

    def draw(c):  # inverse CDF: one index per row of c (..., n)
        u = torch.rand(*c.shape[:-1], 1, generator=g, dtype=c.dtype)
        return torch.searchsorted(c.contiguous(), u).squeeze(-1).clamp_max(c.shape[-1] - 1)

    lanes = torch.arange(K)
    s = draw(mu_c.expand(K, -1))
    t = torch.zeros(K, dtype=torch.long)
    G = torch.zeros(K, dtype=torch.float64)
    returns: list = [[] for _ in range(K)]
    history, steps = [], []
    n_updates = n_syncs = 0
    for step in range(n_steps + 1):
        if step % eval_every == 0:
            with torch.no_grad():
                history.append(net(X.expand(K, -1, -1)).double())
            steps.append(step)
        if step == n_steps:
            break
        eps = eps_end + (eps_start - eps_end) * max(0.0, 1 - step / eps_decay)
        with torch.no_grad():
            greedy = net(X[s].unsqueeze(1)).squeeze(1).argmax(-1)
        explore = torch.rand(K, generator=g) < eps
        a = torch.where(explore, torch.randint(A, (K,), generator=g), greedy)
        s2 = draw(cum[s, a])
        r, done = R[s, a, s2], term[s2]
        buf.add(s, a, r, s2, done)
        G, t = G + r, t + 1
        end = done | (t >= max_steps)
        for k in lanes[end].tolist():
            returns[k].append(G[k].item())
        s = torch.where(end, draw(mu_c.expand(K, -1)), s2)
        G, t = torch.where(end, 0.0, G), torch.where(end, 0, t)
        if len(buf) >= max(learning_starts, 1) and step % train_every == 0:
            bs, ba, br, bs2, bd = buf.sample(batch_size, g)
            with torch.no_grad():
                Q_next = target(X[bs2])
            L = K * dqn_loss(net(X[bs]), ba, br.float(), Q_next, gamma, bd, loss=loss)  # sum of per-agent means
            opt.zero_grad()
            L.backward()
            opt.step()
            n_updates += 1
            if n_updates % C == 0:
                sync_target(target, net)
                n_syncs += 1
    return DQNRun(net, target, torch.stack(history), torch.tensor(steps), returns, n_updates, n_syncs)
