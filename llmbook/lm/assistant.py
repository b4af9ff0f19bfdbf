r"""The book's assistant: a :class:`~llmbook.lm.gpt.TinyGPT` with a byte-level BPE tokenizer that follows instructions.

``python -m llmbook train --recipe assistant`` (:mod:`llmbook.lm.assistant_recipe`) trains it with the book's
own code (chapter 15's BPE, chapter 8's AdamW, schedule and clipping, chapter 10's SFT, DPO and GRPO) on the
program-generated tasks of :mod:`llmbook.agents.assistant_tasks`, and commits its weights and log.
:func:`load_assistant` returns it as an :class:`Assistant`, which implements the
:class:`~llmbook.agents.generation.Generator` protocol: batched generation with a KV cache over left-padded
prompts, stop strings, temperature and seed, per-token log-probabilities, and ``score`` for
:math:`\log p(y \mid x)`.

Transcripts are rendered by :func:`llmbook.agents.assistant_tasks.render`; :func:`encode_transcript` turns one
into token ids with the mask of the tokens the assistant wrote (the SFT labels, the policy's tokens in RL).
Registers no equation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from llmbook.agents.generation import Completion, check_request, continuation_log_prob, sample_loop
from llmbook.lm.bpe import BPETokenizer
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.kv_cache import KVCache, forward_cached
from llmbook.lm.training import _data_dir

__all__ = ["WEIGHTS", "Assistant", "encode_transcript", "load_assistant", "pad_right", "save_assistant"]

WEIGHTS = "assistant.pt"  # in llmbook/data, with assistant_log.json


def encode_transcript(tok: BPETokenizer, text: str) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered transcript and, per token, whether the assistant wrote it.

    A token is the assistant's when it lies inside an assistant turn: after an ``<|assistant|>`` token, up to
    and including the ``<|end|>`` that closes the turn (so the model learns to stop).
    """
    ids = tok.encode(text)
    start, end = tok.special_tokens["<|assistant|>"], tok.special_tokens["<|end|>"]
    mine, inside = [], False
    for t in ids:
        mine.append(inside)
        if t == start:
            inside = True
        elif t == end:
            inside = False
    return ids, mine


def pad_right(rows: Sequence[Sequence[int]], pad: int, masks: Sequence[Sequence[bool]] | None = None
              ) -> tuple[Tensor, Tensor]:
    """Right-pad token rows to one ``(B, T)`` tensor; the second tensor marks the counted tokens.

    The marks are ``masks`` where given (e.g. the assistant's tokens), else every real token. Right padding
    needs no attention mask under causal attention: a real token never sees the padding after it.
    """
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    keep = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(list(r), dtype=torch.long)
        keep[b, :len(r)] = torch.tensor(list(masks[b]) if masks is not None else [True] * len(r))
    return ids, keep


