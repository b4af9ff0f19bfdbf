"""The temperature widget's computation, checked against direct calculations."""

import math

import pytest
import scipy.stats
import torch

from llmbook.widgets import temperature as tw


def test_parse_filter():
    assert tw.parse_filter("none") == {}
    assert tw.parse_filter("top-k 20") == {"top_k": 20}
    assert tw.parse_filter("min-p 0.05") == {"min_p": 0.05}
    with pytest.raises(ValueError, match="filter must be"):
        tw.parse_filter("top-q 3")


def test_greedy_puts_all_mass_on_the_argmax_and_samples_are_deterministic():
    v = tw.temperature_view(0.0, "none", n_generate=20)
    assert v.kept == 1 and v.entropy_bits == 0.0
    assert v.p_warped[0] == 1.0 and float(v.p_warped[1:].sum()) == 0.0
    assert v.p_original[0] == v.p_original.max()
    # greedy continuation = repeatedly taking the argmax of the fitted model
    m = tw.fitted_model()
    ids = list(tw.PROMPT.encode())
    for _ in range(20):
        ids.append(int(torch.argmax(m.next_distribution(ids))))
    assert v.continuation == bytes(ids[len(tw.PROMPT):]).decode("utf-8", errors="replace")


def test_tau_one_without_filter_is_the_model_and_entropy_matches_scipy():
    v = tw.temperature_view(1.0, "none", n_generate=1)
    p = tw.fitted_model().next_distribution(list(tw.PROMPT.encode()))
    assert torch.allclose(v.p_warped, v.p_original, atol=1e-12)
    assert v.kept == 256
    assert math.isclose(v.entropy_bits, scipy.stats.entropy(p.numpy(), base=2), abs_tol=1e-9)


def test_entropy_grows_with_temperature_and_filters_shrink_the_support():
    hs = [tw.temperature_view(t, "none", n_generate=1).entropy_bits for t in tw.TAUS]
    assert all(a < b for a, b in zip(hs, hs[1:], strict=False))
    assert tw.temperature_view(1.0, "top-k 5", n_generate=1).kept == 5
    p = tw.fitted_model().next_distribution(list(tw.PROMPT.encode()))
    kept_min_p = int((p >= 0.2 * p.max()).sum())
    assert tw.temperature_view(1.0, "min-p 0.2", n_generate=1).kept == kept_min_p
    # top-p 0.9: the smallest prefix of the sorted distribution reaching 0.9
    cum = torch.cumsum(torch.sort(p, descending=True).values, 0)
    assert tw.temperature_view(1.0, "top-p 0.9", n_generate=1).kept == int((cum < 0.9).sum()) + 1


def test_explorer_grid_and_frame():
    ex = tw.temperature_explorer(n_generate=5)
    assert ex.grid_size == len(tw.TAUS) * len(tw.FILTERS)
    png = ex.png(tau=0.5, filter="top-p 0.9")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


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
