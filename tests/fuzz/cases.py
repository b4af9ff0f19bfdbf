"""The fuzz suite's case table: one entry per public callable, keyed by its registry name.

Every object in ``llmbook.registry.implementations()`` MUST have an entry here
(``test_every_registered_callable_has_a_case`` fails until it does). A new chapter joins the fuzz
suite by adding, for each function it registers, one line such as::

    add("llmbook.lm.norms:rms_norm", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.C), weight=m.pos(m.s.C)),
        scalars=dict(eps=Float(0)))

The factory ``make(m)`` returns the keyword arguments of a *valid* call, built from the
:class:`~tests.fuzz.harness.Maker` ``m``: ``m.f(*shape)`` float tensors in the case dtype,
``m.pos``, ``m.probs``, ``m.ids(..., high=V)``, ``m.gen()`` a seeded generator, ``m.module(cls, ...)``
a seeded sub-module, and the size symbols ``m.s.B, m.s.T, m.s.D, m.s.H, m.s.V, m.s.E, m.s.K, m.s.C,
m.s.F, m.s.P`` (P: a position offset). Read sizes through ``m.s`` (never hard-code them) so the
degenerate-shape mutations (each symbol set to 0 and 1) reach the callable. ``scalars`` annotates
the integer/float/option arguments with their valid range (``Int``, ``Float``, ``Choice``) so the
bad-scalar mutations know what must be rejected. For a class, ``init`` names the constructor
arguments; the rest go to ``forward``.

Exceptions to the checks are explicit fields of the entry, each with its reason (see ``Case``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .harness import Case, Choice, Float, Int

CASES: dict[str, Case] = {}


def add(name: str, make, **kw) -> None:
    if name in CASES:
        raise ValueError(f"duplicate fuzz case {name}")
    CASES[name] = Case(name, make, **kw)


A = "llmbook.lm.activations:"
AT = "llmbook.lm.attention:"
BL = "llmbook.lm.blocks:"
CE = "llmbook.lm.context_extension:"
DE = "llmbook.lm.decoding:"
EA = "llmbook.lm.efficient_attention:"
EM = "llmbook.lm.embeddings:"
FL = "llmbook.lm.flash:"
IN = "llmbook.lm.init:"
LA = "llmbook.lm.local_attention:"
MO = "llmbook.lm.moe:"
NO = "llmbook.lm.norms:"
PB = "llmbook.lm.position_bias:"
PO = "llmbook.lm.positions:"
RO = "llmbook.lm.rope:"
PR = "llmbook.lm.probability:"
SE = "llmbook.lm.search:"
KF = "llmbook.kernels.flash_attention:"

POS_INT, NONNEG_INT = Int(lo=1), Int(lo=0)
POS, NONNEG = Float(0, lo_open=True), Float(0)
PROB, PROB_OPEN = Float(0, 1), Float(0, 1, lo_open=True)
DROP = Float(0, 1)  # a dropout probability: p = 1 drops everything, as in torch
BASE = Float(1, lo_open=True)  # a RoPE base: below 1 the frequencies grow instead of decaying

SELF_ATTN = dict(overflow="square", nan_reason="x reaches the scores squared (x W_q . x W_k): beyond the square "
                                              "root of the dtype's range the scores overflow, as in torch")
GATED = dict(overflow="square", nan_reason="the gate and the up projection of x multiply: beyond the square "
                                          "root of the dtype's range the product overflows, as in torch")
NORM_SCALE = dict(lowp_scale=1000.0, reason="activations of 1e2-1e3 are routine in fp16 models; "
                                            "torch computes the statistics in float32")


def qkv(m, T_k=None, D_v=None):
    s = m.s
    T_k = s.T if T_k is None else T_k
    return dict(q=m.f(s.B, s.H, s.T, s.D), k=m.f(s.B, s.H, T_k, s.D), v=m.f(s.B, s.H, T_k, D_v or s.D))


# --------------------------------------------------------------------------- activations

for _f in ("relu", "gelu", "gelu_tanh", "silu", "mish", "softplus"):
    add(A + _f, lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D)))
add(A + "glu", lambda m: dict(x=m.f(m.s.B, m.s.C), W_a=m.f(m.s.F, m.s.C), W_b=m.f(m.s.F, m.s.C),
                              b_a=m.f(m.s.F), b_b=m.f(m.s.F)), **GATED)  # weights in nn.Linear's (d_out, d_in)
add(A + "reglu", lambda m: dict(x=m.f(m.s.B, m.s.C), W_a=m.f(m.s.F, m.s.C), W_b=m.f(m.s.F, m.s.C)), **GATED)
add(A + "geglu", lambda m: dict(x=m.f(m.s.B, m.s.C), W_a=m.f(m.s.F, m.s.C), W_b=m.f(m.s.F, m.s.C),
                                approximate="tanh"), scalars=dict(approximate=Choice()), **GATED)
add(A + "swiglu", lambda m: dict(x=m.f(m.s.B, m.s.C), W_gate=m.f(m.s.F, m.s.C), W_up=m.f(m.s.F, m.s.C),
                                 W_down=m.f(m.s.C, m.s.F)), **GATED)
for _c in ("GLUFFN", "GeGLU", "ReGLU", "SwiGLU"):
    add(A + _c, lambda m: dict(d_model=m.s.C, d_ff=m.s.F, x=m.f(m.s.B, m.s.T, m.s.C)),
        init=("d_model", "d_ff"), scalars=dict(d_model=POS_INT, d_ff=POS_INT), **GATED)
add(A + "swiglu_hidden_size", lambda m: dict(d_model=768, multiple_of=64, ffn_mult=4.0),
    scalars=dict(d_model=POS_INT, multiple_of=POS_INT, ffn_mult=POS))

# --------------------------------------------------------------------------- attention

add(AT + "scaled_dot_product_attention", lambda m: dict(**qkv(m), is_causal=True, scale=0.5),
    scalars=dict(scale=POS, dropout_p=DROP))
add(AT + "masked_softmax", lambda m: dict(scores=m.f(m.s.B, m.s.T, m.s.T),
                                          allowed=torch.ones(m.s.T, m.s.T).tril().bool()))
add(AT + "causal_mask", lambda m: dict(T_q=m.s.T, T_k=m.s.T + 2), scalars=dict(T_q=NONNEG_INT, T_k=NONNEG_INT))
add(AT + "softmax_jacobian", lambda m: dict(a=m.probs(m.s.B, m.s.V)))
add(AT + "repeat_kv", lambda m: dict(x=m.f(m.s.B, m.s.H, m.s.T, m.s.D), n_rep=2), scalars=dict(n_rep=POS_INT))
for _c, _extra in (("MultiHeadAttention", {}), ("MultiQueryAttention", {}),
                   ("GroupedQueryAttention", {"n_kv_heads": 1})):
    add(AT + _c, lambda m, _extra=_extra: dict(d_model=m.s.C, n_heads=m.s.H, **_extra, x=m.f(m.s.B, m.s.T, m.s.C),
                                               is_causal=True),
        init=("d_model", "n_heads", "n_kv_heads", "dropout"),
        scalars=dict(d_model=POS_INT, n_heads=POS_INT, dropout=DROP, **{k: POS_INT for k in _extra}), **SELF_ATTN)
add(AT + "CrossAttention", lambda m: dict(d_model=m.s.C, n_heads=m.s.H, x=m.f(m.s.B, m.s.T, m.s.C),
                                          context=m.f(m.s.B, m.s.T + 1, m.s.C)),
    init=("d_model", "n_heads", "n_kv_heads", "dropout"), scalars=dict(d_model=POS_INT, n_heads=POS_INT))

# --------------------------------------------------------------------------- blocks


def _block(m):
    from llmbook.lm.attention import MultiHeadAttention
    from llmbook.lm.blocks import FeedForward
    return dict(d_model=m.s.C, attn=m.module(MultiHeadAttention, m.s.C, m.s.H),
                mlp=m.module(FeedForward, m.s.C, m.s.F), h=m.f(m.s.B, m.s.T, m.s.C))


add(BL + "FeedForward", lambda m: dict(d_model=m.s.C, d_ff=m.s.F, activation="gelu", x=m.f(m.s.B, m.s.T, m.s.C)),
    init=("d_model", "d_ff", "activation", "dropout"),
    scalars=dict(d_model=POS_INT, d_ff=POS_INT, activation=Choice(), dropout=DROP))
for _c in ("PreNormBlock", "PostNormBlock"):
    add(BL + _c, _block, init=("d_model", "attn", "mlp", "dropout", "p_survive"),
        scalars=dict(d_model=POS_INT, dropout=DROP, p_survive=PROB_OPEN), **SELF_ATTN)
add(BL + "dropout", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), p=0.5, generator=m.gen()), scalars=dict(p=DROP))
add(BL + "stochastic_depth", lambda m: dict(h=m.f(m.s.B, m.s.T, m.s.D), f_h=m.f(m.s.B, m.s.T, m.s.D), p_l=0.5,
                                            generator=m.gen()),
    scalars=dict(p_l=PROB_OPEN, mode=Choice()))
add(BL + "linear_decay_survival", lambda m: dict(L=4, p_L=0.5), scalars=dict(L=POS_INT, p_L=PROB_OPEN))

# --------------------------------------------------------------------------- context extension

add(CE + "attention_sink_scores", lambda m: dict(q=m.f(m.s.B, m.s.T, m.s.D), k=m.f(m.s.B, m.s.T, m.s.D), n_sink=1),
    scalars=dict(n_sink=NONNEG_INT))
add(CE + "ntk_inv_freq", lambda m: dict(D=m.s.D, base=1e4, alpha=2.0), scalars=dict(D=POS_INT, base=BASE, alpha=POS))
add(CE + "pi_inv_freq", lambda m: dict(D=m.s.D, base=1e4, factor=2.0), scalars=dict(D=POS_INT, base=BASE, factor=POS))
add(CE + "position_interpolation", lambda m: dict(positions=torch.arange(m.s.T) + m.s.P, L_train=2048, L_target=8192),
    scalars=dict(L_train=POS_INT, L_target=POS_INT))
add(CE + "yarn_inv_freq", lambda m: dict(D=m.s.D, base=1e4, factor=4.0, L_train=64, beta_fast=4.0, beta_slow=1.0),
    scalars=dict(D=POS_INT, base=BASE, factor=POS, L_train=POS_INT, beta_fast=POS, beta_slow=POS,
                 attention_factor=POS))
add(CE + "yarn_ramp", lambda m: dict(D=m.s.D, base=1e4, L_train=64, beta_fast=4.0, beta_slow=1.0),
    scalars=dict(D=POS_INT, base=BASE, L_train=POS_INT, beta_fast=POS, beta_slow=POS))
add(CE + "streaming_mask", lambda m: dict(T=m.s.T, n_sink=1, window=2),
    scalars=dict(T=NONNEG_INT, n_sink=NONNEG_INT, window=POS_INT))
add(CE + "rope_scores_by_distance", lambda m: dict(q=m.f(m.s.D), k=m.f(m.s.D), distances=torch.arange(m.s.T) + m.s.P),
    scalars=dict(attention_factor=POS, base=BASE))

# --------------------------------------------------------------------------- decoding

TAU = Float(0, inf_ok=True)
add(DE + "apply_temperature", lambda m: dict(logits=m.f(m.s.B, m.s.V), tau=0.7), scalars=dict(tau=TAU))
add(DE + "greedy", lambda m: dict(logits=m.f(m.s.B, m.s.V)))
add(DE + "top_k_filter", lambda m: dict(logits=m.f(m.s.B, m.s.V), k=3), scalars=dict(k=POS_INT))
add(DE + "top_p_filter", lambda m: dict(logits=m.f(m.s.B, m.s.V), p=0.9), scalars=dict(p=PROB_OPEN))
add(DE + "min_p_filter", lambda m: dict(logits=m.f(m.s.B, m.s.V), alpha=0.1), scalars=dict(alpha=PROB))
add(DE + "typical_filter", lambda m: dict(logits=m.f(m.s.B, m.s.V), mass=0.9), scalars=dict(mass=PROB_OPEN))
# mu may go negative: mirostat's update mu -= eta (s - tau) does not clip it
add(DE + "mirostat_filter", lambda m: dict(logits=m.f(m.s.B, m.s.V), mu=3.0), scalars=dict(mu=Float()))
add(DE + "mirostat_step", lambda m: dict(logits=m.f(m.s.V), mu=3.0, tau_target=2.0, eta=0.1, generator=m.gen()),
    scalars=dict(mu=Float(), tau_target=NONNEG, eta=NONNEG))
add(DE + "sample", lambda m: dict(logits=m.f(m.s.B, m.s.V), tau=0.8, top_k=5, top_p=0.95, min_p=0.01,
                                  generator=m.gen()),
    scalars=dict(tau=TAU, top_k=POS_INT, top_p=PROB_OPEN, min_p=PROB, typical_p=PROB_OPEN))

# --------------------------------------------------------------------------- efficient attention

add(EA + "favor_features", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), omega=m.f(6, m.s.D)))
add(EA + "linear_attention", lambda m: dict(**qkv(m), causal=True), scalars=dict(feature_map=Choice()))
add(EA + "linear_attention_recurrent", lambda m: dict(**qkv(m)), scalars=dict(feature_map=Choice()))
add(EA + "linformer_attention", lambda m: dict(**qkv(m), E=m.f(3, m.s.T), F_proj=m.f(3, m.s.T)),
    scalars=dict(scale=POS))
add(EA + "lsh_hash", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), R=m.f(m.s.D, 2)),
    lowp_int_reason="a bucket is an argmax over x R; rounding x R to fp16/bf16 can flip near-ties")
add(EA + "performer_attention", lambda m: dict(**qkv(m), n_features=16, generator=m.gen()),
    scalars=dict(n_features=POS_INT, scale=POS))
add(EA + "lsh_attention", lambda m: dict(**qkv(m), n_buckets=4, generator=m.gen()),
    scalars=dict(n_buckets=Int(lo=2), scale=POS),
    lowp_skip="the buckets are argmaxes of rounded projections: a near-tie flips a bucket and changes "
              "which keys a query sees, a discontinuity no tolerance covers")
add(EA + "random_features", lambda m: dict(m=6, D=m.s.D, generator=m.gen()), scalars=dict(m=POS_INT, D=POS_INT))
add(EA + "linformer_projection", lambda m: dict(T=m.s.T, k_dim=3, kind="pool"),
    scalars=dict(T=POS_INT, k_dim=POS_INT, kind=Choice()))

# --------------------------------------------------------------------------- embeddings

add(EM + "embedding_lookup", lambda m: dict(ids=m.ids(m.s.B, m.s.T, high=m.s.V), E=m.f(m.s.V, m.s.C)))
add(EM + "one_hot_embedding", lambda m: dict(ids=m.ids(m.s.B, m.s.T, high=m.s.V), E=m.f(m.s.V, m.s.C)))
add(EM + "lm_head", lambda m: dict(h=m.f(m.s.B, m.s.T, m.s.C), W_U=m.f(m.s.C, m.s.V), b_U=m.f(m.s.V)))
add(EM + "tied_lm_head", lambda m: dict(h=m.f(m.s.B, m.s.T, m.s.C), E=m.f(m.s.V, m.s.C)))
add(EM + "token_position_embedding", lambda m: dict(ids=m.ids(m.s.B, m.s.T, high=m.s.V), E=m.f(m.s.V, m.s.C),
                                                    P=m.f(m.s.T + 2, m.s.C), offset=1),
    scalars=dict(offset=NONNEG_INT))
add(EM + "TokenEmbedding", lambda m: dict(V=m.s.V, d=m.s.C, ids=m.ids(m.s.B, m.s.T, high=m.s.V)),
    init=("V", "d", "std"), scalars=dict(V=POS_INT, d=POS_INT, std=POS))
add(EM + "LMHead", lambda m: dict(d=m.s.C, V=m.s.V, h=m.f(m.s.B, m.s.T, m.s.C)),
    init=("d", "V", "bias", "std"), scalars=dict(d=POS_INT, V=POS_INT, std=POS))

# --------------------------------------------------------------------------- flash (tiled PyTorch)

for _f in ("tiled_attention_forward", "tiled_attention"):
    add(FL + _f, lambda m: dict(**qkv(m, T_k=m.s.T + 2), causal=True, block_q=2, block_k=3),
        scalars=dict(scale=POS, block_q=POS_INT, block_k=POS_INT))
add(FL + "naive_attention", lambda m: dict(**qkv(m), causal=True), scalars=dict(scale=POS))
add(FL + "merge_attention_states", lambda m: dict(o_a=m.f(m.s.B, m.s.T, m.s.D), lse_a=m.f(m.s.B, m.s.T),
                                                  o_b=m.f(m.s.B, m.s.T, m.s.D), lse_b=m.f(m.s.B, m.s.T)))

# --------------------------------------------------------------------------- init

_INIT_SKIP = ("a random initialiser: the draw itself depends on the dtype (torch draws fp16 and float64 "
              "normals differently), so there is no fp64 reference for the same draw")
add(IN + "he_normal_", lambda m: dict(W=m.f(m.s.C, m.s.F), nonlinearity="leaky_relu", a=0.1, generator=m.gen()),
    scalars=dict(nonlinearity=Choice(), mode=Choice(), a=NONNEG), lowp_skip=_INIT_SKIP)
add(IN + "xavier_uniform_", lambda m: dict(W=m.f(m.s.C, m.s.F), gain=1.0, generator=m.gen()),
    scalars=dict(gain=POS), lowp_skip=_INIT_SKIP)

# --------------------------------------------------------------------------- local attention

add(LA + "sliding_window_attention", lambda m: dict(**qkv(m), window=2, block_q=2),
    scalars=dict(window=POS_INT, scale=POS, block_q=POS_INT))
add(LA + "sparse_attention", lambda m: dict(**qkv(m), pattern="strided", stride=2, n_summary=1),
    scalars=dict(pattern=Choice(), stride=POS_INT, n_summary=POS_INT, scale=POS))


def _gathered(m):
    from llmbook.lm.local_attention import sparse_indices
    idx, valid = sparse_indices(max(m.s.T, 1), "strided", 2)
    return dict(**qkv(m), idx=idx[: m.s.T], valid=valid[: m.s.T], scale=0.5)


add(LA + "gathered_attention", _gathered, scalars=dict(scale=POS))
add(LA + "sliding_window_mask", lambda m: dict(T_q=m.s.T, T_k=m.s.T, window=2),
    scalars=dict(T_q=NONNEG_INT, T_k=NONNEG_INT, window=POS_INT))
add(LA + "sparse_mask", lambda m: dict(T=m.s.T, pattern="fixed", stride=2),
    scalars=dict(T=NONNEG_INT, pattern=Choice(), stride=POS_INT, n_summary=POS_INT))

# --------------------------------------------------------------------------- mixture of experts

N_TOK = 6
add(MO + "expert_capacity", lambda m: dict(N=64, E=m.s.E, K=m.s.K, capacity_factor=1.25),
    scalars=dict(N=NONNEG_INT, E=POS_INT, K=POS_INT, capacity_factor=POS))
add(MO + "load_balancing_loss", lambda m: dict(probs=m.probs(N_TOK, m.s.E), topk_ids=m.ids(N_TOK, m.s.K, high=m.s.E),
                                               alpha=0.01),
    scalars=dict(alpha=NONNEG))


class _Expert(nn.Module):
    """A caller's sub-module (an expert, a DeepNorm sublayer): errors raised inside it are the caller's."""

    def __init__(self, C):
        super().__init__()
        self.lin = nn.Linear(C, C)

    def forward(self, x):
        return self.lin(x)


def _moe_output(m):
    experts = [m.module(_Expert, m.s.C) for _ in range(m.s.E)]
    ids = torch.stack([torch.randperm(max(m.s.E, 1), generator=m.g)[: m.s.K] for _ in range(N_TOK)]) % max(m.s.E, 1)
    return dict(x=m.f(N_TOK, m.s.C), experts=experts, topk_ids=ids, topk_weights=m.probs(N_TOK, m.s.K),
                keep=torch.ones(N_TOK, m.s.K, dtype=torch.bool))


add(MO + "moe_output", _moe_output, scalars=dict(d_out=POS_INT))
add(MO + "router_probs", lambda m: dict(x=m.f(N_TOK, m.s.C), W_g=m.f(m.s.E, m.s.C)))
add(MO + "router_z_loss", lambda m: dict(logits=m.f(N_TOK, m.s.E)))
add(MO + "switch_routing", lambda m: dict(probs=m.probs(N_TOK, m.s.E)))
add(MO + "top_k_routing", lambda m: dict(probs=m.probs(N_TOK, m.s.E), K=m.s.K, bias=m.f(m.s.E)),
    scalars=dict(K=POS_INT))
add(MO + "expert_load", lambda m: dict(topk_ids=m.ids(N_TOK, m.s.K, high=m.s.E), E=m.s.E,
                                       keep=torch.ones(N_TOK, m.s.K, dtype=torch.bool)),
    scalars=dict(E=POS_INT))
add(MO + "capacity_mask", lambda m: dict(topk_ids=m.ids(N_TOK, m.s.K, high=m.s.E), E=m.s.E, capacity=2),
    scalars=dict(E=POS_INT, capacity=NONNEG_INT))
add(MO + "update_routing_bias", lambda m: dict(bias=m.f(m.s.E), load=torch.arange(m.s.E) + 1, u=0.01),
    scalars=dict(u=NONNEG))
add("llmbook.lm.moe_layer:MoELayer", lambda m: dict(C=m.s.C, d_ff=m.s.F, E=m.s.E, K=m.s.K, x=m.f(m.s.B, m.s.T, m.s.C)),
    init=("C", "d_ff", "E", "K", "capacity_factor"),
    scalars=dict(C=POS_INT, d_ff=POS_INT, E=POS_INT, K=POS_INT, capacity_factor=POS),
    lowp_int_reason="top-k expert choice over rounded router probabilities can flip near-ties", **GATED)

# --------------------------------------------------------------------------- norms

add(NO + "layer_norm", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.C), weight=m.pos(m.s.C), bias=m.f(m.s.C), eps=1e-5),
    scalars=dict(eps=NONNEG), **NORM_SCALE)
add(NO + "rms_norm", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.C), weight=m.pos(m.s.C), eps=1e-6),
    scalars=dict(eps=NONNEG), **NORM_SCALE)
add(NO + "variance", lambda m: dict(x=m.f(m.s.B, m.s.C)), **NORM_SCALE)
add(NO + "group_norm", lambda m: dict(x=m.f(m.s.B, m.s.C, m.s.T), G=2, weight=m.pos(m.s.C), bias=m.f(m.s.C)),
    scalars=dict(G=POS_INT, eps=NONNEG), **NORM_SCALE)
add(NO + "batch_norm", lambda m: dict(x=m.f(m.s.B, m.s.C, m.s.T), running_mean=m.f(m.s.C),
                                      running_var=m.pos(m.s.C), weight=m.pos(m.s.C), bias=m.f(m.s.C)),
    scalars=dict(momentum=PROB, eps=NONNEG), **NORM_SCALE)
for _c, _init in (("LayerNorm", ("d",)), ("RMSNorm", ("d",))):
    add(NO + _c, lambda m: dict(d=m.s.C, x=m.f(m.s.B, m.s.T, m.s.C)), init=("d", "eps"),
        scalars=dict(d=POS_INT, eps=NONNEG), **NORM_SCALE)
add(NO + "BatchNorm", lambda m: dict(C=m.s.C, x=m.f(m.s.B, m.s.C, m.s.T)), init=("C", "eps", "momentum"),
    scalars=dict(C=POS_INT, eps=NONNEG, momentum=PROB), **NORM_SCALE)
add(NO + "GroupNorm", lambda m: dict(G=2, C=m.s.C, x=m.f(m.s.B, m.s.C, m.s.T)), init=("G", "C", "eps"),
    scalars=dict(G=POS_INT, C=POS_INT, eps=NONNEG), **NORM_SCALE)
add(NO + "DeepNormResidual", lambda m: dict(d=m.s.C, sublayer=m.module(_Expert, m.s.C), alpha=2.0,
                                            x=m.f(m.s.B, m.s.T, m.s.C)),
    init=("d", "sublayer", "alpha", "eps"), scalars=dict(d=POS_INT, alpha=POS, eps=NONNEG), **NORM_SCALE)
add(NO + "deepnorm_constants", lambda m: dict(N=12, M=6), scalars=dict(N=POS_INT, M=POS_INT, part=Choice()))

# --------------------------------------------------------------------------- position bias

add(PB + "T5RelativeBias", lambda m: dict(H=m.s.H, T_q=m.s.T, T_k=m.s.T + 1),
    init=("H", "num_buckets", "max_distance"),
    scalars=dict(H=POS_INT, num_buckets=POS_INT, max_distance=POS_INT, T_q=NONNEG_INT, T_k=NONNEG_INT))
add(PB + "alibi_bias", lambda m: dict(T=m.s.T, H=m.s.H, slopes=m.pos(m.s.H), T_k=m.s.T + 1),
    scalars=dict(T=NONNEG_INT, H=POS_INT, T_k=NONNEG_INT))
add(PB + "alibi_slopes", lambda m: dict(H=m.s.H), scalars=dict(H=POS_INT))

# --------------------------------------------------------------------------- positions


def _positions(m):
    return torch.arange(m.s.T) + m.s.P


def _rope(m):
    from llmbook.lm.rope import rope_cos_sin
    cos, sin = rope_cos_sin(_positions(m), m.s.D, dtype=m.dt)
    return dict(x=m.f(m.s.B, m.s.T, m.s.D), cos=cos, sin=sin)


add(PO + "LearnedPositionEmbedding", lambda m: dict(n_max=m.s.T + 2, d=m.s.C, tok_emb=m.f(m.s.B, m.s.T, m.s.C)),
    init=("n_max", "d"), scalars=dict(n_max=POS_INT, d=POS_INT, offset=NONNEG_INT))
add(RO + "apply_rope", _rope)
add(RO + "apply_rope_complex", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), positions=_positions(m), base=1e4),
    scalars=dict(base=BASE))
add(RO + "apply_rope_matrix", lambda m: dict(x=m.f(m.s.B, m.s.T, m.s.D), positions=_positions(m), base=1e4),
    scalars=dict(base=BASE))
add(PO + "apply_xpos", lambda m: dict(q=m.f(m.s.B, m.s.T, m.s.D), k=m.f(m.s.B, m.s.T, m.s.D), positions=_positions(m)),
    scalars=dict(base=BASE, gamma=NONNEG, scale_base=POS))
add(PO + "nope_embedding", lambda m: dict(ids=m.ids(m.s.B, m.s.T, high=m.s.V), E=m.f(m.s.V, m.s.C)))
add(RO + "rope_relative_score", lambda m: dict(q=m.f(m.s.B, m.s.D), k=m.f(m.s.B, m.s.D), delta=3 + m.s.P, base=1e4),
    scalars=dict(base=BASE))
add(RO + "rope_rotation_matrix", lambda m: dict(position=3.0 + m.s.P, D=m.s.D, base=1e4),
    scalars=dict(position=Float(), D=POS_INT, base=BASE))
add(PO + "sinusoidal_encoding", lambda m: dict(T=m.s.T, d=m.s.D, base=1e4),
    scalars=dict(T=NONNEG_INT, d=POS_INT, base=BASE, layout=Choice()))
add(RO + "rope_cos_sin", lambda m: dict(positions=_positions(m), D=m.s.D, base=1e4, dtype=m.dt),
    scalars=dict(D=POS_INT, base=BASE))
add(PO + "xpos_scale", lambda m: dict(positions=_positions(m), D=m.s.D), scalars=dict(D=POS_INT, gamma=NONNEG,
                                                                                         scale_base=POS))

# --------------------------------------------------------------------------- probability

add(PR + "softmax", lambda m: dict(z=m.f(m.s.B, m.s.V), dim=-1), scalars=dict(dim=Int(-2, 1)))
add(PR + "log_softmax", lambda m: dict(z=m.f(m.s.B, m.s.V), dim=-1), scalars=dict(dim=Int(-2, 1)))
add(PR + "logsumexp", lambda m: dict(z=m.f(m.s.B, m.s.V), dim=-1), scalars=dict(dim=Int(-2, 1)))
for _f in ("cross_entropy", "kl_divergence", "reverse_kl_divergence", "cross_entropy_decomposition"):
    _a, _b = ("y", "p") if _f == "cross_entropy" else ("p", "q")
    add(PR + _f, lambda m, _a=_a, _b=_b: {_a: m.probs(m.s.B, m.s.V), _b: m.probs(m.s.B, m.s.V)})
add(PR + "entropy", lambda m: dict(p=m.probs(m.s.B, m.s.V)))
add(PR + "bits_per_byte", lambda m: dict(total_nll_nats=100.0, n_bytes=50),
    scalars=dict(total_nll_nats=Float(0, inf_ok=True), n_bytes=POS_INT))  # inf: a byte of probability 0
add(PR + "length_normalized_score", lambda m: dict(log_probs=-m.pos(m.s.B, m.s.T), alpha=0.7,
                                                   mask=torch.ones(m.s.B, m.s.T, dtype=torch.bool)),
    scalars=dict(alpha=NONNEG))
for _f in ("nll", "perplexity", "sequence_log_likelihood", "token_log_probs"):
    add(PR + _f, lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V), targets=m.ids(m.s.B, m.s.T, high=m.s.V)),
        scalars=dict(reduction=Choice()) if _f == "nll" else {})
add(PR + "conditional_log_likelihood", lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V),
                                                      targets=m.ids(m.s.B, m.s.T, high=m.s.V), prompt_length=2),
    scalars=dict(prompt_length=NONNEG_INT))


class _Bigram(nn.Module):
    """A tiny language model (ids (B, L) -> logits (B, L, V)) and a one-step scorer for the searches."""

    def __init__(self, V):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, V))

    def forward(self, ids):
        return self.table[ids]

    def step(self, seq):
        return torch.log_softmax(self.table[seq[-1]].double(), -1).to(self.table.dtype)


add(PR + "teacher_forcing_loss", lambda m: dict(model=m.module(_Bigram, m.s.V), x=m.ids(m.s.B, 2, high=m.s.V),
                                                y_star=m.ids(m.s.B, m.s.T, high=m.s.V)))

# --------------------------------------------------------------------------- search


def _steps(m):
    lm = m.module(_Bigram, m.s.V)
    return lm.step


add(SE + "beam_search", lambda m: dict(step_fn=_steps(m), prefix=m.ids(2, high=m.s.V), beam_width=2, max_len=3,
                                       alpha=0.5),
    scalars=dict(beam_width=POS_INT, max_len=POS_INT, eos_id=NONNEG_INT, alpha=NONNEG),
    lowp_int_reason="hypotheses are ranked by rounded scores; a near-tie can reorder them")
add(SE + "speculative_decode", lambda m: dict(target_fn=_steps(m), draft_fn=_steps(m), prefix=m.ids(2, high=m.s.V),
                                              n_draft=2, max_new_tokens=3, generator=m.gen()),
    scalars=dict(n_draft=POS_INT, max_new_tokens=POS_INT),
    lowp_int_reason="acceptance tests u < p/q on rounded probabilities; a near-boundary draw can flip")
for _f in ("contrastive_decode_step", "contrastive_decoding_scores"):
    add(SE + _f, lambda m: dict(expert_logits=m.f(m.s.B, m.s.V), amateur_logits=m.f(m.s.B, m.s.V), alpha=1.0,
                                plausibility=0.1),
        scalars=dict(alpha=NONNEG, plausibility=PROB))
# length = |y| >= 0 generated tokens (the docstring's contract; length 0 gives the factor (5/6)^alpha)
add(SE + "length_penalty", lambda m: dict(log_prob=-m.pos(m.s.B), length=7, alpha=1.0),
    scalars=dict(length=NONNEG_INT, alpha=NONNEG))
add(SE + "speculative_accept_prob", lambda m: dict(p=m.probs(m.s.B, m.s.V), q=m.probs(m.s.B, m.s.V),
                                                   x=m.ids(m.s.B, high=m.s.V)))
add(SE + "speculative_sample", lambda m: dict(p=m.probs(m.s.B, m.s.V), q=m.probs(m.s.B, m.s.V), generator=m.gen()),
    lowp_int_reason="a draw compares a uniform with rounded probabilities; a near-boundary draw can flip")
add(SE + "residual_distribution", lambda m: dict(p=m.probs(m.s.B, m.s.V), q=m.probs(m.s.B, m.s.V)))

# --------------------------------------------------------------------------- gpt, n-grams

add("llmbook.lm.gpt:GPTConfig", lambda m: dict(vocab_size=m.s.V, d_model=m.s.C, n_layers=1, n_heads=m.s.H,
                                               n_kv_heads=1, d_ff=m.s.F, max_seq_len=16),
    init=("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "rope_theta",
          "norm_eps"),
    scalars=dict(vocab_size=POS_INT, d_model=POS_INT, n_layers=POS_INT, n_heads=POS_INT, n_kv_heads=POS_INT,
                 d_ff=POS_INT, max_seq_len=POS_INT, rope_theta=BASE, norm_eps=NONNEG))
add("llmbook.lm.ngram:NGramLM", lambda m: dict(order=2, vocab_size=m.s.V, alpha=1.0),
    init=("order", "vocab_size", "alpha"),
    scalars=dict(order=NONNEG_INT, vocab_size=POS_INT, alpha=POS))

# --------------------------------------------------------------------------- kernels

_INTERP = ("Triton kernel: on a CPU only the interpreter runs it (seconds per call), so only the argument "
           "validation is fuzzed here; tests/kernels compares it with the tiled PyTorch version")


def _flash(m):
    s = m.s
    return dict(q=m.f(s.B, s.H, 16, 16), k=m.f(s.B, s.H, 16, 16), v=m.f(s.B, s.H, 16, 16), block_m=16, block_n=16)


add(KF + "flash_attention", lambda m: dict(**qkv(m), causal=True, backend="torch"),
    scalars=dict(scale=POS, backend=Choice()))
for _f in ("flash_attention_forward", "flash_attention_triton"):
    add(KF + _f, _flash, scalars=dict(scale=POS, block_m=Int(16), block_n=Int(16)), slow=_INTERP)

# Positions are real numbers (interpolated RoPE positions are fractional), and a load may be a float count:
# these integer tensors must accept float values too (a bool is still rejected).
for _name, _args in ((CE + "position_interpolation", ("positions",)), (CE + "rope_scores_by_distance", ("distances",)),
                     (RO + "apply_rope_complex", ("positions",)), (RO + "apply_rope_matrix", ("positions",)),
                     (PO + "apply_xpos", ("positions",)), (RO + "rope_cos_sin", ("positions",)),
                     (PO + "xpos_scale", ("positions",)), (MO + "update_routing_bias", ("load",))):
    CASES[_name].real_ok = _args

assert all(math.isfinite(c.lowp_tol) for c in CASES.values())

# --------------------------------------------------------------------------- training losses (chapter 7)

LO, CO, OB, DI = ("llmbook.lm.losses:", "llmbook.lm.contrastive:", "llmbook.lm.objectives:",
                  "llmbook.lm.distillation:")
_RED = Choice()  # reduction


def _logits_targets(m):
    return dict(logits=m.f(m.s.B, m.s.T, m.s.V), targets=m.ids(m.s.B, m.s.T, high=m.s.V))


add(LO + "smoothed_targets", lambda m: dict(targets=m.ids(m.s.B, m.s.T, high=m.s.V), V=m.s.V, eps=0.1),
    scalars=dict(V=POS_INT, eps=PROB, convention=Choice()))
add(LO + "label_smoothing_loss", lambda m: dict(**_logits_targets(m), eps=0.1, convention="fairseq"),
    scalars=dict(eps=PROB, convention=Choice(), ignore_index=Int(), reduction=_RED))
add(LO + "focal_loss", lambda m: dict(**_logits_targets(m), gamma=2.0, alpha=m.pos(m.s.V)),
    scalars=dict(gamma=NONNEG, ignore_index=Int(), reduction=_RED))
add(LO + "sigmoid_focal_loss", lambda m: dict(logits=m.f(m.s.B, m.s.T), targets=(m.f(m.s.B, m.s.T) > 0).to(m.dt)),
    scalars=dict(gamma=NONNEG, alpha=PROB, reduction=_RED))
add(CO + "info_nce", lambda m: dict(q=m.f(m.s.B, m.s.D), k=m.f(m.s.B, m.s.D), negatives=m.f(m.s.B, 3, m.s.D),
                                    tau=0.1),
    scalars=dict(tau=POS, similarity=Choice(), reduction=_RED))
add(CO + "nt_xent", lambda m: dict(z_i=m.f(m.s.B, m.s.D), z_j=m.f(m.s.B, m.s.D), tau=0.5),
    scalars=dict(tau=POS, reduction=_RED))
add(CO + "triplet_loss", lambda m: dict(a=m.f(m.s.B, m.s.D), p=m.f(m.s.B, m.s.D), n=m.f(m.s.B, m.s.D), margin=1.0),
    scalars=dict(margin=POS, ord=Float(1, inf_ok=True), eps=NONNEG, reduction=_RED))
for _f in ("masked_lm_loss", "causal_lm_loss"):
    add(OB + _f, lambda m: dict(logits=m.f(m.s.B, m.s.T, m.s.V), labels=m.ids(m.s.B, m.s.T, high=m.s.V)),
        scalars=dict(ignore_index=Int(), reduction=_RED, num_items_in_batch=POS_INT))
add(OB + "mlm_mask", lambda m: dict(ids=m.ids(m.s.B, m.s.T, high=m.s.V), mask_id=0, V=m.s.V, p=0.5, generator=m.gen()),
    scalars=dict(mask_id=NONNEG_INT, V=POS_INT, p=PROB, ignore_index=Int()))
add(OB + "random_spans_noise_mask", lambda m: dict(length=4 * m.s.T, generator=m.gen()),
    scalars=dict(length=NONNEG_INT, noise_density=PROB, mean_noise_span_length=Float(1)))


def _span_batch(m):
    from llmbook.lm.objectives import random_spans_noise_mask
    B, T = m.s.B, 4 * m.s.T
    noise = [random_spans_noise_mask(T, generator=m.g) for _ in range(B)]
    return dict(ids=m.ids(B, T, high=m.s.V), noise_mask=torch.stack(noise) if B else torch.zeros(0, T, dtype=bool),
                sentinel_start=m.s.V + 7)


class _Seq2Seq(nn.Module):
    """A tiny encoder-decoder: logits (B, U, V) from encoder ids (B, S) and decoder ids (B, U)."""

    def __init__(self, V):
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, V))

    def forward(self, x, y_in):
        return self.table[y_in] + self.table[x].mean(1, keepdim=True)


add(OB + "span_corruption", lambda m: dict(**_span_batch(m), eos_id=1),
    scalars=dict(sentinel_start=NONNEG_INT, eos_id=NONNEG_INT))
add(OB + "span_corruption_loss", lambda m: dict(model=m.module(_Seq2Seq, m.s.V + 8), **_span_batch(m), eos_id=1),
    scalars=dict(sentinel_start=NONNEG_INT, eos_id=NONNEG_INT, decoder_start_id=NONNEG_INT, reduction=_RED))
add(DI + "distillation_loss", lambda m: dict(student_logits=m.f(m.s.B, m.s.T, m.s.V),
                                             teacher_logits=m.f(m.s.B, m.s.T, m.s.V), tau=2.0),
    scalars=dict(tau=POS, reduction=_RED))
add(DI + "hidden_state_distillation_loss", lambda m: dict(student_states=m.f(2, m.s.B, m.s.T, m.s.C),
                                                          teacher_states=m.f(4, m.s.B, m.s.T, m.s.D),
                                                          W=m.f(2, m.s.C, m.s.D)),
    scalars=dict(reduction=_RED))
add(DI + "uniform_layer_map", lambda m: dict(L_S=2, L_T=4), scalars=dict(L_S=POS_INT, L_T=POS_INT))

# --------------------------------------------------------------------------- optimisers and schedules (chapter 8)

OP = "llmbook.lm.optim:"
SC = "llmbook.lm.schedules:"
ADAM_BETA = Float(0, 1, hi_open=True)  # the bias correction divides by 1 - beta^t
add(OP + "sgd_step", lambda m: dict(theta=m.f(m.s.B, m.s.C), g=m.f(m.s.B, m.s.C), lr=0.1), scalars=dict(lr=NONNEG))
add(OP + "momentum_step", lambda m: dict(theta=m.f(m.s.B, m.s.C), g=m.f(m.s.B, m.s.C), v=m.f(m.s.B, m.s.C), lr=0.1,
                                         momentum=0.9),
    scalars=dict(lr=NONNEG, momentum=PROB))
add(OP + "adam_moments", lambda m: dict(m=m.f(m.s.B, m.s.C), v=m.pos(m.s.B, m.s.C), g=m.f(m.s.B, m.s.C)),
    scalars=dict(beta1=ADAM_BETA, beta2=ADAM_BETA))
add(OP + "adam_update", lambda m: dict(theta=m.f(m.s.B, m.s.C), m=m.f(m.s.B, m.s.C), v=m.pos(m.s.B, m.s.C), t=3),
    scalars=dict(t=POS_INT, lr=NONNEG, beta1=ADAM_BETA, beta2=ADAM_BETA, eps=NONNEG))
add(OP + "adamw_update", lambda m: dict(theta=m.f(m.s.B, m.s.C), m=m.f(m.s.B, m.s.C), v=m.pos(m.s.B, m.s.C), t=3),
    scalars=dict(t=POS_INT, lr=NONNEG, beta1=ADAM_BETA, beta2=ADAM_BETA, eps=NONNEG, weight_decay=NONNEG))
add(OP + "lion_step", lambda m: dict(theta=m.f(m.s.B, m.s.C), m=m.f(m.s.B, m.s.C), g=m.f(m.s.B, m.s.C), lr=1e-3,
                                     weight_decay=0.1),
    scalars=dict(lr=NONNEG, beta1=PROB, beta2=PROB, weight_decay=NONNEG))
add("llmbook.lm.adafactor:adafactor_second_moment",
    lambda m: dict(r=m.pos(m.s.B, m.s.T), c=m.pos(m.s.B, m.s.C), g=m.f(m.s.B, m.s.T, m.s.C), beta2=0.9),
    scalars=dict(beta2=PROB, eps1=NONNEG), overflow="square",
    nan_reason="g enters squared: beyond the square root of the dtype's range r and c overflow to inf and "
               "r / mean(r) is inf / inf, as in torch.optim.Adafactor")
add(SC + "clip_by_global_norm", lambda m: dict(grads=m.f(m.s.B, m.s.C), max_norm=1.0),
    scalars=dict(max_norm=POS, eps=NONNEG))
add(SC + "cosine_decay", lambda m: dict(t=3.0, T=10, eta_max=1e-3, eta_min=1e-4),
    scalars=dict(t=NONNEG, T=POS_INT, eta_max=NONNEG, eta_min=NONNEG))
add(SC + "linear_warmup", lambda m: dict(t=3.0, T_warm=10, eta_max=1e-3),
    scalars=dict(t=NONNEG, T_warm=NONNEG_INT, eta_max=NONNEG))
add(SC + "inverse_sqrt", lambda m: dict(t=100.0, d_model=512, T_warm=4000),
    scalars=dict(t=NONNEG, d_model=POS_INT, T_warm=POS_INT))


# --------------------------------------------------------------------------- one file per chapter
# Later chapters keep their cases in ``tests/fuzz/cases_chNN.py`` (``from .cases import add, ...``),
# so that chapters written side by side never edit the same file. Each is imported here, in order.
def _load_chapter_cases() -> None:
    import importlib
    from pathlib import Path

    for path in sorted(Path(__file__).parent.glob("cases_ch*.py")):
        importlib.import_module(f".{path.stem}", __package__)


_load_chapter_cases()
