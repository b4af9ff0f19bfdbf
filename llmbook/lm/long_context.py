r"""A trained RoPE model run past its training length with scaled frequencies (chapter 4).

:mod:`llmbook.lm.context_extension` computes the scaled frequencies :math:`\theta_j'` and the attention
factor :math:`a` of position interpolation, NTK-aware scaling and YaRN. This module puts them into a
trained :class:`~llmbook.lm.gpt.TinyGPT` and measures what they do to its next-token loss at each
position of a window longer than the one it was trained on:

* :func:`scaled_rope_logits` runs the model with ``cos`` and ``sin`` built from :math:`\theta_j'` and
  multiplied by :math:`a` (the convention of ``transformers``' rotary embedding);
* :func:`token_losses` gives the cross-entropy of every position;
* :func:`band_means` averages it over bands of positions (for instance inside and past the trained length).

The benchmark ``benchmarks/tiny_gpt_context_extension.py`` uses them on the book's held-out text.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import check_choice, check_positive_int, check_range, check_token_ids
from llmbook.lm.context_extension import METHODS, scaled_inv_freq
from llmbook.lm.gpt import TinyGPT
from llmbook.lm.rope import rope_cos_sin

__all__ = ["scaled_rope_logits", "token_losses", "band_means"]


def _check_model(model) -> TinyGPT:
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model must be a TinyGPT (RoPE, half-split layout), got {type(model).__name__}")
    return model


@torch.no_grad()
def scaled_rope_logits(model: TinyGPT, ids: Int[Tensor, "B T"], method: str = "none", factor: float = 1.0,
                       L_train: int | None = None) -> Float[Tensor, "B T V"]:
    r"""Next-token logits of ``model`` on ``ids`` with RoPE's frequencies scaled by ``method``.

    Every layer rotates its queries and keys at position :math:`m` by the angles :math:`m\theta_j'`, with
    the tables multiplied by the attention factor :math:`a`:

    .. math:: \cos' = a\cos(m\theta_j'),\qquad \sin' = a\sin(m\theta_j'),\qquad
              (\theta', a) = \mathrm{scaled\_inv\_freq}(\text{method}, D, b, s, L_{train})

    so every score :math:`q^\top k` is multiplied by :math:`a^2`. ``method`` is one of
    :data:`~llmbook.lm.context_extension.METHODS` (``"none"`` is the model as trained), ``factor`` is
    :math:`s`, ``L_train`` the training context (default ``model.config.max_seq_len``); ``"dynamic"``
    uses the current length ``T``. ``ids`` is ``(B, T)``, of any length ``T >= 1``; returns ``(B, T, V)``.

    >>> from llmbook.lm.gpt import GPTConfig
    >>> net = TinyGPT(GPTConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=2, max_seq_len=4)).eval()
    >>> ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    >>> torch.equal(scaled_rope_logits(net, ids), net(ids))  # "none" is the model itself
    True
    >>> scaled_rope_logits(net, ids, "yarn", factor=2.0).shape
    torch.Size([1, 8, 10])
    """
    cfg = _check_model(model).config
    check_choice(method, "method", METHODS)
    check_range(factor, "factor", 1.0)
    L_train = cfg.max_seq_len if L_train is None else check_positive_int(L_train, "L_train")
    ids = check_token_ids(ids, cfg.vocab_size)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
    T = ids.shape[1]
    inv_freq, a = scaled_inv_freq(method, cfg.head_dim, cfg.rope_theta, factor, L_train, seq_len=T)
    h = model.embed(ids)
    cos, sin = rope_cos_sin(T, cfg.head_dim, inv_freq=inv_freq, dtype=h.dtype)
    rope = (cos * a, sin * a)
    for block in model.blocks:
        h = block(h, is_causal=True, rope=rope)
    return model.head(model.norm(h))


@torch.no_grad()
def token_losses(model: TinyGPT, ids: Int[Tensor, "B T1"], method: str = "none", factor: float = 1.0,
                 L_train: int | None = None) -> Float[Tensor, "B T"]:
    r"""Cross-entropy (nats) of every next token: :math:`\ell_{b,t} = -\log p(x_{b,t+1}\mid x_{b,\le t})`.

    ``ids`` is ``(B, T + 1)``: the model reads ``ids[:, :-1]`` through :func:`scaled_rope_logits` (same
    ``method``, ``factor``, ``L_train``) and is scored on ``ids[:, 1:]``. Position :math:`t` of the result
    is the prediction made at position :math:`t` with :math:`t + 1` tokens of context. Returns ``(B, T)``.

    >>> from llmbook.lm.gpt import GPTConfig
    >>> net = TinyGPT(GPTConfig(vocab_size=10, d_model=16, n_layers=1, n_heads=2, max_seq_len=4)).eval()
    >>> token_losses(net, torch.tensor([[1, 2, 3, 4, 5]]), "pi", factor=2.0).shape
    torch.Size([1, 4])
    """
    ids = torch.as_tensor(ids)
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must have shape (B, T + 1) with T >= 1, got {tuple(ids.shape)}")
    logits = scaled_rope_logits(model, ids[:, :-1], method, factor, L_train)
    return F.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")


def band_means(losses: Float[Tensor, "B T"], edges) -> Float[Tensor, "B K"]:
    r"""Mean of ``losses`` over each band of positions :math:`[e_k, e_{k+1})`: ``(B, T) -> (B, K)``.

    ``edges`` is an increasing sequence of ``K + 1`` ints with :math:`0 \le e_0` and :math:`e_K \le T`.

    >>> band_means(torch.tensor([[1.0, 3.0, 5.0, 7.0]]), [0, 2, 4])
    tensor([[2., 6.]])
    """
    losses = torch.as_tensor(losses)
    if losses.ndim != 2 or losses.shape[1] == 0:
        raise ValueError(f"losses must have shape (B, T) with T >= 1, got {tuple(losses.shape)}")
    e = [int(v) for v in edges]
    if len(e) < 2 or e[0] < 0 or e[-1] > losses.shape[1] or any(b <= a for a, b in zip(e, e[1:], strict=False)):
        raise ValueError(f"edges must be >= 2 strictly increasing ints within [0, T = {losses.shape[1]}], got {e}")
    return torch.stack([losses[:, a:b].mean(1) for a, b in zip(e, e[1:], strict=False)], dim=1)
