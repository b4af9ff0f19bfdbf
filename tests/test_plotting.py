"""The shared plot style, notebook set-up and the source-on-the-page helper."""

import inspect

import pytest

from llmbook.lm import probability
from llmbook.plotting import show_source


def test_show_source_is_the_functions_own_code_and_can_be_cut():
    full = show_source(probability.logsumexp).data
    assert full == inspect.getsource(probability.logsumexp).rstrip("\n")
    cut = show_source(probability.logsumexp, start="def logsumexp", end="def logsumexp").data
    assert cut.splitlines() == [full.splitlines()[[i for i, l in enumerate(full.splitlines())
                                                   if "def logsumexp" in l][0]]]
    with pytest.raises(ValueError, match="contains 'no such line'"):
        show_source(probability.logsumexp, start="no such line")
