r"""Train the book's tiny GPT: batches, checkpoints, the training loop and the pretrained model.

The running example of the book is a :class:`~llmbook.lm.gpt.TinyGPT` trained, character by character,
on the book's frozen offline corpus (:func:`llmbook.data.corpus`). Everything here is what a reader
would write to train a real model, only smaller:

* :class:`CharTokenizer` and :func:`corpus_tokens`: the character vocabulary (``V = 100``) and the fixed
  split into the first 90 % (train) and the last 10 % (held out);
* :func:`get_batch`: random windows of a 1-D token array (a ``numpy.memmap`` of a token file works);
* :func:`save_checkpoint` / :func:`load_checkpoint`: model, optimiser, iteration and a plain-dict config,
  loaded with ``torch.load(weights_only=True)`` (no pickled code runs when a checkpoint is read);
* :func:`train`: AdamW (:class:`llmbook.lm.optim.AdamW`), linear warm-up then cosine decay
  (:func:`llmbook.lm.schedules.warmup_cosine`) and global gradient clipping
  (:func:`llmbook.lm.schedules.clip_grad_norm_`), minimising the cross-entropy
  (:func:`llmbook.lm.probability.cross_entropy_loss`) of the next character,

  .. math:: L(\theta) = -\frac{1}{BT}\sum_{b=1}^{B}\sum_{t=1}^{T} \log p_\theta(x_{b,t+1} \mid x_{b,\le t});

* :func:`train_tiny_gpt` (``python -m llmbook train``) and :func:`pretrained_tiny`, the one-line loader of
  the committed result (``llmbook/data/tiny_gpt.pt`` and its log ``tiny_gpt_log.json``).

Determinism: every random draw comes from a seeded generator (model initialisation, batches) and the
loop runs on ``num_threads`` CPU threads (1 by default), so a rerun on the same machine and torch build
gives bitwise the same losses. Another CPU may pick other BLAS kernels, whose rounding differs in
the last bits; the retraining test therefore compares the first steps with the log to ``1e-6``.

>>> tok = CharTokenizer("abc")
>>> tok.decode(tok.encode("cab"))
'cab'
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from llmbook._checks import check_int, check_positive_int, check_range
from llmbook.lm.gpt import GPTConfig, TinyGPT
from llmbook.lm.optim import AdamW
from llmbook.lm.probability import cross_entropy_loss
from llmbook.lm.schedules import clip_grad_norm_, warmup_cosine

__all__ = ["CharTokenizer", "TrainConfig", "TINY_GPT", "corpus_tokens", "get_batch", "save_checkpoint",
           "load_checkpoint", "model_from_checkpoint", "evaluate_loss", "train", "read_log", "train_tiny_gpt",
           "pretrained_tiny", "generate_text", "main"]

HELDOUT_FRACTION = 0.1
CHECKPOINT_FILE, LOG_FILE = "tiny_gpt.pt", "tiny_gpt_log.json"


class CharTokenizer:
    """Character-level tokenizer: token id ``i`` is the ``i``-th character of ``chars`` (``V = len(chars)``).

    ``CharTokenizer.from_text(text)`` takes the sorted set of characters of ``text``. ``encode(text)``
    returns a ``uint8`` numpy array (``int64`` if ``V > 256``), ``decode(ids)`` a ``str``; a character
    outside the vocabulary raises ``ValueError``.

    >>> tok = CharTokenizer.from_text("hello")
    >>> tok.chars, tok.vocab_size, tok.encode("hole").tolist()
    ('ehlo', 4, [1, 3, 2, 0])
    """

    def __init__(self, chars: str):
        if not isinstance(chars, str) or not chars:
            raise TypeError(f"chars must be a non-empty str, got {chars!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not repeat a character")
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}
        self._dtype = np.uint8 if len(chars) <= 256 else np.int64

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            return np.array([self._index[c] for c in text], dtype=self._dtype)
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the vocabulary of {self.vocab_size}") from None

    def decode(self, ids) -> str:
        ids = np.asarray(ids.tolist() if isinstance(ids, Tensor) else ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, V) = [0, {self.vocab_size}), got range [{ids.min()}, {ids.max()}]")
        return "".join(self.chars[i] for i in ids)


def corpus_tokens() -> tuple[CharTokenizer, np.ndarray, np.ndarray]:
    """The book's corpus as characters: ``(tokenizer, train, heldout)``, a fixed 90 % / 10 % split.

    ``train`` is the first 90 % of the characters, ``heldout`` the last 10 % (whole topics the model
    never sees), both ``uint8`` arrays of token ids.

    >>> tok, train_ids, heldout_ids = corpus_tokens()
    >>> tok.vocab_size, len(train_ids), len(heldout_ids)
    (100, 180000, 20000)
    """
    from llmbook.data import corpus

    text = corpus()
    tok = CharTokenizer.from_text(text)
    ids = tok.encode(text)
    n_train = len(ids) - int(round(HELDOUT_FRACTION * len(ids)))
    return tok, ids[:n_train], ids[n_train:]


def get_batch(data, B: int, T: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    r"""``B`` random windows of ``T + 1`` consecutive tokens of ``data``, split into inputs and next-token labels.

    ``data`` is a 1-D integer array: a numpy array, a ``numpy.memmap`` of a token file (only the
    ``B`` windows are read from disk) or a tensor. Start positions :math:`s_b` are uniform on
    ``[0, N - T - 1]`` (every window fits), drawn with ``generator``. Returns ``(x, y)``, both ``int64``
    ``(B, T)``, with ``x[b] = data[s_b : s_b + T]`` and ``y[b] = data[s_b + 1 : s_b + T + 1]``.

    >>> x, y = get_batch(np.arange(10), B=2, T=3, generator=torch.Generator().manual_seed(0))
    >>> bool((y == x + 1).all()), tuple(x.shape)
    (True, (2, 3))
    """
    B, T = check_positive_int(B, "B"), check_positive_int(T, "T")
    if isinstance(data, Tensor):
        data = data.detach().cpu().numpy()
    if not hasattr(data, "ndim") or data.ndim != 1 or data.dtype.kind not in "iu":
        raise TypeError(f"data must be a 1-D integer array (numpy, memmap or tensor), got {type(data).__name__} "
                        f"with dtype {getattr(data, 'dtype', None)}")
    N = len(data)
    if N < T + 1:
        raise ValueError(f"data holds {N} tokens, fewer than the T + 1 = {T + 1} a window needs")
    starts = torch.randint(0, N - T, (B,), generator=generator).tolist()
    windows = torch.from_numpy(np.stack([np.asarray(data[s:s + T + 1], dtype=np.int64) for s in starts]))
    return windows[:, :-1], windows[:, 1:]


def _plain(config):
    """A config as plain data (dicts, lists, numbers, strings) that ``torch.load(weights_only=True)`` accepts."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    if isinstance(config, dict):
        return {str(k): _plain(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_plain(v) for v in config]
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise TypeError(f"config values must be plain data (dict, list, number, str, None), got {type(config).__name__}")


def save_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer | None, iteration: int,
                    config=None):
    """Write ``{"model", "optimizer", "iteration", "config"}`` to ``path`` with ``torch.save``; returns ``path``.

    ``path`` is a ``str``, a path or a binary file-like object (``io.BytesIO``, an open file): anything
    ``torch.save`` writes to. ``model`` and ``optimizer`` are stored as state dicts (``optimizer=None``
    stores ``None``: a release checkpoint without optimiser state, a third of the size). ``config``
    (optional) is a dict or dataclass of plain data (nested dataclasses become dicts), so
    :func:`load_checkpoint` can read the file with ``weights_only=True``. To resume, rebuild the model and
    optimiser, then ``model.load_state_dict(ckpt["model"])`` and ``optimizer.load_state_dict(ckpt["optimizer"])``.

    >>> import io
    >>> buf = io.BytesIO()
    >>> _ = save_checkpoint(buf, nn.Linear(2, 2), None, 7)
    >>> _ = buf.seek(0)
    >>> load_checkpoint(buf)["iteration"]
    7
    """
    iteration = check_int(iteration, "iteration", low=0, what="an int >= 0")
    state = {"model": model.state_dict(), "optimizer": None if optimizer is None else optimizer.state_dict(),
             "iteration": iteration, "config": None if config is None else _plain(config)}
    target = path if hasattr(path, "write") else Path(path)
    torch.save(state, target)
    return target


