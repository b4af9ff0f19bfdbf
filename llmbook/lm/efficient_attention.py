r"""Kernelised and approximate attention (chapter 3): linear attention, Performer, Linformer, Reformer LSH.

All four trade the exact ``T x T`` softmax for something cheaper:

* linear attention replaces :math:`e^{q^\top k}` by a product of feature maps :math:`\phi(q)^\top\phi(k)`
  and regroups the products, :math:`O(T D^2)` instead of :math:`O(T^2 D)`;
* Performer chooses random features whose product is an *unbiased* estimate of :math:`e^{q^\top k}`;
* Linformer projects the ``T`` keys and values down to ``k`` rows along the sequence;
* Reformer hashes queries and keys so that each query only attends within its bucket.

Shapes follow :mod:`llmbook.lm.attention`: ``(B, H, T, D)`` or ``(B, T, D)``, GQA by repeating heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_int, check_positive_int, check_same_dtype, check_size
from llmbook._precision import compute_dtype, restore_half, upcast_half
from llmbook.lm.attention import (
    attention_scale,
    causal_mask,
    check_attention_inputs,
    repeat_kv,
    scaled_dot_product_attention,
)
from llmbook.lm.local_attention import gathered_attention
from llmbook.registry import implements

__all__ = [
    "FEATURE_MAPS",
    "linear_attention",
    "linear_attention_recurrent",
    "random_features",
    "favor_features",
    "performer_attention",
    "linformer_projection",
    "linformer_attention",
    "lsh_rotations",
    "lsh_hash",
    "lsh_attention",
]

FEATURE_MAPS: dict[str, Callable[[Tensor], Tensor]] = {
    "elu": lambda x: F.elu(x) + 1.0,  # Katharopoulos et al. (2020): positive, smooth
    "relu": F.relu,
}

#: log phi(x) of the maps that have one everywhere (elu(x) + 1 is exp(x) below 0 and 1 + x above). With it the
#: kernel sums are formed in log space, so features that underflow (exp(-300) is 0 in float32) still weigh in.
_LOG_FEATURE_MAPS: dict[str, Callable[[Tensor], Tensor]] = {
    "elu": lambda x: torch.where(x < 0, x, torch.log1p(x.clamp_min(0))),
}


def _inputs(q, k, v):
    """Validated 4-D ``q, k, v`` with the key/value heads repeated to ``H`` (GQA), plus ``squeeze`` and the dtype.

    fp16 / bf16 come back in float32: feature maps, kernel sums and scores overflow fp16 at
    :math:`|q|, |k| \approx 300` (:func:`_output` rounds the result back).
    """
    q4, k4, v4, squeeze = check_attention_inputs(q, k, v)
    G = q4.shape[1] // k4.shape[1]
    return upcast_half(q4), upcast_half(repeat_kv(k4, G)), upcast_half(repeat_kv(v4, G)), squeeze, q4.dtype


def _output(out: Tensor, squeeze: bool, dtype: torch.dtype) -> Tensor:
    """The result in the inputs' dtype and shape (head axis dropped for head-less inputs)."""
    out = restore_half(out, dtype)
    return out.squeeze(1) if squeeze else out


def _feature_map(feature_map) -> Callable[[Tensor], Tensor]:
    if callable(feature_map):
        return feature_map
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, got {feature_map!r}")
    return FEATURE_MAPS[feature_map]


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    # features are non-negative, so a zero denominator means a zero numerator: the output is 0
    return num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)


