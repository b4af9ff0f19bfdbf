"""Tests of llmbook.lm.training: batches, checkpoints, the loop against the committed log, the pretrained model.

Oracles: numpy slicing of the token array (batches), a float64 ``F.cross_entropy`` over hand-cut windows
(evaluation), torch's own ``torch.load(weights_only=True)`` and a continued optimiser step (checkpoints),
the committed training log (retraining), ``numpy.bincount`` unigram statistics (the model beats them).
"""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmbook.cli import main as cli_main
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.optim import AdamW
from llmbook.lm.training import (
    TINY_GPT,
    CharTokenizer,
    TrainConfig,
    corpus_tokens,
    evaluate_loss,
    generate_text,
    get_batch,
    load_checkpoint,
    model_from_checkpoint,
    pretrained_tiny,
    read_log,
    save_checkpoint,
    train,
)


@pytest.fixture(scope="module")
def corpus():
    return corpus_tokens()


@pytest.fixture(scope="module")
def log():
    return read_log()


# ---------------------------------------------------------------------------------------------- data


def test_tokenizer_round_trip_and_errors(corpus):
    tok, train_ids, heldout_ids = corpus
    from llmbook.data import corpus as corpus_text

    text = corpus_text()
    assert tok.chars == "".join(sorted(set(text))) and tok.vocab_size == len(set(text)) == 100
    assert tok.decode(np.concatenate([train_ids, heldout_ids])) == text  # the split loses nothing
    assert len(heldout_ids) == round(0.1 * len(text))
    assert [tok.chars[i] for i in tok.encode("def f():")] == list("def f():")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("\u00e9")
    with pytest.raises(ValueError, match=r"\[0, V\)"):
        tok.decode([100])
    with pytest.raises(ValueError, match="repeat"):
        CharTokenizer("aa")


def test_get_batch_on_a_memmap_gives_contiguous_shifted_windows(tmp_path):
    N, B, T = 50, 4000, 3
    data = np.memmap(tmp_path / "tokens.bin", dtype=np.uint16, mode="w+", shape=(N,))
    data[:] = (np.arange(N) * 7919) % 1000  # distinct ids: each window identifies its start
    data.flush()
    data = np.memmap(tmp_path / "tokens.bin", dtype=np.uint16, mode="r", shape=(N,))
    x, y = get_batch(data, B, T, torch.Generator().manual_seed(0))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
    starts = [int(np.flatnonzero(np.asarray(data) == row[0])[0]) for row in x.tolist()]
    for s, xb, yb in zip(starts, x.tolist(), y.tolist(), strict=True):
        assert xb == data[s:s + T].tolist() and yb == data[s + 1:s + T + 1].tolist()  # oracle: numpy slicing
    counts = np.bincount(starts, minlength=N)
    assert counts[:N - T].min() > 0 and counts[N - T:].sum() == 0  # every start that fits, and no other
    expected = B / (N - T)  # uniform: ~85 per start; 5 standard deviations of a binomial count
    assert np.abs(counts[:N - T] - expected).max() < 5 * math.sqrt(expected)


def test_get_batch_is_seeded_and_checks_its_input():
    data = np.arange(100, dtype=np.int64)
    a = get_batch(data, 3, 5, torch.Generator().manual_seed(1))
    b = get_batch(torch.as_tensor(data), 3, 5, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="fewer than"):
        get_batch(data[:5], 1, 5)
    with pytest.raises(TypeError, match="1-D integer"):
        get_batch(data.reshape(10, 10), 1, 5)
    with pytest.raises(TypeError, match="1-D integer"):
        get_batch(data.astype(np.float32), 1, 5)
    with pytest.raises(ValueError, match="B must be a positive int"):
        get_batch(data, 0, 5)


def test_evaluate_loss_matches_float64_cross_entropy_over_hand_cut_windows():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=11)).eval()
    data = np.random.default_rng(0).integers(0, 11, size=47)
    T = 8  # (47 - 1) // 8 = 5 windows, the last 6 tokens unused
    windows = [torch.as_tensor(data[i * T:i * T + T + 1]) for i in range(5)]
    x, y = torch.stack([w[:-1] for w in windows]), torch.stack([w[1:] for w in windows])
    with torch.no_grad():
        want = F.cross_entropy(model(x).double().reshape(-1, 11), y.reshape(-1)).item()
    for B in (1, 2, 64):  # the batching of the windows does not change the number (tolerance: float32 logits)
        assert evaluate_loss(model, data, T, B) == pytest.approx(want, rel=1e-6)


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_resumes_training_exactly(tmp_path):
    cfg = GPTConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    x = torch.randint(0, 16, (2, 6))

    def step(model, opt):
        loss = F.cross_entropy(model(x).transpose(1, 2), x)
        opt.zero_grad()
        loss.backward()
        opt.step()

    model = TinyGPT(cfg)
    opt = AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, opt)
    path = save_checkpoint(tmp_path / "ck.pt", model, opt, 2, {"model": cfg, "note": "x", "sizes": (1, 2)})
    raw = torch.load(path, weights_only=True)  # oracle: torch's safe loader reads it as it is
    assert raw["iteration"] == 2 and raw["config"]["model"] == dataclasses.asdict(cfg)
    assert raw["config"]["sizes"] == [1, 2]
    ckpt = load_checkpoint(path)
    model2 = model_from_checkpoint(ckpt)
    opt2 = AdamW(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(ckpt["optimizer"])
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    step(model, opt)  # one more step from the original and from the restored copy: bitwise the same
    step(model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert save_checkpoint(tmp_path / "release.pt", model, None, 3, {})  # no optimiser state
    assert load_checkpoint(tmp_path / "release.pt")["optimizer"] is None
    with pytest.raises(TypeError, match="plain data"):
        save_checkpoint(tmp_path / "bad.pt", model, None, 0, {"f": object()})
    with pytest.raises(ValueError, match="iteration"):
        save_checkpoint(tmp_path / "bad.pt", model, None, -1, {})



def test_checkpoint_to_a_file_object_and_a_str_path_without_config(tmp_path):
    import io

    model = TinyGPT(GPTConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, d_ff=16, max_seq_len=8))
    opt = AdamW(model.parameters(), lr=1e-2)
    buf = io.BytesIO()
    assert save_checkpoint(buf, model, opt, 5) is buf  # config is optional
    raw = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)  # oracle: torch's own loader
    assert raw["config"] is None and raw["iteration"] == 5
    buf.seek(0)
    ckpt = load_checkpoint(buf)
    assert all(torch.equal(ckpt["model"][k], v) for k, v in model.state_dict().items())
    with open(tmp_path / "f.pt", "wb") as f:  # an open file
        save_checkpoint(f, model, None, 1)
    with open(tmp_path / "f.pt", "rb") as f:
        assert load_checkpoint(f)["iteration"] == 1
    save_checkpoint(str(tmp_path / "s.pt"), model, None, 2)  # a str path
    assert load_checkpoint(str(tmp_path / "s.pt"))["iteration"] == 2


