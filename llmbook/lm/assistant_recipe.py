r"""``python -m llmbook train --recipe assistant``: the book's assistant, trained end to end by the book's own code.

Five stages, each with the book's implementations, all seeded:

1. **tokenizer**: chapter 15's byte-level BPE (:func:`~llmbook.lm.bpe.train_bpe`) on the pre-training text,
   with the transcript's special tokens;
2. **pre-training**: chapter 8's loop (:func:`~llmbook.lm.training.train`: AdamW, warm-up + cosine, global-norm
   clipping) on the book's Python-documentation corpus and program-generated prose about random people;
3. **SFT**: the next-token loss on the assistant's tokens only (:func:`~llmbook.lm.rlhf.sft_loss`), on gold
   demonstrations of the training tasks (:func:`~llmbook.agents.assistant_tasks.demonstration`), a quarter of
   them act-only;
4. **DPO**: :func:`~llmbook.lm.preference.dpo_loss` on pairs of the SFT model's *own* sampled episodes, one
   the verifier accepts and one it rejects, with the SFT model as the frozen reference;
5. **GRPO**, also from the SFT model (DPO and GRPO are two branches, each compared with SFT): on-policy
   rollouts of the agent loop (:func:`~llmbook.agents.agent_loop.run_agent`), the verifier's 0/1 reward, group
   advantages (:func:`~llmbook.lm.rlhf.grpo_advantages`) and the clipped objective with its KL penalty to the
   SFT model (:func:`~llmbook.lm.rlhf.grpo_objective`): no value network, no reward model. Its model is the
   one committed.

DPO and GRPO train on prompts from the ``rl`` templates, which have no demonstrations.

After each stage the model is evaluated on held-out tasks (templates and seeds never used in training),
greedily, with the tools and without (closed book). The log records every curve and every held-out reward,
rounded, and no timing, so a rerun writes the same bytes; the timings go to standard output.
"""

from __future__ import annotations

import copy
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmbook.agents.agent_loop import failure_mode, run_agent, self_consistency
from llmbook.agents.assistant_tasks import (
    KINDS,
    SPECIALS,
    closed_book,
    demonstration,
    make_tasks,
    render,
    world_document,
)
from llmbook.lm.assistant import WEIGHTS, Assistant, encode_transcript, pad_right, save_assistant
from llmbook.lm.bpe import train_bpe
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.optim import AdamW
from llmbook.lm.preference import dpo_loss, sequence_log_probs
from llmbook.lm.probability import token_log_probs
from llmbook.lm.rlhf import grpo_advantages, grpo_objective, sft_loss
from llmbook.lm.schedules import clip_grad_norm_, warmup_cosine
from llmbook.lm.training import TrainConfig, _data_dir, _param_groups, train

__all__ = ["LOG", "RecipeConfig", "evaluate", "fine_tune", "heldout_tasks", "main", "pretrain", "read_assistant_log",
           "run_recipe", "train_tokenizer", "training_tasks"]

LOG = "assistant_log.json"


@dataclass(frozen=True)
class RecipeConfig:
    """Sizes of every stage; the defaults trained the committed assistant (the test runs a miniature)."""

    n_merges: int = 762          # V = 256 + 762 + 6 specials = 1024
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 344
    max_seq_len: int = 256
    world_docs: int = 3000
    pretrain_steps: int = 100
    sft_examples: int = 16000
    sft_steps: int = 1600
    dpo_prompts: int = 200
    dpo_steps: int = 40
    grpo_iterations: int = 30
    grpo_prompts: int = 16
    grpo_G: int = 8
    grpo_lr: float = 2e-4
    heldout: int = 300
    episode_tokens: int = 40     # the most tokens of one assistant turn
    chunk: int = 8               # rows per length-sorted chunk of an SFT or GRPO batch (cost only)
    seed: int = 0
    num_threads: int = 2


def training_tasks(cfg: RecipeConfig) -> list:
    """Every task the recipe trains on: the tokenizer's demonstrations, SFT, DPO's prompts and GRPO's."""
    out = make_tasks(500, seed=cfg.seed + 7) + make_tasks(cfg.sft_examples, seed=cfg.seed + 1)
    out += make_tasks(cfg.dpo_prompts, seed=cfg.seed + 3, split="rl")
    for it in range(cfg.grpo_iterations):
        out += make_tasks(cfg.grpo_prompts, seed=cfg.seed + 20_000 + it, split="rl")
    return out


