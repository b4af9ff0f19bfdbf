"""Prefix tuning, prompt tuning, deep prompts, IA3 and BitFit (chapter 11) against ``peft`` 0.21 and torch.

The model-level oracles run ``peft`` on a small random ``transformers.LlamaForCausalLM`` (float64, grouped
key/value heads) whose weights are loaded into the book's :class:`~llmbook.lm.gpt.TinyGPT`.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmbook.lm import adapters as adp
from llmbook.lm import lora as lo
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.rope import apply_rope, rope_cos_sin

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

F64 = dict(atol=1e-10, rtol=1e-10)
# transformers' Llama upcasts to float32 in RMSNorm, RoPE and the softmax whatever the dtype: a float64 Llama
# is float32-accurate (tests/lm/test_gpt.py uses the same tolerance); a misplaced prefix moves logits by ~1
LLAMA = dict(atol=1e-5, rtol=1e-5)


def tiny_llama(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    return model.double()


def _ids(B=2, T=7, seed=3):
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(seed))


def _load_prefix(peft_model, K, V):
    """Write per-layer prefixes ``K[l], V[l]`` (``(H_kv, P, D)``) into peft's prefix embedding ``(P, 2 L H_kv D)``."""
    L, P = len(K), K[0].shape[1]
    table = torch.stack([t for l in range(L) for t in (K[l], V[l])])  # (2L, H_kv, P, D)
    with torch.no_grad():
        peft_model.prompt_encoder["default"].embedding.weight.copy_(table.permute(2, 0, 1, 3).reshape(P, -1))


# --------------------------------------------------------------------------- 11.05 prefix tuning


@pytest.mark.equation("11.05", oracle="torch.nn.functional.scaled_dot_product_attention on the concatenated keys "
                                      "with an explicit mask")
def test_prefix_attention_matches_torch_with_explicit_concatenation():
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, T, P, D = 2, 4, 2, 5, 3, 8
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H_kv, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    K_p, V_p = (torch.randn(H_kv, P, D, generator=g, dtype=torch.float64) for _ in range(2))
    K = torch.cat([K_p.expand(B, -1, -1, -1), k], 2).repeat_interleave(H // H_kv, 1)
    V = torch.cat([V_p.expand(B, -1, -1, -1), v], 2).repeat_interleave(H // H_kv, 1)
    allowed = torch.ones(T, P + T, dtype=torch.bool)
    allowed[:, P:] = torch.ones(T, T, dtype=torch.bool).tril()  # prefix always visible, tokens causal
    expected = F.scaled_dot_product_attention(q, K, V, attn_mask=allowed)
    torch.testing.assert_close(adp.prefix_attention(q, k, v, K_p, V_p), expected, **F64)
    # a per-example prefix (B, H_kv, P, D) broadcasts the same way
    torch.testing.assert_close(adp.prefix_attention(q, k, v, K_p.expand(B, -1, -1, -1), V_p), expected, **F64)


@pytest.mark.equation("11.05", oracle="peft.PrefixTuningConfig on transformers.LlamaForCausalLM (GQA), same weights")
def test_prefix_tuned_tiny_gpt_matches_peft():
    llama = tiny_llama()
    ours = TinyGPT.from_llama(llama).eval()
    P = 3
    theirs = peft.get_peft_model(copy.deepcopy(llama), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                              num_virtual_tokens=P)).double().eval()
    layers = adp.add_prefix(ours, P)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            layer.prefix_k.copy_(torch.randn(layer.prefix_k.shape, generator=g, dtype=torch.float64))
            layer.prefix_v.copy_(torch.randn(layer.prefix_v.shape, generator=g, dtype=torch.float64))
    _load_prefix(theirs, [layer.prefix_k for layer in layers], [layer.prefix_v for layer in layers])
    ids = _ids()
    with torch.no_grad():
        # with a prefix in the cache, transformers gives the tokens positions P .. P + T - 1
        ours_logits = ours(ids, positions=torch.arange(P, P + ids.shape[1]))
        expected = theirs(input_ids=ids).logits
        torch.testing.assert_close(ours_logits, expected, **LLAMA)
        assert (ours(ids) - expected).abs().max() > 1e-2  # the check can fail: positions 0..T-1 are wrong
    assert lo.count_trainable(ours) == 2 * 2 * P * 2 * 8  # 2 layers, K and V, P rows of H_kv * D


# --------------------------------------------------------------------------- 11.06 prompt tuning


@pytest.mark.equation("11.06", oracle="peft.PromptTuningConfig on transformers.LlamaForCausalLM, same weights")
def test_prompt_tuning_matches_peft():
    llama = tiny_llama()
    m = 4
    theirs = peft.get_peft_model(copy.deepcopy(llama), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                              num_virtual_tokens=m)).double().eval()
    ours = adp.PromptedGPT(TinyGPT.from_llama(llama).eval(), m)
    with torch.no_grad():
        w = torch.randn(m, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        theirs.prompt_encoder["default"].embedding.weight.copy_(w)
        ours.prompts.copy_(w[None])
        ids = _ids()
        expected = theirs(input_ids=ids).logits  # (B, m + T, V): peft returns the virtual positions too
        torch.testing.assert_close(ours(ids), expected[:, m:], **LLAMA)
    assert lo.count_trainable(ours) == m * 32


def test_prepend_prompt_is_an_explicit_concatenation():
    E_x, P = torch.randn(2, 5, 4), torch.randn(3, 4)
    h = adp.prepend_prompt(E_x, P)
    assert h.shape == (2, 8, 4)
    assert torch.equal(h[0, :3], P) and torch.equal(h[1, :3], P) and torch.equal(h[:, 3:], E_x)


# --------------------------------------------------------------------------- 11.07 deep prompts


@pytest.mark.equation("11.07", oracle="peft.PrefixTuningConfig (P-tuning v2's key/value implementation) with keys and "
                                      "values computed from P_l in float64")
def test_deep_prompts_equal_prefix_tuning_with_tied_keys_and_values():
    llama = tiny_llama()
    m = 3
    base = TinyGPT.from_llama(llama).eval()
    ours = adp.PromptedGPT(copy.deepcopy(base), m, deep=True)
    with torch.no_grad():
        ours.prompts.copy_(torch.randn(ours.prompts.shape, generator=torch.Generator().manual_seed(4),
                                       dtype=torch.float64))
    # layer l sees the prompt only through its keys and values:
    # K_p = RoPE(W_K RMSNorm(P_l)) at positions 0..m-1 and V_p = W_V RMSNorm(P_l)
    cos, sin = rope_cos_sin(torch.arange(m), 8, dtype=torch.float64)
    K, V = [], []
    with torch.no_grad():
        for l, block in enumerate(base.blocks):
            h = block.norm1(ours.prompts[l][None])
            k = block.attn.k_proj(h).view(1, m, 2, 8).transpose(1, 2)
            v = block.attn.v_proj(h).view(1, m, 2, 8).transpose(1, 2)
            K.append(apply_rope(k, cos, sin)[0])
            V.append(v[0])
    theirs = peft.get_peft_model(copy.deepcopy(llama), peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                              num_virtual_tokens=m)).double().eval()
    _load_prefix(theirs, K, V)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, **LLAMA)
    assert lo.count_trainable(ours) == 2 * m * 32


