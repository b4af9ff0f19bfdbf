r"""Attention-free sequence mixers (chapter 18): RWKV's WKV, RetNet's retention, Hyena's long convolution.

Each replaces softmax attention by something with a fixed-size state or a convolution:

* :func:`wkv` is RWKV-4's weighted key-value average with exponential decay, as an RNN with a
  running maximum that keeps the exponentials finite (18.05); :func:`wkv_parallel` is the same
  average in parallel, as a causal softmax over the scores :math:`-(t-1-i)w + k_i` (no query);
* :func:`retention` is RetNet's decayed linear attention in its parallel, recurrent and chunkwise
  forms (18.06);
* :func:`long_convolution` is the causal convolution with a filter as long as the sequence, by FFT
  in :math:`O(T\log T)` (18.07); :class:`HyenaFilter` makes such a filter from a few weights.

Shapes are batch-first: ``(B, T, C)`` channels, ``(B, H, T, D)`` heads.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_finite,
    check_positive_int,
    check_range,
    check_shape,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.registry import implements

__all__ = ["wkv", "wkv_parallel", "retention", "long_convolution", "HyenaFilter"]

FORMS = ("parallel", "recurrent", "chunkwise")


def _promote(*ts: Tensor) -> torch.dtype:
    dtype = ts[0].dtype
    for t in ts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _wkv_inputs(k, v, w, u):
    """Validated ``k, v (B, T, C)``, ``w, u (C,)`` in one compute dtype, and the caller's dtype."""
    k, v, w = as_tensor(k, "k"), as_tensor(v, "v"), as_tensor(w, "w")
    check_dim(k, "k", "(B, T, C)", min_dim=3, max_dim=3)
    check_shape(v, k.shape, "v", "k (B, T, C)")
    C = k.shape[-1]
    check_shape(w, (C,), "w", f"the channels C = {C} of k")
    u = w if u is None else check_shape(as_tensor(u, "u"), (C,), "u", f"the channels C = {C} of k")
    for t, name in ((k, "k"), (w, "w"), (u, "u")):
        check_finite(t, name)
    if (w < 0).any():
        raise ValueError("w must be >= 0 (a decay rate per channel; RWKV uses w = exp(time_decay))")
    dtype = _promote(k, v, w, u)
    return *(upcast_half(t.to(dtype)) for t in (k, v, w, u)), dtype


@implements("18.05")
def wkv(
    k: Float[Tensor, "B T C"], v: Float[Tensor, "B T C"], w: Float[Tensor, " C"], u: Float[Tensor, " C"] | None = None,
    state: tuple[Tensor, Tensor, Tensor] | None = None, return_state: bool = False,
):
    r"""RWKV's WKV operator as a recurrence: a decayed average of the values, weighted by :math:`e^{k}`.

    .. math:: wkv_t = \frac{\sum_{i=1}^{t-1} e^{-(t-1-i)w + k_i} v_i + e^{u + k_t} v_t}
        {\sum_{i=1}^{t-1} e^{-(t-1-i)w + k_i} + e^{u + k_t}}

    Symbols: ``k``, ``v`` the keys and values ``(B, T, C)``, ``w`` the per-channel decay rate
    :math:`w \ge 0` ``(C,)``, ``u`` the bonus of the current token ``(C,)`` (RWKV-4's ``time_first``).
    ``u = None`` means ``u = w``: then the current token is merely the newest term of the decayed sum,
    :math:`wkv_t = \sum_{i \le t} e^{-(t-i)w + k_i} v_i / \sum_{i \le t} e^{-(t-i)w + k_i}`.

    The state is three vectors per channel, :math:`(a, b, p)`: the numerator and denominator sums,
    both divided by :math:`e^{p}`, with :math:`p` the largest exponent so far. Every exponential is
    then :math:`e^{\le 0}`, so keys of 100 or 1000 neither overflow nor lose the small terms, as in
    RWKV's own kernels. ``state`` continues from a previous call; ``return_state`` returns it.
    Returns ``wkv (B, T, C)`` (and ``(a, b, p)``, each ``(B, C)``).

    >>> k, v = torch.zeros(1, 2, 1), torch.tensor([[[1.0], [3.0]]])
    >>> wkv(k, v, w=torch.zeros(1)).flatten()  # no decay, equal keys: the running mean
    tensor([1., 2.])
    """
    k, v, w, u, dtype = _wkv_inputs(k, v, w, u)
    Bsz, T, C = k.shape
    if state is None:
        a, b = torch.zeros(Bsz, C, dtype=k.dtype), torch.zeros(Bsz, C, dtype=k.dtype)
        p = torch.full((Bsz, C), -math.inf, dtype=k.dtype)
    else:
        if not isinstance(state, (tuple, list)) or len(state) != 3:
            raise TypeError("state must be the tuple (a, b, p) returned with return_state=True")
        a, b, p = (check_shape(as_tensor(s, n), (Bsz, C), n, "(B, C)").to(k.dtype)
                   for s, n in zip(state, "abp", strict=True))
    out = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        q = torch.maximum(p, u + kt)  # the largest exponent of this output's sums
        e1, e2 = torch.exp(p - q), torch.exp(u + kt - q)
        out.append((e1 * a + e2 * vt) / (e1 * b + e2))
        q = torch.maximum(p - w, kt)  # decay the past by e^{-w}, add the current token with weight e^{k_t}
        e1, e2 = torch.exp(p - w - q), torch.exp(kt - q)
        a, b, p = e1 * a + e2 * vt, e1 * b + e2, q
    y = restore_half(torch.stack(out, 1) if out else torch.zeros_like(v), dtype)
    return (y, tuple(restore_half(s, dtype) for s in (a, b, p))) if return_state else y


