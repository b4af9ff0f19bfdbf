"""The temperature widget's computation, checked against direct calculations on the tiny GPT."""

import math

import pytest
import scipy.stats
import torch
from transformers import TopPLogitsWarper

from llmbook.widgets import explorer
from llmbook.widgets import temperature as tw


@pytest.fixture(scope="module")
def p_model():
    """The tiny GPT's next-character distribution after the prompt, computed here without the widget."""
    model, tok = tw.tiny_gpt()
    ids = torch.as_tensor(tok.encode(tw.PROMPT), dtype=torch.long)[None]
    with torch.no_grad():
        return torch.softmax(model(ids)[0, -1].double(), -1)


def test_parse_filter():
    assert tw.parse_filter("none") == {}
    assert tw.parse_filter("top-k 20") == {"top_k": 20}
    assert tw.parse_filter("min-p 0.05") == {"min_p": 0.05}
    with pytest.raises(ValueError, match="filter must be"):
        tw.parse_filter("top-q 3")


def test_next_logits_are_the_models_and_the_view_shows_them(p_model):
    v = tw.temperature_view(1.0, "none", n_draws=1)
    torch.testing.assert_close(torch.softmax(tw.next_logits().double(), -1), p_model, rtol=0, atol=1e-6)
    assert v.V == 100 and len(v.labels) == 12
    top = torch.argsort(p_model, descending=True)[:12]
    torch.testing.assert_close(v.p_original.double(), p_model[top], rtol=0, atol=1e-6)
    chars = tw.tiny_gpt()[1].chars
    assert v.labels == [{" ": "␣", "\n": "⏎"}.get(chars[i], chars[i]) for i in top.tolist()]
    with pytest.raises(ValueError, match="prompt must be a non-empty str"):
        tw.next_logits("")


def test_greedy_puts_all_mass_on_the_argmax_and_every_draw_is_it(p_model):
    v = tw.temperature_view(0.0, "none", n_draws=20)
    assert v.kept == 1 and v.entropy_bits == 0.0
    assert v.p_warped[0] == 1.0 and float(v.p_warped[1:].sum()) == 0.0
    assert v.draws == v.labels[0] * 20


def test_tau_one_without_filter_is_the_model_and_entropy_matches_scipy(p_model):
    v = tw.temperature_view(1.0, "none", n_draws=1)
    torch.testing.assert_close(v.p_warped, v.p_original, rtol=0, atol=1e-12)
    assert v.kept == 100
    assert math.isclose(v.entropy_bits, scipy.stats.entropy(p_model.numpy(), base=2), abs_tol=1e-5)


def test_entropy_grows_with_temperature_and_filters_shrink_the_support(p_model):
    hs = [tw.temperature_view(t, "none", n_draws=1).entropy_bits for t in tw.TAUS]
    assert all(a < b for a, b in zip(hs, hs[1:], strict=False))
    assert tw.temperature_view(1.0, "top-k 10", n_draws=1).kept == 10
    assert tw.temperature_view(1.0, "min-p 0.1", n_draws=1).kept == int((p_model >= 0.1 * p_model.max()).sum())
    for tau in tw.TAUS:  # top-p after temperature: transformers' warper is the oracle
        z = torch.log(p_model).float()[None] / tau
        kept = int(torch.isfinite(TopPLogitsWarper(0.9)(None, z)).sum())
        assert tw.temperature_view(tau, "top-p 0.9", n_draws=1).kept == kept, tau


def test_draws_come_from_the_kept_set_and_are_seeded(p_model):
    v = tw.temperature_view(3.0, "min-p 0.1", n_draws=200)
    # min-p 0.1 after temperature 3 keeps p_i^(1/3) >= 0.1 max_j p_j^(1/3), written in logs
    logp = torch.log(p_model)
    kept = logp >= logp.max() - 3.0 * math.log(10)
    chars = tw.tiny_gpt()[1].chars
    kept_chars = {{" ": "␣", "\n": "⏎"}.get(chars[i], chars[i]) for i in torch.nonzero(kept).flatten().tolist()}
    assert v.kept == int(kept.sum()) and len(v.draws) == 200
    assert set(v.draws) <= kept_chars and len(set(v.draws)) > 5
    assert tw.temperature_view(3.0, "min-p 0.1", n_draws=200).draws == v.draws
    assert tw.temperature_view(3.0, "min-p 0.1", n_draws=200, seed=1).draws != v.draws


def test_every_grid_point_shows_an_effect():
    """No frame where the slider changes nothing: every filter cuts at every τ, and τ moves the entropy."""
    for tau in tw.TAUS:
        for spec in tw.FILTERS[1:]:
            assert tw.temperature_view(tau, spec, n_draws=1).kept < 100, (tau, spec)
    for spec in tw.FILTERS:
        hs = [tw.temperature_view(t, spec, n_draws=1).entropy_bits for t in tw.TAUS]
        assert min(b - a for a, b in zip(hs, hs[1:], strict=False)) > 0.05, spec


def test_explorer_grid_and_readable_frame():
    ex = tw.temperature_explorer(n_draws=5)
    assert ex.grid_size == len(tw.TAUS) * len(tw.FILTERS)
    png = ex.png(tau=0.5, filter="top-p 0.9")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert ex.dpi >= 100 and ex.figsize[0] * ex.dpi <= explorer.MAX_DISPLAY_WIDTH_PX
    assert ex.smallest_text_pt(tau=3.0, filter="none") >= 9


@pytest.mark.parametrize(
    "spec, exc, match",
    [
        # issue 11: parse_filter failed with int()/float() errors or an AttributeError on bad input
        (None, TypeError, r"filter must be a str such as 'top-p 0.9' or 'none', got NoneType"),
        (0.9, TypeError, r"filter must be a str .*, got float"),
        ("top-k 2.5", ValueError, r"the value of the top-k filter must be an int, got '2.5' in 'top-k 2.5'"),
        ("top-p abc", ValueError, r"the value of the top-p filter must be a number, got 'abc'"),
        ("top-k 0", ValueError, r"top-k's k must be a positive int, got 0"),
        ("top-p 1.5", ValueError, r"top-p's value must lie in \(0.0, 1.0\], got 1.5"),
        ("top-p 0", ValueError, r"top-p's value must lie in \(0.0, 1.0\], got 0.0"),
        ("min-p nan", ValueError, r"min-p's value must be a real number, got nan"),
        ("top-p", ValueError, r"filter must be 'none' or one of"),
    ],
)
def test_parse_filter_rejects_bad_specs(spec, exc, match):
    with pytest.raises(exc, match=match):
        tw.parse_filter(spec)


def test_parse_filter_round_trips_good_specs():
    # oracle: the keywords sample() takes, written out by hand
    assert tw.parse_filter(" top-p  0.5 ") == {"top_p": 0.5}
    assert tw.parse_filter("min-p 0") == {"min_p": 0.0}
    assert tw.parse_filter("top-k 7") == {"top_k": 7}