def _log_kernel_attention_causal(lq: Tensor, lk: Tensor, v: Tensor, max_elements: int = 1 << 22) -> Tensor:
    """Causal kernel attention from log-features: weights :math:`\\log A_{ij} = \\mathrm{LSE}_r(\\log\\phi(q_i)_r +
    \\log\\phi(k_j)_r)`, normalised over the allowed keys by a softmax (exact, no underflow); rows in chunks."""
    T_q, T_k, D = lq.shape[-2], lk.shape[-2], lq.shape[-1]
    allowed = causal_mask(T_q, T_k, device=lq.device).bool()
    rows = max(1, max_elements // max(1, T_k * D * lq.shape[0] * lq.shape[1]))
    outs = []
    for i in range(0, T_q, rows):
        logA = torch.logsumexp(lq[..., i:i + rows, None, :] + lk[..., None, :, :], dim=-1)
        logA = logA.masked_fill(~allowed[i:i + rows], float("-inf"))
        w = torch.softmax(logA, dim=-1).nan_to_num(0.0)  # a row with no allowed key gives 0
        outs.append(w @ v)
    return torch.cat(outs, dim=-2) if outs else v.new_zeros(*lq.shape[:-1], v.shape[-1])


def _kernel_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """Kernel attention from the features ``phi_q, phi_k``: the ratio of equation 03.09 over allowed keys."""
    if causal:  # parallel causal form: the masked T_q x T_k kernel matrix
        A = (phi_q @ phi_k.transpose(-1, -2)) * causal_mask(phi_q.shape[-2], phi_k.shape[-2], device=phi_q.device)
        return _safe_div(A @ v, A.sum(-1))
    S = phi_k.transpose(-1, -2) @ v  # (B, H, D_phi, D_v): the sum over keys, done once
    z = phi_k.sum(-2)  # (B, H, D_phi)
    return _safe_div(phi_q @ S, (phi_q * z.unsqueeze(-2)).sum(-1))


@implements("03.09")
def linear_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H_kv T_k D"], v: Float[Tensor, "B *H_kv T_k D_v"],
    feature_map: str | Callable[[Tensor], Tensor] = "elu", causal: bool = False,
) -> Float[Tensor, "B *H T_q D_v"]:
    r"""Linear (kernelised) attention, parallel form.

    .. math::
        \mathrm{Attn}(Q, K, V)_i = \frac{\phi(q_i)^\top \sum_j \phi(k_j) v_j^\top}{\phi(q_i)^\top \sum_j \phi(k_j)}

    ``feature_map`` is :math:`\phi` (``"elu"``: :math:`\mathrm{elu}(x) + 1`, ``"relu"``, or any callable
    returning non-negative features). Without ``causal`` the sums over all keys are computed once,
    :math:`O(T D D_v)`. With ``causal`` the sum runs over :math:`j \le i` (bottom-right aligned) and
    is computed in parallel from the masked kernel matrix; :func:`linear_attention_recurrent` is
    the same causal attention as an RNN. No :math:`1/\sqrt{d_k}` scale: :math:`\phi` replaces the softmax.

    >>> q = k = v = torch.ones(1, 3, 2)
    >>> linear_attention(q, k, v, causal=True)
    tensor([[[1., 1.],
             [1., 1.],
             [1., 1.]]])
    """
    q4, k4, v4, squeeze, dtype = _inputs(q, k, v)
    phi = _feature_map(feature_map)
    log_phi = _LOG_FEATURE_MAPS.get(feature_map) if isinstance(feature_map, str) else None
    if log_phi is None:
        out = _kernel_attention(phi(q4), phi(k4), v4, causal)
    elif causal:
        out = _log_kernel_attention_causal(log_phi(q4), log_phi(k4), v4)
    else:  # each feature's sum over keys, shifted by that feature's largest key: the ratio does not change
        lk = log_phi(k4)
        M = lk.amax(-2, keepdim=True)  # (B, H, 1, D_phi)
        lq = log_phi(q4) + M
        out = _kernel_attention((lq - lq.amax(-1, keepdim=True)).exp(), (lk - M).exp(), v4, causal=False)
    return _output(out, squeeze, dtype)