def load_checkpoint(path) -> dict:
    """Read a checkpoint of :func:`save_checkpoint` with ``torch.load(weights_only=True)``, on the CPU.

    ``path`` is a ``str``, a path or a binary file-like object positioned at the checkpoint's start.
    """
    return torch.load(path if hasattr(path, "read") else Path(path), map_location="cpu", weights_only=True)


def model_from_checkpoint(ckpt: dict) -> TinyGPT:
    """A :class:`~llmbook.lm.gpt.TinyGPT` built from ``ckpt["config"]["model"]``, weights ``ckpt["model"]``."""
    model = TinyGPT(GPTConfig(**ckpt["config"]["model"]))
    model.load_state_dict(ckpt["model"])
    return model


@dataclass(frozen=True)
class TrainConfig:
    r"""Hyper-parameters of :func:`train`; the defaults trained the committed tiny GPT (:data:`TINY_GPT`).

    ``steps`` is the number of optimiser steps (the schedule's :math:`T`), ``T_warm`` the linear warm-up,
    ``eta_max`` / ``eta_min`` the peak and final learning rate of the cosine, ``B`` and ``T`` the batch
    and context of each step, ``betas``, ``eps``, ``weight_decay`` AdamW's (decay on matrices only, not
    on norm gains), ``max_norm`` the global gradient-clipping threshold, ``eval_interval`` how often the
    held-out loss is logged, ``seed`` seeds the initialisation and the batches, ``num_threads`` the CPU
    threads (fixed, for reproducible losses).
    """

    steps: int = 800
    T_warm: int = 80
    eta_max: float = 3e-3
    eta_min: float = 3e-4
    B: int = 32
    T: int = 64
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_norm: float = 1.0
    eval_interval: int = 100
    seed: int = 0
    num_threads: int = 1

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(self.betas))  # a checkpoint's plain config stores a list
        for name in ("steps", "B", "T", "eval_interval", "num_threads"):
            check_positive_int(getattr(self, name), name)
        check_int(self.T_warm, "T_warm", low=0, high=self.steps, what=f"an int in [0, steps = {self.steps}]")
        check_range(self.eta_max, "eta_max", 0.0, low_open=True)
        check_range(self.eta_min, "eta_min", 0.0, self.eta_max)
        check_range(self.max_norm, "max_norm", 0.0, low_open=True)


