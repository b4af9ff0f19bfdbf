r"""Sampling and decoding (chapter 9): greedy, temperature and the truncation warpers, Mirostat.

A *warper* maps logits ``(..., V)`` to logits ``(..., V)`` with the removed tokens set to ``-inf``;
``softmax`` of the result is the renormalised distribution :math:`p_i' = p_i 1[i\in S] / \sum_{j\in S} p_j`.
Every warper keeps at least one token (the argmax, except typical sampling, which keeps the most
*typical* token and can drop the most probable one), accepts any leading batch dimensions, and
rejects NaN, ``+inf``, rows with no finite logit, empty vocabularies and out-of-range arguments.

Beam search, length penalty, contrastive and speculative decoding live in :mod:`llmbook.lm.search`.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_int, check_nonempty, check_range
from llmbook._precision import upcast_half
from llmbook.lm.probability import entropy, log_softmax, softmax
from llmbook.registry import implements

__all__ = [
    "greedy",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "typical_filter",
    "min_p_filter",
    "sample",
    "mirostat_filter",
    "mirostat_step",
    "tail_mass",
    "find_crossing",
]

NEG_INF = float("-inf")


def _logits(z, name: str = "logits") -> Tensor:
    """Validate logits ``(..., V)``: real, non-empty, no NaN / ``+inf``, at least one finite entry per row."""
    z = as_tensor(z, name)
    check_dim(z, name, "(..., V)")
    check_nonempty(z, name)
    check_finite(z, name, allow_neg_inf=True)
    if not torch.isfinite(z).any(-1).all():
        raise ValueError(f"{name} has a row that is entirely -inf: no token left to choose")
    return z


def _tau(tau) -> float:
    """Temperature ``tau`` in ``[0, inf)``; NaN is a ``ValueError`` (a value, not a type, problem)."""
    if isinstance(tau, float) and math.isnan(tau):
        raise ValueError("tau must lie in [0, inf) (0 = greedy), got nan")
    check_range(tau, "tau", 0.0, math.inf, high_open=True)
    return tau


@implements("09.01")
def greedy(logits: Float[Tensor, "... V"]) -> Int[Tensor, "..."]:
    r"""Greedy decoding :math:`x_t = \arg\max_i p_\theta(i \mid x_{1:t-1})`.

    Softmax is monotone, so the argmax of the logits is the argmax of the probabilities. Ties go to
    the first index (as :func:`torch.argmax`). Shape ``(..., V) -> (...)``.

    >>> greedy(torch.tensor([[0.1, 2.0, 2.0], [3.0, 0.0, -1.0]]))
    tensor([1, 0])
    """
    return _logits(logits).argmax(-1)


@implements("09.02")
def apply_temperature(logits: Float[Tensor, "... V"], tau: float) -> Float[Tensor, "... V"]:
    r"""Temperature: warp logits :math:`z \mapsto z/\tau`, so :math:`p_i^{(\tau)} = e^{z_i/\tau}/\sum_j e^{z_j/\tau}`.

    ``tau`` is :math:`\tau \in [0, \infty)`: ``tau < 1`` sharpens, ``tau = 1`` leaves the distribution
    unchanged, ``tau -> inf`` tends to uniform. ``tau = 0`` is the limit, greedy decoding: every
    logit but the argmax becomes ``-inf`` (the argmax keeps its value; on ties the *first* index
    wins, as :func:`torch.argmax`). Nothing is ever divided by zero. fp16 / bf16 logits are divided in
    float32. When :math:`z/\tau` would overflow the logits' dtype (``[100., 99.]`` in fp16 at
    ``tau = 1e-3``: both ``inf``, a false tie), that row is returned shifted by its maximum,
    :math:`(z - \max z)/\tau` (computed in float64): the same distribution, the argmax at 0 and the
    other tokens at large negative values or ``-inf``. Shape ``(..., V) -> (..., V)``.

    >>> apply_temperature(torch.tensor([1.0, 2.0, 4.0]), 2.0)
    tensor([0.5000, 1.0000, 2.0000])
    >>> apply_temperature(torch.tensor([1.0, 4.0, 4.0]), 0)
    tensor([-inf, 4., -inf])
    """
    z = _logits(logits)
    _tau(tau)
    if tau == 0:
        keep = torch.zeros_like(z, dtype=torch.bool).scatter(-1, z.argmax(-1, keepdim=True), True)
        return z.masked_fill(~keep, NEG_INF)
    h = upcast_half(z) / tau
    over = (torch.isfinite(z) & ~(h.abs() <= torch.finfo(z.dtype).max)).any(-1, keepdim=True)
    if over.any():  # softmax is shift-invariant: subtract the row maximum before dividing
        shifted = (z.double() - z.double().amax(-1, keepdim=True)) / tau
        h = torch.where(over, shifted.to(h.dtype), h)
    return h.to(z.dtype)


@implements("09.03")
def top_k_filter(logits: Float[Tensor, "... V"], k: int) -> Float[Tensor, "... V"]:
    r"""Top-k: keep :math:`S_k = \mathrm{TopK}(p, k)`, set every other logit to ``-inf``.

    ``k`` is an int in ``[1, V]``. Ties: every token whose logit *equals* the k-th largest is kept
    (so more than ``k`` tokens survive when the k-th value is tied), exactly as transformers'
    ``TopKLogitsWarper``; the kept set does not depend on token order. Shape ``(..., V) -> (..., V)``.

    >>> top_k_filter(torch.tensor([1.0, 3.0, 2.0, 0.0]), 2)
    tensor([-inf, 3., 2., -inf])
    """
    z = _logits(logits)
    V = z.shape[-1]
    k = check_int(k, "k", low=1, high=V, what=f"an int in [1, V] = [1, {V}] (V is the vocabulary size)")
    kth = z.topk(k, dim=-1).values[..., -1:]
    return z.masked_fill(z < kth, NEG_INF)


@implements("09.04")
def top_p_filter(logits: Float[Tensor, "... V"], p: float) -> Float[Tensor, "... V"]:
    r"""Nucleus (top-p): keep :math:`S_p = \min\{S : \sum_{i\in S} p_i \ge p\}`, the most probable tokens first.

    Tokens are ranked by logit (descending); the token at rank :math:`r` is kept iff the tokens
    ranked before it hold less than ``p`` of the mass, computed as "it and the tokens after it hold
    more than :math:`1-p`" (the form transformers' ``TopPLogitsWarper`` uses, which keeps every
    token at ``p = 1``). The top token is always kept. ``p`` lies in :math:`(0, 1]`.

    Ties at the boundary are broken by token index (lower index kept first: a stable sort);
    transformers sorts ascending and so may keep a *different member* of a tied group, but the
    same number of tokens and the same mass. Shape ``(..., V) -> (..., V)``.

    >>> top_p_filter(torch.log(torch.tensor([0.5, 0.1, 0.3, 0.1])), 0.75)  # 0.5 + 0.3 >= 0.75
    tensor([-0.6931,    -inf, -1.2040,    -inf])
    """
    z = _logits(logits)
    check_range(p, "p", 0.0, 1.0, low_open=True)
    sorted_z, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    sorted_p = softmax(sorted_z)
    mass_from_here = sorted_p.flip(-1).cumsum(-1).flip(-1)  # mass of rank r and everything ranked below it
    keep_sorted = mass_from_here > 1 - p
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, idx, keep_sorted)
    return z.masked_fill(~keep, NEG_INF)


@implements("09.05")
def typical_filter(logits: Float[Tensor, "... V"], mass: float) -> Float[Tensor, "... V"]:
    r"""Locally typical sampling (Meister et al., 2023): keep tokens whose surprise is close to the entropy.

    The catalogue writes the set as :math:`S = \{i : |-\log p_i - H(p)| \le \tau\}`, where :math:`\tau` is a
    distance bound, not a temperature (chapter 9 writes it :math:`\varepsilon`). In practice
    (the paper's experiments and transformers' ``TypicalLogitsWarper``) the threshold is not a
    fixed :math:`\tau` but a *mass*: sort tokens by the distance :math:`d_i = |-\log p_i - H(p)|`
    (ascending) and keep the smallest prefix whose probability reaches ``mass``; :math:`\tau` is
    then the distance of the last kept token. Tokens tied with it in distance are kept too, and the
    most typical token always survives. Unlike the other warpers this one can remove the argmax
    (when it is far more probable than the entropy suggests: ``p = [0.4] + [0.06] * 10`` with
    ``mass = 0.25`` keeps the ten 0.06 tokens, tied in distance, and drops the 0.4 one).
    ``mass`` is in :math:`(0, 1]` (``1`` keeps everything). The distribution, entropy and distances
    of fp16 / bf16 logits are computed in float32. Entropy in nats. Shape ``(..., V) -> (..., V)``.

    >>> z = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))  # H = 1.2130 nats
    >>> typical_filter(z, 0.5)  # d = [0.52, 0.17, 0.87, 0.87]: keep 0.25, then 0.5 (mass 0.75)
    tensor([-0.6931, -1.3863,    -inf,    -inf])
    """
    z = _logits(logits)
    check_range(mass, "mass", 0.0, 1.0, low_open=True)
    if mass == 1:
        return z.clone()
    logp = log_softmax(upcast_half(z))
    probs = logp.exp()
    d = (-logp - entropy(probs).unsqueeze(-1)).abs()  # -inf logits: d = inf, ranked last
    sorted_d, idx = torch.sort(d, dim=-1, stable=True)
    cum = probs.gather(-1, idx).cumsum(-1)
    last = (cum < mass).sum(-1, keepdim=True).clamp(max=z.shape[-1] - 1)  # first rank reaching the mass
    return z.masked_fill(d > sorted_d.gather(-1, last), NEG_INF)


@implements("09.06")
def min_p_filter(logits: Float[Tensor, "... V"], alpha: float) -> Float[Tensor, "... V"]:
    r"""Min-p: keep :math:`S = \{i : p_i \ge \alpha \max_j p_j\}`, a threshold that scales with confidence.

    ``alpha`` is :math:`\alpha \in [0, 1]`: ``0`` keeps everything, ``1`` only the token(s) tied with
    the maximum. The argmax always survives. Shape ``(..., V) -> (..., V)``.

    >>> min_p_filter(torch.log(torch.tensor([0.6, 0.3, 0.06, 0.04])), 0.1)  # keep p >= 0.06
    tensor([-0.5108, -1.2040, -2.8134,    -inf])
    """
    z = _logits(logits)
    check_range(alpha, "alpha", 0.0, 1.0)
    probs = softmax(z)
    return z.masked_fill(probs < alpha * probs.amax(-1, keepdim=True), NEG_INF)


def sample(
    logits: Float[Tensor, "... V"],
    tau: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "..."]:
    r"""Draw one token per row from the warped distribution :math:`\mathrm{softmax}(\mathrm{warp}(z))`.

    Warpers run in a fixed order, the one transformers' ``generate`` uses: temperature
    (:func:`apply_temperature`), then :func:`top_k_filter`, :func:`top_p_filter`,
    :func:`min_p_filter`, :func:`typical_filter`; ``None`` skips a warper. Each truncation sees the
    distribution left by the previous ones. ``tau = 0`` returns :func:`greedy` exactly (no
    division, no randomness). Draws use :func:`torch.multinomial` with ``generator``.
    Shape ``(..., V) -> (...)``.

    >>> sample(torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]]), tau=0)
    tensor([1, 0])
    >>> sample(torch.tensor([0.0, 5.0, 1.0]), top_k=1)  # only one token left to draw
    tensor(1)
    """
    z = _logits(logits)
    _tau(tau)
    if tau == 0:
        return z.argmax(-1)
    z = apply_temperature(z, tau)
    if top_k is not None:
        z = top_k_filter(z, top_k)
    if top_p is not None:
        z = top_p_filter(z, top_p)
    if min_p is not None:
        z = min_p_filter(z, min_p)
    if typical_p is not None:
        z = typical_filter(z, typical_p)
    probs = softmax(upcast_half(z)).reshape(-1, z.shape[-1])
    return torch.multinomial(probs, 1, generator=generator).reshape(z.shape[:-1])


def mirostat_filter(logits: Float[Tensor, "... V"], mu: float) -> Float[Tensor, "... V"]:
    r"""Mirostat v2 truncation: keep tokens with surprise :math:`-\log_2 p_i \le \mu` (bits); the argmax always stays.

    Shape ``(..., V) -> (..., V)``.

    >>> mirostat_filter(torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125])), 2.0)  # surprises 1, 2, 3, 3
    tensor([-0.6931, -1.3863,    -inf,    -inf])
    """
    z = _logits(logits)
    check_range(mu, "mu")
    surprise = -log_softmax(z) / math.log(2)
    keep = (surprise <= mu).scatter(-1, z.argmax(-1, keepdim=True), True)
    return z.masked_fill(~keep, NEG_INF)


@implements("09.11")
def mirostat_step(
    logits: Float[Tensor, " V"], mu: float, tau_target: float, eta: float,
    generator: torch.Generator | None = None,
) -> tuple[int, float, float]:
    r"""One step of Mirostat v2 (Basu et al., 2021): sample, then steer the truncation to a target surprise.

    1. Truncate: keep the tokens whose surprise :math:`-\log_2 p_i` is at most :math:`\mu_t`
       (:func:`mirostat_filter`); renormalise and draw :math:`x_t`.
    2. Observe its surprise :math:`s_t = -\log_2 p(x_t)` under the *untruncated* distribution (as
       the authors' reference code; llama.cpp uses the renormalised one).
    3. Update :math:`\mu_{t+1} = \mu_t - \eta\,(s_t - \tau)`.

    In the catalogue :math:`\tau` is the *target surprise* in bits (argument ``tau_target``, > 0),
    **not** a temperature; ``eta`` (> 0) is the learning rate; ``mu`` is usually started at
    :math:`2\tau`. The feedback keeps the average observed surprise near :math:`\tau`, which
    controls perplexity (:math:`2^\tau`) and avoids both repetition and incoherence.

    ``logits`` is one row ``(V,)``. Returns ``(token, new_mu, surprise)``.

    >>> z = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    >>> mirostat_step(z, mu=0.5, tau_target=3.0, eta=0.1)  # only the argmax survives: s = 1 bit
    (0, 0.7, 1.0)
    """
    z = _logits(logits)
    check_dim(z, "logits", "(V,)", max_dim=1)
    check_range(mu, "mu")
    check_range(tau_target, "tau_target", 0.0, low_open=True)
    check_range(eta, "eta", 0.0, low_open=True)
    truncated = mirostat_filter(z, mu)
    token = int(torch.multinomial(softmax(truncated), 1, generator=generator).item())
    surprise = -log_softmax(z.double())[token].item() / math.log(2)
    return token, mu - eta * (surprise - tau_target), surprise


# --------------------------------------------------------------------------- measuring a warper


def tail_mass(logits: Float[Tensor, "... V"], warped: Float[Tensor, "... V"],
              floor: float = 0.01) -> Float[Tensor, "..."]:
    r"""Probability a warped distribution puts on the model's tail: :math:`\sum_i p'_i\,\mathbb{1}[p_i < f]`.

    :math:`p = \mathrm{softmax}(` ``logits`` :math:`)` is the model's own distribution (temperature 1),
    :math:`p' = \mathrm{softmax}(` ``warped`` :math:`)` the one a sampler draws from after temperature
    and truncation, and :math:`f` is ``floor`` in :math:`(0, 1]`: the "junk" is every token the model
    itself gives less than ``floor``. Shapes ``(..., V), (..., V) -> (...)``.

    >>> z = torch.log(torch.tensor([0.9, 0.095, 0.005]))  # the third token is junk at floor 0.01
    >>> round(float(tail_mass(z, z / 4.0)), 4)  # temperature 4: 0.005 ** (1/4), renormalised
    0.1481
    """
    z, w = _logits(logits), _logits(warped, "warped")
    if z.shape != w.shape:
        raise ValueError(f"logits {tuple(z.shape)} and warped {tuple(w.shape)} must have the same shape (..., V)")
    check_range(floor, "floor", 0.0, 1.0, low_open=True)
    junk = softmax(z) < floor
    return (softmax(w) * junk).sum(-1)


def find_crossing(f, lo: float, hi: float, tol: float = 1e-10) -> float:
    r"""A point where the real function ``f`` changes sign in :math:`[lo, hi]`, by bisection.

    ``f(lo)`` and ``f(hi)`` must have opposite signs (or one of them be 0). Each step halves the
    bracket and keeps the half whose end values still differ in sign, until it is shorter than
    ``tol``; ``f`` need not be continuous (a jump across zero is found like a root). With several
    sign changes in the bracket it returns one of them.

    >>> round(find_crossing(lambda t: t * t - 2.0, 0.0, 2.0), 8)  # sqrt(2)
    1.41421356
    """
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"need finite lo < hi, got lo = {lo}, hi = {hi}")
    check_range(tol, "tol", 0.0, low_open=True)
    f_lo, f_hi = float(f(lo)), float(f(hi))
    if math.isnan(f_lo) or math.isnan(f_hi):
        raise ValueError(f"f is NaN at an end of the bracket: f({lo}) = {f_lo}, f({hi}) = {f_hi}")
    if f_lo == 0:
        return lo
    if f_hi == 0:
        return hi
    if (f_lo > 0) == (f_hi > 0):
        raise ValueError(f"f must change sign on [lo, hi]; got f({lo}) = {f_lo:.3g} and f({hi}) = {f_hi:.3g}")
    while hi - lo > tol:
        mid = (lo + hi) / 2
        f_mid = float(f(mid))
        if f_mid == 0:
            return mid
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2