def heldout_tasks(cfg: RecipeConfig = RecipeConfig(), n: int | None = None) -> list:
    """The held-out tasks the recipe evaluates on (their own seed and the held-out templates)."""
    return make_tasks(cfg.heldout if n is None else n, seed=cfg.seed + 10_000, split="heldout")


def train_tokenizer(cfg: RecipeConfig, grounded: bool = False):
    """The recipe's first stage, the BPE tokenizer: ``(tok, text, demos)``, ``text`` being the pre-training text.

    ``grounded`` selects the demonstrations' thoughts (:func:`~llmbook.agents.assistant_tasks.demonstration`).
    """
    rng = random.Random(cfg.seed)
    corpus = (_data_dir() / "corpus.txt").read_text(encoding="utf-8")
    docs = "\n\n".join(world_document(rng) for _ in range(cfg.world_docs))
    demos = [render(t, demonstration(t, grounded=grounded)) for t in make_tasks(500, seed=cfg.seed + 7)]
    tok = train_bpe(corpus + "\n\n" + docs + "\n\n" + "\n".join(demos), cfg.n_merges, SPECIALS)
    return tok, corpus + "\n\n" + docs, demos


def pretrain(cfg: RecipeConfig, tok, text: str) -> tuple[TinyGPT, dict, int]:
    """The recipe's second stage, pre-training on ``text``; returns ``(model, training log, number of tokens)``."""
    mcfg = GPTConfig(vocab_size=tok.V, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     d_ff=cfg.d_ff, max_seq_len=cfg.max_seq_len)
    data = torch.tensor(tok.encode(text))
    split = int(0.95 * len(data))
    tcfg = TrainConfig(steps=cfg.pretrain_steps, T_warm=cfg.pretrain_steps // 10, B=16, T=128,
                       eval_interval=cfg.pretrain_steps, seed=cfg.seed, num_threads=cfg.num_threads)
    model, _, plog = train(mcfg, tcfg, data[:split], data[split:])
    torch.set_num_threads(cfg.num_threads)
    return model, plog, len(data)


def _rounded(xs, digits=4):
    return [round(float(x), digits) for x in xs]


