"""Tests of llmbook.agents.generation: the Hugging Face wrapper against transformers' own generate and forward."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from llmbook.agents.generation import Completion, Generator, HFGenerator, check_request, sample_loop


@pytest.fixture(scope="module")
def hf():
    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(40)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval(), tok


def test_greedy_matches_transformers_generate(hf):
    model, tok = hf
    g = HFGenerator(model, tok)
    assert isinstance(g, Generator)
    prompts = ["w1 w2 w3 w4 w5", "w7 w8"]  # different lengths: left padding must not change either row
    outs = g.generate(prompts, max_new_tokens=6)
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([tok(p)["input_ids"]])
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        new = ref[0, ids.shape[1]:].tolist()
        assert out.text == tok.decode(new) and out.finish_reason == "length"
        # log-probabilities against one full forward pass
        with torch.no_grad():
            logits = model(ref).logits[0, ids.shape[1] - 1:-1].double().log_softmax(-1)
        expect = logits.gather(-1, torch.tensor(new)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expect, atol=1e-5, rtol=0)
        assert g.score([p], [" " + tok.decode(new)])[0] == pytest.approx(float(expect.detach().sum()), abs=1e-4)


def test_stop_strings_and_seeded_sampling(hf):
    model, tok = hf
    g = HFGenerator(model, tok)
    full = g.generate(["w1 w2"], max_new_tokens=8)[0].text
    words = full.split()
    cut = g.generate(["w1 w2"], max_new_tokens=8, stop=[words[2]])[0]
    assert cut.finish_reason == "stop" and cut.text.split() == words[:2]
    a = g.generate(["w1 w2", "w3"], max_new_tokens=8, temperature=1.0, seed=3)
    b = g.generate(["w1 w2", "w3"], max_new_tokens=8, temperature=1.0, seed=3)
    c = g.generate(["w1 w2", "w3"], max_new_tokens=8, temperature=1.0, seed=4)
    assert [x.text for x in a] == [x.text for x in b] != [x.text for x in c]


def test_sample_loop_stops_rows_independently():
    V = 5
    seq = [[1, 2, 4, 3, 3], [2, 4, 1, 1, 1]]  # token 4 is the stop token

    state = {"t": 0}

    def step(tokens):
        z = torch.full((2, V), -10.0)
        for b in range(2):
            z[b, seq[b][state["t"]]] = 10.0
        state["t"] += 1
        return z

    outs = sample_loop(step, lambda ids: "".join("abcde"[i] for i in ids), 2, 5, (), 0.0, 0, stop_ids=(4,))
    assert [o.text for o in outs] == ["bc", "c"] and [len(o.logprobs) for o in outs] == [3, 2]
    assert all(isinstance(o, Completion) and o.finish_reason == "stop" for o in outs)
    assert state["t"] == 3  # the loop ended when both rows had stopped


def test_bad_requests():
    with pytest.raises(TypeError, match="sequence of strings"):
        check_request("w1", 4, (), 0.0)
    with pytest.raises(ValueError, match="stop"):
        check_request(["w1"], 4, [""], 0.0)
    with pytest.raises(ValueError, match="temperature"):
        check_request(["w1"], 4, (), -1.0)


def test_agent_loop_runs_on_a_hugging_face_model(hf):
    from llmbook.agents import assistant_tasks as AT
    from llmbook.agents.agent_loop import run_agent

    model, tok = hf
    trajs = run_agent(HFGenerator(model, tok), AT.make_tasks(2, seed=0), max_steps=2, max_new_tokens=4, window=60)
    # a random model never writes "Act:": every turn is a format error, answered and retried, within the window
    assert [(t.steps, t.format_errors, t.reward) for t in trajs] == [(2, 2, 0.0)] * 2
