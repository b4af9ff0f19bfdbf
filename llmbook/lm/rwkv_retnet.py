r"""The parts of RWKV and RetNet around their recurrences (chapter 18): token shift, receptance, rotation.

* :func:`token_shift` mixes each token with the one before it, RWKV's cheap stand-in for a short convolution;
* :func:`rwkv_time_mixing` is RWKV-4's whole time-mixing block: token shift, the projections to
  :math:`r, k, v`, the WKV average (:func:`llmbook.lm.recurrent.wkv`) and the receptance gate
  :math:`\sigma(r) \odot wkv`;
* :func:`retnet_rotate` multiplies query and key features by :math:`e^{in\theta}`, the complex rotation that
  RetNet builds into retention (an xPos-like relative position: scores depend on :math:`n - m` only).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_shape
from llmbook.lm.recurrent import wkv

__all__ = ["token_shift", "rwkv_time_mixing", "retnet_rotate", "retnet_angles"]


def token_shift(x: Float[Tensor, "B T C"], mu: Float[Tensor, " C"],
                x_prev: Float[Tensor, "B C"] | None = None) -> Float[Tensor, "B T C"]:
    r"""RWKV's token shift: :math:`\mu \odot x_t + (1 - \mu) \odot x_{t-1}`, per channel.

    ``x (B, T, C)``, ``mu (C,)`` the learned mixing weights (RWKV's ``time_mix_*``, one vector for each of
    :math:`r, k, v`), ``x_prev (B, C)`` the token before the first one (zeros at the start of a text; the
    last token of the previous chunk when generating). A channel with :math:`\mu = 1` sees only the current
    token, one with :math:`\mu = 0` only the previous one. Returns ``(B, T, C)``.

    >>> token_shift(torch.tensor([[[1.0], [2.0], [4.0]]]), torch.tensor([0.5]))[0, :, 0]
    tensor([0.5000, 1.5000, 3.0000])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(B, T, C)", min_dim=3, max_dim=3)
    mu = check_shape(as_tensor(mu, "mu"), x.shape[-1:], "mu", "the channels C of x")
    if x_prev is None:
        x_prev = torch.zeros_like(x[:, 0])
    check_shape(as_tensor(x_prev, "x_prev"), (x.shape[0], x.shape[2]), "x_prev", "(B, C): one token per sequence")
    shifted = torch.cat([x_prev[:, None].to(x.dtype), x[:, :-1]], 1)  # x_{t-1}
    return mu * x + (1 - mu) * shifted


