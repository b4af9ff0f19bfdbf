r"""One generation interface for the book's loops: the :class:`Generator` protocol, and two implementations.

Chapters 10, 29 and 40 run their loops (RLHF rollouts, RAG generation, agents) through anything with

``generate(prompts, max_new_tokens, stop, temperature, seed) -> list[Completion]``

where a :class:`Completion` holds the text up to (not including) the first stop string, the log-probability of
each generated token under the model (temperature 1, whatever the sampling temperature), and why it ended.
``score(prompts, continuations)`` gives the summed log-probability of given continuations, for the chapters
that need :math:`\log p(y \mid x)` (RAG-Sequence, best-of-N).

* :class:`llmbook.lm.assistant.Assistant`, the book's own assistant, implements it;
* :class:`HFGenerator` wraps any local Hugging Face causal LM and its tokenizer, so a reader can run the same
  loops with a real instruction model.

Both decode with :func:`sample_loop`: temperature 0 is greedy, a ``seed`` fixes the draws, and rows stop
independently at a stop string or after ``max_new_tokens``. Registers no equation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from llmbook._checks import check_nonnegative_int, check_range
from llmbook.lm.decoding import sample

__all__ = ["Completion", "Generator", "HFGenerator", "check_request", "continuation_log_prob", "sample_loop"]


@dataclass
class Completion:
    """A generated continuation: ``text`` (cut before the stop string), per-token ``logprobs``, ``finish_reason``.

    ``finish_reason`` is ``"stop"`` (a stop string was produced) or ``"length"`` (``max_new_tokens`` reached).
    ``logprobs`` are natural-log probabilities of the generated tokens under the model at temperature 1,
    the stop tokens included.
    """

    text: str
    logprobs: list[float]
    finish_reason: str


@runtime_checkable
class Generator(Protocol):
    """What the book's loops need from a language model (see the module docstring)."""

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 64, stop: Sequence[str] = (),
                 temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        ...  # pragma: no cover - a protocol