# ---------------------------------------------------------------------------------------------- the committed run


def test_committed_log_is_the_code_default(log):
    model_config, config = TINY_GPT
    assert log["config"]["model"] == dataclasses.asdict(model_config)
    assert TrainConfig(**log["config"]["train"]) == config
    assert len(log["train"]["loss"]) == config.steps
    assert log["eval"]["iteration"][-1] == config.steps and log["heldout_loss"] == log["eval"]["heldout_loss"][-1]


def test_retraining_the_first_steps_reproduces_the_committed_log(corpus, log):
    """The loop replays the log: learning rates exactly (pure Python), losses and norms to 1e-6.

    On the machine that wrote the log the losses agree bitwise (seeded generators, one thread); another
    CPU may pick other BLAS kernels whose float32 rounding differs in the last bits, hence 1e-6.
    """
    tok, train_ids, heldout_ids = corpus
    model_config = GPTConfig(**log["config"]["model"])
    config = TrainConfig(**log["config"]["train"])
    n = 5
    _, _, replay = train(model_config, config, train_ids, heldout_ids, stop_after=n, evaluate=False)
    assert replay["train"]["iteration"] == list(range(n))
    assert replay["train"]["lr"] == log["train"]["lr"][:n]
    np.testing.assert_allclose(replay["train"]["loss"], log["train"]["loss"][:n], rtol=0, atol=1e-6)
    np.testing.assert_allclose(replay["train"]["grad_norm"], log["train"]["grad_norm"][:n], rtol=1e-6, atol=0)
    assert replay["eval"]["iteration"] == []  # evaluate=False: the replay skips the held-out evaluations


def test_pretrained_model_reaches_the_logged_loss_and_beats_unigram_statistics(corpus, log):
    tok, train_ids, heldout_ids = corpus
    model, tok2 = pretrained_tiny()
    assert tok2.chars == tok.chars and not model.training
    loss = evaluate_loss(model, heldout_ids, TINY_GPT[1].T)
    assert loss == pytest.approx(log["heldout_loss"], abs=1e-5)
    # oracle: the held-out cross-entropy of add-one unigram frequencies of the training split, with numpy
    counts = np.bincount(train_ids, minlength=tok.vocab_size) + 1.0
    unigram = -np.log(counts / counts.sum())[heldout_ids].mean()
    assert log["baselines"]["ngram_1"] == pytest.approx(unigram, abs=0.05)
    assert loss < unigram - 1.5  # about 3.4 nats for unigram statistics
    assert loss < log["baselines"]["ngram_5"]  # and below an interpolated 5-gram model


def test_generate_text_is_seeded_and_reads_like_the_corpus():
    model, tok = pretrained_tiny()
    a = generate_text(model, tok, "The ", max_new_tokens=30, seed=3)
    assert a == generate_text(model, tok, "The ", max_new_tokens=30, seed=3) and len(a) == 30
    greedy = generate_text(model, tok, "the ", max_new_tokens=60, tau=0)
    words = [w.strip(".,:;()\"'") for w in greedy.split()]
    assert sum(w.isalpha() for w in words) >= len(words) // 2  # mostly letters-and-spaces words, not noise
    with pytest.raises(ValueError, match="non-empty"):
        generate_text(model, tok, "")


def test_cli_train_writes_a_loadable_checkpoint_and_log(tmp_path, capsys, monkeypatch):
    import llmbook.lm.training as training

    tiny = (GPTConfig(vocab_size=100, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16),
            TrainConfig(steps=3, T_warm=1, B=2, T=16, eval_interval=2))
    monkeypatch.setattr(training, "TINY_GPT", tiny)
    monkeypatch.setattr(training, "_baselines", lambda *a: {"uniform": math.log(100), "ngram_1": 3.4,
                                                           "ngram_5": 1.6})
    assert cli_main(["train", "--out", str(tmp_path), "--steps", "2"]) == 0
    assert "held-out loss" in capsys.readouterr().out
    model, tok = pretrained_tiny(tmp_path / "tiny_gpt.pt")
    written = read_log(tmp_path / "tiny_gpt_log.json")
    assert written["train"]["iteration"] == [0, 1] and written["eval"]["iteration"] == [0, 2]
    assert written["config"]["train"]["steps"] == 2 and model.config == tiny[0]
