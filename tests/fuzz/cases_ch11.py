"""Fuzz cases of chapter 11 (PEFT and adapters): llmbook.lm.lora, llmbook.lm.adalora and llmbook.lm.adapters.

Sizes: ``C`` is d_in, ``F`` is d_out, ``K`` the LoRA rank (or the prefix / prompt length).
"""

from __future__ import annotations

import torch
from torch import nn

from .cases import SELF_ATTN, Choice, Float, Int, add

LO = "llmbook.lm.lora:"
AD = "llmbook.lm.adalora:"
AP = "llmbook.lm.adapters:"
ALPHA = Float()  # any finite real scale (0 switches the adapter off; a negative one flips it)


def _lowrank(m):
    s = m.s
    return dict(x=m.f(s.B, s.T, s.C), W=m.f(s.F, s.C), A=m.f(s.K, s.C), B=m.f(s.F, s.K), alpha=2.0)


add(LO + "lora_linear", lambda m: dict(**_lowrank(m), bias=m.f(m.s.F)), scalars=dict(alpha=ALPHA))


def _qlora(m):
    s = m.s
    block_size = max(s.C, 1)  # one block per row of W, whatever the degenerate sizes
    codes = torch.randint(0, 16, (s.F, s.C), generator=m.g)  # int64 NF4 indices, as llmbook.lm.nf4 gives them
    return dict(x=m.f(s.B, s.C), codes=codes, absmax=m.pos(s.F * s.C // block_size), A=m.f(s.K, s.C),
                B=m.f(s.F, s.K), alpha=2.0, block_size=block_size)


add(LO + "qlora_linear", _qlora, scalars=dict(alpha=ALPHA, block_size=Int(lo=1)))
add(LO + "dora_linear", lambda m: dict(**_lowrank(m), m=m.pos(m.s.F)), scalars=dict(alpha=ALPHA))
add(AD + "adalora_linear", lambda m: dict(x=m.f(m.s.B, m.s.C), W=m.f(m.s.F, m.s.C), P=m.f(m.s.F, m.s.K),
                                          Lambda=m.f(m.s.K), Q=m.f(m.s.K, m.s.C), alpha=2.0),
    scalars=dict(alpha=ALPHA))

add(AP + "prefix_attention", lambda m: dict(q=m.f(m.s.B, m.s.H, m.s.T, m.s.D), k=m.f(m.s.B, m.s.H, m.s.T, m.s.D),
                                            v=m.f(m.s.B, m.s.H, m.s.T, m.s.D), K_p=m.f(m.s.H, m.s.K, m.s.D),
                                            V_p=m.f(m.s.H, m.s.K, m.s.D)), **SELF_ATTN)
add(AP + "prepend_prompt", lambda m: dict(E_x=m.f(m.s.B, m.s.T, m.s.C), P=m.f(m.s.K, m.s.C)))
add(AP + "deep_prompt", lambda m: dict(h=m.f(m.s.B, m.s.K + m.s.T, m.s.C), P_l=m.f(m.s.K, m.s.C)))
add(AP + "ia3_linear", lambda m: dict(x=m.f(m.s.B, m.s.C), W=m.f(m.s.F, m.s.C), l=m.pos(m.s.F), scale="output",
                                      bias=m.f(m.s.F)), scalars=dict(scale=Choice()))
add(AP + "bitfit", lambda m: dict(model=m.module(nn.Linear, m.s.C, m.s.F)),
    lowp_skip="returns the names of the trainable parameters, no numbers")