#: The committed model, as the pair (GPTConfig, TrainConfig); ``vocab_size`` is the corpus's 100 characters.
TINY_GPT = (GPTConfig(vocab_size=100, d_model=128, n_layers=4, n_heads=4, d_ff=344, max_seq_len=64),
            TrainConfig())


@torch.no_grad()
def evaluate_loss(model: nn.Module, data, T: int, B: int = 64) -> float:
    r"""Mean next-token cross-entropy (nats per token) of ``model`` over ``data``, deterministically.

    ``data`` (1-D token ids, as for :func:`get_batch`) is cut into the :math:`\lfloor (N-1)/T \rfloor`
    consecutive, non-overlapping windows of ``T`` inputs (plus one label), evaluated ``B`` windows at a
    time; the result averages over every predicted token, so it is the same number (to rounding) whatever ``B``.
    The model is put in eval mode for the evaluation and restored afterwards.
    """
    T, B = check_positive_int(T, "T"), check_positive_int(B, "B")
    ids = torch.as_tensor(np.asarray(data, dtype=np.int64))
    n = (len(ids) - 1) // T
    if n < 1:
        raise ValueError(f"data holds {len(ids)} tokens, fewer than the T + 1 = {T + 1} a window needs")
    x = ids[:n * T].view(n, T)
    y = ids[1:n * T + 1].view(n, T)
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, B):
        total += cross_entropy_loss(model(x[i:i + B]), y[i:i + B], reduction="sum").double().item()
    model.train(was_training)
    return total / (n * T)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on the matrices (``ndim >= 2``), none on norm gains and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def train(model_config: GPTConfig, config: TrainConfig, train_data, heldout_data, *, stop_after: int | None = None,
          evaluate: bool = True, progress=None) -> tuple[TinyGPT, torch.optim.Optimizer, dict]:
    r"""Train a fresh :class:`~llmbook.lm.gpt.TinyGPT` from ``config.seed``; returns ``(model, optimizer, log)``.

    Each step :math:`t = 0, 1, \dots` draws a batch with :func:`get_batch`, computes the mean
    cross-entropy, back-propagates, clips the global gradient norm to ``max_norm``
    (:func:`~llmbook.lm.schedules.clip_grad_norm_`), sets the learning rate
    :math:`\eta_t` = ``warmup_cosine(t, T_warm, steps, eta_max, eta_min)`` and takes an
    :class:`~llmbook.lm.optim.AdamW` step. ``stop_after`` stops after that many steps of the same
    schedule (to replay the start of a run; ``evaluate=False`` then also skips the held-out evaluations,
    about two seconds each); ``progress`` (e.g. ``print``) receives one line per evaluation.

    ``log`` holds plain lists (JSON-ready):

    * ``log["train"]``: ``iteration`` :math:`t` (updates made so far), ``loss`` (the batch loss at
      :math:`t`), ``lr`` (:math:`\eta_t`, used for update :math:`t+1`), ``grad_norm`` (before clipping);
    * ``log["eval"]``: ``iteration`` (0, every ``eval_interval`` and the last), ``heldout_loss`` and
      ``train_loss`` (:func:`evaluate_loss` on ``heldout_data`` and on as many leading tokens of
      ``train_data``), the curves to compare for over-fitting.

    Model initialisation uses ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (the caller's
    global generator is left alone) and the batches a ``torch.Generator`` seeded with ``seed + 1``; the
    loop runs with ``torch.set_num_threads(num_threads)`` (restored afterwards).
    """
    if not isinstance(model_config, GPTConfig) or not isinstance(config, TrainConfig):
        raise TypeError("model_config must be a GPTConfig and config a TrainConfig, got "
                        f"{type(model_config).__name__} and {type(config).__name__}")
    if config.T > model_config.max_seq_len:
        raise ValueError(f"T = {config.T} exceeds the model's max_seq_len = {model_config.max_seq_len}")
    n_steps = config.steps if stop_after is None else check_int(
        stop_after, "stop_after", low=0, high=config.steps, what=f"an int in [0, steps = {config.steps}]")
    threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = TinyGPT(model_config)
        optimizer = AdamW(_param_groups(model, config.weight_decay), lr=config.eta_max, betas=config.betas,
                          eps=config.eps, weight_decay=config.weight_decay)
        gen = torch.Generator().manual_seed(config.seed + 1)
        train_eval = train_data[:len(heldout_data)]
        log = {"train": {"iteration": [], "loss": [], "lr": [], "grad_norm": []},
               "eval": {"iteration": [], "heldout_loss": [], "train_loss": []}}

        def run_eval(t):
            if not evaluate:
                return
            ev = log["eval"]
            ev["iteration"].append(t)
            ev["heldout_loss"].append(evaluate_loss(model, heldout_data, config.T))
            ev["train_loss"].append(evaluate_loss(model, train_eval, config.T))
            if progress is not None:
                progress(f"iteration {t:5d}  train loss {ev['train_loss'][-1]:.4f}  "
                         f"held-out loss {ev['heldout_loss'][-1]:.4f}")

        model.train()
        for t in range(n_steps):
            if t % config.eval_interval == 0:
                run_eval(t)
            x, y = get_batch(train_data, config.B, config.T, gen)
            loss = cross_entropy_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = clip_grad_norm_(model.parameters(), config.max_norm)
            eta = warmup_cosine(t, config.T_warm, config.steps, config.eta_max, config.eta_min)
            for group in optimizer.param_groups:
                group["lr"] = eta
            optimizer.step()
            rec = log["train"]
            rec["iteration"].append(t)
            rec["loss"].append(loss.item())
            rec["lr"].append(float(eta))
            rec["grad_norm"].append(float(grad_norm))
        if n_steps % config.eval_interval == 0 or n_steps == config.steps:
            run_eval(n_steps)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return model, optimizer, log


