"""Tests of llmbook.lm.assistant_recipe: a miniature of the whole recipe, run twice (byte-identical logs), reloaded."""

from llmbook.agents import assistant_tasks as AT
from llmbook.lm.assistant import load_assistant
from llmbook.lm.assistant_recipe import RecipeConfig, read_assistant_log, run_recipe


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