def linear_attention_recurrent(
    q: Float[Tensor, "B *H T D"], k: Float[Tensor, "B *H_kv T D"], v: Float[Tensor, "B *H_kv T D_v"],
    feature_map: str | Callable[[Tensor], Tensor] = "elu",
) -> Float[Tensor, "B *H T D_v"]:
    r"""Causal linear attention as a recurrent network, one step per token.

    .. math:: S_t = S_{t-1} + \phi(k_t) v_t^\top, \quad z_t = z_{t-1} + \phi(k_t), \quad
        o_t = \frac{S_t^\top \phi(q_t)}{z_t^\top \phi(q_t)}

    The state :math:`(S_t, z_t)` has a fixed size :math:`D \times D_v + D` whatever the context length:
    generation costs :math:`O(1)` per token. Equal to ``linear_attention(..., causal=True)``.
    Self-attention only (``T_q == T_k``).

    >>> q = k = v = torch.ones(1, 3, 2)
    >>> linear_attention_recurrent(q, k, v).shape
    torch.Size([1, 3, 2])
    """
    q4, k4, v4, squeeze, dtype = _inputs(q, k, v)
    B, H, T, _ = q4.shape
    if k4.shape[2] != T:
        raise ValueError(f"the recurrent form is self-attention: T_q ({T}) must equal T_k ({k4.shape[2]})")
    phi = _feature_map(feature_map)
    log_phi = _LOG_FEATURE_MAPS.get(feature_map) if isinstance(feature_map, str) else None
    outs = []
    if log_phi is None:
        phi_q, phi_k = phi(q4), phi(k4)
        S = q4.new_zeros(B, H, phi_k.shape[-1], v4.shape[-1])
        z = q4.new_zeros(B, H, phi_k.shape[-1])
        for t in range(T):
            S = S + phi_k[:, :, t, :, None] * v4[:, :, t, None, :]
            z = z + phi_k[:, :, t]
            num = (phi_q[:, :, t, :, None] * S).sum(-2)
            outs.append(_safe_div(num, (phi_q[:, :, t] * z).sum(-1)))
    else:
        # the state in log-space scale: S_t = exp(m_t) * S~_t feature by feature, m_t the running largest
        # log phi(k); as FlashAttention rescales its running sums, S~ and z~ are rescaled when m grows
        lq, lk = log_phi(q4), log_phi(k4)
        m = lk.new_full((B, H, lk.shape[-1]), float("-inf"))
        S = q4.new_zeros(B, H, lk.shape[-1], v4.shape[-1])
        z = q4.new_zeros(B, H, lk.shape[-1])
        for t in range(T):
            m_new = torch.maximum(m, lk[:, :, t])
            decay, w = (m - m_new).exp(), (lk[:, :, t] - m_new).exp()
            S = S * decay[..., None] + w[..., None] * v4[:, :, t, None, :]
            z = z * decay + w
            m = m_new
            a = lq[:, :, t] + m  # log of phi(q_t) times each feature's scale
            a = (a - a.amax(-1, keepdim=True)).exp()
            outs.append(_safe_div((a[..., None] * S).sum(-2), (a * z).sum(-1)))
    out = torch.stack(outs, dim=2)
    return _output(out, squeeze, dtype)


