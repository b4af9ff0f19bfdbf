"""Tests of llmbook.lm.assistant and its recipe: batched cached generation against TinyGPT.generate, the masks,
and a miniature of the recipe run twice (byte-identical logs) and reloaded."""

import pytest
import torch

from llmbook.agents import assistant_tasks as AT
from llmbook.lm.assistant import Assistant, encode_transcript, load_assistant, pad_right, save_assistant
from llmbook.lm.bpe import train_bpe
from llmbook.lm.gpt import GPTConfig, TinyGPT


def tiny_assistant_model(texts, max_seq_len: int = 256):
    """A float64 two-layer TinyGPT and a 60-merge BPE trained on ``texts`` (transcripts): ``(model, tok)``."""
    tok = train_bpe("\n".join(texts), 60, AT.SPECIALS)
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=tok.V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=max_seq_len))
    return model.double(), tok


def check_trains_a_copy(train, assistant, examples, **kw):
    """Run ``train(assistant, examples, **kw)``; assert that it leaves ``assistant`` untouched and halves the loss.

    Shared by the tests of the fine-tuned copies (rater, writer, summariser). Returns ``(copy, losses)``.
    """
    before = {k: v.clone() for k, v in assistant.model.state_dict().items()}
    copy, losses = train(assistant, examples, **kw)
    assert all(torch.equal(before[k], v) for k, v in assistant.model.state_dict().items())
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    return copy, losses


@pytest.fixture(scope="module")
def small():
    model, tok = tiny_assistant_model([AT.render(t, AT.demonstration(t)) for t in AT.make_tasks(60, seed=1)])
    return Assistant(model.eval(), tok), tok


def test_batched_generation_matches_uncached_generate(small):
    a, tok = small
    prompts = [AT.render(t) + "<|assistant|>" for t in AT.make_tasks(3, seed=4)] + ["<|user|>hi"]
    outs = a.generate(prompts, max_new_tokens=8, stop=())
    for p, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([tok.encode(p)])
        ref = a.model.generate(ids, 8, tau=0)[0, ids.shape[1]:]
        assert out.text == tok.decode(ref.tolist()) and out.finish_reason == "length"
        with torch.no_grad():
            full = a.model(torch.cat([ids[0], ref])[None])[0, ids.shape[1] - 1:-1].log_softmax(-1)
        expect = full.gather(-1, ref[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expect, atol=1e-10, rtol=0)
        y = tok.decode(ref.tolist())
        if tok.encode(y) == ref.tolist():  # score re-encodes the text; a random model's tokens may re-segment
            assert a.score([p], [y])[0] == pytest.approx(float(expect.sum()), abs=1e-8)


def test_special_token_stop(small):
    a, tok = small
    end = tok.special_tokens["<|end|>"]
    with torch.no_grad():  # make <|end|> the model's favourite token: every row stops at once
        bias = torch.zeros(tok.V, dtype=torch.float64)
        bias[end] = 1e3
        old = a.model.head.forward
        a.model.head.forward = lambda h: old(h) + bias
        try:
            outs = a.generate(["<|user|>a", "<|user|>b c"], max_new_tokens=5)
        finally:
            del a.model.head.forward
    assert [(o.text, o.finish_reason, len(o.logprobs)) for o in outs] == [("", "stop", 1)] * 2


def test_transcript_mask_and_padding(small):
    _, tok = small
    t = AT.make_tasks(1, seed=2, kinds=("calc",))[0]
    ids, mine = encode_transcript(tok, AT.render(t, AT.demonstration(t)))
    text_mine = tok.decode([i for i, m in zip(ids, mine, strict=True) if m])
    assert text_mine == "".join(b + "<|end|>" for r, b in AT.demonstration(t) if r == "assistant")
    x, keep = pad_right([[1, 2, 3], [4]], 0, [[False, True, True], [True]])
    assert x.tolist() == [[1, 2, 3], [4, 0, 0]] and keep.tolist() == [[False, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="max_seq_len"):
        Assistant(small[0].model, tok).generate(["<|user|>" + "word " * 300], max_new_tokens=4)


def test_committed_assistant_loads():
    a = load_assistant()
    assert a.model.num_parameters() * 4 < 20e6 and next(a.model.parameters()).dtype == torch.float64


def test_token_log_probs_batched_match_one_row_scores(small):
    """The right-padded batch against score's one-sequence forward pass per row (float64, 1e-10)."""
    a, tok = small
    prompts = [AT.render(t) + "<|assistant|>" for t in AT.make_tasks(3, seed=5)] + ["<|user|>hi"]
    conts = ["Act: answer 12<|end|>", " Tarsk", "Thought: x\nAct: calc 1 + 2", " a b c d e f"]
    lps = a.token_log_probs(prompts, conts)
    assert [len(lp) for lp in lps] == [len(tok.encode(c)) for c in conts]
    for lp, s in zip(lps, a.score(prompts, conts), strict=True):
        assert float(lp.sum()) == pytest.approx(s, abs=1e-10)
    with pytest.raises(ValueError, match="prompts but"):
        a.token_log_probs(["a"], [])
    with pytest.raises(ValueError, match="max_seq_len"):
        a.token_log_probs(["<|user|>" * 254], [" a b c"])


def test_save_assistant_round_trips_through_load_assistant(small, tmp_path):
    a, tok = small
    path = save_assistant(a.model, tok, tmp_path / "copy.pt")
    b = load_assistant(path, dtype=torch.float64)
    assert b.tok.merges == tok.merges and list(b.tok.special_tokens) == list(tok.special_tokens)
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    prompts = [AT.render(t) + "<|assistant|>" for t in AT.make_tasks(2, seed=8)]
    same = [c.text for c in b.generate(prompts, max_new_tokens=6)]
    assert [c.text for c in a.generate(prompts, max_new_tokens=6)] == same