def wkv_parallel(k: Float[Tensor, "B T C"], v: Float[Tensor, "B T C"], w: Float[Tensor, " C"],
                 u: Float[Tensor, " C"] | None = None) -> Float[Tensor, "B T C"]:
    r"""The WKV operator of :func:`wkv` computed for all positions at once (how RWKV can train in parallel).

    The weights of :math:`wkv_t` are a softmax over :math:`i \le t` of the scores
    :math:`s_{ti} = -(t-1-i)w + k_i` (:math:`i < t`) and :math:`s_{tt} = u + k_t`: attention with a
    fixed, decaying position bias and no query. The softmax subtracts the row maximum, so large
    keys are safe. :math:`O(T^2 C)` memory; same arguments as :func:`wkv`.

    >>> wkv_parallel(torch.zeros(1, 2, 1), torch.tensor([[[1.0], [3.0]]]), torch.zeros(1)).flatten()
    tensor([1., 2.])
    """
    k, v, w, u, dtype = _wkv_inputs(k, v, w, u)
    T = k.shape[1]
    pos = torch.arange(T)
    d = (pos[:, None] - pos[None, :]).to(k.dtype)  # t - i
    past = -(d - 1).clamp_min(0)[None, :, :, None] * w + k[:, None, :, :]  # (B, T, T, C) scores of i < t
    s = torch.where((d == 0)[None, :, :, None], (u + k)[:, :, None, :], past)
    s = s.masked_fill((d < 0)[None, :, :, None], -math.inf)
    y = (torch.softmax(s, dim=2) * v[:, None, :, :]).sum(2)
    return restore_half(y, dtype)


def _gamma(gamma, H: int, dtype) -> Tensor:
    """``gamma`` as a tensor ``(H, 1, 1)`` of decays in ``(0, 1]``."""
    if isinstance(gamma, torch.Tensor):
        check_shape(gamma, (H,), "gamma", f"one decay per head, H = {H}")
        check_finite(gamma, "gamma")
        if ((gamma <= 0) | (gamma > 1)).any():
            raise ValueError("gamma must lie in (0, 1] for every head")
        return gamma.to(dtype)[:, None, None]
    return torch.full((H, 1, 1), check_range(gamma, "gamma", 0.0, 1.0, low_open=True), dtype=dtype)


