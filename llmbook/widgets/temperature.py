"""The temperature widget: how temperature and truncation reshape a trained transformer's next-token distribution.

The distribution is the book's trained tiny GPT's (:func:`llmbook.lm.training.pretrained_tiny`, character-level,
``V = 100``) after a prompt from its corpus. :func:`temperature_view` is the pure computation (tested in
``tests/widgets/test_temperature.py``): the distribution warped by a temperature and one truncation rule,
its entropy, the size of the kept set, and ``n_draws`` draws of the next character with
:func:`llmbook.lm.decoding.sample` from one seeded generator (no forward pass beyond the first, so the
static explorer's whole grid costs one forward pass of the model). :func:`temperature_explorer` wraps it
in an :class:`~llmbook.widgets.explorer.Explorer` with sliders for the temperature and the truncation rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from llmbook._checks import check_nonnegative_int, check_positive_int, check_unit_interval
from llmbook.lm.decoding import apply_temperature, min_p_filter, sample, top_k_filter, top_p_filter
from llmbook.lm.probability import entropy, softmax
from llmbook.widgets.explorer import Explorer, Param

__all__ = ["FILTERS", "TAUS", "PROMPT", "tiny_gpt", "next_logits", "parse_filter", "TemperatureView",
           "temperature_view", "draw_temperature", "temperature_explorer"]

#: Truncation rules offered by the widget, as ``"name value"`` strings.
FILTERS = ["none", "top-k 10", "top-p 0.9", "min-p 0.1"]
#: Temperatures on the static explorer's grid. No 0 (greedy), where every rule gives the same frame.
TAUS = [0.25, 0.5, 1.0, 2.0, 3.0]
#: The prompt, a phrase of the corpus the model was trained on.
PROMPT = "The return statement"


@cache
def tiny_gpt():
    """The book's trained tiny GPT and its tokenizer, loaded once: ``model, tok = tiny_gpt()``."""
    from llmbook.lm.training import pretrained_tiny

    return pretrained_tiny()


