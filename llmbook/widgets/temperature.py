"""The temperature widget: how temperature and truncation reshape a real next-token distribution.

The distribution comes from a byte-level n-gram model fitted, at run time, on the frozen offline
corpus (:func:`llmbook.data.corpus`). :func:`temperature_view` is the pure computation (tested in
``tests/widgets/test_temperature.py``); :func:`temperature_explorer` wraps it in an
:class:`~llmbook.widgets.explorer.Explorer` with sliders for the temperature and the truncation rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from llmbook._checks import check_positive_int, check_unit_interval
from llmbook.data import corpus
from llmbook.lm.decoding import apply_temperature, min_p_filter, sample, top_k_filter, top_p_filter
from llmbook.lm.ngram import NGramLM, byte_tokens
from llmbook.lm.probability import entropy, softmax
from llmbook.widgets.explorer import Explorer, Param

__all__ = ["FILTERS", "TAUS", "fitted_model", "parse_filter", "TemperatureView", "temperature_view",
           "temperature_explorer"]

#: Truncation rules offered by the widget, as ``"name value"`` strings.
FILTERS = ["none", "top-k 5", "top-k 20", "top-p 0.5", "top-p 0.9", "min-p 0.05", "min-p 0.2"]
#: Temperatures on the static explorer's grid (0 is greedy).
TAUS = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
PROMPT = "The return statement"


@cache
def fitted_model(order: int = 5, alpha: float = 0.5) -> NGramLM:
    """A byte-level n-gram model fitted on the book's offline corpus (cached)."""
    return NGramLM(order=order, vocab_size=256, alpha=alpha).fit(byte_tokens(corpus()))


def parse_filter(spec: str) -> dict:
    """Turn ``"top-p 0.9"`` into ``{"top_p": 0.9}`` (the keywords of :func:`llmbook.lm.decoding.sample`).

    >>> parse_filter("top-k 5"), parse_filter("none")
    ({'top_k': 5}, {})
    """
    if not isinstance(spec, str):
        raise TypeError(f"filter must be a str such as 'top-p 0.9' or 'none', got {type(spec).__name__}")
    name, _, value = spec.strip().partition(" ")
    if name == "none" and not value:
        return {}
    kinds = {"top-k": ("top_k", int), "top-p": ("top_p", float), "min-p": ("min_p", float)}
    if name not in kinds or not value:
        raise ValueError(f"filter must be 'none' or one of {sorted(kinds)} followed by a value, got {spec!r}")
    key, cast = kinds[name]
    try:
        number = cast(value.strip())
    except ValueError:
        kind = "an int" if cast is int else "a number"
        raise ValueError(f"the value of the {name} filter must be {kind}, got {value.strip()!r} in {spec!r}") from None
    if key == "top_k":
        check_positive_int(number, "top-k's k")
    else:  # top-p's p in (0, 1], min-p's alpha in [0, 1], as sample() checks them
        check_unit_interval(number, f"{name}'s value", low_open=key == "top_p")
    return {key: number}


def _warp(logits: torch.Tensor, tau: float, filt: dict) -> torch.Tensor:
    """Warped logits in the order :func:`~llmbook.lm.decoding.sample` applies them."""
    z = apply_temperature(logits, tau)
    if "top_k" in filt:
        z = top_k_filter(z, filt["top_k"])
    if "top_p" in filt:
        z = top_p_filter(z, filt["top_p"])
    if "min_p" in filt:
        z = min_p_filter(z, filt["min_p"])
    return z


def _show(byte: int) -> str:
    ch = chr(byte)
    return {" ": "␣", "\n": "⏎", "\t": "⇥"}.get(ch, ch if ch.isprintable() and byte < 128 else f"\\x{byte:02x}")


@dataclass
class TemperatureView:
    """Everything the widget draws for one setting."""

    labels: list[str]  # the n_show most likely next bytes under the original model, printable
    p_original: torch.Tensor  # their probabilities at tau = 1, no truncation
    p_warped: torch.Tensor  # their probabilities after temperature and truncation
    entropy_bits: float  # entropy of the whole warped distribution, in bits
    kept: int  # tokens with non-zero probability after warping
    continuation: str  # text sampled with these settings after the prompt


def temperature_view(tau: float, filter: str = "none", prompt: str = PROMPT, n_show: int = 12,
                     n_generate: int = 60, seed: int = 0, model: NGramLM | None = None) -> TemperatureView:
    """Next-byte distribution after ``prompt`` under temperature ``tau`` and a truncation ``filter``.

    ``tau = 0`` is greedy: all mass on the most likely byte. The continuation samples ``n_generate``
    bytes one at a time with :func:`llmbook.lm.decoding.sample` and a generator seeded with ``seed``.
    """
    model = model or fitted_model()
    filt = parse_filter(filter)
    ctx = byte_tokens(prompt)
    logits = model.logits(ctx)
    p0 = softmax(logits)
    top = torch.argsort(p0, descending=True, stable=True)[:n_show]
    p = softmax(_warp(logits, tau, filt))
    kept = int((p > 0).sum())
    gen = torch.Generator().manual_seed(seed)
    out = list(ctx)
    for _ in range(n_generate):
        out.append(int(sample(model.logits(out), tau=tau, generator=gen, **filt)))
    text = bytes(out[len(ctx):]).decode("utf-8", errors="replace")
    h_bits = max(float(entropy(p)) / math.log(2), 0.0)  # +0.0: greedy prints 0, not -0
    return TemperatureView([_show(int(i)) for i in top], p0[top], p[top], h_bits, kept, text)


def draw_temperature(view: TemperatureView, fig) -> None:
    """Bars of the original and warped probabilities, with entropy, support size and a sample."""
    ax = fig.subplots()
    x = torch.arange(len(view.labels)).numpy()
    ax.bar(x - 0.2, view.p_original.numpy(), width=0.4, label="model (τ = 1)", color="#BBBBBB")
    ax.bar(x + 0.2, view.p_warped.numpy(), width=0.4, label="after temperature + filter")
    ax.set_xticks(x, view.labels)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("probability")
    ax.set_xlabel(f"next byte after “{PROMPT}”")
    ax.set_title(f"entropy {view.entropy_bits:.2f} bits · {view.kept} of 256 bytes kept", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    sample_text = view.continuation.replace("\n", "⏎")
    fig.text(0.01, -0.04, f"sample: {PROMPT}{sample_text}", fontsize=8, family="monospace", ha="left", va="top")


def temperature_explorer(n_generate: int = 60) -> Explorer:
    """Sliders for temperature and the truncation rule over the fitted model's distribution."""
    return Explorer(
        lambda tau, filter: temperature_view(tau, filter, n_generate=n_generate),
        draw_temperature,
        [Param("tau", TAUS, label="τ", default=1.0, step=0.05), Param("filter", FILTERS, label="filter")],
        figsize=(7.5, 3.2),
        dpi=72,
        title="temperature explorer",
    )