def check_request(prompts, max_new_tokens, stop, temperature) -> tuple[list[str], int, tuple[str, ...], float]:
    """Validate a ``generate`` call's arguments; return them normalised."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not one string (wrap it in a list)")
    prompts = list(prompts)
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("every prompt must be a str")
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    return (prompts, check_nonnegative_int(max_new_tokens, "max_new_tokens"), stop,
            check_range(temperature, "temperature", 0.0))


def sample_loop(step: Callable[[Tensor | None], Tensor], decode: Callable[[list[int]], str], B: int,
                max_new_tokens: int, stop: Sequence[str], temperature: float, seed: int,
                stop_ids: Sequence[int] = ()) -> list[Completion]:
    """Decode ``B`` rows: ``step(None)`` gives the prompts' next-token logits ``(B, V)``, ``step(tokens)`` the next.

    Each step draws a token per row with :func:`llmbook.lm.decoding.sample` (``tau = temperature``; 0 is
    greedy) from a ``torch.Generator`` seeded with ``seed``, records its log-probability at temperature 1, and
    checks the row's decoded text for a stop string (or its token against ``stop_ids``, tokens that *are* a
    stop string). Finished rows keep being fed a token but their output no longer changes; the loop ends when
    every row has finished. Returns one :class:`Completion` per row.
    """
    gen = torch.Generator().manual_seed(int(seed))
    new: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    done = [False] * B
    texts = [""] * B
    reasons = ["length"] * B
    z = step(None) if max_new_tokens > 0 else None
    for _ in range(max_new_tokens):
        z = z.double()
        nxt = sample(z, generator=gen, tau=temperature)
        logp = torch.log_softmax(z, -1).gather(-1, nxt[:, None])[:, 0]
        for b in range(B):
            if done[b]:
                continue
            t = int(nxt[b])
            new[b].append(t)
            lps[b].append(float(logp[b]))
            if t in stop_ids:
                done[b], reasons[b], texts[b] = True, "stop", decode(new[b][:-1])
                continue
            text = decode(new[b])
            hit = [text.index(s) for s in stop if s in text]
            if hit:
                done[b], reasons[b], texts[b] = True, "stop", text[:min(hit)]
        if all(done):
            break
        z = step(nxt)
    return [Completion(texts[b] if done[b] else decode(new[b]), lps[b], reasons[b]) for b in range(B)]


def continuation_log_prob(logits_of: Callable[[Tensor], Tensor], xi: list[int], yi: list[int]) -> float:
    r""":math:`\log p(y \mid x) = \sum_t \log p(y_t \mid x, y_{<t})` from one forward pass over ``xi + yi``.

    ``logits_of`` maps ids ``(1, T)`` to logits ``(1, T, V)``; ``xi``, ``yi`` are the prompt's and the
    continuation's token ids (the prompt non-empty). Summed in float64.
    """
    if not xi or not yi:
        raise ValueError("the prompt and the continuation must each encode to at least one token")
    with torch.no_grad():
        logits = logits_of(torch.tensor([xi + yi]))[0, len(xi) - 1:-1].double()
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(yi)[:, None]).sum())


class HFGenerator:
    """A :class:`Generator` over a local Hugging Face causal LM and its tokenizer (left-padded batches, KV cache).

    ``model`` is any ``transformers`` causal LM (``AutoModelForCausalLM.from_pretrained(...)``), ``tokenizer``
    its tokenizer. A tokenizer without a pad token pads with its end-of-sequence token; prompts are encoded
    without special tokens unless ``add_special_tokens=True``. Nothing is downloaded here: load the model
    first (on Colab, e.g. ``"Qwen/Qwen2.5-0.5B-Instruct"``).
    """

    def __init__(self, model, tokenizer, add_special_tokens: bool = False):
        self.model, self.tokenizer, self.add_special_tokens = model.eval(), tokenizer, add_special_tokens
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = 0 if pad is None else int(pad)
        # transformers 5 calls the KV cache ``cache``; 4.x (Colab's today) ``past_key_values``
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _batch(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        rows = [self.tokenizer(p, add_special_tokens=self.add_special_tokens)["input_ids"] for p in prompts]
        if any(len(r) == 0 for r in rows):
            raise ValueError("every prompt must encode to at least one token")
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return ids, mask

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], max_new_tokens: int = 64, stop: Sequence[str] = (),
                 temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        prompts, max_new_tokens, stop, temperature = check_request(prompts, max_new_tokens, stop, temperature)
        if not prompts:
            return []
        ids, mask = self._batch(prompts)
        state = {"past": None, "mask": mask}

        def step(tokens):
            m = state["mask"]
            if tokens is None:
                inp = ids
            else:
                m = state["mask"] = torch.cat([m, torch.ones(len(prompts), 1, dtype=m.dtype)], 1)
                inp = tokens[:, None]
            pos = (m.cumsum(1) - 1).clamp(min=0)[:, -inp.shape[1]:]
            out = self.model(input_ids=inp, attention_mask=m, position_ids=pos, use_cache=True,
                             **{self._cache_arg: state["past"]})
            state["past"] = getattr(out, self._cache_arg)
            return out.logits[:, -1].float()

        eos = () if self.tokenizer.eos_token_id is None else (int(self.tokenizer.eos_token_id),)
        return sample_loop(step, lambda t: self.tokenizer.decode(t, skip_special_tokens=False), len(prompts),
                           max_new_tokens, stop, temperature, seed, stop_ids=eos)

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` (the agent loop's context budget)."""
        return len(self.tokenizer(text, add_special_tokens=self.add_special_tokens)["input_ids"])

    @torch.no_grad()
    def score(self, prompts: Sequence[str], continuations: Sequence[str]) -> list[float]:
        """:math:`\\log p(y \\mid x)` of each continuation ``y`` after its prompt ``x``, summed over ``y``'s tokens."""
        return [continuation_log_prob(lambda ids: self.model(input_ids=ids).logits,
                                      self.tokenizer(x, add_special_tokens=self.add_special_tokens)["input_ids"],
                                      self.tokenizer(y, add_special_tokens=False)["input_ids"])
                for x, y in zip(prompts, continuations, strict=True)]