def test_deep_prompt_replaces_the_prompt_rows_only():
    h, P_l = torch.randn(2, 6, 4), torch.randn(2, 4)
    out = adp.deep_prompt(h, P_l)
    assert torch.equal(out[:, :2], P_l.expand(2, -1, -1)) and torch.equal(out[:, 2:], h[:, 2:])
    # shallow prompt tuning differs: its prompt rows flow on through the layers
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2))
    shallow, deep = adp.PromptedGPT(model, 2), adp.PromptedGPT(model, 2, deep=True)
    with torch.no_grad():
        deep.prompts.copy_(shallow.prompts.expand(2, -1, -1))
        assert not torch.allclose(shallow(_ids(1, 4) % 20), deep(_ids(1, 4) % 20))


# --------------------------------------------------------------------------- 11.08 IA3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.k_proj, self.v_proj = nn.Linear(16, 8, bias=True), nn.Linear(16, 8)
        self.w_down = nn.Linear(24, 16)
        self.up = nn.Linear(16, 24)

    def forward(self, x):
        return self.k_proj(x) * self.v_proj(x).sum(-1, keepdim=True) + self.w_down(torch.relu(self.up(x)))[..., :8]


@pytest.mark.equation("11.08", oracle="peft.IA3Config (k, v: output scaling; w_down: feed-forward input scaling), "
                                      "forward and merged weights")
def test_ia3_matches_peft():
    torch.manual_seed(0)
    base = Block().double()
    cfg = peft.IA3Config(target_modules=["k_proj", "v_proj", "w_down"], feedforward_modules=["w_down"])
    theirs = peft.get_peft_model(copy.deepcopy(base), cfg).double()
    ours = copy.deepcopy(base)
    assert adp.add_ia3(ours) == ["k_proj", "v_proj", "w_down"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("k_proj", "v_proj", "w_down"):
            l = getattr(theirs.base_model.model, name).ia3_l["default"]
            l.copy_(1 + 0.5 * torch.randn(l.shape, generator=g, dtype=torch.float64))
            getattr(ours, name).ia3_l.copy_(l.flatten())
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), **F64)
    assert lo.count_trainable(ours) == lo.count_trainable(theirs) == 8 + 8 + 24
    merged = theirs.merge_and_unload()
    for name in ("k_proj", "v_proj", "w_down"):
        torch.testing.assert_close(getattr(ours, name).merged_weight(), getattr(merged, name).weight, **F64)