@implements("18.06")
def retention(
    q: Float[Tensor, "B *H T D"], k: Float[Tensor, "B *H T D"], v: Float[Tensor, "B *H T D_v"],
    gamma: float | Float[Tensor, " H"], form: str = "parallel", chunk_size: int = 64,
) -> Float[Tensor, "B *H T D_v"]:
    r"""RetNet's retention: causal linear attention whose past fades by :math:`\gamma` per step.

    .. math:: \mathrm{Retention}(Q,K,V) = (QK^\top \odot D)V,\qquad
        D_{nm} = \begin{cases}\gamma^{n-m} & n \ge m\\ 0 & n < m\end{cases}

    Three forms, equal up to rounding: ``"parallel"`` builds the :math:`T\times T` matrix (training,
    :math:`O(T^2)`); ``"recurrent"`` carries the state :math:`S_n = \gamma S_{n-1} + k_n^\top v_n`, output
    :math:`q_n S_n` (decoding, :math:`O(1)` per token, a ``D x D_v`` state per head); ``"chunkwise"``
    runs the parallel form inside chunks of ``chunk_size`` tokens and passes the state between chunks:
    :math:`R_i = K_{[i]}^\top (V_{[i]} \odot \zeta) + \gamma^{c} R_{i-1}`, with the cross-chunk term
    :math:`(Q_{[i]} R_{i-1}) \odot \xi`, :math:`\xi_j = \gamma^{j+1}` (long sequences). ``q, k``
    ``(B, H, T, D)`` or ``(B, T, D)``, ``v`` ``(B, H, T, D_v)``; ``gamma`` in :math:`(0, 1]`, a float or one per
    head ``(H,)`` (RetNet's multi-scale :math:`\gamma_h = 1 - 2^{-5-h}`). RetNet's scaling and group
    norm around it are not part of this function.

    >>> q = k = v = torch.ones(1, 3, 1)
    >>> retention(q, k, v, gamma=0.5).flatten()
    tensor([1.0000, 1.5000, 1.7500])
    """
    check_choice(form, "form", FORMS)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    q, k, v = as_tensor(q, "q"), as_tensor(k, "k"), as_tensor(v, "v")
    check_dim(q, "q", "(B, H, T, D) or (B, T, D)", min_dim=3, max_dim=4)
    squeeze = q.ndim == 3
    check_shape(k, q.shape, "k", "q")
    check_dim(v, "v", "like q with its own last axis D_v", min_dim=q.ndim, max_dim=q.ndim)
    check_shape(v, (*q.shape[:-1], v.shape[-1]), "v", "q's batch, heads and length")
    if squeeze:
        q, k, v = q[:, None], k[:, None], v[:, None]
    dtype = _promote(q, k, v, gamma) if isinstance(gamma, torch.Tensor) else _promote(q, k, v)
    q, k, v = (upcast_half(t.to(dtype)) for t in (q, k, v))
    Bsz, H, T, _ = q.shape
    log_g = torch.log(_gamma(gamma, H, q.dtype))  # (H, 1, 1)

    def decay(c: int) -> Tensor:  # D for c positions: gamma^{n-m} below the diagonal, 0 above
        n = torch.arange(c, dtype=q.dtype)
        diff = n[:, None] - n[None, :]
        return torch.where(diff >= 0, torch.exp(diff.clamp_min(0) * log_g), torch.zeros((), dtype=q.dtype))

    if form == "parallel":
        out = ((q @ k.transpose(-1, -2)) * decay(T)) @ v
    elif form == "recurrent":
        S = torch.zeros(Bsz, H, q.shape[-1], v.shape[-1], dtype=q.dtype)
        g = torch.exp(log_g)  # (H, 1, 1), broadcast over S (B, H, D, D_v)
        outs = []
        for n in range(T):
            S = g * S + k[:, :, n, :, None] * v[:, :, n, None, :]
            outs.append((q[:, :, n, None, :] @ S)[:, :, 0])
        out = torch.stack(outs, 2) if outs else q.new_zeros(Bsz, H, 0, v.shape[-1])
    else:
        R = torch.zeros(Bsz, H, q.shape[-1], v.shape[-1], dtype=q.dtype)
        outs = []
        for s in range(0, T, chunk_size):
            Qi, Ki, Vi = q[:, :, s:s + chunk_size], k[:, :, s:s + chunk_size], v[:, :, s:s + chunk_size]
            c = Qi.shape[2]
            j = torch.arange(c, dtype=q.dtype)[:, None]  # (c, 1)
            xi = torch.exp((j + 1) * log_g)  # (H, c, 1): gamma^{j+1}, the decay from the chunk's start
            zeta = torch.exp((c - 1 - j) * log_g)  # (H, c, 1): gamma^{c-1-j}, the decay to the chunk's end
            outs.append(((Qi @ Ki.transpose(-1, -2)) * decay(c)) @ Vi + (Qi @ R) * xi)
            R = Ki.transpose(-1, -2) @ (Vi * zeta) + torch.exp(c * log_g) * R
        out = torch.cat(outs, 2) if outs else q.new_zeros(Bsz, H, 0, v.shape[-1])
    out = restore_half(out, dtype)
    return out[:, 0] if squeeze else out


