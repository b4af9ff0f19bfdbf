r"""Adapters that add inputs or rescale activations (chapter 11, ids 11.05-11.09).

Prefix tuning (:func:`prefix_attention`) prepends trained keys and values to every attention layer;
prompt tuning (:func:`prepend_prompt`) prepends trained vectors to the input embeddings; P-tuning v2's
deep prompts (:func:`deep_prompt`) give every layer its own; IA3 (:func:`ia3_linear`) multiplies
activations by trained vectors; BitFit (:func:`bitfit`) trains only the bias terms. All leave the base
weights frozen and untouched. Symbols: ``B`` batch, ``T`` tokens, ``C`` width, ``H``/``H_kv`` query and
key/value heads of width ``D``, ``P`` prefix length, ``m`` prompt length, ``L`` layers.

To apply them to the book's :class:`~llmbook.lm.gpt.TinyGPT` without touching its code:
:func:`add_prefix` swaps each block's attention for a :class:`PrefixAttention` around it,
:class:`PromptedGPT` runs the model's own modules on ``[P; E x]`` (shallow or deep),
:func:`add_ia3` wraps ``nn.Linear`` children, :func:`bitfit` only flips ``requires_grad``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from llmbook._checks import (
    as_tensor,
    check_choice,
    check_dim,
    check_module_input,
    check_positive_int,
    check_same_dtype,
    check_shape,
    check_token_ids,
)
from llmbook._precision import restore_half, upcast_half
from llmbook.lm.attention import MultiHeadAttention, scaled_dot_product_attention
from llmbook.lm.lora import freeze, replace_linears
from llmbook.lm.probability import cross_entropy_loss
from llmbook.lm.rope import rope_cos_sin
from llmbook.lm.training import get_batch
from llmbook.registry import implements

__all__ = ["prefix_attention", "PrefixAttention", "add_prefix", "prepend_prompt", "deep_prompt", "PromptedGPT",
           "ia3_linear", "IA3Linear", "add_ia3", "bitfit", "peft_param_counts", "train_adapter"]


# --------------------------------------------------------------------------- 11.05 prefix tuning


@implements("11.05")
def prefix_attention(q: Float[Tensor, "B H T D"], k: Float[Tensor, "B H_kv S D"], v: Float[Tensor, "B H_kv S D"],
                     K_p: Float[Tensor, "*B H_kv P D"], V_p: Float[Tensor, "*B H_kv P D"],
                     is_causal: bool = True) -> Float[Tensor, "B H T D"]:
    r"""Attention with a trained prefix: :math:`K' = [K_p; K]`, :math:`V' = [V_p; V]`, then softmax attention.

    ``K_p``, ``V_p`` (``(H_kv, P, D)``, shared by the batch, or ``(B, H_kv, P, D)``) are ``P`` keys and
    values that no token produced; every query sees all of them, and the tokens among themselves stay
    causal (``is_causal``): query ``i`` sees the prefix and keys ``0..i``. In a model with RoPE the prefix
    keys are used as given (they are already "rotated"), exactly as a KV cache would hold them.
    Shapes: ``q (B, H, T, D)``, ``k, v (B, H_kv, S, D)``; returns ``(B, H, T, D)``.

    >>> q = k = v = torch.zeros(1, 1, 2, 4)
    >>> prefix_attention(q, k, v, torch.zeros(1, 1, 4), torch.ones(1, 1, 4))[0, 0, :, 0]  # 1/2, then 1/3
    tensor([0.5000, 0.3333])
    """
    q, k, v = as_tensor(q, "q"), as_tensor(k, "k"), as_tensor(v, "v")
    K_p, V_p = as_tensor(K_p, "K_p"), as_tensor(V_p, "V_p")
    check_dim(k, "k", "(B, H_kv, S, D)", min_dim=4, max_dim=4)
    check_dim(v, "v", "(B, H_kv, S, D)", min_dim=4, max_dim=4)
    B, H_kv, S, _ = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (B, H_kv, S)")
    for t, n, ref in ((K_p, "K_p", k), (V_p, "V_p", v)):
        check_dim(t, n, "(H_kv, P, D) or (B, H_kv, P, D)", min_dim=3, max_dim=4)
        check_same_dtype(ref, t, "k" if n == "K_p" else "v", n)
        D = ref.shape[-1]
        if t.shape[-1] != D or t.shape[-3] != H_kv or (t.ndim == 4 and t.shape[0] != B):
            raise ValueError(f"{n} must have shape (H_kv, P, D) = ({H_kv}, P, {D}) or (B, H_kv, P, D) with B = {B}, "
                             f"got {tuple(t.shape)}")
    if K_p.shape[-2] != V_p.shape[-2]:
        raise ValueError(f"K_p {tuple(K_p.shape)} and V_p {tuple(V_p.shape)} must have the same prefix length P")
    K = torch.cat([K_p.expand(B, *K_p.shape[-3:]), k], dim=-2)
    V = torch.cat([V_p.expand(B, *V_p.shape[-3:]), v], dim=-2)
    return scaled_dot_product_attention(q, K, V, is_causal=is_causal, causal_alignment="bottom_right")


class PrefixAttention(nn.Module):
    """A frozen :class:`~llmbook.lm.attention.MultiHeadAttention` with ``P`` trained keys and values in front.

    ``prefix_k``, ``prefix_v`` have shape ``(H_kv, P, D)``. The wrapped module computes the queries, keys
    and values (RoPE included) and the output projection; only the attention step changes. Called like
    the module it wraps, for self-attention: ``forward(x, is_causal=..., rope=...)``.
    """

    def __init__(self, attn: MultiHeadAttention, P: int, std: float = 1.0):
        super().__init__()
        if not isinstance(attn, MultiHeadAttention):
            raise TypeError(f"attn must be a MultiHeadAttention, got {type(attn).__name__}")
        self.attn, self.P = attn.requires_grad_(False), check_positive_int(P, "P")
        w = attn.k_proj.weight
        shape = (attn.n_kv_heads, self.P, attn.head_dim)
        self.prefix_k = nn.Parameter(torch.randn(shape, dtype=w.dtype, device=w.device) * std)
        self.prefix_v = nn.Parameter(torch.randn(shape, dtype=w.dtype, device=w.device) * std)

    def forward(self, x: Float[Tensor, "B T C"], is_causal: bool = True, rope=None) -> Float[Tensor, "B T C"]:
        q, k, v = self.attn._qkv(x, None, rope)  # the wrapped module's own projections and RoPE
        o = prefix_attention(q, k, v, self.prefix_k, self.prefix_v, is_causal=is_causal)
        B, _, T, _ = o.shape
        return self.attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def add_prefix(model: nn.Module, P: int, std: float = 1.0) -> list[PrefixAttention]:
    """Freeze a :class:`~llmbook.lm.gpt.TinyGPT` and put a :class:`PrefixAttention` in every block; returns them."""
    freeze(model)
    for block in model.blocks:
        block.attn = PrefixAttention(block.attn, P, std)
    return [block.attn for block in model.blocks]


# --------------------------------------------------------------------------- 11.06 / 11.07 soft prompts


def _prompt_args(h, P, what):
    h, P = as_tensor(h, "h"), as_tensor(P, "P")
    check_dim(h, "h", f"(B, {what}, C)", min_dim=3, max_dim=3)
    check_dim(P, "P", "(m, C)", min_dim=2, max_dim=2)
    check_same_dtype(h, P, "h", "P")
    if P.shape[1] != h.shape[2]:
        raise ValueError(f"P {tuple(P.shape)} and h {tuple(h.shape)} disagree on the width C")
    return h, P


@implements("11.06")
def prepend_prompt(E_x: Float[Tensor, "B T C"], P: Float[Tensor, "m C"]) -> Float[Tensor, "B m+T C"]:
    r"""Prompt tuning's input :math:`h^{(0)} = [P_1, \dots, P_m, E_{x_1}, \dots, E_{x_n}]`.

    ``P`` holds ``m`` trained "soft tokens" (vectors in embedding space that need not be any word's
    embedding); ``E_x`` the embeddings of the real tokens. The frozen model then runs on ``m + T``
    positions. Returns ``(B, m + T, C)``.

    >>> prepend_prompt(torch.zeros(2, 3, 4), torch.ones(1, 4))[:, :, 0]
    tensor([[1., 0., 0., 0.],
            [1., 0., 0., 0.]])
    """
    E_x, P = _prompt_args(E_x, P, "T")
    return torch.cat([P.expand(E_x.shape[0], *P.shape), E_x], dim=1)


@implements("11.07")
def deep_prompt(h: Float[Tensor, "B m+T C"], P_l: Float[Tensor, "m C"]) -> Float[Tensor, "B m+T C"]:
    r"""P-tuning v2's deep prompt at layer :math:`l`: :math:`h_l' = [P_l; h_l]`.

    ``h`` is the input of layer ``l`` over ``m + T`` positions; its first ``m`` rows (what the previous
    layer made of the prompt) are *replaced* by the layer's own trained ``P_l`` (``(m, C)``), and the token
    rows pass through. Causal attention means those rows reach the tokens only as keys and values, so this
    is prefix tuning whose keys and values are tied to :math:`P_l` through the layer's own projections.

    >>> deep_prompt(torch.zeros(1, 3, 2), torch.ones(1, 2))[0, :, 0]
    tensor([1., 0., 0.])
    """
    h, P_l = _prompt_args(h, P_l, "m + T")
    if h.shape[1] < P_l.shape[0]:
        raise ValueError(f"h {tuple(h.shape)} must have at least m = {P_l.shape[0]} positions")
    return torch.cat([P_l.expand(h.shape[0], *P_l.shape), h[:, P_l.shape[0]:]], dim=1)


class PromptedGPT(nn.Module):
    """A frozen :class:`~llmbook.lm.gpt.TinyGPT` run on ``[P; E x]``: prompt tuning, or deep prompts (``deep``).

    ``prompts`` has shape ``(1, m, C)`` (prompt tuning) or ``(L, m, C)`` (one per layer). ``init_ids``
    (``m`` token ids) starts the prompts from those tokens' embeddings, as Lester et al. recommend; otherwise
    they start :math:`\\mathcal{N}(0, 0.02^2)`. ``forward(ids (B, T)) -> logits (B, T, V)`` of the real tokens,
    whose positions are ``m .. m + T - 1`` (the prompt takes the first ``m``). The model's own modules do
    all the work; its code is not changed.
    """

    def __init__(self, model: nn.Module, m: int, deep: bool = False, init_ids=None):
        super().__init__()
        self.model, self.m, self.deep = freeze(model), check_positive_int(m, "m"), bool(deep)
        cfg = model.config
        n = cfg.n_layers if deep else 1
        w = model.embed.weight
        if init_ids is not None:
            init_ids = check_token_ids(init_ids, cfg.vocab_size, "init_ids")
            check_shape(init_ids, (self.m,), "init_ids", "m")
            start = w.detach()[init_ids].expand(n, -1, -1).clone()
        else:
            start = torch.randn(n, self.m, cfg.d_model, dtype=w.dtype, device=w.device) * 0.02
        self.prompts = nn.Parameter(start)

    def forward(self, ids) -> Tensor:
        cfg, model = self.model.config, self.model
        ids = check_token_ids(ids, cfg.vocab_size)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        h = prepend_prompt(model.embed(ids), self.prompts[0])
        cos, sin = rope_cos_sin(torch.arange(h.shape[1], device=ids.device), cfg.head_dim, base=cfg.rope_theta,
                                dtype=h.dtype)
        for l, block in enumerate(model.blocks):
            if self.deep and l > 0:
                h = deep_prompt(h, self.prompts[l])
            h = block(h, is_causal=True, rope=(cos, sin))
        return model.head(model.norm(h))[:, self.m:]


# --------------------------------------------------------------------------- 11.08 IA3


@implements("11.08")
def ia3_linear(x: Float[Tensor, "... d_in"], W: Float[Tensor, "d_out d_in"], l: Float[Tensor, " d"],
               scale: str = "output", bias: Tensor | None = None) -> Float[Tensor, "... d_out"]:
    r"""IA3: a linear layer whose activations are rescaled by a trained vector, :math:`y = (l \odot W) x`.

    ``scale="output"``: :math:`y = l \odot (W x + b)` with ``l`` of shape ``(d_out,)``, the form IA3 uses
    for keys and values (:math:`K' = l_K \odot K`, :math:`V' = l_V \odot V`); ``scale="input"``:
    :math:`y = W (l \odot x) + b` with ``l`` of shape ``(d_in,)``, the form for the FFN's down projection
    (scaling the hidden activation :math:`l_{ff} \odot \gamma(W_1 x)`). Both are :math:`W` with its rows,
    or its columns, multiplied by ``l``, so they merge into :math:`W` for free. ``l`` starts at ones.

    >>> ia3_linear(torch.ones(1, 2), torch.eye(2), torch.tensor([2.0, 3.0]))
    tensor([[2., 3.]])
    """
    x, W, l = as_tensor(x, "x"), as_tensor(W, "W"), as_tensor(l, "l")
    check_choice(scale, "scale", ("output", "input"))
    check_dim(W, "W", "(d_out, d_in)", min_dim=2, max_dim=2)
    check_dim(x, "x", "(..., d_in)")
    d_out, d_in = W.shape
    if x.shape[-1] != d_in:
        raise ValueError(f"x must have shape (..., d_in) with d_in = {d_in}, got {tuple(x.shape)}")
    check_shape(l, (d_out if scale == "output" else d_in,), "l", f"the {scale} width of W {tuple(W.shape)}")
    for t, n in ((W, "W"), (l, "l")) + (() if bias is None else ((as_tensor(bias, "bias"), "bias"),)):
        check_same_dtype(x, t, "x", n)
    if bias is not None:
        bias = upcast_half(check_shape(as_tensor(bias, "bias"), (d_out,), "bias", "(d_out,)"))
    dtype, x, W, l = x.dtype, upcast_half(x), upcast_half(W), upcast_half(l)
    y = (x * l if scale == "input" else x) @ W.T
    y = y if bias is None else y + bias
    return restore_half(y * l if scale == "output" else y, dtype)


class IA3Linear(nn.Module):
    """A frozen ``nn.Linear`` with IA3's trained vector ``ia3_l`` (ones at the start).

    :meth:`merged_weight` folds the vector into the base weight.
    """

    def __init__(self, base: nn.Linear, scale: str = "output"):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        check_choice(scale, "scale", ("output", "input"))
        self.base, self.scale = base.requires_grad_(False), scale
        n = base.out_features if scale == "output" else base.in_features
        self.ia3_l = nn.Parameter(torch.ones(n, dtype=base.weight.dtype, device=base.weight.device))

    def forward(self, x: Tensor) -> Tensor:
        x = check_module_input(self, x, d=self.base.in_features, symbol="d_in")
        return ia3_linear(x, self.base.weight, self.ia3_l, self.scale, self.base.bias)

    def merged_weight(self) -> Tensor:
        r""":math:`l \odot W`: rows (``"output"``) or columns (``"input"``) of the base weight times ``l``."""
        l = self.ia3_l.detach()
        return self.base.weight * (l[:, None] if self.scale == "output" else l[None, :])


def add_ia3(model: nn.Module, targets=("k_proj", "v_proj", "w_down"), feedforward=("w_down",)) -> list[str]:
    """Freeze ``model`` and wrap its linears named in ``targets`` with :class:`IA3Linear` (input scaling for
    those in ``feedforward``, output scaling for the rest; the paper's and ``peft``'s choice); returns their names."""
    freeze(model)
    feedforward = set(feedforward)
    names = replace_linears(model, targets, lambda lin: IA3Linear(lin, "output"))
    for n in names:
        parent, _, child = n.rpartition(".")
        if child in feedforward:
            setattr(model.get_submodule(parent), child, IA3Linear(model.get_submodule(n).base, "input"))
    return names


# --------------------------------------------------------------------------- 11.09 BitFit


@implements("11.09")
def bitfit(model: nn.Module, add_bias: bool = False) -> list[str]:
    r"""BitFit: train the bias terms only, :math:`\theta_{train} = \{b : b \in \theta\}`; everything else frozen.

    Sets ``requires_grad`` on every parameter whose name ends in ``bias`` and clears it on the rest, in
    place; returns the trainable names. Llama-style models (the book's tiny GPT) have no biases at all:
    ``add_bias=True`` first gives every bias-free ``nn.Linear`` a zero bias (so the model's function is
    unchanged at the start), the usual way to apply BitFit to them. ``ValueError`` if nothing is trainable.

    >>> bitfit(nn.Sequential(nn.Linear(3, 2), nn.LayerNorm(2)))
    ['0.bias', '1.bias']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if add_bias:
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.bias is None:
                w = mod.weight
                mod.bias = nn.Parameter(torch.zeros(mod.out_features, dtype=w.dtype, device=w.device))
    names = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.rsplit(".", 1)[-1] == "bias")
        if p.requires_grad:
            names.append(name)
    if not names:
        raise ValueError("model has no bias terms to train; pass add_bias=True to add zero biases to its linears")
    return names


# --------------------------------------------------------------------------- parameter counts


def peft_param_counts(cfg, r: int = 8, P: int = 16, m: int = 16, lora_targets=("q_proj", "v_proj")) -> dict:
    r"""Closed-form trainable-parameter counts of each method on a :class:`~llmbook.lm.gpt.TinyGPT` config.

    With :math:`L` layers, width :math:`C`, key/value width :math:`C_{kv} = H_{kv} D`, FFN width :math:`F`:
    LoRA :math:`r \sum (d_{in} + d_{out})` over the targets (QLoRA the same), DoRA adds :math:`d_{out}`
    per target, AdaLoRA adds :math:`r`, prefix :math:`2 L P C_{kv}`, prompt :math:`m C`, deep prompts
    :math:`L m C`, IA3 :math:`L (2 C_{kv} + F)`, BitFit (added biases) :math:`L (3C + 2C_{kv} + 2F)`.

    >>> from llmbook.lm.gpt import GPTConfig
    >>> peft_param_counts(GPTConfig(d_model=32, n_layers=2, d_ff=88), r=4)["LoRA"]
    1024
    """
    r, P, m = check_positive_int(r, "r"), check_positive_int(P, "P"), check_positive_int(m, "m")
    L, C, F, C_kv = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.kv_heads * cfg.head_dim
    shapes = {"q_proj": (C, C), "k_proj": (C, C_kv), "v_proj": (C, C_kv), "o_proj": (C, C),
              "w_gate": (C, F), "w_up": (C, F), "w_down": (F, C)}  # (d_in, d_out)
    for t in lora_targets:
        check_choice(t, "lora target", tuple(shapes))
    lora = L * sum(r * sum(shapes[t]) for t in lora_targets)
    return {"LoRA": lora, "rsLoRA": lora, "QLoRA": lora,
            "DoRA": lora + L * sum(shapes[t][1] for t in lora_targets),
            "AdaLoRA": lora + L * r * len(lora_targets), "prefix tuning": 2 * L * P * C_kv,
            "prompt tuning": m * C, "P-tuning v2 (deep prompts)": L * m * C, "IA3": L * (2 * C_kv + F),
            "BitFit (added biases)": L * (3 * C + 2 * C_kv + 2 * F)}


def train_adapter(model: nn.Module, data, steps: int, lr: float = 1e-2, B: int = 4, T: int = 64,
                  seed: int = 0) -> list[float]:
    """Adam on the *trainable* parameters of ``model`` (an adapted LM) over random windows of ``data``.

    Each step draws ``B`` windows of ``T`` tokens with :func:`llmbook.lm.training.get_batch` (seeded by
    ``seed``) and minimises the next-token cross-entropy; frozen parameters get no gradient and no update.
    Returns the training loss of every step.
    """
    steps = check_positive_int(steps, "steps")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters: add an adapter first")
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, B, T, generator=g)
        loss = cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses
