"""Chapter 4, a RoPE model run past its training length (``llmbook.lm.long_context``).

Oracles: ``transformers.LlamaForCausalLM`` with the same weights and ``rope_parameters`` of type ``linear``
(PI), ``dynamic`` (dynamic NTK) and ``yarn`` (its rotary embedding multiplies cos and sin by the attention
factor, as ours does), logits at ``1e-5``; the model's own ``forward`` (``none``; PI through fractional
positions m / s) and a copy of the model with the NTK base b alpha^(D/(D-2)) (static NTK); log-softmax
gathered by hand for the losses; numpy for the band means.
"""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from llmbook.lm.gpt import TinyGPT
from llmbook.lm.long_context import band_means, scaled_rope_logits, token_losses

F32 = dict(rtol=1e-5, atol=1e-5)
L_TRAIN, T = 8, 24  # a model "trained" on 8 positions, read on 24 (factor 3)


def llama(rope_parameters=None, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=88, max_position_embeddings=L_TRAIN, tie_word_embeddings=True,
        attn_implementation="eager",
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if p.ndim == 1 else 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def pair():
    base = llama()
    return base, TinyGPT.from_llama(base).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 40, (3, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method, params", [
    ("pi", {"rope_type": "linear", "factor": 3.0}),
    ("dynamic", {"rope_type": "dynamic", "factor": 3.0}),
    ("yarn", {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": L_TRAIN}),
])
def test_matches_transformers_scaled_llama(pair, ids, method, params):
    base, ours = pair
    ref_model = llama({"rope_theta": 10000.0, **params})
    ref_model.load_state_dict(base.state_dict(), strict=False)  # the same weights; inv_freq stays as configured
    with torch.no_grad():
        ref = ref_model(ids).logits
    torch.testing.assert_close(scaled_rope_logits(ours, ids, method, 3.0, L_TRAIN), ref, **F32)
    # the oracle is sensitive: the unscaled model differs by far more than the tolerance
    assert (scaled_rope_logits(ours, ids) - ref).abs().max() > 1e-2


def test_none_pi_ntk_through_the_model_itself(pair, ids):
    _, ours = pair
    with torch.no_grad():
        torch.testing.assert_close(scaled_rope_logits(ours, ids), ours(ids), rtol=0, atol=0)
        pi_ref = ours(ids, positions=torch.arange(T, dtype=torch.float32) / 3.0)
        torch.testing.assert_close(scaled_rope_logits(ours, ids, "pi", 3.0, L_TRAIN), pi_ref, **F32)
        cfg, D = ours.config, ours.config.head_dim
        ntk = TinyGPT(dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 3.0 ** (D / (D - 2)))).eval()
        ntk.load_state_dict(ours.state_dict())
        torch.testing.assert_close(scaled_rope_logits(ours, ids, "ntk", 3.0, L_TRAIN), ntk(ids), **F32)


def test_token_losses_and_band_means(pair, ids):
    _, ours = pair
    got = token_losses(ours, ids, "yarn", 2.0, L_TRAIN)
    logp = torch.log_softmax(scaled_rope_logits(ours, ids[:, :-1], "yarn", 2.0, L_TRAIN).double(), -1)
    ref = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(got.double(), ref, **F32)
    x = np.arange(24.0).reshape(2, 12) ** 2
    np.testing.assert_allclose(band_means(torch.from_numpy(x), [0, 4, 12]).numpy(),
                               np.stack([x[:, :4].mean(1), x[:, 4:].mean(1)], 1), rtol=1e-12)


def test_bad_input(pair, ids):
    _, ours = pair
    with pytest.raises(TypeError, match="TinyGPT"):
        scaled_rope_logits(torch.nn.Linear(2, 2), ids)
    with pytest.raises(ValueError, match="method"):
        scaled_rope_logits(ours, ids, "rope2x")
    with pytest.raises(ValueError, match="factor"):
        scaled_rope_logits(ours, ids, "pi", 0.5)
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        scaled_rope_logits(ours, ids[0])
    with pytest.raises(ValueError, match=r"\(B, T \+ 1\)"):
        token_losses(ours, ids[:, :1])
    with pytest.raises(ValueError, match="edges"):
        band_means(torch.ones(2, 5), [0, 3, 3])
    with pytest.raises(ValueError, match="edges"):
        band_means(torch.ones(2, 5), [0, 6])