@implements("18.07")
def long_convolution(x: Float[Tensor, "B T C"], h: Float[Tensor, "T_h C"],
                     D: Float[Tensor, " C"] | None = None) -> Float[Tensor, "B T C"]:
    r"""Causal long convolution by FFT, Hyena's core: every channel filtered by its own filter.

    .. math:: y = x * h,\qquad y_t = \sum_{s=0}^{t} h_s\,x_{t-s} \;(+\,D\,x_t)

    Symbols: ``x`` the input ``(B, T, C)``, ``h`` one filter per channel ``(T_h, C)`` (taps beyond ``T``
    never reach an output), ``D`` an optional skip ``(C,)``. Both are zero-padded to at least
    :math:`T + T_h - 1` points, so the FFT's circular convolution equals the linear one and no output
    sees a later input; :math:`O(T\log T)` instead of :math:`O(T^2)` for the direct sum. A filter
    as long as the input has as many taps as tokens: Hyena generates them from a few weights
    (:class:`HyenaFilter`).

    >>> long_convolution(torch.tensor([[[1.0], [0.0], [0.0]]]), torch.tensor([[1.0], [0.5], [0.25]])).flatten()
    tensor([1.0000, 0.5000, 0.2500])
    """
    x, h = as_tensor(x, "x"), as_tensor(h, "h")
    check_dim(x, "x", "(B, T, C)", min_dim=3, max_dim=3)
    C = x.shape[-1]
    check_dim(h, "h", f"(T_h, C) with C = {C}", min_dim=2, max_dim=2)
    check_shape(h, (h.shape[0], C), "h", f"the channels C = {C} of x")
    parts = [x, h]
    if D is not None:
        parts.append(check_shape(as_tensor(D, "D"), (C,), "D", f"the channels C = {C} of x"))
    dtype = _promote(*parts)
    x, h, *rest = (upcast_half(t.to(dtype)) for t in parts)
    T = x.shape[1]
    h = h[:T]
    if x.numel() == 0 or h.shape[0] == 0:  # MKL's FFT rejects empty batches
        y = torch.zeros_like(x)
    else:
        n = T + h.shape[0] - 1
        y = torch.fft.irfft(torch.fft.rfft(x, n=n, dim=1) * torch.fft.rfft(h, n=n, dim=0), n=n, dim=1)[:, :T]
    if rest:
        y = y + x * rest[0]
    return restore_half(y, dtype)


class HyenaFilter(nn.Module):
    r"""Hyena's implicit filter: ``C`` filters of any length ``T`` from a small network of position.

    .. math:: h_t = \mathrm{FFN}(z_t) \odot e^{-\alpha\,t/T},\qquad
        z_t = \big(t/T,\ \cos(2\pi f t/T),\ \sin(2\pi f t/T)\big)_{f=1..F}

    The positional features :math:`z_t` feed a two-layer network with sine activations (frequency
    ``omega``), whose ``C`` outputs are windowed by an exponential decay, one rate :math:`\alpha` per
    channel from fast to slow (a short and a long memory). The parameter count depends on ``C``,
    ``n_freq`` and ``width``, never on ``T``. ``forward(T)`` returns ``h (T, C)`` for :func:`long_convolution`.

    >>> HyenaFilter(C=4)(T=100).shape
    torch.Size([100, 4])
    """

    def __init__(self, C: int, n_freq: int = 2, width: int = 16, omega: float = 1.0,
                 fast: float = 0.3, slow: float = 1.5, target: float = 1e-2):
        super().__init__()
        self.C, self.n_freq = check_positive_int(C, "C"), check_positive_int(n_freq, "n_freq")
        width = check_positive_int(width, "width")
        self.omega = check_range(omega, "omega", 0.0, low_open=True)
        fast = check_range(fast, "fast", 0.0, low_open=True)
        slow = check_range(slow, "slow", 0.0, low_open=True)
        target = check_range(target, "target", 0.0, 1.0, low_open=True, high_open=True)
        self.layers = nn.ModuleList([nn.Linear(1 + 2 * self.n_freq, width), nn.Linear(width, width),
                                     nn.Linear(width, self.C)])
        # a channel's window falls to `target` after the share `fast` (first channel) to `slow` (last) of the input
        self.register_buffer("alpha", torch.linspace(-math.log(target) / fast, -math.log(target) / slow, self.C))

    def forward(self, T: int) -> Float[Tensor, "T C"]:
        T = check_positive_int(T, "T")
        dtype = self.layers[0].weight.dtype
        t = torch.arange(T, dtype=dtype)[:, None] / T  # (T, 1) in [0, 1)
        f = torch.arange(1, self.n_freq + 1, dtype=dtype)
        z = torch.cat([t, torch.cos(2 * math.pi * f * t), torch.sin(2 * math.pi * f * t)], dim=-1)
        a = torch.sin(self.omega * self.layers[0](z))
        a = torch.sin(self.omega * self.layers[1](a))
        return self.layers[2](a) * torch.exp(-t * self.alpha.to(dtype))
