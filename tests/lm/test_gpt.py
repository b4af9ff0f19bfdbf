"""The tiny GPT of chapter 2 against transformers' LlamaForCausalLM with the same weights.

The Llama model is built from a ``LlamaConfig`` with random weights (no download), eager attention.
Its weights are then spread out (matrices N(0, 0.3^2), norm gains 1 + N(0, 0.1^2)) so the logits are
of order one and a swapped or mis-mapped parameter could not hide below the tolerance. Tolerances:
``rtol = atol = 1e-5`` (``F32``) in float32 and float64 alike (Llama computes its norms and softmax in
float32 whatever the dtype); generated token ids exactly.

A reader's own Llama written below in plain torch (Meta's reference code: ``tok_embeddings``/``wq``/``w1``
names, interleaved RoPE by complex multiplication) is the independent reference for loading a plain
state dict; in float64 it agrees to ``rtol = atol = 1e-10`` (``F64``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbook.lm.checkpoints import meta_llama_key_map
from llmbook.lm.gpt import GPTConfig, TinyGPT, llama_key_map

F32 = dict(rtol=1e-5, atol=1e-5)
F64 = dict(rtol=1e-10, atol=1e-10)


def tiny_llama(n_kv_heads=2, tie=True, dtype=torch.float32, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=n_kv_heads,
        intermediate_size=88, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=tie,
        attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    return model.to(dtype)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.mark.equation("02.04", "02.05", oracle="transformers.LlamaForCausalLM logits, same weights (tied, pre-norm)")
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_logits_match_llama(n_kv_heads):
    llama = tiny_llama(n_kv_heads)
    ours = TinyGPT.from_llama(llama).eval()
    assert ours.config.kv_heads == n_kv_heads and ours.config.rope_theta == 10000.0
    assert ours.head.weight is ours.embed.weight
    ids = torch.randint(0, 64, (3, 13))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, **F32)


def test_untied_and_float64_match_llama():
    # Llama upcasts to float32 *whatever the input dtype* in RMSNorm and the attention softmax, so a
    # float64 Llama is float32-accurate: the comparison keeps the float32 tolerance.
    llama = tiny_llama(tie=False, dtype=torch.float64, seed=1)
    ours = TinyGPT.from_llama(llama).eval()
    assert not ours.config.tie_embeddings and ours.head.weight is not ours.embed.weight
    assert ours.embed.weight.dtype == torch.float64
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(ids).logits, **F32)
    assert ours.num_parameters() == sum(p.numel() for p in llama.parameters())


def test_positions_move_rope_like_llama_position_ids(llama):
    ours = TinyGPT.from_llama(llama).eval()
    ids = torch.randint(0, 64, (2, 7))
    positions = torch.arange(20, 27)
    with torch.no_grad():
        ref = llama(ids, position_ids=positions.expand(2, -1)).logits
        torch.testing.assert_close(ours(ids, positions=positions), ref, **F32)


def test_greedy_generation_matches_llama_generate(llama):
    ours = TinyGPT.from_llama(llama).eval()
    prompt = torch.randint(0, 64, (2, 4))
    ref = llama.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 6, tau=0), ref)
    assert torch.equal(ours.generate(prompt, 6, top_k=1), ref)  # one candidate left: sampling is greedy


def test_sampling_is_reproducible_and_valid(llama):
    ours = TinyGPT.from_llama(llama).eval()
    prompt = torch.randint(0, 64, (3, 2))
    a = ours.generate(prompt, 6, generator=torch.Generator().manual_seed(4), tau=0.8, top_p=0.9)
    b = ours.generate(prompt, 6, generator=torch.Generator().manual_seed(4), tau=0.8, top_p=0.9)
    assert torch.equal(a, b) and a.shape == (3, 8) and torch.equal(a[:, :2], prompt)
    assert ((a >= 0) & (a < 64)).all()


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    return TinyGPT(GPTConfig()).eval(), torch.randint(0, 64, (1, 10))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(t=st.integers(1, 9), token=st.integers(0, 63))
def test_causal_future_tokens_do_not_change_the_past(toy, t, token):
    model, ids = toy
    changed = ids.clone()
    changed[0, t] = token
    with torch.no_grad():
        torch.testing.assert_close(model(changed)[:, :t], model(ids)[:, :t], rtol=0, atol=0)


def test_key_map_covers_every_parameter():
    for tie in (True, False):
        model = TinyGPT(GPTConfig(tie_embeddings=tie, n_layers=3))
        mapped = set(llama_key_map(3, tie))
        names = set(model.state_dict())
        assert mapped == (names - {"head.weight"} if tie else names)


def test_bad_configs_and_weights_are_rejected(llama):
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        GPTConfig(d_model=30)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        GPTConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match="must be even for RoPE"):
        GPTConfig(d_model=12, n_heads=4)
    with pytest.raises(ValueError, match="keys with no place in this model: 'model.layers.1.self_attn"):
        TinyGPT(GPTConfig(n_layers=1, n_kv_heads=2)).load_llama_weights(llama)
    with pytest.raises(ValueError, match="lacks 9 keys the key map reads: 'model.layers.2.input_layernorm"):
        TinyGPT(GPTConfig(n_layers=3, n_kv_heads=2)).load_llama_weights(llama)
    with pytest.raises(ValueError, match=r"k_proj.weight \(16, 32\) -> blocks.0.attn.k_proj.weight needs \(32, 32\)"):
        TinyGPT(GPTConfig()).load_llama_weights(llama)
    state = dict(llama.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="head.weight and embed.weight are one tied tensor .* lm_head.weight and "
                                         "model.embed_tokens.weight differ"):
        TinyGPT(GPTConfig(n_kv_heads=2)).load_llama_weights(state)
    model = TinyGPT(GPTConfig())
    with pytest.raises(ValueError, match=r"token ids in \[0, V\) = \[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"positions must have shape \(T,\) = \(2,\) or that of ids \(1, 2\)"):
        model(torch.tensor([[1, 2]]), positions=torch.arange(3))
    with pytest.raises(ValueError, match="RoPE layout must be"):
        GPTConfig(rope_layout="rotate_half")
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        model.generate(torch.tensor([[1]]), -1)
    bad = transformers.LlamaConfig(hidden_act="gelu", vocab_size=8, hidden_size=8, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=8, num_hidden_layers=1)
    with pytest.raises(ValueError, match="hidden_act must be 'silu'"):
        GPTConfig.from_llama_config(bad)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # issue 11: GPTConfig accepted rope_theta=0.5 and norm_eps=inf
        ({"rope_theta": 0.5}, ValueError, r"rope_theta \(the RoPE base\) must lie in \(1.0, inf\), got 0.5"),
        ({"norm_eps": float("inf")}, ValueError, r"norm_eps must lie in \[0.0, inf\), got inf"),
        ({"norm_eps": float("nan")}, ValueError, r"norm_eps must be a real number, got nan"),
        ({"rope_theta": "1e4"}, TypeError, r"rope_theta \(the RoPE base\) must be a real number, got '1e4'"),
        ({"d_model": 32.0}, TypeError, r"d_model must be a positive int, got 32.0 \(float\)"),
        ({"n_layers": True}, TypeError, r"n_layers must be a positive int, got True \(bool\)"),
        ({"n_kv_heads": 0}, ValueError, r"n_kv_heads \(None or an int\) must be a positive int, got 0"),
    ],
)
def test_config_rejects_bad_scalars(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        GPTConfig(**kwargs)


def test_generate_rejects_non_integer_max_new_tokens():
    model = TinyGPT(GPTConfig())
    with pytest.raises(TypeError, match=r"max_new_tokens must be a non-negative int, got 2.5 \(float\)"):
        model.generate(torch.tensor([[1]]), 2.5)


# ================================================================= a reader's own model, loaded from a plain state dict


class ReaderLlama:
    """A from-scratch Llama in plain torch, after Meta's reference ``model.py`` (no llmbook inside).

    Weights are a plain dict with Meta's names; RoPE rotates interleaved pairs (2j, 2j+1) by complex
    multiplication with ``freqs_cis``; frequencies are formed in float32 as Meta does, angles in float64.
    """

    def __init__(self, V=50, C=32, L=2, H=4, H_kv=2, d_ff=64, eps=1e-5, theta=10000.0, seed=0):
        self.V, self.C, self.L, self.H, self.H_kv, self.D, self.eps, self.theta = V, C, L, H, H_kv, C // H, eps, theta
        g = torch.Generator().manual_seed(seed)
        mat = lambda *shape: 0.3 * torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        gain = lambda: 1 + 0.1 * torch.randn(C, generator=g, dtype=torch.float64)  # noqa: E731
        sd = {"tok_embeddings.weight": mat(V, C), "norm.weight": gain(), "output.weight": mat(V, C)}
        for l in range(L):
            p = f"layers.{l}."
            sd[p + "attention.wq.weight"], sd[p + "attention.wo.weight"] = mat(H * self.D, C), mat(C, H * self.D)
            sd[p + "attention.wk.weight"], sd[p + "attention.wv.weight"] = mat(H_kv * self.D, C), mat(H_kv * self.D, C)
            sd[p + "feed_forward.w1.weight"], sd[p + "feed_forward.w3.weight"] = mat(d_ff, C), mat(d_ff, C)
            sd[p + "feed_forward.w2.weight"] = mat(C, d_ff)
            sd[p + "attention_norm.weight"], sd[p + "ffn_norm.weight"] = gain(), gain()
        self.state_dict = sd

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def freqs_cis(self, positions):  # positions (B, T) -> (B, T, D/2) unit phasors
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.D, 2)[: self.D // 2].float() / self.D))
        angles = positions.double()[..., None] * freqs.double()
        return torch.polar(torch.ones_like(angles), angles)

    def __call__(self, ids, positions=None):
        sd, (B, T), D = self.state_dict, ids.shape, self.D
        positions = torch.arange(T).expand(B, T) if positions is None else positions.expand(B, T)
        fc = self.freqs_cis(positions)[:, :, None, :]  # (B, T, 1, D/2): one phasor per sequence and position
        rot = lambda x: torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * fc).flatten(3)  # noqa: E731
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
        h = sd["tok_embeddings.weight"][ids]
        for l in range(self.L):
            p = f"layers.{l}."
            x = self.rms(h, sd[p + "attention_norm.weight"])
            q = rot((x @ sd[p + "attention.wq.weight"].T).view(B, T, self.H, D)).transpose(1, 2)
            k = rot((x @ sd[p + "attention.wk.weight"].T).view(B, T, self.H_kv, D)).transpose(1, 2)
            v = (x @ sd[p + "attention.wv.weight"].T).view(B, T, self.H_kv, D).transpose(1, 2)
            k, v = (t.repeat_interleave(self.H // self.H_kv, dim=1) for t in (k, v))
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + mask, -1) @ v
            h = h + a.transpose(1, 2).reshape(B, T, self.C) @ sd[p + "attention.wo.weight"].T
            x = self.rms(h, sd[p + "ffn_norm.weight"])
            ff = F.silu(x @ sd[p + "feed_forward.w1.weight"].T) * (x @ sd[p + "feed_forward.w3.weight"].T)
            h = h + ff @ sd[p + "feed_forward.w2.weight"].T
        return self.rms(h, sd["norm.weight"]) @ sd["output.weight"].T


@pytest.mark.parametrize("model_layout", ["interleaved", "half"])
def test_reader_model_from_plain_state_dict_matches(model_layout):
    reader = ReaderLlama()
    cfg = GPTConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                    tie_embeddings=False, rope_layout=model_layout)
    # the checkpoint is interleaved: a half-layout model converts its q/k rows on the way in
    model = TinyGPT(cfg).double().load_mapped_state_dict(reader.state_dict, meta_llama_key_map(2),
                                                         rope_layout="interleaved").eval()
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0], [5], [40]]) + torch.arange(11)  # (B, T): each sequence starts elsewhere
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reader(ids), **F64)
        torch.testing.assert_close(model(ids, positions=positions), reader(ids, positions), **F64)
        torch.testing.assert_close(model(ids, positions=positions[1]), reader(ids, positions[1]), **F64)
    if model_layout == "interleaved":  # loading without telling the layout mixes the pairs: logits differ
        wrong = TinyGPT(GPTConfig(**{**cfg.__dict__, "rope_layout": "half"})).double()
        wrong.load_mapped_state_dict(reader.state_dict, meta_llama_key_map(2))
        with torch.no_grad():
            assert not torch.allclose(wrong(ids), reader(ids), atol=1e-3)


@pytest.mark.parametrize("model_layout", ["half", "interleaved"])
def test_llama_loaded_from_its_plain_state_dict(model_layout):
    llama = tiny_llama(n_kv_heads=2, tie=False, dtype=torch.float64, seed=2)
    cfg = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=88,
                    tie_embeddings=False, rope_layout=model_layout)
    state = {k: v.clone() for k, v in llama.state_dict().items()}  # a plain dict[str, Tensor]
    model = TinyGPT(cfg).double().load_mapped_state_dict(state, llama_key_map(2, tie_embeddings=False),
                                                         rope_layout="half", ignore=["*inv_freq"]).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    position_ids = torch.stack([torch.arange(9), torch.arange(9) + 17])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), llama(ids).logits, **F32)
        torch.testing.assert_close(model(ids, positions=position_ids), llama(ids, position_ids=position_ids).logits,
                                   **F32)


def test_default_config_is_plain_multi_head_attention():
    cfg = GPTConfig()
    assert cfg.n_kv_heads is None and cfg.kv_heads == cfg.n_heads and cfg.rope_layout == "half"
    model = TinyGPT(cfg)
    attn = model.blocks[0].attn
    assert attn.n_kv_heads == attn.n_heads == 4 and attn.k_proj.weight.shape == (32, 32)
    # V C (tied embedding) + L (4 C^2 attention + 3 C d_ff SwiGLU + 2 C norms) + C final norm
    assert model.num_parameters() == 64 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 88 + 2 * 32) + 32


def test_attention_maps_are_the_weights_that_transformers_llama_computes():
    """Oracle: LlamaForCausalLM(output_attentions=True, eager attention) with the same weights.

    Tolerance 1e-6: both run in float64, but Llama forms its RoPE tables from float32 frequencies.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, attn_implementation="eager")
    llama = LlamaForCausalLM(cfg).double().eval()
    ours = TinyGPT.from_llama(llama).double()
    ids = torch.randint(0, 40, (2, 9))
    maps = ours.attention_maps(ids)
    with torch.no_grad():
        ref = llama(ids, output_attentions=True).attentions
    assert maps.shape == (2, 2, 4, 9, 9)
    for l in range(2):
        torch.testing.assert_close(maps[l], ref[l], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="ids must have shape"):
        ours.attention_maps(torch.tensor([1, 2]))


