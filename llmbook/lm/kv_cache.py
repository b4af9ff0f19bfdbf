r"""The KV cache (chapter 17, ids 17.03 and 17.04): its size, and a real one for the tiny GPT.

Decoding token :math:`t+1` needs the keys and values of tokens :math:`1..t` in every layer. They do not
change once computed (attention is causal), so a server keeps them: the *KV cache*. Its size is

.. math:: M_{KV} = 2 \cdot L \cdot B \cdot S \cdot H_{kv} \cdot d_h \cdot \mathrm{bytes}

(:func:`kv_cache_bytes`): keys and values, in each of :math:`L` layers, for :math:`B` sequences of
:math:`S` tokens, :math:`H_{kv}` key/value heads of width :math:`d_h`. Llama-2-7B in fp16 holds 512 KiB
per token. Sharing key/value heads shrinks it by :math:`H_{kv}/H_q` (:func:`kv_memory_ratio`):
multi-query attention (Shazeer, 2019) keeps one head, grouped-query attention (Ainslie et al., 2023)
:math:`g` groups, and DeepSeek-V2's multi-head latent attention caches a low-rank latent instead of
heads (:func:`kv_bytes_per_token`).

:class:`KVCache` is a preallocated (static) cache of real tensors, and :func:`forward_cached` runs
:class:`~llmbook.lm.gpt.TinyGPT`'s own modules (embedding, norms, projections, RoPE, attention, MLP,
head) on new tokens only, reading earlier keys and values from the cache. Its logits equal those of a
full forward pass up to float rounding; :func:`generate_cached` decodes with it.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from llmbook._checks import (
    check_choice,
    check_nonnegative_int,
    check_positive_int,
    check_range,
    check_token_ids,
)
from llmbook.lm.attention import attend
from llmbook.lm.decoding import sample
from llmbook.lm.rope import apply_rope, rope_cos_sin
from llmbook.registry import implements

__all__ = ["kv_cache_bytes", "kv_memory_ratio", "kv_bytes_per_token", "KVCache", "forward_cached",
           "generate_cached"]

ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")


@implements("17.03")
def kv_cache_bytes(L: int, B: int, S: int, H_kv: int, d_h: int, bytes_per_elem: float = 2) -> float:
    r"""KV-cache memory :math:`M_{KV} = 2 \cdot L \cdot B \cdot S \cdot H_{kv} \cdot d_h \cdot \mathrm{bytes}`.

    ``L`` layers, ``B`` sequences, ``S`` cached tokens each, ``H_kv`` key/value heads of width ``d_h``,
    ``bytes_per_elem`` bytes per number (2 for fp16/bf16, 1 for an fp8 cache, 4 for float32). The 2 is
    keys and values. Returns bytes (an ``int`` when ``bytes_per_elem`` is one).

    >>> kv_cache_bytes(32, 1, 1, 32, 128) // 1024   # Llama-2-7B, fp16: KiB per token
    512
    >>> kv_cache_bytes(32, 1, 4096, 32, 128) / 2**30   # a full 4096-token context: GiB
    2.0
    """
    L, B, S = check_nonnegative_int(L, "L (layers)"), check_nonnegative_int(B, "B"), check_nonnegative_int(S, "S")
    H_kv, d_h = check_positive_int(H_kv, "H_kv (key/value heads)"), check_positive_int(d_h, "d_h (head width)")
    b = check_range(bytes_per_elem, "bytes_per_elem", 0.0, low_open=True)
    return 2 * L * B * S * H_kv * d_h * (int(b) if float(b).is_integer() else b)


@implements("17.04")
def kv_memory_ratio(H_kv: int, H_q: int) -> float:
    r"""KV memory of grouped-query attention relative to multi-head attention: :math:`M_{GQA}/M_{MHA} = H_{kv}/H_q`.

    ``H_q`` query heads share ``H_kv`` key/value heads (``H_kv`` must divide ``H_q``): ``H_kv = H_q`` is
    multi-head attention (ratio 1), ``H_kv = 1`` multi-query attention (:math:`1/H_q`). Everything else
    in :func:`kv_cache_bytes` is unchanged, so the ratio holds for any length, batch and dtype.

    >>> kv_memory_ratio(8, 64)   # Llama-2-70B: 8 key/value heads for 64 query heads
    0.125
    """
    H_kv, H_q = check_positive_int(H_kv, "H_kv (key/value heads)"), check_positive_int(H_q, "H_q (query heads)")
    if H_q % H_kv:
        raise ValueError(f"H_kv ({H_kv}) must divide H_q ({H_q}): each key/value head serves H_q / H_kv query heads")
    return H_kv / H_q


def kv_bytes_per_token(kind: str, n_layers: int, H_q: int, d_h: int, *, H_kv: int | None = None,
                       d_c: int | None = None, d_rope: int | None = None, bytes_per_elem: float = 2) -> float:
    r"""Cache bytes per token of one sequence for ``kind`` in ``("MHA", "GQA", "MQA", "MLA")``.

    MHA caches :math:`2 H_q d_h` numbers per layer, GQA :math:`2 H_{kv} d_h` (``H_kv`` required), MQA
    :math:`2 d_h` (all :func:`kv_cache_bytes` with one token). MLA (DeepSeek-V2) caches one compressed
    latent of width ``d_c`` shared by keys and values, plus one RoPE key of width ``d_rope`` shared by
    all heads: :math:`d_c + d_h^R` numbers per layer, no factor 2 (DeepSeek-V2: :math:`d_c = 512`,
    :math:`d_h^R = 64`, i.e. :math:`4.5\,d_h` for :math:`d_h = 128`).

    >>> [kv_bytes_per_token(k, 32, 32, 128, H_kv=8, d_c=512, d_rope=64) // 1024 for k in ATTENTION_KINDS]
    [512, 128, 16, 36]
    """
    check_choice(kind, "kind", ATTENTION_KINDS)
    if kind == "MLA":
        if d_c is None or d_rope is None:
            raise ValueError("MLA needs d_c (the latent width) and d_rope (the decoupled RoPE key width)")
        n_layers = check_nonnegative_int(n_layers, "n_layers")
        width = check_positive_int(d_c, "d_c") + check_nonnegative_int(d_rope, "d_rope")
        return n_layers * width * check_range(bytes_per_elem, "bytes_per_elem", 0.0, low_open=True)
    if kind == "GQA" and H_kv is None:
        raise ValueError("GQA needs H_kv, the number of key/value heads")
    heads = {"MHA": H_q, "GQA": H_kv, "MQA": 1}[kind]
    kv_memory_ratio(heads, check_positive_int(H_q, "H_q"))  # validates that heads divides H_q
    return kv_cache_bytes(n_layers, 1, 1, heads, d_h, bytes_per_elem)


class KVCache:
    r"""A preallocated KV cache: per layer, keys and values of shape ``(B, H_kv, S_max, d_h)``.

    Like a server's static cache, the memory is reserved up front for ``S_max`` tokens; ``length`` tokens
    of it are filled. :meth:`nbytes` is the reserved memory, :meth:`used_nbytes` the filled part (both by
    ``.numel() * .element_size()`` of the real tensors). :meth:`update` writes a layer's new keys and
    values at the current position and returns views of everything cached so far; :meth:`advance` moves
    the position once every layer has written (:func:`forward_cached` does both).

    >>> cache = KVCache(n_layers=2, B=1, H_kv=4, S_max=10, d_h=8)
    >>> cache.nbytes() == kv_cache_bytes(2, 1, 10, 4, 8, bytes_per_elem=4)
    True
    """

    def __init__(self, n_layers: int, B: int, H_kv: int, S_max: int, d_h: int, dtype: torch.dtype = torch.float32,
                 device=None):
        shape = tuple(check_positive_int(v, name) for v, name in
                      ((B, "B"), (H_kv, "H_kv"), (S_max, "S_max"), (d_h, "d_h")))
        n_layers = check_positive_int(n_layers, "n_layers")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    @classmethod
    def for_model(cls, model, B: int, S_max: int | None = None) -> KVCache:
        """An empty cache shaped for a :class:`~llmbook.lm.gpt.TinyGPT` (``S_max`` defaults to its ``max_seq_len``)."""
        cfg = model.config
        p = next(model.parameters())
        return cls(cfg.n_layers, B, cfg.kv_heads, cfg.max_seq_len if S_max is None else S_max, cfg.head_dim,
                   dtype=p.dtype, device=p.device)

    @property
    def S_max(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        """Bytes reserved by the cache tensors: ``sum(t.numel() * t.element_size())`` over keys and values."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def used_nbytes(self) -> int:
        """Bytes of the filled part, counted on the views ``k[:, :, :length]`` of the real tensors."""
        return sum(t[:, :, :self.length].numel() * t.element_size() for t in self.k + self.v)

    def update(self, layer: int, k: Float[Tensor, "B H_kv T d_h"], v: Float[Tensor, "B H_kv T d_h"]
               ) -> tuple[Float[Tensor, "B H_kv S d_h"], Float[Tensor, "B H_kv S d_h"]]:
        """Write ``k, v`` at positions ``length .. length + T - 1`` of ``layer``; return all keys and values so far."""
        T = k.shape[2]
        end = self.length + T
        if end > self.S_max:
            raise ValueError(f"the cache holds S_max = {self.S_max} tokens; {self.length} cached + {T} new exceed it")
        if k.shape != v.shape or k.shape[:2] + k.shape[3:] != self.k[layer].shape[:2] + self.k[layer].shape[3:]:
            raise ValueError(f"k and v must have shape (B, H_kv, T, d_h) = {tuple(self.k[layer].shape[:2])} + "
                             f"(T, {self.k[layer].shape[3]}), got {tuple(k.shape)} and {tuple(v.shape)}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, T: int) -> None:
        """Mark ``T`` more positions as filled (after every layer has called :meth:`update`)."""
        self.length += check_nonnegative_int(T, "T")


def forward_cached(model, ids: Int[Tensor, "B T"], cache, positions: Int[Tensor, "B T"] | None = None,
                   key_mask: Bool[Tensor, "B S"] | None = None) -> Float[Tensor, "B T V"]:
    r"""Logits of ``ids`` as the continuation of what ``cache`` holds, reusing the cached keys and values.

    The new tokens sit at positions ``cache.length .. cache.length + T - 1`` (their RoPE angles). Each
    layer runs the model's own modules on the new tokens only: ``norm1``, the ``q/k/v`` projections,
    RoPE, then attention of the new queries over all cached keys plus the new ones (the causal diagonal
    aligned bottom-right, so a chunk of several new tokens is masked correctly), ``o_proj``, the
    residual, ``norm2`` and the MLP. The cache then advances by ``T``. A prompt is one call (the
    prefill); each decoded token is a call with ``T = 1``. ``cache`` is a :class:`KVCache` or any object
    with ``length``, ``update(layer, k, v)`` and ``advance(T)`` (the paged cache of
    :mod:`llmbook.lm.serving`). Inference only: dropout and stochastic depth are not applied.

    For a batch of prompts of different lengths, left-padded: ``positions`` ``(B, T)`` gives each new
    token's RoPE position (a padded row's first real token at 0), and ``key_mask`` ``(B, S)`` marks with
    ``True`` the keys that may be attended, for all ``S = cache.length + T`` positions so far (``False`` on
    the padding). Both default to the unpadded case above.
    """
    cfg = model.config
    ids = check_token_ids(ids, cfg.vocab_size)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
    B, T = ids.shape
    start = cache.length
    h = model.embed(ids)
    if positions is None:
        positions = torch.arange(start, start + T, device=ids.device)
    elif tuple(positions.shape) != (B, T):
        raise ValueError(f"positions must have shape (B, T) = ({B}, {T}), got {tuple(positions.shape)}")
    mask = None
    if key_mask is not None:
        if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, start + T):
            raise ValueError(f"key_mask must be a bool tensor of shape (B, cached + new) = ({B}, {start + T}), "
                             f"got {key_mask.dtype} {tuple(key_mask.shape)}")
        mask = key_mask[:, None, None, :]
    cos, sin = rope_cos_sin(positions, cfg.head_dim, base=cfg.rope_theta, dtype=h.dtype)
    for layer, block in enumerate(model.blocks):
        h = h + _cached_attention(block.attn, block.norm1(h), cache, layer, cos, sin, mask)
        h = h + block.mlp(block.norm2(h))
    cache.advance(T)
    return model.head(model.norm(h))


def _cached_attention(attn, x: Tensor, cache, layer: int, cos: Tensor, sin: Tensor, mask: Tensor | None = None
                      ) -> Tensor:
    """One attention sublayer on the new tokens ``x (B, T, C)``: project, rotate, cache, attend, project back."""
    B, T, _ = x.shape
    H, H_kv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)         # (B, H, T, D)
    k = attn.k_proj(x).view(B, T, H_kv, D).transpose(1, 2)      # (B, H_kv, T, D)
    v = attn.v_proj(x).view(B, T, H_kv, D).transpose(1, 2)
    q, k = apply_rope(q, cos, sin, attn.rope_layout), apply_rope(k, cos, sin, attn.rope_layout)
    K, V = cache.update(layer, k, v)                             # (B, H_kv, S, D): cached + new
    o, _ = attend(q, K, V, mask, True, D ** -0.5)  # unchecked: the model produced q, K, V (see attend)
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, H * D))


