r"""A tiny GPT assembled only from llmbook parts (chapter 2), Llama-compatible.

.. math::
    h^{(0)} = E[x], \qquad
    h^{(l+1)} = \mathrm{Block}_l(h^{(l)}) \ (l = 0..L-1), \qquad
    z = \mathrm{RMSNorm}(h^{(L)})\, E^\top

* embedding: :class:`llmbook.lm.embeddings.TokenEmbedding` (no absolute positions; positions enter
  through RoPE inside attention);
* ``L`` pre-norm blocks (:class:`llmbook.lm.blocks.PreNormBlock`) with
  :class:`~llmbook.lm.norms.RMSNorm`, causal :class:`~llmbook.lm.attention.MultiHeadAttention` with
  RoPE (:func:`~llmbook.lm.positions.rope_cos_sin`) and grouped key/value heads, and a
  :class:`~llmbook.lm.activations.SwiGLU` MLP;
* a final RMSNorm and the LM head (:class:`~llmbook.lm.embeddings.LMHead`), tied to the embedding.

This is the architecture of Llama, so :meth:`TinyGPT.load_llama_weights` can copy a
``transformers.LlamaForCausalLM`` into it; the logits then agree to float precision. The key mapping
(ours <- Llama's) is the documented contract, :func:`llama_key_map`:

=============================================  ==================================================
``embed.weight``                               ``model.embed_tokens.weight``
``blocks.{l}.norm1.weight``                    ``model.layers.{l}.input_layernorm.weight``
``blocks.{l}.attn.{q,k,v,o}_proj.weight``      ``model.layers.{l}.self_attn.{q,k,v,o}_proj.weight``
``blocks.{l}.norm2.weight``                    ``model.layers.{l}.post_attention_layernorm.weight``
``blocks.{l}.mlp.w_gate.weight``               ``model.layers.{l}.mlp.gate_proj.weight``
``blocks.{l}.mlp.w_up.weight``                 ``model.layers.{l}.mlp.up_proj.weight``
``blocks.{l}.mlp.w_down.weight``               ``model.layers.{l}.mlp.down_proj.weight``
``norm.weight``                                ``model.norm.weight``
``head.weight`` (untied models only)           ``lm_head.weight``
=============================================  ==================================================

Later chapters reuse the model: decoding (:meth:`TinyGPT.generate`), the KV cache and FLOP counting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from llmbook.lm.activations import SwiGLU
from llmbook.lm.attention import MultiHeadAttention
from llmbook.lm.blocks import PreNormBlock
from llmbook.lm.decoding import sample
from llmbook.lm.embeddings import LMHead, TokenEmbedding, check_token_ids
from llmbook.lm.norms import RMSNorm
from llmbook.lm.positions import rope_cos_sin

__all__ = ["GPTConfig", "TinyGPT", "llama_key_map"]


@dataclass(frozen=True)
class GPTConfig:
    r"""Shape of a :class:`TinyGPT`. Defaults give a 2-layer toy with GQA (4 query heads, 2 key/value heads).

    ``vocab_size`` is :math:`V`, ``d_model`` :math:`C`, ``n_layers`` :math:`L`, ``n_heads`` :math:`H`,
    ``n_kv_heads`` :math:`H_{kv}` (``None`` = ``H``), ``d_ff`` the SwiGLU width, ``max_seq_len`` the
    longest context :meth:`TinyGPT.generate` keeps, ``rope_theta`` the RoPE base, ``norm_eps`` the
    RMSNorm :math:`\epsilon`, ``tie_embeddings`` whether :math:`W_U = E^\top`.

    >>> GPTConfig().head_dim
    8
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    d_ff: int = 88
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        H_kv = self.kv_heads
        if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1:
            raise ValueError(f"n_kv_heads must be a positive int or None, got {self.n_kv_heads!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % H_kv:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({H_kv})")
        if self.head_dim % 2:
            raise ValueError(f"the head width d_model / n_heads = {self.head_dim} must be even for RoPE")
        if not self.rope_theta > 0 or not self.norm_eps >= 0:
            raise ValueError(f"rope_theta ({self.rope_theta}) must be > 0 and norm_eps ({self.norm_eps}) >= 0")

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
                   rope_theta=float(theta), norm_eps=cfg.rms_norm_eps, tie_embeddings=cfg.tie_word_embeddings)


