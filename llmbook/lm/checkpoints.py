r"""Loading weights by name (chapter 2): a plain state dict, a documented key map, clear errors.

A checkpoint is a ``dict[str, Tensor]``; its names are those of the code that saved it. To load it
into a model with other names, give a *key map* ``ours <- theirs``: one entry per tensor of the model,
``{our_name: their_name}``. :func:`load_mapped_state_dict` checks the map against both sides before it
copies anything and names every problem: a key the map reads but the state dict lacks (*missing*), a
key of the state dict the map does not use (*unexpected*; pass ``ignore`` for buffers such as rotary
``inv_freq``), a tensor whose shape differs (*mis-shaped*), and tied tensors whose sources disagree.

Two maps for :class:`llmbook.lm.gpt.TinyGPT` are provided, :func:`llama_key_map` (Hugging Face
``LlamaForCausalLM``) and :func:`meta_llama_key_map` (Meta's reference Llama code). Per layer ``l``
the names below carry the prefixes ``blocks.{l}.`` (ours), ``model.layers.{l}.`` (Hugging Face) and
``layers.{l}.`` (Meta):

====================================  ===================================  ==================================
ours                                  Hugging Face                         Meta
====================================  ===================================  ==================================
``embed.weight``                      ``model.embed_tokens.weight``        ``tok_embeddings.weight``
``norm1.weight``                      ``input_layernorm.weight``           ``attention_norm.weight``
``attn.{q,k,v,o}_proj.weight``        ``self_attn.{q,k,v,o}_proj.weight``  ``attention.w{q,k,v,o}.weight``
``norm2.weight``                      ``post_attention_layernorm.weight``  ``ffn_norm.weight``
``mlp.w_gate.weight``                 ``mlp.gate_proj.weight``             ``feed_forward.w1.weight``
``mlp.w_up.weight``                   ``mlp.up_proj.weight``               ``feed_forward.w3.weight``
``mlp.w_down.weight``                 ``mlp.down_proj.weight``             ``feed_forward.w2.weight``
``norm.weight``                       ``model.norm.weight``                ``norm.weight``
``head.weight`` (untied models only)  ``lm_head.weight``                   ``output.weight``
====================================  ===================================  ==================================

The two also differ in RoPE layout: Hugging Face's q/k rows are half-split, Meta's interleaved
(:func:`llmbook.lm.rope.interleaved_to_half_weight` converts; :meth:`TinyGPT.load_mapped_state_dict
<llmbook.lm.gpt.TinyGPT.load_mapped_state_dict>` does it when told the checkpoint's layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase

import torch
from torch import Tensor, nn

__all__ = ["load_mapped_state_dict", "llama_key_map", "meta_llama_key_map"]


def _names(keys, limit: int = 8) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", ... and {len(keys) - limit} more" if len(keys) > limit else "")


def _aliases(ours: Mapping[str, Tensor]) -> dict[str, str]:
    """Keys of a state dict that share storage with an earlier key (tied weights): alias -> first key."""
    first: dict[tuple, str] = {}
    out = {}
    for name, t in ours.items():
        if t.numel() == 0:
            continue
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident in first:
            out[name] = first[ident]
        else:
            first[ident] = name
    return out


def load_mapped_state_dict(model: nn.Module, state: Mapping[str, Tensor], key_map: Mapping[str, str], *,
                           ignore: Iterable[str] = (),
                           transform: Mapping[str, Callable[[Tensor], Tensor]] | None = None) -> nn.Module:
    r"""Copy ``state[key_map[k]]`` into ``model``'s tensor ``k`` for every ``k``, after checking everything.

    ``state`` is a plain ``dict[str, Tensor]`` (e.g. ``torch.load(...)``, ``safetensors.torch.load_file``);
    ``key_map`` maps *our* names (``model.state_dict()`` keys) to *theirs* (``state`` keys). Every tensor
    of the model must be mapped, except a tied alias (a key sharing storage with an earlier one, like
    a tied LM head): it is filled from the tensor it shares; if the map names a source for it as well,
    that source must equal the other one. ``ignore`` lists ``state`` keys (or ``fnmatch`` patterns such
    as ``"*.inv_freq"``) that may be left unused; any other unused key is an error, since it usually
    means a config mismatch. ``transform`` maps some of our names to a function applied to the source
    tensor first (a layout conversion). Values are copied in place, cast to the model's dtype and
    device. Returns ``model``. Raises ``TypeError`` for a non-mapping or non-tensor source, and
    ``ValueError`` naming every missing, unexpected, unmapped or mis-shaped key.

    >>> lin = nn.Linear(2, 2, bias=False)
    >>> _ = load_mapped_state_dict(lin, {"w": torch.eye(2)}, {"weight": "w"})
    >>> lin.weight.detach()
    tensor([[1., 0.],
            [0., 1.]])
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping name -> Tensor (a state dict), got {type(state).__name__}")
    if not isinstance(key_map, Mapping):
        raise TypeError(f"key_map must be a mapping our name -> their name, got {type(key_map).__name__}")
    ignore, transform = list(ignore), dict(transform or {})
    ours = model.state_dict()
    aliases = _aliases(ours)
    unknown = [k for k in list(key_map) + list(transform) if k not in ours]
    if unknown:
        raise ValueError(f"key_map names {len(unknown)} keys this model does not have: {_names(unknown)} "
                         f"(the model's keys look like {_names(list(ours), 3)})")
    unmapped = [k for k in ours if k not in key_map and k not in aliases]
    if unmapped:
        raise ValueError(f"key_map leaves {len(unmapped)} of the model's tensors unmapped: {_names(unmapped)}")
    missing = [f"{theirs} (for {mine})" for mine, theirs in key_map.items() if theirs not in state]
    if missing:
        raise ValueError(f"the state dict lacks {len(missing)} keys the key map reads: {_names(missing)}")
    used = set(key_map.values())
    unexpected = [k for k in state if k not in used and not any(fnmatchcase(k, p) for p in ignore)]
    if unexpected:
        raise ValueError(f"the state dict has {len(unexpected)} keys with no place in this model: "
                         f"{_names(unexpected)} (a config mismatch, e.g. n_layers? pass ignore=[...] for "
                         "buffers that are meant to be dropped)")
    new, bad = {}, []
    for mine, theirs in key_map.items():
        value = state[theirs]
        if not isinstance(value, Tensor):
            raise TypeError(f"state[{theirs!r}] must be a Tensor, got {type(value).__name__}")
        if mine in transform:
            value = transform[mine](value)
        if tuple(value.shape) != tuple(ours[mine].shape):
            bad.append(f"{theirs} {tuple(value.shape)} -> {mine} needs {tuple(ours[mine].shape)}")
        new[mine] = value
    if bad:
        raise ValueError(f"{len(bad)} tensors have the wrong shape (the configs differ): {'; '.join(bad[:8])}")
    for alias, source in aliases.items():
        if alias in new and not torch.equal(new[alias].to(new[source]), new[source]):
            raise ValueError(f"{alias} and {source} are one tied tensor in this model, but their sources "
                             f"{key_map[alias]} and {key_map[source]} differ")
        new[alias] = new[source]
    model.load_state_dict(new, strict=True)
    return model