def _data_dir() -> Path:
    return Path(str(resources.files("llmbook.data")))


def read_log(path=None) -> dict:
    """The training log of :func:`train_tiny_gpt` (default: the committed ``llmbook/data/tiny_gpt_log.json``).

    Keys: ``config`` (``model``, ``train``, ``vocab``: as in the checkpoint), ``baselines`` (held-out
    loss of the uniform model, ``log V``, and of n-gram models of orders 1, 3, 5 fitted on the training
    split), ``train`` and ``eval`` (the columns described in :func:`train`), ``heldout_loss`` (the final one).
    """
    path = _data_dir() / LOG_FILE if path is None else Path(path)
    return json.loads(path.read_text(encoding="utf-8"))


def _baselines(tok: CharTokenizer, train_ids, heldout_ids) -> dict:
    """Held-out cross-entropy (nats per character) of the uniform model and of n-gram models (orders 1, 3, 5)."""
    from llmbook.lm.ngram import NGramLM

    out = {"uniform": math.log(tok.vocab_size)}
    for order in (1, 3, 5):
        lm = NGramLM(order=order, vocab_size=tok.vocab_size).fit(train_ids)
        out[f"ngram_{order}"] = -lm.score(heldout_ids).mean().item()
    return out


def train_tiny_gpt(out_dir=None, model_config: GPTConfig | None = None, config: TrainConfig | None = None,
                   progress=print) -> tuple[Path, Path]:
    """Train the book's tiny GPT on the corpus and write its checkpoint and log (``python -m llmbook train``).

    Defaults: :data:`TINY_GPT`, written to the package's data folder as ``tiny_gpt.pt`` (model weights
    and config, no optimiser state) and ``tiny_gpt_log.json`` (:func:`read_log`). Both files are
    bitwise reproducible on one machine: the log holds no timing. Returns the two paths.
    """
    model_config = TINY_GPT[0] if model_config is None else model_config
    config = TINY_GPT[1] if config is None else config
    tok, train_ids, heldout_ids = corpus_tokens()
    if model_config.vocab_size != tok.vocab_size:
        raise ValueError(f"model_config.vocab_size = {model_config.vocab_size}, but the corpus has "
                         f"{tok.vocab_size} characters")
    model, _, log = train(model_config, config, train_ids, heldout_ids, progress=progress)
    out = _data_dir() if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": model_config, "train": config, "vocab": tok.chars}
    ckpt_path = save_checkpoint(out / CHECKPOINT_FILE, model, None, config.steps, meta)
    record = {"config": _plain(meta), "baselines": _baselines(tok, train_ids, heldout_ids),
              "heldout_loss": log["eval"]["heldout_loss"][-1], **log}
    log_path = out / LOG_FILE
    log_path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return ckpt_path, log_path


