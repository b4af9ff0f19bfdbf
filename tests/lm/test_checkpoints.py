"""Loading a plain state dict through a key map: the copy is exact, and every mismatch is named.

Oracle: the tensors themselves (``torch.equal`` after loading) and ``nn.Module.state_dict``.
"""

import pytest
import torch
from torch import nn

from llmbook.lm.checkpoints import llama_key_map, load_mapped_state_dict, meta_llama_key_map
from llmbook.lm.gpt import GPTConfig, TinyGPT


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_values_are_copied_transformed_and_tied():
    model = Tied()
    E = torch.randn(5, 3)
    load_mapped_state_dict(model, {"wte": E}, {"emb.weight": "wte"})
    assert torch.equal(model.emb.weight, E) and model.head.weight is model.emb.weight
    load_mapped_state_dict(model, {"wte": E, "lm": E.clone()}, {"emb.weight": "wte", "head.weight": "lm"},
                           transform={"emb.weight": lambda t: 2 * t, "head.weight": lambda t: 2 * t})
    assert torch.equal(model.emb.weight, 2 * E)


def test_every_mismatch_is_named():
    model = nn.Linear(3, 2)
    state = {"w": torch.randn(2, 3), "b": torch.randn(2)}
    good = {"weight": "w", "bias": "b"}
    with pytest.raises(ValueError, match=r"lacks 1 keys the key map reads: 'b \(for bias\)'"):
        load_mapped_state_dict(model, {"w": state["w"]}, good)
    with pytest.raises(ValueError, match=r"1 keys with no place in this model: 'extra'"):
        load_mapped_state_dict(model, {**state, "extra": torch.ones(1)}, good)
    load_mapped_state_dict(model, {**state, "rotary.inv_freq": torch.ones(1)}, good, ignore=["*.inv_freq"])
    with pytest.raises(ValueError, match=r"wrong shape .*: w \(3, 2\) -> weight needs \(2, 3\)"):
        load_mapped_state_dict(model, {**state, "w": state["w"].T}, good)
    with pytest.raises(ValueError, match=r"leaves 1 of the model's tensors unmapped: 'bias'"):
        load_mapped_state_dict(model, {"w": state["w"]}, {"weight": "w"})
    with pytest.raises(ValueError, match=r"names 1 keys this model does not have: 'weights'"):
        load_mapped_state_dict(model, state, {"weights": "w", "bias": "b"})
    with pytest.raises(TypeError, match=r"state\['b'\] must be a Tensor, got list"):
        load_mapped_state_dict(model, {**state, "b": [0.0, 0.0]}, good)
    with pytest.raises(TypeError, match="state must be a mapping"):
        load_mapped_state_dict(model, [state], good)
    with pytest.raises(ValueError, match="head.weight and emb.weight are one tied tensor .* lm and wte differ"):
        load_mapped_state_dict(Tied(), {"wte": torch.ones(5, 3), "lm": torch.zeros(5, 3)},
                               {"emb.weight": "wte", "head.weight": "lm"})


@pytest.mark.parametrize("tie", [True, False])
def test_key_maps_cover_every_tinygpt_tensor(tie):
    names = set(TinyGPT(GPTConfig(tie_embeddings=tie, n_layers=3)).state_dict())
    for key_map in (llama_key_map(3, tie), meta_llama_key_map(3, tie)):
        assert set(key_map) == (names - {"head.weight"} if tie else names)
        assert len(set(key_map.values())) == len(key_map)  # one source per tensor
