r"""Position as a bias on the attention scores (chapter 4): ALiBi and T5's bucketed relative bias.

Neither touches the embeddings or the queries and keys; both add a term that depends on the
distance between query ``i`` and key ``j`` to the scores before the softmax. ALiBi's term is a fixed
linear penalty per head, T5's a learned scalar per (distance bucket, head).

Symbols: ``T`` queries, ``T_k`` keys, ``H`` heads, ``m_h`` the slope of head ``h``.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import as_tensor, check_integer_tensor, check_nonnegative_int, check_positive_int
from llmbook.registry import implements

__all__ = ["alibi_slopes", "alibi_bias", "t5_relative_position_bucket", "T5RelativeBias"]


# --------------------------------------------------------------------------- 04.06 ALiBi


def alibi_slopes(H: int) -> Float[Tensor, " H"]:
    r"""ALiBi's head slopes :math:`m_h`: a geometric sequence from :math:`2^{-8/H}` with ratio :math:`2^{-8/H}`.

    For ``H`` a power of two, :math:`m_h = 2^{-8h/H}` for :math:`h = 1..H`. Otherwise take the slopes
    of the largest power of two :math:`P < H` and add every other slope of :math:`2P` heads (the ones
    that interleave between them) until there are ``H``. Float32, shape ``(H,)``.

    >>> alibi_slopes(4)
    tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    H = check_positive_int(H, "H (the number of heads)")

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    P = 2 ** int(math.floor(math.log2(H)))
    slopes = geometric(P) + geometric(2 * P)[0::2][: H - P]
    return torch.tensor(slopes, dtype=torch.float32)


@implements("04.06")
def alibi_bias(T: int, H: int, slopes: Tensor | None = None, T_k: int | None = None) -> Float[Tensor, "H T T_k"]:
    r"""The ALiBi bias :math:`-m_h\,(i-j)` added to the scaled scores; no position enters the embeddings.

    .. math:: \mathrm{score}_{ij} = \frac{q_i^\top k_j}{\sqrt{d_k}} - m_h\,(i-j)

    ``i`` indexes ``T`` queries, ``j`` indexes ``T_k`` keys (default ``T``); the query positions are the
    last ``T`` of the ``T_k`` (as when decoding with a cache). Entries with ``j > i`` come out positive
    and are meant to be removed by the causal mask. ``slopes`` defaults to :func:`alibi_slopes`.
    Shape ``(H, T, T_k)``.

    >>> alibi_bias(3, 1, torch.tensor([0.5]))
    tensor([[[ 0.0000,  0.5000,  1.0000],
             [-0.5000,  0.0000,  0.5000],
             [-1.0000, -0.5000,  0.0000]]])
    """
    T, H = check_nonnegative_int(T, "T"), check_positive_int(H, "H")
    T_k = T if T_k is None else check_nonnegative_int(T_k, "T_k")
    if T_k < T:
        raise ValueError(f"need 0 <= T ({T}) <= T_k ({T_k})")
    slopes = alibi_slopes(H) if slopes is None else as_tensor(slopes, "slopes")
    if tuple(slopes.shape) != (H,):
        raise ValueError(f"slopes must have shape (H,) = ({H},), got {tuple(slopes.shape)}")
    i = torch.arange(T_k - T, T_k)[:, None]
    j = torch.arange(T_k)[None, :]
    return slopes[:, None, None] * (j - i).to(slopes.dtype)  # = -m_h (i - j), without a -0.0


# --------------------------------------------------------------------------- 04.07 T5 buckets


def t5_relative_position_bucket(relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32,
                                max_distance: int = 128) -> Tensor:
    r"""Map a relative position :math:`j - i` to one of ``num_buckets`` buckets, as T5 does.

    Half the buckets (per direction when ``bidirectional``) are exact for small distances
    :math:`|j-i| < n_{exact}`; the rest cover :math:`[n_{exact}, \text{max\_distance})` logarithmically,
    and everything farther shares the last bucket. With ``bidirectional=False`` (a decoder) only
    :math:`j \le i` is distinguished and every future key falls into bucket 0. Same shape as the input.

    >>> t5_relative_position_bucket(torch.tensor([-3, 0, 3, 1000]), num_buckets=8, max_distance=16)
    tensor([2, 0, 6, 7])
    """
    rel = check_integer_tensor(relative_position, "relative_position")
    num_buckets = check_positive_int(num_buckets, "num_buckets")
    max_distance = check_positive_int(max_distance, "max_distance")
    if num_buckets < 2 or (bidirectional and num_buckets < 4):
        raise ValueError(f"num_buckets ({num_buckets}) is too small (need >= 2, or >= 4 bidirectional)")
    bucket = torch.zeros_like(rel, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (rel > 0).long() * num_buckets  # keys to the right get the upper half
        n = rel.abs()
    else:
        n = (-rel).clamp(min=0)  # distance into the past; the future is 0
    n_exact = num_buckets // 2
    if max_distance <= n_exact:
        raise ValueError(f"max_distance ({max_distance}) must exceed the exact range ({n_exact})")
    log_ratio = torch.log(n.float() / n_exact) / math.log(max_distance / n_exact)
    large = n_exact + (log_ratio * (num_buckets - n_exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(n < n_exact, n, large)


@implements("04.07")
class T5RelativeBias(nn.Module):
    r"""A learned scalar per (bucket, head), added to the attention scores.

    .. math:: \mathrm{score}_{ij} = \frac{q_i^\top k_j}{\sqrt{d_k}} + b_{\mathrm{bucket}(j-i)}

    (T5 itself folds the :math:`1/\sqrt{d_k}` into its initialisation.) ``forward(T_q, T_k, offset=0)``
    returns the bias of shape ``(1, H, T_q, T_k)``; query ``i`` sits at position ``offset + i``.
    The table is ``relative_attention_bias`` (``nn.Embedding(num_buckets, H)``), as in ``transformers``.

    >>> T5RelativeBias(H=2)(3, 3).shape
    torch.Size([1, 2, 3, 3])
    """

    def __init__(self, H: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        H, num_buckets = check_positive_int(H, "H"), check_positive_int(num_buckets, "num_buckets")
        max_distance = check_positive_int(max_distance, "max_distance")
        t5_relative_position_bucket(torch.zeros(1, dtype=torch.long), bidirectional, num_buckets, max_distance)
        self.H, self.num_buckets, self.max_distance, self.bidirectional = H, num_buckets, max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, H)

    def forward(self, T_q: int, T_k: int, offset: int = 0) -> Float[Tensor, "1 H T_q T_k"]:
        T_q, T_k = check_nonnegative_int(T_q, "T_q"), check_nonnegative_int(T_k, "T_k")
        offset = check_nonnegative_int(offset, "offset")
        i = torch.arange(T_q)[:, None] + offset
        j = torch.arange(T_k)[None, :]
        b = t5_relative_position_bucket(j - i, self.bidirectional, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(b).permute(2, 0, 1).unsqueeze(0)