@cache
def next_logits(prompt: str = PROMPT) -> torch.Tensor:
    """The tiny GPT's next-character logits after ``prompt`` (its last ``max_seq_len`` characters): ``(V,)``."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty str, got {prompt!r}")
    model, tok = tiny_gpt()
    ids = torch.as_tensor(tok.encode(prompt), dtype=torch.long)[None, -model.config.max_seq_len:]
    with torch.no_grad():
        return model(ids)[0, -1].float()


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


def _show(ch: str) -> str:
    return {" ": "␣", "\n": "⏎", "\t": "⇥"}.get(ch, ch)


@dataclass
class TemperatureView:
    """Everything the widget draws for one setting."""

    tau: float
    filter: str
    labels: list[str]  # the n_show most likely next characters under the model, printable
    p_original: torch.Tensor  # their probabilities at tau = 1, no truncation
    p_warped: torch.Tensor  # their probabilities after temperature and truncation
    entropy_bits: float  # entropy of the whole warped distribution, in bits
    kept: int  # tokens with non-zero probability after warping
    V: int  # vocabulary size
    draws: str  # n_draws independent draws of the next character with these settings, printable


def temperature_view(tau: float, filter: str = "none", prompt: str = PROMPT, n_show: int = 12,
                     n_draws: int = 40, seed: int = 0) -> TemperatureView:
    """The tiny GPT's next-character distribution after ``prompt`` under temperature ``tau`` and a ``filter``.

    ``tau = 0`` is greedy: all mass on the most likely character. ``draws`` holds ``n_draws`` independent
    draws of the next character by :func:`llmbook.lm.decoding.sample` with a generator seeded with
    ``seed`` (the same seed for every setting, so two settings differ only by the distribution).

    >>> v = temperature_view(0.0, n_draws=3)  # greedy: one character left, always drawn
    >>> v.kept, v.entropy_bits, v.draws
    (1, 0.0, '␣␣␣')
    """
    n_show = check_positive_int(n_show, "n_show")
    n_draws = check_nonnegative_int(n_draws, "n_draws")
    filt = parse_filter(filter)
    _, tok = tiny_gpt()
    logits = next_logits(prompt)
    p0 = softmax(logits)
    top = torch.argsort(p0, descending=True, stable=True)[:n_show]
    p = softmax(_warp(logits, tau, filt))
    kept = int((p > 0).sum())
    gen = torch.Generator().manual_seed(seed)
    drawn = sample(logits.expand(n_draws, -1), tau=tau, generator=gen, **filt) if n_draws else torch.zeros(0)
    h_bits = max(float(entropy(p)) / math.log(2), 0.0)  # +0.0: greedy prints 0, not -0
    return TemperatureView(float(tau), filter, [_show(tok.chars[int(i)]) for i in top], p0[top], p[top], h_bits,
                           kept, len(p), "".join(_show(tok.chars[int(i)]) for i in drawn))


def draw_temperature(view: TemperatureView, fig):
    """Bars of the original and warped probabilities, the cut characters shaded, entropy, kept-set size, draws.

    Returns an updater (the :class:`~llmbook.widgets.explorer.Explorer` protocol): the axes, tick labels,
    legend and caption are drawn once into a cached background, and each frame blits only what changes
    (shading, bars, title, draws) onto it and returns the pixels.
    """
    import numpy as np

    ax = fig.add_axes((0.09, 0.31, 0.89, 0.58))
    x = torch.arange(len(view.labels)).numpy()
    spans = [ax.axvspan(i - 0.5, i + 0.5, color="#D55E00", alpha=0.12, lw=0) for i in x]
    original = ax.bar(x - 0.2, view.p_original.numpy(), width=0.4, label="model (τ = 1)", color="#BBBBBB")
    warped = ax.bar(x + 0.2, view.p_warped.numpy(), width=0.4, label="after τ and filter")
    ax.set_xticks(x, view.labels, fontsize=11)
    ax.set_xlim(-0.5, len(x) - 0.5)
    ax.set_ylim(0, 1.0)
    ax.set_ylabel("probability")
    legend = ax.legend(loc="upper right", fontsize=9, title="shaded: cut by the filter", title_fontsize=9)
    fig.text(0.01, 0.13, f"next character after “{PROMPT}”: its 12 likeliest, and {len(view.draws)} draws",
             fontsize=9, ha="left", va="bottom")
    ax.set_title(" ", fontsize=10)
    draws = fig.text(0.01, 0.025, "", fontsize=10, family="monospace", ha="left", va="bottom")
    moving = [*spans, *original, *warped, legend, ax.title]  # drawn per frame, in this order
    for artist in [*moving, draws]:
        artist.set_animated(True)
    canvas = fig.canvas
    canvas.draw()
    background = canvas.copy_from_bbox(fig.bbox)

    def update(v: TemperatureView):
        for span, bar, p in zip(spans, warped, v.p_warped.tolist(), strict=True):
            span.set_visible(p == 0)
            bar.set_height(p)
        ax.title.set_text(f"τ = {v.tau:g}, {v.filter}: keeps {v.kept} of {v.V} characters · "
                          f"entropy {v.entropy_bits:.2f} bits")
        draws.set_text(v.draws)
        canvas.restore_region(background)
        for artist in moving:
            ax.draw_artist(artist)
        fig.draw_artist(draws)
        return np.asarray(canvas.buffer_rgba())

    return update


def temperature_explorer(n_draws: int = 40) -> Explorer:
    """Sliders for temperature and the truncation rule over the tiny GPT's next-character distribution."""
    return Explorer(
        lambda tau, filter: temperature_view(tau, filter, n_draws=n_draws),
        draw_temperature,
        [Param("tau", TAUS, label="τ", default=1.0, step=0.05), Param("filter", FILTERS, label="filter")],
        figsize=(7.0, 3.4),
        title="temperature explorer",
    )