def llama_key_map(n_layers: int, tie_embeddings: bool = True) -> dict[str, str]:
    """Our state-dict key -> the ``LlamaForCausalLM`` key it is copied from (see the module docstring).

    >>> llama_key_map(1)["blocks.0.mlp.w_gate.weight"]
    'model.layers.0.mlp.gate_proj.weight'
    """
    out = {"embed.weight": "model.embed_tokens.weight"}
    for l in range(n_layers):
        ours, theirs = f"blocks.{l}.", f"model.layers.{l}."
        out[ours + "norm1.weight"] = theirs + "input_layernorm.weight"
        for p in ("q", "k", "v", "o"):
            out[ours + f"attn.{p}_proj.weight"] = theirs + f"self_attn.{p}_proj.weight"
        out[ours + "norm2.weight"] = theirs + "post_attention_layernorm.weight"
        for mine, llama in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[ours + f"mlp.{mine}.weight"] = theirs + f"mlp.{llama}.weight"
    out["norm.weight"] = "model.norm.weight"
    if not tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    return out


class TinyGPT(nn.Module):
    r"""Decoder-only transformer: embedding -> ``L`` pre-norm RMSNorm/RoPE/GQA/SwiGLU blocks -> norm -> tied head.

    ``forward(ids (B, T), positions=None) -> logits (B, T, V)``; ``positions`` (a ``(T,)`` tensor of
    integer positions, default ``0..T-1``) only moves RoPE, e.g. to continue a sequence. Attention is
    causal. Weights start as GPT-2/Llama do: :math:`\mathcal{N}(0, 0.02^2)` for every matrix, norms at one.

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
            PreNormBlock(C, MultiHeadAttention(C, cfg.n_heads, cfg.kv_heads), SwiGLU(C, cfg.d_ff), norm=norm)
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

    def hidden_states(self, ids: Int[Tensor, "B T"], positions: Int[Tensor, " T"] | None = None
                      ) -> Float[Tensor, "B T C"]:
        r"""The final normalised hidden states :math:`\mathrm{RMSNorm}(h^{(L)})`, the input of the LM head."""
        cfg = self.config
        ids = check_token_ids(ids, cfg.vocab_size)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        T = ids.shape[1]
        if positions is None:
            positions = torch.arange(T, device=ids.device)
        positions = torch.as_tensor(positions, device=ids.device)
        if positions.shape != (T,):
            raise ValueError(f"positions must have shape (T,) = ({T},), got {tuple(positions.shape)}")
        h = self.embed(ids)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, base=cfg.rope_theta, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, is_causal=True, rope=(cos, sin))
        return self.norm(h)

    def forward(self, ids: Int[Tensor, "B T"], positions: Int[Tensor, " T"] | None = None
                ) -> Float[Tensor, "B T V"]:
        return self.head(self.hidden_states(ids, positions))

    # ------------------------------------------------------------------ transformers interop

    def load_llama_weights(self, llama) -> TinyGPT:
        """Copy the weights of a ``LlamaForCausalLM`` (or its ``state_dict()``) into this model, in place.

        Uses :func:`llama_key_map`. Every mapped key must be present with the same shape, and the Llama
        state may hold nothing we would ignore except ``lm_head.weight`` of a tied model (which must then
        equal the embedding) and rotary ``inv_freq`` buffers. Returns ``self``.
        """
        state = llama.state_dict() if isinstance(llama, nn.Module) else llama
        if not isinstance(state, Mapping):
            raise TypeError(f"llama must be an nn.Module or a state dict, got {type(llama).__name__}")
        cfg = self.config
        mapping = llama_key_map(cfg.n_layers, cfg.tie_embeddings)
        ours = self.state_dict()
        missing = [k for k in mapping.values() if k not in state]
        if missing:
            raise ValueError(f"the Llama state dict lacks {len(missing)} keys this config needs, e.g. {missing[:3]}")
        ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
        unexpected = [k for k in state if k not in mapping.values() and k not in ignorable
                      and not k.endswith("inv_freq")]
        if unexpected:
            raise ValueError(f"the Llama state dict has {len(unexpected)} keys with no place in this model, "
                             f"e.g. {unexpected[:3]} (a config mismatch: n_layers = {cfg.n_layers}?)")
        new = {}
        for mine, theirs in mapping.items():
            if tuple(state[theirs].shape) != tuple(ours[mine].shape):
                raise ValueError(f"{theirs} has shape {tuple(state[theirs].shape)} but {mine} needs "
                                 f"{tuple(ours[mine].shape)}: the configs differ")
            new[mine] = state[theirs]
        if cfg.tie_embeddings and "lm_head.weight" in state and not torch.equal(
                state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise ValueError("this model ties W_U = E^T, but the Llama lm_head.weight differs from embed_tokens")
        if cfg.tie_embeddings:
            new["head.weight"] = new["embed.weight"]
        self.load_state_dict(new, strict=True)
        return self

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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        for _ in range(max_new_tokens):
            context = ids[:, -self.config.max_seq_len:]
            z = self(context)[:, -1].float()
            nxt = sample(z, generator=generator, **sampling)
            ids = torch.cat([ids, nxt.unsqueeze(-1)], dim=1)
        return ids

