r"""A tiny GPT assembled only from llmbook parts (chapter 2), Llama-compatible.

.. math::
    h^{(0)} = E[x], \qquad
    h^{(l+1)} = \mathrm{Block}_l(h^{(l)}) \ (l = 0..L-1), \qquad
    z = \mathrm{RMSNorm}(h^{(L)})\, E^\top

* embedding: :class:`llmbook.lm.embeddings.TokenEmbedding` (no absolute positions; positions enter
  through RoPE inside attention);
* ``L`` pre-norm blocks (:class:`llmbook.lm.blocks.PreNormBlock`) with
  :class:`~llmbook.lm.norms.RMSNorm`, causal :class:`~llmbook.lm.attention.MultiHeadAttention` with
  RoPE (:func:`~llmbook.lm.rope.rope_cos_sin`) and grouped key/value heads, and a
  :class:`~llmbook.lm.activations.SwiGLU` MLP;
* a final RMSNorm and the LM head (:class:`~llmbook.lm.embeddings.LMHead`), tied to the embedding.

This is the architecture of Llama. Weights load from any plain state dict through a documented key
map (ours <- theirs) with :meth:`TinyGPT.load_mapped_state_dict`; :mod:`llmbook.lm.checkpoints` holds
the maps for Hugging Face's ``LlamaForCausalLM`` (:func:`llama_key_map`, used by
:meth:`TinyGPT.from_llama`, whose logits then agree to float precision) and for Meta's reference code
(:func:`~llmbook.lm.checkpoints.meta_llama_key_map`).

Later chapters reuse the model: decoding (:meth:`TinyGPT.generate`), the KV cache and FLOP counting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from llmbook._checks import check_divisible, check_nonnegative_int, check_positive_int, check_range
from llmbook.lm.activations import SwiGLU
from llmbook.lm.attention import MultiHeadAttention
from llmbook.lm.blocks import PreNormBlock
from llmbook.lm.checkpoints import llama_key_map, load_mapped_state_dict
from llmbook.lm.decoding import sample
from llmbook.lm.embeddings import LMHead, TokenEmbedding, check_token_ids
from llmbook.lm.norms import RMSNorm
from llmbook.lm.rope import (
    check_rope_layout,
    half_to_interleaved_weight,
    interleaved_to_half_weight,
    rope_cos_sin,
)

__all__ = ["GPTConfig", "TinyGPT", "llama_key_map"]


@dataclass(frozen=True)
class GPTConfig:
    r"""Shape of a :class:`TinyGPT`. Defaults give a 2-layer toy with plain multi-head attention.

    ``vocab_size`` is :math:`V`, ``d_model`` :math:`C`, ``n_layers`` :math:`L`, ``n_heads`` :math:`H`,
    ``n_kv_heads`` :math:`H_{kv}` (default ``None`` = ``H``: as many key/value heads as query heads; a
    divisor of ``H`` gives grouped-query attention), ``d_ff`` the SwiGLU width, ``max_seq_len`` the
    longest context :meth:`TinyGPT.generate` keeps, ``rope_theta`` the RoPE base, ``norm_eps`` the
    RMSNorm :math:`\epsilon`, ``tie_embeddings`` whether :math:`W_U = E^\top`, ``rope_layout`` which
    channels form a RoPE pair (see :class:`~llmbook.lm.attention.MultiHeadAttention`).

    Choices that differ from a textbook GPT-2 and are fixed (the architecture is Llama's): no biases
    anywhere, :class:`~llmbook.lm.norms.RMSNorm` (pre-norm, :math:`\epsilon` inside the square root)
    instead of LayerNorm, a SwiGLU MLP instead of GELU, RoPE in every attention layer instead of
    learned absolute positions. Choices with a default that a checkpoint may need changed:

    * ``tie_embeddings=True``: the LM head is the embedding (GPT-2, small Llamas); Meta's and most
      large Llama checkpoints are untied;
    * ``rope_theta=10000.0``: the base of Llama 1/2 (Llama 3 uses 500000);
    * ``rope_layout="half"``: half-split pairs :math:`(j, j + D/2)`, the layout of Hugging Face
      checkpoints; Meta's reference code and the RoFormer paper use ``"interleaved"``;
    * ``norm_eps=1e-6`` (Hugging Face's default; Meta's Llama uses 1e-5).

    >>> GPTConfig().head_dim, GPTConfig().kv_heads
    (8, 4)
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 88
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    rope_layout: str = "half"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            check_positive_int(getattr(self, name), name)
        H_kv = check_positive_int(self.kv_heads, "n_kv_heads (None or an int)")
        check_divisible(self.d_model, self.n_heads, "d_model", "n_heads")
        check_divisible(self.n_heads, H_kv, "n_heads", "n_kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"the head width d_model / n_heads = {self.head_dim} must be even for RoPE")
        check_rope_layout(self.rope_layout)
        check_range(self.rope_theta, "rope_theta (the RoPE base)", 1.0, low_open=True)
        check_range(self.norm_eps, "norm_eps", 0.0)

    @property
    def kv_heads(self) -> int:
        """:math:`H_{kv}`, resolving ``None`` to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """:math:`D = C / H`."""
        return self.d_model // self.n_heads

    @classmethod
    def from_llama_config(cls, cfg, max_seq_len: int | None = None) -> GPTConfig:
        """Read a ``transformers.LlamaConfig`` (duck-typed: no import of transformers here)."""
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"only the default RoPE is supported, got rope_type {rope.get('rope_type')!r}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        problems = []
        if head_dim * cfg.num_attention_heads != cfg.hidden_size:
            problems.append(f"head_dim ({head_dim}) * num_attention_heads != hidden_size ({cfg.hidden_size})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act must be 'silu', got {cfg.hidden_act!r}")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            problems.append("attention_bias and mlp_bias must be False")
        if problems:
            raise ValueError("this Llama config has no TinyGPT equivalent: " + "; ".join(problems))
        return cls(vocab_size=cfg.vocab_size, d_model=cfg.hidden_size, n_layers=cfg.num_hidden_layers,
                   n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
                   d_ff=cfg.intermediate_size, max_seq_len=max_seq_len or cfg.max_position_embeddings,
                   rope_theta=float(theta), norm_eps=cfg.rms_norm_eps, tie_embeddings=cfg.tie_word_embeddings,
                   rope_layout="half")


class TinyGPT(nn.Module):
    r"""Decoder-only transformer: embedding -> ``L`` pre-norm RMSNorm/RoPE/GQA/SwiGLU blocks -> norm -> tied head.

    ``forward(ids (B, T), positions=None) -> logits (B, T, V)``, or with any leading axes,
    ``(..., T) -> (..., T, V)``; ``positions`` (default ``0..T-1``) only moves RoPE: a ``(T,)`` tensor shared
    by the batch (to continue a sequence) or a tensor of ``ids``' shape with one row per sequence (left
    padding, packed sequences). Attention is causal. Weights start as
    GPT-2/Llama do: :math:`\mathcal{N}(0, 0.02^2)` for every matrix, norms at one.

    >>> model = TinyGPT(GPTConfig())
    >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 5, 64])
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        cfg = config if config is not None else GPTConfig()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(cfg).__name__}")
        self.config = cfg
        C = cfg.d_model
        norm = partial(RMSNorm, eps=cfg.norm_eps)
        self.embed = TokenEmbedding(cfg.vocab_size, C)
        self.blocks = nn.ModuleList(
            PreNormBlock(C, MultiHeadAttention(C, cfg.n_heads, cfg.kv_heads, rope_layout=cfg.rope_layout),
                         SwiGLU(C, cfg.d_ff), norm=norm)
            for _ in range(cfg.n_layers)
        )
        self.norm = norm(C)
        self.head = LMHead(C, cfg.vocab_size, tied_to=self.embed if cfg.tie_embeddings else None)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def num_parameters(self) -> int:
        """Number of trainable scalars, each shared tensor counted once (a tied head adds nothing)."""
        return sum(p.numel() for p in self.parameters())

    def hidden_states(self, ids: Int[Tensor, "*B T"], positions: Int[Tensor, "*B T"] | None = None
                      ) -> Float[Tensor, "*B T C"]:
        r"""The final normalised hidden states :math:`\mathrm{RMSNorm}(h^{(L)})`, the input of the LM head.

        ``ids`` is ``(B, T)`` or has any leading axes, ``(..., T)`` (``(T,)`` for one sequence); ``positions``
        is ``(T,)`` or has the shape of ``ids``. The result is ``(..., T, C)``.
        """
        cfg = self.config
        ids = check_token_ids(ids, cfg.vocab_size)
        if ids.ndim == 0 or ids.shape[-1] == 0:
            raise ValueError(f"ids must have shape (..., T) with T >= 1, got {tuple(ids.shape)}")
        lead, T = tuple(ids.shape[:-1]), ids.shape[-1]
        ids = ids.reshape(-1, T)
        if positions is None:
            positions = torch.arange(T, device=ids.device)
        positions = torch.as_tensor(positions, device=ids.device)
        if positions.shape not in ((T,), (*lead, T)):
            raise ValueError(f"positions must have shape (T,) = ({T},) or that of ids {(*lead, T)}, "
                             f"got {tuple(positions.shape)}")
        positions = positions.reshape(-1, T) if positions.ndim > 1 else positions
        h = self.embed(ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, base=cfg.rope_theta, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, is_causal=True, rope=(cos, sin))
        return self.norm(h).reshape(*lead, T, cfg.d_model)

    @torch.no_grad()
    def attention_maps(self, ids: Int[Tensor, "B T"], positions: Int[Tensor, "*B T"] | None = None
                       ) -> Float[Tensor, "L B H T T"]:
        """The causal attention weights of every layer and head on ``ids``: ``(L, B, H, T, T)``.

        Runs the same computation as ``forward`` and asks each block's attention for its weights
        (:meth:`llmbook.lm.attention.MultiHeadAttention.attention_weights`), for looking at what the
        heads of a trained model attend to. Rows sum to one; entries above the diagonal are zero.

        >>> TinyGPT(GPTConfig(vocab_size=10, d_model=16, n_layers=2, n_heads=2)).attention_maps(
        ...     torch.tensor([[1, 2, 3]])).shape
        torch.Size([2, 1, 2, 3, 3])
        """
        cfg = self.config
        ids = check_token_ids(ids, cfg.vocab_size)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        T = ids.shape[1]
        positions = torch.arange(T, device=ids.device) if positions is None else positions
        h = self.embed(ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, base=cfg.rope_theta, dtype=h.dtype)
        maps = []
        for block in self.blocks:
            maps.append(block.attn.attention_weights(block.norm1(h), is_causal=True, rope=(cos, sin)))
            h = block(h, is_causal=True, rope=(cos, sin))
        return torch.stack(maps)

    def forward(self, ids: Int[Tensor, "*B T"], positions: Int[Tensor, "*B T"] | None = None
                ) -> Float[Tensor, "*B T V"]:
        return self.head(self.hidden_states(ids, positions))

    # ------------------------------------------------------------------ transformers interop

    def load_mapped_state_dict(self, state: Mapping[str, Tensor], key_map: Mapping[str, str], *,
                               rope_layout: str | None = None, ignore=()) -> TinyGPT:
        """Load a plain state dict through a key map ``ours <- theirs``, in place; returns ``self``.

        ``key_map`` maps each of our names to the checkpoint's (:func:`llama_key_map`,
        :func:`~llmbook.lm.checkpoints.meta_llama_key_map`, or a reader's own). ``rope_layout`` is the
        RoPE layout of the checkpoint's q/k rows when it differs from ``config.rope_layout``: those rows
        are then converted (:func:`~llmbook.lm.rope.interleaved_to_half_weight` or its inverse);
        ``None`` means the checkpoint matches the model. ``ignore`` lists checkpoint keys (or patterns)
        to leave unused. Every check and error of
        :func:`~llmbook.lm.checkpoints.load_mapped_state_dict` applies: missing, unexpected, unmapped
        and mis-shaped keys are named.
        """
        cfg = self.config
        transform = {}
        if rope_layout is not None and check_rope_layout(rope_layout) != cfg.rope_layout:
            convert = interleaved_to_half_weight if rope_layout == "interleaved" else half_to_interleaved_weight
            for l in range(cfg.n_layers):
                transform[f"blocks.{l}.attn.q_proj.weight"] = partial(convert, n_heads=cfg.n_heads)
                transform[f"blocks.{l}.attn.k_proj.weight"] = partial(convert, n_heads=cfg.kv_heads)
        load_mapped_state_dict(self, state, key_map, ignore=ignore, transform=transform)
        return self

    def load_llama_weights(self, llama) -> TinyGPT:
        """Copy the weights of a ``LlamaForCausalLM`` (or its ``state_dict()``) into this model, in place.

        Uses :func:`llama_key_map` and :meth:`load_mapped_state_dict`; the Llama q/k rows are half-split
        and are converted if this model's ``rope_layout`` is ``"interleaved"``. Rotary ``inv_freq``
        buffers are ignored, and the ``lm_head.weight`` of a tied model must equal the embedding.
        Returns ``self``.
        """
        state = llama.state_dict() if isinstance(llama, nn.Module) else llama
        if not isinstance(state, Mapping):
            raise TypeError(f"llama must be an nn.Module or a state dict, got {type(llama).__name__}")
        cfg = self.config
        mapping = llama_key_map(cfg.n_layers, cfg.tie_embeddings)
        if cfg.tie_embeddings and "lm_head.weight" in state:
            mapping["head.weight"] = "lm_head.weight"  # must then equal the embedding (checked)
        return self.load_mapped_state_dict(state, mapping, rope_layout="half", ignore=["*inv_freq"])

    @classmethod
    def from_llama(cls, llama) -> TinyGPT:
        """A new :class:`TinyGPT` with the config and weights of a ``LlamaForCausalLM``."""
        model = cls(GPTConfig.from_llama_config(llama.config))
        first = next(llama.parameters())
        return model.to(dtype=first.dtype, device=first.device).load_llama_weights(llama)

    # ------------------------------------------------------------------ decoding

    @torch.no_grad()
    def generate(self, ids: Int[Tensor, "B T"], max_new_tokens: int, generator: torch.Generator | None = None,
                 **sampling) -> Int[Tensor, "B T+N"]:
        """Append ``max_new_tokens`` tokens, each drawn by :func:`llmbook.lm.decoding.sample` from the last logits.

        ``sampling`` is passed on (``tau``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``); ``tau=0`` is
        greedy. No KV cache: every step re-reads the whole context, cropped to its last ``max_seq_len``
        tokens (chapter 17 adds the cache). Returns the prompt followed by the new tokens.

        >>> model = TinyGPT(GPTConfig())
        >>> model.generate(torch.zeros(1, 3, dtype=torch.long), 4, tau=0).shape
        torch.Size([1, 7])
        """
        ids = check_token_ids(ids, self.config.vocab_size)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        max_new_tokens = check_nonnegative_int(max_new_tokens, "max_new_tokens")
        for _ in range(max_new_tokens):
            context = ids[:, -self.config.max_seq_len:]
            z = self(context)[:, -1].float()
            nxt = sample(z, generator=generator, **sampling)
            ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=1)
        return ids