def random_features(m: int, D: int, orthogonal: bool = True, generator: torch.Generator | None = None,
                    dtype: torch.dtype = torch.float32) -> Float[Tensor, "m D"]:
    r"""``m`` random projection directions :math:`\omega_r \in \mathbb{R}^D`, each marginally :math:`N(0, I_D)`.

    With ``orthogonal`` the rows come in blocks of ``D`` exactly orthogonal directions (QR of a Gaussian
    matrix), each rescaled by the norm of an independent Gaussian vector so that its length has the
    same (chi) distribution as a Gaussian's: still unbiased, with lower variance (Performer's "OR+").

    >>> random_features(3, 4, generator=torch.Generator().manual_seed(0)).shape
    torch.Size([3, 4])
    """
    m, D = check_positive_int(m, "m"), check_positive_int(D, "D")
    if not orthogonal:
        return torch.randn(m, D, generator=generator, dtype=dtype)
    n_blocks = math.ceil(m / D)
    Q, R = torch.linalg.qr(torch.randn(n_blocks, D, D, generator=generator, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-random orthogonal blocks
    norms = torch.randn(n_blocks, D, D, generator=generator, dtype=torch.float64).norm(dim=-1)
    rows = Q.transpose(-1, -2) * norms.unsqueeze(-1)  # block b, row r: orthonormal direction times a chi length
    return rows.reshape(n_blocks * D, D)[:m].to(dtype)


@implements("03.10")
def favor_features(x: Float[Tensor, "... D"], omega: Float[Tensor, "m D"]) -> Float[Tensor, "... m"]:
    r"""FAVOR+ positive random features, whose inner product estimates the softmax kernel without bias.

    .. math:: \phi(x) = \frac{e^{-\|x\|^2/2}}{\sqrt m}\big(e^{\omega_1^\top x}, \dots, e^{\omega_m^\top x}\big),
        \qquad \mathbb{E}_\omega\big[\phi(q)^\top \phi(k)\big] = e^{q^\top k}

    ``omega`` holds the :math:`m` directions :math:`\omega_r \sim N(0, I_D)` (:func:`random_features`).
    For i.i.d. directions the estimate's variance is :math:`e^{2q^\top k}(e^{\|q + k\|^2} - 1)/m`.
    Every feature is positive, so attention weights built from them are never negative. ``x`` and
    ``omega`` share one dtype; fp16 / bf16 are computed in float32 (:math:`\|x\|^2` overflows fp16 at
    :math:`|x| \approx 256`) and the features returned in their dtype.

    >>> omega = torch.zeros(4, 2)  # degenerate directions: phi(x) = exp(-|x|^2 / 2) / 2 in every slot
    >>> favor_features(torch.tensor([0.0, 0.0]), omega)
    tensor([0.5000, 0.5000, 0.5000, 0.5000])
    """
    x, omega = as_tensor(x, "x"), as_tensor(omega, "omega")
    if x.ndim == 0 or omega.ndim != 2 or x.shape[-1] != omega.shape[-1]:
        raise ValueError(f"x (..., D) {tuple(x.shape)} and omega (m, D) {tuple(omega.shape)} must share D")
    check_same_dtype(x, omega, "x", "omega")
    if omega.shape[0] == 0:
        raise ValueError(f"omega (m, D) {tuple(omega.shape)} must hold at least one direction (m >= 1)")
    dtype, x, omega = x.dtype, upcast_half(x), upcast_half(omega)  # fp16: |x|^2 and x omega overflow at |x| ~ 256
    m = omega.shape[0]
    log_phi = x @ omega.T - 0.5 * (x * x).sum(-1, keepdim=True) - 0.5 * math.log(m)
    return restore_half(log_phi.exp(), dtype)


def performer_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H_kv T_k D"], v: Float[Tensor, "B *H_kv T_k D_v"],
    n_features: int = 256, causal: bool = False, omega: Tensor | None = None, orthogonal: bool = True,
    scale: float | None = None, generator: torch.Generator | None = None,
) -> Float[Tensor, "B *H T_q D_v"]:
    r"""Performer attention: linear attention with FAVOR+ features, an estimate of softmax attention.

    Queries and keys are scaled by :math:`\sqrt{\text{scale}}` (default :math:`d_k^{-1/4}` each, so
    their product carries the usual :math:`1/\sqrt{d_k}`), then mapped by :func:`favor_features`
    with ``n_features`` directions (or the given ``omega``). For numerical safety (all in log space,
    float32 for fp16 / bf16 input) each feature column of the keys is divided by its largest entry,
    that factor moved onto the queries, and each query's features divided by their largest entry:
    every factor cancels in the ratio, and every denominator stays at least 1 even when
    :math:`|q|, |k|` are in the hundreds. A query or key whose :math:`\|x\|^2 \cdot` scale overflows
    the compute dtype (float32 at :math:`|x| \approx 10^{19}`) raises ``ValueError``: all its features
    underflow to 0 and the ratio is 0/0.

    >>> q = k = v = torch.ones(1, 4, 2)
    >>> performer_attention(q, k, v, n_features=8, generator=torch.Generator().manual_seed(0)).shape
    torch.Size([1, 4, 2])
    """
    q4, k4, v4, squeeze, dtype = _inputs(q, k, v)
    D = q4.shape[-1]
    s = math.sqrt(attention_scale(scale, D))
    if omega is None:
        omega = random_features(n_features, D, orthogonal=orthogonal, generator=generator, dtype=q4.dtype)
    else:
        omega = as_tensor(omega, "omega")
        check_dim(omega, "omega", f"(m, D) with D = {D}", min_dim=2, max_dim=2)
        check_size(omega, -1, D, "omega", f"(m, D) with D = {D}")
        if omega.shape[0] == 0:
            raise ValueError(f"omega (m, D) {tuple(omega.shape)} must hold at least one direction (m >= 1)")
        if omega.dtype not in (dtype, q4.dtype):  # fp16 / bf16 inputs compute in (and accept) float32
            allowed = dtype if dtype == q4.dtype else f"{dtype} or {q4.dtype}"
            raise TypeError(f"omega ({omega.dtype}) must have the dtype of q, k, v ({allowed})")
    omega = upcast_half(omega.to(q4.device))
    m = omega.shape[0]
    qs, ks = q4 * s, k4 * s

    def log_features(x, name):
        sq = (x * x).sum(-1, keepdim=True)
        if torch.isposinf(sq).any():  # every feature of that row underflows: the ratio would be 0/0
            raise ValueError(f"{name} is too large for FAVOR+ features in {x.dtype}: |{name}|^2 * scale overflows "
                             f"(largest |{name}| entry {x.abs().max().item() / s:.3g}), so exp(w.x - |x|^2/2) is 0 "
                             f"for every feature and the attention ratio is 0/0; scale {name} down or use float64")
        return x @ omega.T - 0.5 * sq - 0.5 * math.log(m)

    lq, lk = log_features(qs, "q"), log_features(ks, "k")
    c = lk.amax(dim=-2, keepdim=True)  # (B, H, 1, m): each feature's largest key, moved onto the queries
    lq = lq + c
    phi_q = (lq - lq.amax(-1, keepdim=True)).exp()
    phi_k = (lk - c).exp()
    out = _kernel_attention(phi_q, phi_k, v4, causal)
    return _output(out, squeeze, dtype)


def linformer_projection(T: int, k_dim: int, kind: str = "pool", generator: torch.Generator | None = None,
                         dtype: torch.dtype = torch.float32) -> Float[Tensor, "k_dim T"]:
    r"""A fixed Linformer projection :math:`E \in \mathbb{R}^{k \times T}` (a trained model learns it).

    * ``"pool"``: row :math:`r` averages positions :math:`\lfloor rT/k \rfloor` to
      :math:`\lceil (r+1)T/k \rceil - 1` (adaptive mean pooling, one of the paper's choices); ``k = T``
      gives the identity, and a sequence that is constant on each pooled segment is attended exactly;
    * ``"gaussian"``: i.i.d. :math:`N(0, 1/k)` entries, the Johnson-Lindenstrauss projection of the
      paper's analysis (:math:`\mathbb{E}[E^\top E] = I`).

    >>> linformer_projection(4, 2)
    tensor([[0.5000, 0.5000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.5000, 0.5000]])
    """
    T, k_dim = check_positive_int(T, "T"), check_positive_int(k_dim, "k_dim")
    if kind == "gaussian":
        return torch.randn(k_dim, T, generator=generator, dtype=dtype) / math.sqrt(k_dim)
    if kind != "pool":
        raise ValueError(f"kind must be 'pool' or 'gaussian', got {kind!r}")
    if k_dim > T:
        raise ValueError(f"k_dim ({k_dim}) must not exceed T ({T}) for pooling")
    r = torch.arange(k_dim)
    start, end = (r * T) // k_dim, -((-(r + 1) * T) // k_dim)  # floor and ceil, as adaptive pooling
    j = torch.arange(T)
    inside = (j >= start.unsqueeze(-1)) & (j < end.unsqueeze(-1))
    inside = inside.to(dtype)
    return inside / inside.sum(-1, keepdim=True)


@implements("03.11")
def linformer_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H_kv T_k D"], v: Float[Tensor, "B *H_kv T_k D_v"],
    E: Float[Tensor, "*H k_dim T_k"], F_proj: Float[Tensor, "*H k_dim T_k"] | None = None,
    scale: float | None = None,
) -> Float[Tensor, "B *H T_q D_v"]:
    r"""Linformer: attend to ``k_dim`` projected keys and values instead of ``T_k``.

    .. math:: \mathrm{Attn}(Q, K, V) = \mathrm{softmax}\!\Big(\frac{Q (EK)^\top}{\sqrt{d_k}}\Big) F V

    ``E`` and ``F_proj`` (default: ``E``, shared as in the paper's cheapest variant) are ``(k, T_k)``
    or per head ``(H, k, T_k)``; they mix positions, so there is no causal version. The score matrix
    is ``T_q x k``: linear in ``T`` for a fixed ``k``. With :math:`E = F = I_T` it is exact attention.

    >>> q = k = v = torch.randn(1, 6, 4)
    >>> torch.allclose(linformer_attention(q, k, v, torch.eye(6)),
    ...                scaled_dot_product_attention(q, k, v), atol=1e-6)
    True
    """
    q4, k4, v4, squeeze, dtype = _inputs(q, k, v)
    F_proj = E if F_proj is None else F_proj
    T_k = k4.shape[2]
    E, F_proj = as_tensor(E, "E"), as_tensor(F_proj, "F_proj")
    for name, P in (("E", E), ("F_proj", F_proj)):
        if P.ndim not in (2, 3) or P.shape[-1] != T_k or (P.ndim == 3 and P.shape[0] != q4.shape[1]):
            raise ValueError(f"{name} must have shape (k, T_k) or (H, k, T_k) with T_k = {T_k}, H = {q4.shape[1]}, "
                             f"got {tuple(P.shape)}")
    K_proj = E.to(k4.device, k4.dtype) @ k4  # (B, H, k, D)
    V_proj = F_proj.to(v4.device, v4.dtype) @ v4
    out = scaled_dot_product_attention(q4, K_proj, V_proj, scale=scale)
    return _output(out, squeeze, dtype)