def test_ia3_linear_closed_forms():
    g = torch.Generator().manual_seed(0)
    x, W, b = torch.randn(4, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    l_out, l_in = torch.rand(3, generator=g), torch.rand(5, generator=g)
    torch.testing.assert_close(adp.ia3_linear(x, W, l_out, "output", b), (x @ W.T + b) * l_out)
    torch.testing.assert_close(adp.ia3_linear(x, W, l_in, "input", b), x @ (W * l_in).T + b)
    with pytest.raises(ValueError, match="scale must be one of"):
        adp.ia3_linear(x, W, l_out, "rows")
    with pytest.raises(ValueError, match=r"l must have shape \(5,\)"):
        adp.ia3_linear(x, W, l_out, "input")


# --------------------------------------------------------------------------- 11.09 BitFit


@pytest.mark.equation("11.09", oracle="brute force: one AdamW step on the tiny GPT changes exactly the bias tensors; "
                                      "count against the state dict")
def test_bitfit_trains_only_biases():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, d_ff=24))
    ids = _ids(2, 6) % 20
    with torch.no_grad():
        before_logits = model(ids)
    with pytest.raises(ValueError, match="no bias terms"):
        adp.bitfit(model)  # Llama-style: no biases at all
    names = adp.bitfit(model, add_bias=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), before_logits, atol=1e-6, rtol=0)  # zero biases change nothing
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bias_keys = {k for k in state if k.endswith(".bias")}
    assert set(names) == bias_keys and len(names) == 2 * 7
    assert lo.count_trainable(model) == sum(state[k].numel() for k in bias_keys) == 2 * (3 * 16 + 2 * 16 + 2 * 24)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    opt.step()
    after = model.state_dict()
    changed = {k for k in state if not torch.equal(state[k], after[k])}
    assert changed == bias_keys


# --------------------------------------------------------------------------- counts on the tiny GPT


def test_closed_form_parameter_counts_match_the_adapted_models():
    cfg = GPTConfig(vocab_size=20, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    counts = adp.peft_param_counts(cfg, r=4, P=3, m=5)

    def fresh():
        torch.manual_seed(0)
        return TinyGPT(cfg)

    measured = {}
    for name, kind, kw in (("LoRA", "lora", {}), ("rsLoRA", "lora", {"rslora": True}), ("DoRA", "dora", {}),
                           ("QLoRA", "qlora", {"block_size": 32})):
        model = fresh()
        lo.add_lora(model, r=4, alpha=8, kind=kind, **kw)
        measured[name] = lo.count_trainable(model)
    from llmbook.lm.adalora import add_adalora
    model = fresh()
    add_adalora(model, r=4, alpha=8)
    measured["AdaLoRA"] = lo.count_trainable(model)
    model = fresh()
    adp.add_prefix(model, 3)
    measured["prefix tuning"] = lo.count_trainable(model)
    measured["prompt tuning"] = lo.count_trainable(adp.PromptedGPT(fresh(), 5))
    measured["P-tuning v2 (deep prompts)"] = lo.count_trainable(adp.PromptedGPT(fresh(), 5, deep=True))
    model = fresh()
    adp.add_ia3(model)
    measured["IA3"] = lo.count_trainable(model)
    model = fresh()
    adp.bitfit(model, add_bias=True)
    measured["BitFit (added biases)"] = lo.count_trainable(model)
    assert measured == counts


def test_bad_input_raises_clear_errors():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="K_p must have shape"):
        adp.prefix_attention(q, q, q, torch.zeros(2, 1, 5), torch.zeros(2, 1, 4))
    with pytest.raises(ValueError, match="same prefix length"):
        adp.prefix_attention(q, q, q, torch.zeros(2, 1, 4), torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="disagree on the width"):
        adp.prepend_prompt(torch.zeros(1, 2, 4), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="at least m = 3"):
        adp.deep_prompt(torch.zeros(1, 2, 4), torch.zeros(3, 4))
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        adp.PrefixAttention(nn.Linear(2, 2), 3)


def test_try_it_solutions_of_chapter_11():
    from tests.try_it import assert_states

    tiny = GPTConfig(vocab_size=100, d_model=128, n_layers=4, n_heads=4, d_ff=344)  # the trained tiny GPT's shape
    seven = ("q_proj", "k_proj", "v_proj", "o_proj", "w_gate", "w_up", "w_down")
    n = adp.peft_param_counts(tiny, r=8, lora_targets=seven)["LoRA"]
    torch.manual_seed(0)
    model = TinyGPT(tiny)
    total = model.num_parameters()
    lo.add_lora(model, r=8, alpha=16, targets=seven)
    assert n == lo.count_trainable(model) == 78_080 and total == 804_480
    assert f"{100 * n / total:.2f}" == "9.71"
    s = [lo.lora_scaling(16, r, rs) for rs in (False, True) for r in (4, 64)]
    assert s == [4.0, 0.25, 8.0, 2.0]
    llama7b = adp.peft_param_counts(GPTConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008),
                                    m=20)
    assert (llama7b["prompt tuning"], llama7b["IA3"]) == (81_920, 614_400)
    assert_states("11-peft.ipynb", ["78{,}080", "9.71 %", "$s = 4$", "$s = 0.25$", "$s = 8$", "$s = 2$",
                                    "81{,}920", "614{,}400"])
