r"""A reward model for the book's assistant, trained on its own episodes, and exact best-of-N estimates.

The reward model (RM) reads an episode of :func:`llmbook.agents.agent_loop.run_agent` with the assistant's own
frozen trunk (:meth:`llmbook.lm.gpt.TinyGPT.hidden_states`), pools the hidden states into one vector
:math:`\phi(y)` (:func:`episode_features`) and scores it with a linear head :math:`r(y) = w^\top(\phi(y) -
\mu)/\sigma` (:class:`RewardHead`), fitted with chapter 10's Bradley-Terry loss
(:func:`llmbook.lm.preference.reward_model_loss`) on pairs of accepted and rejected episodes of the same prompt
(:func:`within_prompt_pairs`, :func:`fit_reward_head`). :func:`best_of_n` gives the expected gold reward of the
episode a scorer picks out of :math:`n`, averaged exactly over every subset of :math:`n` of the :math:`N`
stored samples; :func:`within_prompt_auc` is the RM's pairwise accuracy on held-out prompts and
:func:`prompt_bootstrap` an interval over prompts. Chapter 41 (``benchmarks/assistant_reward_model.py``) uses
them. Registers no equation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from llmbook._checks import check_choice, check_positive_int, check_range
from llmbook.lm.assistant import encode_transcript, pad_right
from llmbook.lm.preference import reward_model_loss

__all__ = ["RewardHead", "best_of_n", "episode_features", "fit_reward_head", "prompt_bootstrap",
           "within_prompt_auc", "within_prompt_pairs"]

POOLS = ("mean", "last")


def _grid(name: str, x) -> Tensor:
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must have shape (P, N) with P, N >= 1 (prompts, samples), got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite")
    return x


@torch.no_grad()
def episode_features(assistant, trajectories, pool: str = "mean", batch_size: int = 64) -> Tensor:
    r"""The RM's input :math:`\phi(y)`, ``(M, C)``: the assistant's final hidden states pooled over an episode.

    Each trajectory's transcript (``trajectory.text()``) is encoded with :func:`llmbook.lm.assistant.encode_transcript`;
    ``pool="mean"`` averages the hidden states of the tokens the assistant wrote, ``"last"`` takes the last
    token's. Episodes are right-padded in batches of ``batch_size`` (causal attention: padding after a token
    does not change it). Returned in the model's dtype.
    """
    check_choice(pool, "pool", POOLS)
    batch_size = check_positive_int(batch_size, "batch_size")
    enc = [encode_transcript(assistant.tok, t.text()) for t in trajectories]
    if not enc:
        raise ValueError("trajectories must be non-empty")
    out = []
    for i in range(0, len(enc), batch_size):
        rows, mine = [e[0] for e in enc[i:i + batch_size]], [e[1] for e in enc[i:i + batch_size]]
        ids, keep = pad_right(rows, assistant.pad_id, mine)
        h = assistant.model.hidden_states(ids)
        if pool == "last":
            out.append(h[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])])
        else:
            k = keep.to(h.dtype)[..., None]
            out.append((h * k).sum(1) / k.sum(1).clamp(min=1))
    return torch.cat(out)


def within_prompt_pairs(y) -> tuple[Tensor, Tensor]:
    """Every (accepted, rejected) pair of samples of one prompt: flat indices ``(winners, losers)`` into ``y``.

    ``y`` is ``(P, G)``, the gold 0/1 rewards of ``G`` samples of each of ``P`` prompts; sample ``g`` of prompt
    ``p`` has flat index ``p * G + g``. A prompt with ``k`` successes gives ``k (G - k)`` pairs.

    >>> [t.tolist() for t in within_prompt_pairs([[1, 0, 0], [1, 1, 1]])]
    [[0, 0], [1, 2]]
    """
    y = _grid("y", y)
    P, G = y.shape
    win, lose = [], []
    for p in range(P):
        good = [p * G + g for g in range(G) if y[p, g] > 0.5]
        bad = [p * G + g for g in range(G) if y[p, g] <= 0.5]
        win += [i for i in good for _ in bad]
        lose += bad * len(good)
    return torch.tensor(win, dtype=torch.long), torch.tensor(lose, dtype=torch.long)


@dataclass
class RewardHead:
    r"""A linear reward on standardised features: :math:`r(y) = w^\top (\phi(y) - \mu) / \sigma`, ``(M, C) -> (M,)``."""

    w: Tensor
    mu: Tensor
    sd: Tensor

    def __call__(self, phi: Tensor) -> Tensor:
        phi = torch.as_tensor(phi, dtype=torch.float64)
        if phi.ndim != 2 or phi.shape[1] != self.w.shape[0]:
            raise ValueError(f"phi must have shape (M, {self.w.shape[0]}), got {tuple(phi.shape)}")
        return (phi - self.mu) / self.sd @ self.w

    def to_dict(self) -> dict:
        """Plain lists (for a JSON file)."""
        return {k: getattr(self, k).tolist() for k in ("w", "mu", "sd")}

    @classmethod
    def from_dict(cls, d: dict) -> RewardHead:
        """The inverse of :meth:`to_dict`."""
        return cls(*(torch.tensor(d[k], dtype=torch.float64) for k in ("w", "mu", "sd")))


def fit_reward_head(phi: Tensor, winners, losers, weight_decay: float = 0.01, max_iter: int = 200) -> RewardHead:
    r"""Fit :class:`RewardHead` by Bradley-Terry maximum likelihood with an L2 penalty, to convergence (L-BFGS).

    .. math:: \min_w\ \frac{1}{|D|}\sum_{(i, j) \in D} -\log\sigma\big(r(y_i) - r(y_j)\big) + \lambda \|w\|^2

    ``phi`` :math:`\phi` ``(M, C)``; ``winners``, ``losers``: the pairs :math:`D` as index tensors into ``phi``;
    ``weight_decay`` :math:`\lambda \ge 0`. :math:`\mu, \sigma` are the features' mean and standard deviation
    (float64). The loss is chapter 10's :func:`llmbook.lm.preference.reward_model_loss`.
    """
    phi = torch.as_tensor(phi, dtype=torch.float64)
    if phi.ndim != 2 or phi.shape[0] < 2:
        raise ValueError(f"phi must have shape (M, C) with M >= 2, got {tuple(phi.shape)}")
    winners, losers = torch.as_tensor(winners, dtype=torch.long), torch.as_tensor(losers, dtype=torch.long)
    if winners.ndim != 1 or winners.shape != losers.shape or winners.numel() == 0:
        raise ValueError(f"winners and losers must be non-empty 1-D index tensors of one length, got shapes "
                         f"{tuple(winners.shape)} and {tuple(losers.shape)}")
    lam = check_range(weight_decay, "weight_decay", 0.0)
    mu, sd = phi.mean(0), phi.std(0) + 1e-6
    z = (phi - mu) / sd
    dz = z[winners] - z[losers]
    w = torch.zeros(phi.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=check_positive_int(max_iter, "max_iter"), tolerance_grad=1e-10,
                            tolerance_change=1e-14, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        r = dz @ w
        loss = reward_model_loss(r, torch.zeros_like(r)) + lam * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return RewardHead(w.detach(), mu, sd)


def best_of_n(s, y, n: int) -> Tensor:
    r"""Expected :math:`y` of the sample with the highest score :math:`s` among :math:`n` drawn from :math:`N`.

    The :math:`n` are a uniformly random subset of the :math:`N` stored samples of each prompt (without
    replacement), ties in :math:`s` broken uniformly at random. With the samples sorted by score, ascending,
    the one at rank :math:`i` is the subset's maximum with probability
    :math:`\binom{i-1}{n-1} / \binom{N}{n}`, so

    .. math:: \mathbb{E}[y_{\text{pick}}] = \sum_{i=n}^{N} \frac{\binom{i-1}{n-1}}{\binom{N}{n}}\, \bar y_{(i)}

    where :math:`\bar y_{(i)}` is the mean :math:`y` over the samples whose score ties with rank :math:`i`'s
    (uniform tie-breaking). ``s`` and ``y`` are ``(P, N)``; returns ``(P,)`` float64. ``best_of_n(y, y, n)``
    is the oracle, pass@n; ``best_of_n(s, s, n)`` the expected score of the pick; ``n = 1`` the mean.

    >>> best_of_n([[0.1, 0.9, 0.5]], [[0.0, 0.0, 1.0]], 2).tolist()  # subsets {0,1}, {0,2}, {1,2}
    [0.3333333333333333]
    """
    s, y = _grid("s", s), _grid("y", y)
    if s.shape != y.shape:
        raise ValueError(f"s and y must have one shape (P, N), got {tuple(s.shape)} and {tuple(y.shape)}")
    N = s.shape[1]
    n = check_positive_int(n, "n")
    if n > N:
        raise ValueError(f"n ({n}) must be at most the number of samples N = {N}")
    s_sorted, order = torch.sort(s, dim=1, stable=True)
    y_sorted = y.gather(1, order)
    y_bar = torch.empty_like(y_sorted)
    for p in range(s.shape[0]):  # replace y by its mean over each group of tied scores
        _, inverse, counts = torch.unique_consecutive(s_sorted[p], return_inverse=True, return_counts=True)
        sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, y_sorted[p])
        y_bar[p] = (sums / counts)[inverse]
    weight = torch.tensor([math.comb(i - 1, n - 1) / math.comb(N, n) for i in range(1, N + 1)], dtype=torch.float64)
    return y_bar @ weight


def within_prompt_auc(s, y) -> float:
    r"""Share of (accepted, rejected) pairs of the same prompt that ``s`` orders right (ties count one half).

    .. math:: \mathrm{AUC} = \frac{\sum_p \sum_{i: y_{pi} = 1} \sum_{j: y_{pj} = 0}
              \big([s_{pi} > s_{pj}] + \tfrac12 [s_{pi} = s_{pj}]\big)}{\sum_p k_p (N - k_p)}

    ``s`` and ``y`` (0/1) are ``(P, N)``; the held-out pairwise accuracy of a reward model.

    >>> within_prompt_auc([[0.2, 0.1, 0.9], [0.0, 1.0, 2.0]], [[1, 0, 0], [1, 1, 1]])
    0.5
    """
    s, y = _grid("s", s), _grid("y", y)
    if s.shape != y.shape:
        raise ValueError(f"s and y must have one shape (P, N), got {tuple(s.shape)} and {tuple(y.shape)}")
    good = y > 0.5
    d = s[:, :, None] - s[:, None, :]  # (P, i, j)
    pair = good[:, :, None] & ~good[:, None, :]
    if not pair.any():
        raise ValueError("no prompt has both an accepted and a rejected sample")
    right = (d > 0).double() + 0.5 * (d == 0).double()
    return float((right * pair).sum() / pair.sum())


def prompt_bootstrap(values, weights=None, n_boot: int = 10_000, confidence: float = 0.95, seed: int = 0
                     ) -> tuple[float, float, float]:
    r"""Mean of per-prompt ``values`` ``(P,)`` and its percentile bootstrap interval over prompts: (mean, low, high).

    With ``weights`` :math:`m_p` ``(P,)`` the statistic is :math:`\sum_p m_p x_p / \sum_p m_p` (e.g. per-prompt
    AUCs weighted by their pair counts, which gives :func:`within_prompt_auc`); prompts are resampled whole.

    >>> prompt_bootstrap([0.0, 1.0, 1.0, 1.0], n_boot=2000)[0], prompt_bootstrap([0.0, 1.0], [3, 1])[0]
    (0.75, 0.25)
    """
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size < 2 or not np.isfinite(x).all():
        raise ValueError(f"values must be 1-D, finite, with at least 2 prompts, got shape {x.shape}")
    m = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64)
    if m.shape != x.shape or not np.isfinite(m).all() or (m < 0).any() or m.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative, not all 0, of shape {x.shape}, got {m.shape}")
    confidence = check_range(confidence, "confidence", 0.0, 1.0, low_open=True, high_open=True)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(check_positive_int(n_boot, "n_boot"), x.size))
    boot = (x[idx] * m[idx]).sum(1) / np.maximum(m[idx].sum(1), 1e-300)
    lo, hi = np.quantile(boot, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float((x * m).sum() / m.sum()), float(lo), float(hi)