class Assistant:
    """The book's assistant as a :class:`~llmbook.agents.generation.Generator`: ``model`` and its ``tok``."""

    def __init__(self, model: TinyGPT, tok: BPETokenizer):
        self.model, self.tok = model, tok
        self.pad_id = tok.special_tokens["<|pad|>"]
        self.context_window = model.config.max_seq_len

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_new_tokens: int = 64, stop: Sequence[str] = ("<|end|>",),
                 temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        """Continue each prompt; stop strings that are special tokens stop on the token itself."""
        prompts, max_new_tokens, stop, temperature = check_request(prompts, max_new_tokens, stop, temperature)
        if not prompts:
            return []
        step = self.stepper(prompts, max_new_tokens)
        was_training = self.model.training
        self.model.eval()
        special = {s: self.tok.special_tokens[s] for s in stop if s in self.tok.special_tokens}
        try:
            return sample_loop(step, self.tok.decode, len(prompts), max_new_tokens,
                               [s for s in stop if s not in special], temperature, seed,
                               stop_ids=tuple(special.values()))
        finally:
            self.model.train(was_training)

    def stepper(self, prompts: Sequence[str], max_new_tokens: int):
        """The incremental decoder behind ``generate``, for decoders that choose each token themselves.

        ``step(None)`` gives the prompts' next-token logits ``(B, V)``; ``step(tokens)`` feeds one token per row
        and gives the next logits (a KV cache over left-padded rows).
        """
        model, S_max = self.model, self.model.config.max_seq_len
        rows = [self.tok.encode(p) for p in prompts]
        if any(len(r) == 0 for r in rows):
            raise ValueError("every prompt must encode to at least one token")
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens > S_max:
            raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model's max_seq_len = {S_max}; shorten the context")
        B = len(rows)
        ids = torch.tensor([[self.pad_id] * (longest - len(r)) + r for r in rows])
        valid = torch.tensor([[False] * (longest - len(r)) + [True] * len(r) for r in rows])
        state = {"pos": (valid.long().cumsum(1) - 1).clamp(min=0), "mask": valid}
        cache = KVCache.for_model(model, B, longest + max(max_new_tokens, 1))

        @torch.no_grad()
        def step(tokens):
            if tokens is None:
                z = forward_cached(model, ids, cache, positions=state["pos"], key_mask=state["mask"])
            else:
                state["pos"] = state["pos"][:, -1:] + 1
                state["mask"] = torch.cat([state["mask"], torch.ones(B, 1, dtype=torch.bool)], 1)
                z = forward_cached(model, tokens[:, None], cache, positions=state["pos"], key_mask=state["mask"])
            return z[:, -1]

        return step

    @torch.no_grad()
    def token_log_probs(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[Tensor]:
        r"""Per-token :math:`\log p(y_t \mid x, y_{<t})` of each continuation after its prompt (float64), batched.

        One forward pass over the right-padded rows ``x + y`` (causal attention: a row never sees its padding).
        """
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        xs = [self.tok.encode(x) for x in prompts]
        ys = [self.tok.encode(y) for y in continuations]
        if any(not x or not y for x, y in zip(xs, ys, strict=True)):
            raise ValueError("every prompt and continuation must encode to at least one token")
        if not xs:
            return []
        longest = max(len(x) + len(y) for x, y in zip(xs, ys, strict=True))
        if longest > self.model.config.max_seq_len:
            raise ValueError(f"a prompt plus its continuation has {longest} tokens, more than the model's "
                             f"max_seq_len = {self.model.config.max_seq_len}")
        ids, _ = pad_right([x + y for x, y in zip(xs, ys, strict=True)], self.pad_id)
        logp = torch.log_softmax(self.model(ids).double(), -1)
        return [logp[b, len(x) - 1:len(x) + len(y) - 1].gather(-1, torch.tensor(y)[:, None])[:, 0]
                for b, (x, y) in enumerate(zip(xs, ys, strict=True))]

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` (the agent loop's context budget)."""
        return len(self.tok.encode(text))

    @torch.no_grad()
    def score(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[float]:
        r""":math:`\log p(y \mid x)` of each continuation after its prompt, summed over the continuation's tokens."""
        return [continuation_log_prob(self.model, self.tok.encode(x), self.tok.encode(y))
                for x, y in zip(prompts, continuations, strict=True)]


def save_assistant(model: TinyGPT, tok: BPETokenizer, path) -> Path:
    """Write ``model`` and its tokenizer in the format :func:`load_assistant` reads; returns the path.

    The file holds the model's config, its state dict, the BPE merges and the special tokens in their order (no
    optimiser state). The recipe writes the assistant with it, and the benchmarks their fine-tuned copies.
    """
    path = Path(path)
    torch.save({"config": asdict(model.config), "merges": tok.merges, "special_tokens": list(tok.special_tokens),
                "model": model.state_dict()}, path)
    return path


def load_assistant(path=None, dtype: torch.dtype = torch.float64) -> Assistant:
    """The committed assistant (``llmbook/data/assistant.pt``), in eval mode, as an :class:`Assistant`.

    ``dtype`` defaults to float64, so that a greedy choice does not flip on a CPU's last bits and the chapters'
    stored outputs reproduce on any machine; pass ``torch.float32`` for speed.
    """
    ckpt = torch.load(Path(path) if path is not None else _data_dir() / WEIGHTS, weights_only=True)
    tok = BPETokenizer([tuple(m) for m in ckpt["merges"]], ckpt["special_tokens"])
    model = TinyGPT(GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    return Assistant(model.to(dtype).eval(), tok)
