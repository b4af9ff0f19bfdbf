r"""Chapter 6's parameter-matched FFN experiment: the next character from the previous two.

Each character gets an ``e``-dimensional embedding; the two previous characters side by side form
:math:`h \in \mathbb{R}^{2e}`, and the logits of the next character are read from
:math:`h + \mathrm{FFN}(\mathrm{RMSNorm}(h))`, a pre-norm residual FFN as in a transformer block. Without an FFN
the logit of the next character is a sum of one term per previous character, so the model cannot express
that "th" predicts differently from what "t" and "h" predict apart; the FFN supplies that interaction. The
training text is grouped by its two-character contexts, so one full-batch step sees every character once.

:func:`train_pair_model` trains one model; :func:`run_experiment` trains the three models of the chapter
over several seeds (``benchmarks/ffn_matched.py`` records it, and the chapter re-trains one seed to check the
record). Everything is float64 from the initial draw on: 150 Adam steps amplify a difference in the last
bits thousands-fold, and float32's last bits depend on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from llmbook.lm import activations as act
from llmbook.lm import blocks
from llmbook.lm import norms as nm

__all__ = ["PairModel", "context_counts", "nats_per_char", "ffn_factories", "train_pair_model", "run_experiment"]


def context_counts(data, V: int) -> tuple[Int[Tensor, "P 2"], Float[Tensor, "P V"]]:
    r"""The two-character contexts of ``data`` and how often each next character follows them.

    Returns ``(pairs, counts)``: ``pairs[p] = (a, b)`` for every context that occurs (sorted by
    :math:`aV + b`), and ``counts[p, c]`` the number of positions :math:`t` with
    :math:`(x_{t-2}, x_{t-1}, x_t) = (a, b, c)`, in float64. ``data`` is a 1-D array of ids below ``V``.

    >>> pairs, counts = context_counts(np.array([0, 1, 0, 1, 2]), V=3)
    >>> pairs.tolist(), counts.tolist()
    ([[0, 1], [1, 0]], [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    """
    data = torch.as_tensor(np.asarray(data).astype("int64"))
    if data.ndim != 1 or len(data) < 3:
        raise ValueError(f"data must be a 1-D sequence of at least 3 ids, got shape {tuple(data.shape)}")
    if int(data.min()) < 0 or int(data.max()) >= V:
        raise ValueError(f"ids must lie in [0, V = {V}), got [{int(data.min())}, {int(data.max())}]")
    counts = torch.zeros(V * V, V, dtype=torch.float64)
    counts.index_put_((data[:-2] * V + data[1:-1], data[2:]), torch.ones(len(data) - 2, dtype=torch.float64),
                      accumulate=True)
    seen = (counts.sum(1) > 0).nonzero().squeeze(1)
    return torch.stack([seen // V, seen % V], 1), counts[seen]


class PairModel(nn.Module):
    """The next character from the previous two: two ``e``-dim embeddings side by side (``d = 2e``), an FFN, a head.

    ``ffn`` maps ``(P, d) -> (P, d)`` or is ``None``. ``PairModel(V, ffn)(pairs)`` takes ``(P, 2)`` ids and
    returns ``(P, V)`` logits.

    >>> PairModel(5, None, e=2)(torch.tensor([[0, 1], [4, 4]])).shape
    torch.Size([2, 5])
    """

    def __init__(self, V: int, ffn: nn.Module | None, e: int = 6):
        super().__init__()
        self.embed, self.ffn, self.head = nn.Embedding(V, e), ffn, nn.Linear(2 * e, V, bias=False)

    def forward(self, pairs: Int[Tensor, "P 2"]) -> Float[Tensor, "P V"]:
        h = self.embed(pairs).flatten(1)
        if self.ffn is not None:
            h = h + self.ffn(nm.rms_norm(h))
        return self.head(h)


def nats_per_char(model: Callable[[Tensor], Tensor], pairs: Int[Tensor, "P 2"],
                  counts: Float[Tensor, "P V"]) -> Tensor:
    r"""The cross-entropy of the text in nats per character, from its context counts.

    .. math:: \mathcal{L} = -\frac{1}{\sum_{p,c} n_{pc}} \sum_{p,c} n_{pc} \log \mathrm{softmax}(z_p)_c

    with :math:`z_p` the logits of context ``pairs[p]`` and :math:`n_{pc}` = ``counts[p, c]``: the mean of
    :math:`-\log p(x_t \mid x_{t-2}, x_{t-1})` over the text, each context's logits computed once.

    >>> pairs, counts = context_counts(np.array([0, 1, 0, 1, 2]), V=3)
    >>> round(nats_per_char(lambda p: torch.zeros(len(p), 3), pairs, counts).item(), 4)  # log 3
    1.0986
    """
    return -(counts * torch.log_softmax(model(pairs), -1)).sum() / counts.sum()


def ffn_factories(d: int = 12) -> dict[str, Callable[[], nn.Module | None]]:
    r"""The chapter's three models by name: no FFN, a GELU FFN with :math:`d_{ff} = 4d`, a SwiGLU FFN with
    :math:`d_{ff} = \tfrac83 d` (both FFNs :math:`8d^2` weights, no biases).

    >>> list(ffn_factories(12))
    ['no FFN', 'GELU FFN, d_ff = 4d = 48', 'SwiGLU FFN, d_ff = 8d/3 = 32']
    """
    return {"no FFN": lambda: None,
            f"GELU FFN, d_ff = 4d = {4 * d}": lambda: blocks.FeedForward(d, 4 * d, activation="gelu", bias=False),
            f"SwiGLU FFN, d_ff = 8d/3 = {act.swiglu_hidden_size(d)}": lambda: act.SwiGLU(d, act.swiglu_hidden_size(d))}


def train_pair_model(V: int, make_ffn: Callable[[], nn.Module | None], seed: int, train: tuple[Tensor, Tensor],
                     steps: int = 150, lr: float = 3e-2, e: int = 6) -> tuple[PairModel, list[float]]:
    """Full-batch Adam on ``train = (pairs, counts)`` from seed ``seed``: ``(model, training losses)``.

    The embeddings and the head are drawn first, then the FFN, so every model of a seed starts from the same
    embeddings and head (a paired comparison). The model is float64; the default dtype is restored after.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = PairModel(V, None, e=e)
        model.ffn = make_ffn()
    finally:
        torch.set_default_dtype(previous)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    curve = []
    for _ in range(steps):
        loss = nats_per_char(model, *train)
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return model, curve


def run_experiment(V: int, train: tuple[Tensor, Tensor], heldout: tuple[Tensor, Tensor],
                   seeds: Iterable[int] = range(7), steps: int = 150, d: int = 12) -> dict:
    """Every model of :func:`ffn_factories` from every seed (the model without an FFN from the first only).

    Returns ``{name: {"seeds", "n_ffn", "n_params", "train", "heldout", "curves"}}``: the final losses per seed
    (nats per character) and the training curves, as plain lists.
    """
    seeds = list(seeds)
    out = {}
    for name, make_ffn in ffn_factories(d).items():
        runs = seeds[:1] if name == "no FFN" else seeds  # the FFN-less model only shows what an FFN adds
        rec = {"seeds": runs, "train": [], "heldout": [], "curves": []}
        for seed in runs:
            model, curve = train_pair_model(V, make_ffn, seed, train, steps=steps, e=d // 2)
            with torch.no_grad():
                rec["train"].append(nats_per_char(model, *train).item())
                rec["heldout"].append(nats_per_char(model, *heldout).item())
            rec["curves"].append(curve)
        rec["n_ffn"] = 0 if model.ffn is None else sum(p.numel() for p in model.ffn.parameters())
        rec["n_params"] = sum(p.numel() for p in model.parameters())
        out[name] = rec
    return out