@torch.no_grad()
def generate_cached(model, ids: Int[Tensor, "B T"], max_new_tokens: int, generator: torch.Generator | None = None,
                    cache: KVCache | None = None, **sampling) -> Int[Tensor, "B T+N"]:
    """:meth:`~llmbook.lm.gpt.TinyGPT.generate` with a KV cache: one prefill, then one token per step.

    ``sampling`` goes to :func:`llmbook.lm.decoding.sample` (``tau=0`` greedy). ``cache`` defaults to a
    :class:`KVCache` sized for the prompt plus ``max_new_tokens``. Unlike ``generate`` the context is never
    cropped: the cache must hold it all. Returns the prompt followed by the new tokens.

    >>> from llmbook.lm.gpt import GPTConfig, TinyGPT
    >>> generate_cached(TinyGPT(GPTConfig()), torch.zeros(1, 3, dtype=torch.long), 4, tau=0).shape
    torch.Size([1, 7])
    """
    ids = check_token_ids(ids, model.config.vocab_size)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
    max_new_tokens = check_nonnegative_int(max_new_tokens, "max_new_tokens")
    if cache is None:
        cache = KVCache.for_model(model, ids.shape[0], ids.shape[1] + max(max_new_tokens, 1))
    z = forward_cached(model, ids, cache)[:, -1]  # the prefill: the whole prompt in one call
    for i in range(max_new_tokens):
        nxt = sample(z.float(), generator=generator, **sampling)
        ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=1)
        if i < max_new_tokens - 1:  # one decode step: only the new token goes through the model
            z = forward_cached(model, nxt.unsqueeze(-1), cache)[:, -1]
    return ids