def _optimizer(model, lr: float) -> AdamW:
    return AdamW(_param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _update(model, opt, t: int, steps: int, eta_max: float) -> float:
    """Clip the accumulated gradient, set the warm-up + cosine rate of step ``t`` and step the optimiser."""
    norm = clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
        g["lr"] = warmup_cosine(t, max(1, steps // 10), steps, eta_max, eta_max / 10)
    opt.step()
    return float(norm)


def _step(model, opt, loss, t: int, steps: int, eta_max: float) -> float:
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return _update(model, opt, t, steps, eta_max)


def _length_chunks(tok, rows, size: int) -> list:
    """A batch of encoded transcripts cut into chunks of ``size`` rows of similar length: ``[(idx, ids, keep)]``.

    The rows are sorted by length and each chunk is padded only to its own longest row, so a batch whose
    lengths vary costs fewer padded positions. The batch is the same; a loss that is a sum (or a mean) over
    rows is the sum of its chunks' shares, so the accumulated gradient is the batch's gradient (up to the
    order of floating-point additions). Only the cost changes.
    """
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out = []
    for c in range(0, len(order), size):
        idx = order[c:c + size]
        ids, keep = pad_right([rows[i][0] for i in idx], tok.special_tokens["<|pad|>"], [rows[i][1] for i in idx])
        out.append((idx, ids, keep))
    return out


def fine_tune(assistant: Assistant, draw: Callable[[random.Random], list[tuple[str, str]]], *, steps: int,
              lr: float = 1e-3, seed: int = 0, chunk: int = 8, progress: Callable[[str], None] | None = None,
              name: str = "fine-tune") -> tuple[Assistant, list[float]]:
    """Fine-tune a *copy* of ``assistant`` on ``(prompt, target)`` pairs: the next-token loss on the target only.

    ``draw(rng)`` returns each step's batch (``rng`` is ``random.Random(seed)``, so the batches are seeded); the
    prompt and the target are encoded separately and concatenated, and the loss is
    :func:`~llmbook.lm.rlhf.sft_loss` summed over the target tokens and divided by the batch size, with the
    recipe's AdamW, warm-up + cosine schedule (peak ``lr``) and clipping. The assistant itself is untouched.
    Returns ``(model, losses)``, the model an :class:`~llmbook.lm.assistant.Assistant` in float32, eval mode.
    A target should end with ``<|end|>``, so that the model learns to stop.
    """
    tok = assistant.tok
    model = copy.deepcopy(assistant.model).float().train()
    opt, rng, losses = _optimizer(model, lr), random.Random(seed), []
    for t in range(steps):
        batch = draw(rng)
        if not batch:
            raise ValueError(f"{name}: draw returned an empty batch at step {t}")
        rows = []
        for prompt, target in batch:
            x, y = tok.encode(prompt), tok.encode(target)
            rows.append((x + y, [False] * len(x) + [True] * len(y)))
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for _, ids, keep in _length_chunks(tok, rows, chunk):
            labels = torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
            part = sft_loss(model(ids[:, :-1]), labels, reduction="sum") / len(batch)
            part.backward()
            loss += part.item()
        _update(model, opt, t, steps, lr)
        losses.append(loss)
        if progress is not None and (t + 1) % 50 == 0:
            progress(f"{name} step {t + 1}: loss {sum(losses[-50:]) / 50:.4f}")
    return Assistant(model.eval(), tok), losses


def _encode(tok, texts: list[str]):
    rows, masks = zip(*(encode_transcript(tok, t) for t in texts), strict=True)
    return pad_right(rows, tok.special_tokens["<|pad|>"], masks)


def _token_logps(model, ids, keep):
    """Per-token log-probabilities of ``ids[:, 1:]`` and the mask of the counted (assistant) tokens."""
    return token_log_probs(model(ids[:, :-1]), ids[:, 1:]), keep[:, 1:]


def evaluate(assistant: Assistant, tasks, *, closed: bool = True, agent: bool = False, max_new_tokens: int = 40
             ) -> dict:
    """Greedy held-out evaluation in float64: each task's reward with tools and context, and closed book.

    The model is evaluated on a float64 copy, so a reader's CPU reproduces every greedy choice (the chapters
    rerun part of it). ``agent=True`` adds chapter 40's comparisons: act-only (no thoughts), self-consistency
    (5 episodes at temperature 0.7, majority answer) and each ReAct episode's failure mode.
    """
    a64 = Assistant(copy.deepcopy(assistant.model).double().eval(), assistant.tok)
    loop = {"max_new_tokens": max_new_tokens}
    with_tools = run_agent(a64, tasks, **loop)
    out = {"kinds": [t.kind for t in tasks], "reward": [tr.reward for tr in with_tools],
           "format_errors": [tr.format_errors for tr in with_tools]}
    if closed:
        outs = a64.generate([closed_book(t) for t in tasks], max_new_tokens=16)
        out["closed_book"] = [float(o.text.strip() == t.answer) for o, t in zip(outs, tasks, strict=True)]
    if agent:
        out["failure_mode"] = [failure_mode(tr) for tr in with_tools]
        out["act_only"] = [tr.reward for tr in run_agent(a64, tasks, react=False, **loop)]
        out["self_consistency"] = [r for _, r in self_consistency(a64, tasks, k=5, temperature=0.7, seed=7, **loop)]
    return out


def _summary(ev: dict) -> str:
    n = len(ev["reward"])
    cb = f", closed book {sum(ev['closed_book']) / n:.3f}" if "closed_book" in ev else ""
    return f"held-out success {sum(ev['reward']) / n:.3f}{cb}, format errors {sum(ev['format_errors'])}"


def run_recipe(cfg: RecipeConfig = RecipeConfig(), out_dir=None, progress=print) -> dict:
    """Run the five stages; write ``assistant.pt`` and ``assistant_log.json`` to ``out_dir``; return the log."""
    out_dir = Path(out_dir) if out_dir is not None else _data_dir()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.num_threads)
    # with 2 threads the embedding's backward (an index_put with accumulation) adds in a varying order;
    # the deterministic kernels make a rerun reproduce every loss to the last bit
    torch.use_deterministic_algorithms(True)
    log: dict = {"config": asdict(cfg), "stages": {}}
    clock = time.perf_counter()

    def done(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        progress(f"[{stage}] {now - clock:.1f} s")
        clock = now

    try:
        tok, text, demos = train_tokenizer(cfg)
        log["stages"]["tokenizer"] = {"V": tok.V, "example": [tok.decode([t]) for t in tok.encode(demos[0])][:40]}
        done("tokenizer")

        heldout = heldout_tasks(cfg)
        model, plog, n_tokens = pretrain(cfg, tok, text)
        log["stages"]["pretrain"] = {"tokens": n_tokens, "loss": _rounded(plog["train"]["loss"]),
                                     "heldout_loss": _rounded(plog["eval"]["heldout_loss"])}
        log["stages"]["pretrain"]["heldout"] = evaluate(Assistant(model, tok), heldout,
                                                        max_new_tokens=cfg.episode_tokens)
        progress("base: " + _summary(log["stages"]["pretrain"]["heldout"]))
        done("pretrain")

        model = _sft(cfg, model, tok, log)
        log["stages"]["sft"]["heldout"] = evaluate(Assistant(model, tok), heldout, max_new_tokens=cfg.episode_tokens)
        progress("SFT: " + _summary(log["stages"]["sft"]["heldout"]))
        done("sft")

        dpo_model = _dpo(cfg, copy.deepcopy(model), tok, log)  # a branch: DPO and GRPO both start from SFT
        log["stages"]["dpo"]["heldout"] = evaluate(Assistant(dpo_model, tok), heldout,
                                                   max_new_tokens=cfg.episode_tokens)
        progress("DPO: " + _summary(log["stages"]["dpo"]["heldout"]))
        done("dpo")

        model = _grpo(cfg, model, tok, log)
        log["stages"]["grpo"]["heldout"] = evaluate(Assistant(model, tok), heldout, agent=True,
                                                    max_new_tokens=cfg.episode_tokens)
        progress("GRPO: " + _summary(log["stages"]["grpo"]["heldout"]))
        done("grpo")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_assistant(model, tok, out_dir / WEIGHTS)
    (out_dir / LOG).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    return log


def _sft(cfg: RecipeConfig, model: TinyGPT, tok, log: dict, grounded: bool = False) -> TinyGPT:
    tasks = make_tasks(cfg.sft_examples, seed=cfg.seed + 1)
    texts = [render(t, demonstration(t, react=i % 4 != 3, grounded=grounded)) for i, t in enumerate(tasks)]
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    opt, losses, B = _optimizer(model, 3e-3), [], 32
    model.train()
    for t in range(cfg.sft_steps):
        idx = torch.randint(len(texts), (B,), generator=gen).tolist()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for _, ids, keep in _length_chunks(tok, [encode_transcript(tok, texts[i]) for i in idx], cfg.chunk):
            labels = torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
            part = sft_loss(model(ids[:, :-1]), labels, reduction="sum") / B  # the batch mean, in shares
            part.backward()
            loss += part.item()
        _update(model, opt, t, cfg.sft_steps, 3e-3)
        losses.append(loss)
    model.eval()
    log["stages"]["sft"] = {"examples": len(texts), "loss": _rounded(losses)}
    return model


def _dpo(cfg: RecipeConfig, model: TinyGPT, tok, log: dict) -> TinyGPT:
    ref = copy.deepcopy(model).eval()
    tasks = make_tasks(cfg.dpo_prompts, seed=cfg.seed + 3, split="rl")
    runs = [run_agent(Assistant(model, tok), tasks, temperature=1.0, seed=cfg.seed + 100 * i,
                      max_new_tokens=cfg.episode_tokens) for i in range(4)]
    pairs = []
    for j in range(len(tasks)):
        good = [r[j] for r in runs if r[j].reward == 1.0]
        bad = [r[j] for r in runs if r[j].reward == 0.0]
        if good and bad:
            pairs.append((good[0].text(), bad[0].text()))
    opt, losses, accs, B = _optimizer(model, 5e-5), [], [], 16
    gen = torch.Generator().manual_seed(cfg.seed + 4)
    model.train()
    for t in range(cfg.dpo_steps if pairs else 0):
        idx = torch.randint(len(pairs), (min(B, len(pairs)),), generator=gen).tolist()
        ids, keep = _encode(tok, [pairs[i][0] for i in idx] + [pairs[i][1] for i in idx])
        labels = torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -100))
        logp = sequence_log_probs(model(ids[:, :-1]), labels)
        with torch.no_grad():
            ref_logp = sequence_log_probs(ref(ids[:, :-1]), labels)
        n = len(idx)
        loss = dpo_loss(logp[:n], logp[n:], ref_logp[:n], ref_logp[n:], beta=0.1)
        _step(model, opt, loss, t, cfg.dpo_steps, 5e-5)
        losses.append(loss.item())
        accs.append(float(((logp[:n] - ref_logp[:n]) > (logp[n:] - ref_logp[n:])).float().mean()))
    model.eval()
    log["stages"]["dpo"] = {"pairs": len(pairs), "sampled_success": _rounded(
        [sum(r[j].reward for r in runs) / 4 for j in range(len(tasks))], 2), "loss": _rounded(losses),
        "reward_accuracy": _rounded(accs)}
    return model


def _grpo(cfg: RecipeConfig, model: TinyGPT, tok, log: dict) -> TinyGPT:
    ref = copy.deepcopy(model).eval()
    opt, B = _optimizer(model, cfg.grpo_lr), cfg.grpo_prompts * cfg.grpo_G
    rec = {"reward": [], "kl": [], "length": [], "clip_fraction": [], "group_rewards": []}
    for it in range(cfg.grpo_iterations):
        tasks = make_tasks(cfg.grpo_prompts, seed=cfg.seed + 20_000 + it, split="rl")
        group = [t for t in tasks for _ in range(cfg.grpo_G)]
        model.eval()
        trajs = run_agent(Assistant(model, tok), group, temperature=1.0, seed=cfg.seed + 30_000 + 10 * it,
                          max_new_tokens=cfg.episode_tokens)
        r = torch.tensor([tr.reward for tr in trajs], dtype=torch.float64)
        A = grpo_advantages(r.view(cfg.grpo_prompts, cfg.grpo_G)).flatten()
        chunks = _length_chunks(tok, [encode_transcript(tok, tr.text()) for tr in trajs], cfg.chunk)
        with torch.no_grad():
            old = [_token_logps(model, ids, keep) for _, ids, keep in chunks]
            refs = [_token_logps(ref, ids, keep)[0] for _, ids, keep in chunks]
        model.train()
        for inner in range(2):  # two updates per batch: the second is off-policy, where the clip acts
            opt.zero_grad(set_to_none=True)
            n_tok = kl_sum = clipped = 0.0
            for (idx, ids, keep), (logp_old, mask), logp_ref in zip(chunks, old, refs, strict=True):
                logp, _ = _token_logps(model, ids, keep)
                J = grpo_objective(logp, logp_old, logp_ref, A[idx], eps=0.2, beta=0.04, mask=mask)
                (-J * len(idx) / B).backward()  # the mean over the B responses, in shares
                with torch.no_grad():
                    ratio = (logp.detach() - logp_old).exp()
                    log_ratio = logp_ref - logp.detach()
                    n_tok += float(mask.sum())
                    kl_sum += float(((log_ratio.exp() - log_ratio - 1) * mask).sum())
                    clipped += float((((ratio - 1).abs() > 0.2) & mask).sum())
            _update(model, opt, 2 * it + inner, 2 * cfg.grpo_iterations, cfg.grpo_lr)
        rec["reward"].append(float(r.mean()))
        rec["kl"].append(kl_sum / n_tok)  # of the policy before the second update, as the clip fraction
        rec["length"].append(n_tok / B)
        rec["clip_fraction"].append(clipped / n_tok)
        rec["group_rewards"].append(r.view(cfg.grpo_prompts, cfg.grpo_G).int().tolist())
    model.eval()
    groups = rec.pop("group_rewards")
    log["stages"]["grpo"] = {k: _rounded(v) for k, v in rec.items()}
    log["stages"]["grpo"]["group_rewards"] = groups
    # what GRPO trains: the policy's parameters and nothing else (no value network, no reward model)
    log["stages"]["grpo"]["trained_parameters"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    log["stages"]["grpo"]["policy_parameters"] = model.num_parameters()
    return model


def read_assistant_log(path=None) -> dict:
    """The committed log of the recipe (``llmbook/data/assistant_log.json``)."""
    return json.loads((Path(path) if path is not None else _data_dir() / LOG).read_text(encoding="utf-8"))


def main(out_dir=None, **sizes) -> int:
    """The CLI entry: run the recipe (``sizes`` override :class:`RecipeConfig` fields for a quick trial)."""
    start = time.perf_counter()
    run_recipe(RecipeConfig(**sizes), out_dir)
    print(f"[total] {time.perf_counter() - start:.1f} s; kinds {', '.join(KINDS)}")
    return 0