def rwkv_time_mixing(x: Float[Tensor, "B T C"], W_r: Float[Tensor, "C C"], W_k: Float[Tensor, "C C"],
                     W_v: Float[Tensor, "C C"], W_o: Float[Tensor, "C C"], mu_r: Float[Tensor, " C"],
                     mu_k: Float[Tensor, " C"], mu_v: Float[Tensor, " C"], w: Float[Tensor, " C"],
                     u: Float[Tensor, " C"]) -> Float[Tensor, "B T C"]:
    r"""RWKV-4's time-mixing block: :math:`o_t = W_o\big(\sigma(r_t) \odot wkv_t\big)`.

    .. math:: r_t = W_r\,\mathrm{shift}_{\mu_r}(x)_t,\quad k_t = W_k\,\mathrm{shift}_{\mu_k}(x)_t,\quad
        v_t = W_v\,\mathrm{shift}_{\mu_v}(x)_t

    with :func:`token_shift` and :math:`wkv_t` = :func:`llmbook.lm.recurrent.wkv` ``(k, v, w, u)``. The
    **receptance** :math:`\sigma(r_t) \in (0, 1)` gates, channel by channel, how much of the averaged past the
    token lets through: it plays the role of attention's query, which :math:`wkv` lacks. Weights in
    ``nn.Linear`` layout ``(C_out, C_in)``; ``w, u (C,)`` the decay and the bonus of :func:`~llmbook.lm.recurrent.wkv`.
    Returns ``(B, T, C)``.

    >>> C = 2
    >>> I = torch.eye(C)
    >>> o = rwkv_time_mixing(torch.ones(1, 3, C), I, I, I, I, *(torch.ones(C),) * 3, torch.ones(C), torch.zeros(C))
    >>> round(o[0, 0, 0].item(), 4)  # sigmoid(1) * 1
    0.7311
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(B, T, C)", min_dim=3, max_dim=3)
    C = x.shape[-1]
    for M, name in ((W_r, "W_r"), (W_k, "W_k"), (W_v, "W_v")):
        check_dim(as_tensor(M, name), name, "(C_att, C)", min_dim=2, max_dim=2)
        check_shape(M, (M.shape[0], C), name, "(C_att, C) with the channels C of x")
    r = token_shift(x, mu_r) @ W_r.T
    k = token_shift(x, mu_k) @ W_k.T
    v = token_shift(x, mu_v) @ W_v.T
    return (torch.sigmoid(r) * wkv(k, v, w, u)) @ as_tensor(W_o, "W_o").T


def retnet_angles(D: int, base: float = 10000.0, dtype: torch.dtype = torch.float64) -> Float[Tensor, " D/2"]:
    r"""RetNet's rotation frequencies :math:`\theta_j = \text{base}^{-j/(D/2 - 1)}`, :math:`j = 0..D/2-1`.

    The official code writes ``1 / 10000 ** linspace(0, 1, D // 2)``: from 1 radian per position down to
    :math:`10^{-4}`. ``D`` (even) is the head width.

    >>> retnet_angles(4)
    tensor([1.0000e+00, 1.0000e-04], dtype=torch.float64)
    """
    if isinstance(D, bool) or not isinstance(D, int) or D < 2 or D % 2:
        raise ValueError(f"D must be an even int >= 2 (pairs of features rotate together), got {D!r}")
    return 1.0 / base ** torch.linspace(0, 1, D // 2, dtype=dtype)


def retnet_rotate(x: Float[Tensor, "... T D"], theta: Float[Tensor, " D/2"], offset: int = 0,
                  conjugate: bool = False) -> Float[Tensor, "... T D"]:
    r"""RetNet's rotation: feature pair :math:`j` of position :math:`n` times :math:`e^{in\theta_j}`.

    Retention writes :math:`Q = (XW_Q) \odot \Theta`, :math:`K = (XW_K) \odot \bar\Theta` with
    :math:`\Theta_n = e^{in\theta}`, so :math:`Q_n \bar K_m^{\top}` carries :math:`e^{i(n-m)\theta}`: the score
    depends on the positions only through :math:`n - m`, the relative position that :math:`\gamma^{n-m}` also
    uses. In real arithmetic each pair :math:`(x_{2j}, x_{2j+1})` is read as the complex number
    :math:`x_{2j} + i\,x_{2j+1}` and rotated by the angle :math:`n\theta_j` (RetNet's ``theta_shift``, the
    interleaved layout of GPT-J's rotary embedding). ``x (..., T, D)``, ``theta (D/2,)``, ``offset`` the
    position of the first row (for generation), ``conjugate`` rotates by :math:`e^{-in\theta}`.

    >>> retnet_rotate(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([torch.pi / 2]))
    tensor([[ 1.0000e+00,  0.0000e+00],
            [-4.3711e-08,  1.0000e+00]])
    """
    x = as_tensor(x, "x")
    check_dim(x, "x", "(..., T, D)", min_dim=2)
    T, D = x.shape[-2:]
    if D % 2:
        raise ValueError(f"the feature width D of x must be even (pairs rotate together), got {D}")
    theta = check_shape(as_tensor(theta, "theta"), (D // 2,), "theta", f"D/2 = {D // 2} angles for x's width D")
    n = torch.arange(offset, offset + T, dtype=theta.dtype)
    angle = (n[:, None] * theta) * (-1.0 if conjugate else 1.0)  # (T, D/2)
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    re, im = x[..., 0::2], x[..., 1::2]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(-2)