def llama_key_map(n_layers: int, tie_embeddings: bool = True) -> dict[str, str]:
    """Our :class:`~llmbook.lm.gpt.TinyGPT` key -> the ``LlamaForCausalLM`` key it is copied from (table above).

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


def meta_llama_key_map(n_layers: int, tie_embeddings: bool = False) -> dict[str, str]:
    """Our :class:`~llmbook.lm.gpt.TinyGPT` key -> the key of Meta's reference Llama code (table above).

    Meta's checkpoints are untied (``output.weight``) and their q/k rows are in the interleaved RoPE
    layout: build the model with ``GPTConfig(rope_layout="interleaved", tie_embeddings=False)``, or
    load into a half-split model with ``rope_layout="interleaved"`` so that the rows are converted.
    Llama-1 checkpoints also hold a ``rope.freqs`` buffer: pass ``ignore=["rope.freqs"]``.

    >>> meta_llama_key_map(1)["blocks.0.mlp.w_up.weight"]
    'layers.0.feed_forward.w3.weight'
    """
    out = {"embed.weight": "tok_embeddings.weight"}
    for l in range(n_layers):
        ours, theirs = f"blocks.{l}.", f"layers.{l}."
        out[ours + "norm1.weight"] = theirs + "attention_norm.weight"
        for p in ("q", "k", "v", "o"):
            out[ours + f"attn.{p}_proj.weight"] = theirs + f"attention.w{p}.weight"
        out[ours + "norm2.weight"] = theirs + "ffn_norm.weight"
        for mine, meta in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            out[ours + f"mlp.{mine}.weight"] = theirs + f"feed_forward.{meta}.weight"
    out["norm.weight"] = "norm.weight"
    if not tie_embeddings:
        out["head.weight"] = "output.weight"
    return out