def lsh_rotations(D: int, n_buckets: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = torch.float32) -> Float[Tensor, "D n_half"]:
    """A random Gaussian matrix ``R`` of shape ``(D, n_buckets // 2)`` for :func:`lsh_hash`.

    >>> lsh_rotations(8, 4).shape
    torch.Size([8, 2])
    """
    n_buckets = check_int(n_buckets, "n_buckets", low=2, what="an even int >= 2")
    if n_buckets % 2:
        raise ValueError(f"n_buckets must be an even int >= 2, got {n_buckets}")
    D = check_positive_int(D, "D")
    return torch.randn(D, n_buckets // 2, generator=generator, dtype=dtype)


@implements("03.12")
def lsh_hash(x: Float[Tensor, "... D"], R: Float[Tensor, "D n_half"]) -> Int[Tensor, "..."]:
    r"""Angular locality-sensitive hash of Reformer: :math:`h(x) = \arg\max([xR; -xR])`.

    ``R`` is a random ``(D, b/2)`` matrix; the hash is one of ``b`` buckets. Nearby directions land in
    the same bucket more often: for ``b = 2`` (one random hyperplane) two vectors at angle
    :math:`\theta` collide with probability :math:`1 - \theta/\pi`. Scaling ``x`` by a positive
    number never changes its bucket.

    >>> lsh_hash(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), torch.tensor([[1.0], [0.0]]))
    tensor([0, 1])
    """
    x, R = as_tensor(x, "x"), as_tensor(R, "R")  # integer input hashes as float: never truncate R
    if R.ndim != 2 or x.ndim == 0 or x.shape[-1] != R.shape[0]:
        raise ValueError(f"x (..., D) {tuple(x.shape)} and R (D, n_buckets/2) {tuple(R.shape)} must share D")
    dt = compute_dtype(torch.promote_types(x.dtype, R.dtype))  # fp16 / bf16: the projections in float32
    xR = x.to(dt) @ R.to(x.device, dt)
    return torch.cat([xR, -xR], dim=-1).argmax(-1)


def lsh_attention(
    q: Float[Tensor, "B *H T_q D"], k: Float[Tensor, "B *H_kv T_k D"], v: Float[Tensor, "B *H_kv T_k D_v"],
    n_buckets: int = 8, R: Tensor | None = None, causal: bool = False, scale: float | None = None,
    generator: torch.Generator | None = None,
) -> Float[Tensor, "B *H T_q D_v"]:
    r"""Attention restricted to keys in the query's LSH bucket: :math:`S_{ij} = [h(q_i) = h(k_j)]`.

    Queries and keys are hashed with the same ``R`` (drawn with ``n_buckets`` buckets if not given).
    Keys are sorted by bucket, and each query gathers the keys of its own bucket, so the cost is
    :math:`O(T \cdot \text{bucket size})`. Reformer also ties keys to queries (shared-QK) and hashes
    several rounds; here ``q`` and ``k`` are free and there is one round. A query whose bucket holds
    no allowed key gets a zero output. ``causal`` additionally requires :math:`j \le i + T_k - T_q`.

    >>> q = k = v = torch.ones(1, 5, 2)  # identical vectors share one bucket: full attention
    >>> lsh_attention(q, k, v, n_buckets=4, generator=torch.Generator().manual_seed(0))[0, 0]
    tensor([1., 1.])
    """
    q4, k4, v4, squeeze, dtype = _inputs(q, k, v)
    B, H, T_q, D = q4.shape
    T_k = k4.shape[2]
    if R is None:
        R = lsh_rotations(D, n_buckets, generator=generator, dtype=q4.dtype).to(q4.device)
    nb = 2 * R.shape[-1]
    h_q, h_k = lsh_hash(q4, R), lsh_hash(k4, R)  # (B, H, T)
    order = torch.argsort(h_k, dim=-1, stable=True)  # keys sorted by bucket
    counts = F.one_hot(h_k, nb).sum(-2)  # (B, H, nb)
    start = counts.cumsum(-1) - counts
    n_max = max(int(counts.max()), 1)
    first, size = start.gather(-1, h_q), counts.gather(-1, h_q)  # (B, H, T_q)
    r = torch.arange(n_max, device=q4.device)
    pos = (first.unsqueeze(-1) + r).clamp_max(T_k - 1)
    idx = order.gather(-1, pos.flatten(-2)).view(B, H, T_q, n_max)
    valid = r < size.unsqueeze(-1)
    if causal:
        valid = valid & (idx <= torch.arange(T_q, device=q4.device).view(T_q, 1) + (T_k - T_q))
    out = gathered_attention(q4, k4, v4, idx, valid, attention_scale(scale, D))
    return _output(out, squeeze, dtype)
