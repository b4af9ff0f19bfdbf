"""Tests of llmbook.lm.assistant_recipe: a miniature of the whole recipe, run twice (byte-identical logs), reloaded; the
length-sorted chunks against one padded batch."""

import torch

from llmbook.agents import assistant_tasks as AT
from llmbook.lm.assistant import encode_transcript, load_assistant, pad_right
from llmbook.lm.assistant_recipe import RecipeConfig, _length_chunks, _token_logps, read_assistant_log, run_recipe
from llmbook.lm.rlhf import grpo_objective, sft_loss
from tests.lm.test_assistant import tiny_assistant_model


def test_recipe_miniature_is_reproducible(tmp_path):
    cfg = dict(n_merges=40, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=512, world_docs=20,
               pretrain_steps=4, sft_examples=40, sft_steps=4, dpo_prompts=8, dpo_steps=2, grpo_iterations=1,
               grpo_prompts=2, grpo_G=2, heldout=3, episode_tokens=8)
    run_recipe(RecipeConfig(**cfg), tmp_path / "a", progress=lambda s: None)
    run_recipe(RecipeConfig(**cfg), tmp_path / "b", progress=lambda s: None)
    assert (tmp_path / "a" / "assistant_log.json").read_bytes() == (tmp_path / "b" / "assistant_log.json").read_bytes()
    log = read_assistant_log(tmp_path / "a" / "assistant_log.json")
    assert list(log["stages"]) == ["tokenizer", "pretrain", "sft", "dpo", "grpo"]
    assert all(len(log["stages"][s]["heldout"]["reward"]) == 3 for s in ("pretrain", "sft", "dpo", "grpo"))
    a = load_assistant(tmp_path / "a" / "assistant.pt")
    assert a.tok.V == 256 + 40 + len(AT.SPECIALS) and a.model.config.d_model == 32


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_length_chunks_give_the_whole_batch_gradient():
    # the recipe's chunked SFT and GRPO steps against one padded batch (the textbook step), in float64
    texts = [AT.render(t, AT.demonstration(t, react=i % 2 == 0)) for i, t in enumerate(AT.make_tasks(40, seed=5))]
    model, tok = tiny_assistant_model(texts, max_seq_len=512)
    rows = [encode_transcript(tok, t) for t in texts[:12]]
    assert len({len(r[0]) for r in rows}) > 3  # lengths vary, so chunks pad less than the batch
    chunks = _length_chunks(tok, rows, 5)
    assert sorted(i for idx, _, _ in chunks for i in idx) == list(range(12))
    assert [len(idx) for idx, _, _ in chunks] == [5, 5, 2]
    assert sum(ids.numel() for _, ids, _ in chunks) < 12 * max(len(r[0]) for r in rows)
    ids, keep = pad_right([r[0] for r in rows], tok.special_tokens["<|pad|>"], [r[1] for r in rows])

    def labels_of(ids, keep):
        return torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))

    model.zero_grad()
    whole = sft_loss(model(ids[:, :-1]), labels_of(ids, keep))
    whole.backward()
    g_whole = _grads(model)
    model.zero_grad()
    parts = 0.0
    for _, c_ids, c_keep in chunks:
        part = sft_loss(model(c_ids[:, :-1]), labels_of(c_ids, c_keep), reduction="sum") / len(rows)
        part.backward()
        parts += part.item()
    assert abs(parts - whole.item()) < 1e-10 * abs(whole.item())
    for a, b in zip(_grads(model), g_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    # GRPO: a mean over responses of per-response token means, with the old and reference log-probabilities
    A = torch.linspace(-1.5, 1.5, len(rows), dtype=torch.float64)
    with torch.no_grad():
        old, mask = _token_logps(model, ids, keep)
    ref = old - 0.05 * torch.arange(old.shape[1], dtype=torch.float64) / old.shape[1]
    model.zero_grad()
    logp, _ = _token_logps(model, ids, keep)
    (-grpo_objective(logp, old, ref, A, mask=mask)).backward()
    g_whole = _grads(model)
    model.zero_grad()
    for idx, c_ids, c_keep in chunks:
        with torch.no_grad():
            c_old, c_mask = _token_logps(model, c_ids, c_keep)
        c_ref = c_old - 0.05 * torch.arange(c_old.shape[1], dtype=torch.float64) / old.shape[1]
        c_logp, _ = _token_logps(model, c_ids, c_keep)
        (-grpo_objective(c_logp, c_old, c_ref, A[idx], mask=c_mask) * len(idx) / len(rows)).backward()
    for a, b in zip(_grads(model), g_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