def test_leading_axes_are_flattened_and_restored():
    """Issue 28: attention, blocks and TinyGPT take (..., T, C) / (..., T); each sequence as if it were alone."""
    from llmbook.lm.attention import MultiHeadAttention

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2)).double().eval()
    ids = torch.randint(0, 11, (2, 3, 6))
    logits = model(ids)
    assert logits.shape == (2, 3, 6, 11)
    alone = torch.stack([torch.stack([model(ids[a, b][None])[0] for b in range(3)]) for a in range(2)])
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(model(ids[1, 2]), alone[1, 2], rtol=0, atol=1e-12)  # (T,) -> (T, V)
    positions = torch.arange(6).expand(2, 3, 6) + torch.arange(3)[None, :, None]  # one row of positions each
    torch.testing.assert_close(model(ids, positions)[0, 2], model(ids[0, 2][None], positions[0, 2][None])[0],
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="positions must have shape"):
        model(ids, torch.arange(6).expand(3, 6))
    mha = MultiHeadAttention(16, 4).double()
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    y = mha(x, is_causal=True)
    torch.testing.assert_close(y[1, 0], mha(x[1, 0][None], is_causal=True)[0], rtol=0, atol=1e-12)
    assert mha(x[0, 0], is_causal=True).shape == (5, 16)
    assert mha.attention_weights(x, is_causal=True).shape == (2, 3, 4, 5, 5)
    with pytest.raises(ValueError, match="leading axes of x"):
        mha(x, context=torch.randn(3, 7, 16, dtype=torch.float64))
    block = model.blocks[0]
    torch.testing.assert_close(block(x.new_ones(2, 3, 5, 16), is_causal=True)[1, 1],
                               block(x.new_ones(1, 5, 16), is_causal=True)[0], rtol=0, atol=1e-12)