def pretrained_tiny(path=None) -> tuple[TinyGPT, CharTokenizer]:
    """The book's trained tiny GPT and its character tokenizer: ``model, tok = pretrained_tiny()``.

    Loads the committed checkpoint (``llmbook/data/tiny_gpt.pt``, or ``path``) with
    ``weights_only=True``; the model is in eval mode, in float32 on the CPU. ``tok.encode(text)`` gives
    token ids (a numpy array), ``tok.decode(ids)`` text; :func:`generate_text` samples a continuation.
    Its held-out loss and training curve are in :func:`read_log`.

    >>> model, tok = pretrained_tiny()
    >>> model.config.vocab_size == tok.vocab_size, model.training
    (True, False)
    """
    ckpt = load_checkpoint(_data_dir() / CHECKPOINT_FILE if path is None else path)
    model = model_from_checkpoint(ckpt).eval()
    return model, CharTokenizer(ckpt["config"]["vocab"])


def generate_text(model: TinyGPT, tok: CharTokenizer, prompt: str = "\n", max_new_tokens: int = 200,
                  seed: int = 0, **sampling) -> str:
    """Sample ``max_new_tokens`` characters after ``prompt`` (non-empty) and return them (without the prompt).

    Uses :meth:`~llmbook.lm.gpt.TinyGPT.generate` with a ``torch.Generator`` seeded by ``seed``; ``sampling`` goes
    to it (``tau=0`` greedy, ``tau``, ``top_k``, ``top_p``, ...).

    >>> model, tok = pretrained_tiny()
    >>> len(generate_text(model, tok, "The ", max_new_tokens=5))
    5
    """
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, got {prompt!r}")
    ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long).unsqueeze(0)
    gen = torch.Generator().manual_seed(check_int(seed, "seed"))
    out = model.generate(ids, max_new_tokens, generator=gen, **sampling)
    return tok.decode(out[0, ids.shape[1]:])


def main(out_dir=None, steps: int | None = None) -> int:
    """``python -m llmbook train [--out DIR] [--steps N]``: :func:`train_tiny_gpt` with progress and a summary.

    ``steps`` shortens the run (warm-up capped at ``steps``) for a quick trial; the committed files come
    from the default :data:`TINY_GPT`.
    """
    model_config, config = TINY_GPT
    if steps is not None:
        steps = check_positive_int(steps, "steps")
        config = dataclasses.replace(config, steps=steps, T_warm=min(config.T_warm, steps))
    start = time.perf_counter()
    ckpt_path, log_path = train_tiny_gpt(out_dir, model_config, config)
    seconds = time.perf_counter() - start
    log = read_log(log_path)
    base = log["baselines"]
    print(f"trained {model_config.n_layers} layers, d_model {model_config.d_model} "
          f"({TinyGPT(model_config).num_parameters():,} parameters) for {config.steps} steps in {seconds:.0f} s")
    print(f"held-out loss {log['heldout_loss']:.4f} nats/char (uniform {base['uniform']:.4f}, "
          f"unigram {base['ngram_1']:.4f}, 5-gram {base['ngram_5']:.4f})")
    print(f"wrote {ckpt_path} ({ckpt_path.stat().st_size / 1e6:.2f} MB) and {log_path}")
    return 0
