"""The published pre-tokenisation patterns (GPT-2, cl100k / Llama 3, o200k) against an independent regex engine.

Oracle: HuggingFace ``tokenizers``' ``pre_tokenizers.Split(Regex(pattern), behavior="isolated")``, which runs the
same pattern in Rust's Oniguruma engine (not Python's ``regex``), on strings that exercise every alternative:
contractions in any case, digit runs, leading non-letters, newlines, CJK, emoji, combining accents. The
pattern texts are compared with the published ones (tiktoken's ``openai_public.py``; Meta's ``llama3``
``tokenizer.py``), and a few splits with what the tiktoken documentation and the Llama 3 code imply by hand.
"""

from __future__ import annotations

import pytest
from tokenizers import Regex, pre_tokenizers

from llmbook.data import corpus
from llmbook.lm.pretokenization import CL100K_PATTERN, LLAMA3_PATTERN, PATTERNS, pretokenize, pretokenize_as

STRINGS = [
    "He'LL pay 12345 for x.append\n\n  def f(a, b):\r\n\treturn a+b  ",
    "I'm naïve: 東京 🙂👍🏽 e\u0301 HTTPServer's 3.14159 ½ ² DON'T we've",
    "   \n\n\t x  y\n",
    "",
]

# tiktoken_ext/openai_public.py (cl100k_base) and meta-llama/llama3 llama/tokenizer.py (pat_str), verbatim
PUBLISHED_CL100K = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                    r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


@pytest.mark.parametrize("scheme", sorted(PATTERNS))
def test_patterns_match_tokenizers_split(scheme):
    split = pre_tokenizers.Split(Regex(PATTERNS[scheme]), behavior="isolated")
    for s in [*STRINGS, corpus()[:20_000]]:
        ours = pretokenize_as(s, scheme)
        assert ours == [piece for piece, _ in split.pre_tokenize_str(s)]
        assert "".join(ours) == s


def test_published_pattern_texts_and_hand_splits():
    assert CL100K_PATTERN == PUBLISHED_CL100K == LLAMA3_PATTERN
    assert pretokenize_as("gpt2 text", "gpt2") == pretokenize("gpt2 text")
    s = "DON'T pay 1234567"
    assert pretokenize_as(s, "gpt2") == ["DON", "'", "T", " pay", " 1234567"]       # lower-case 't only
    assert pretokenize_as(s, "cl100k") == ["DON", "'T", " pay", " ", "123", "456", "7"]  # (?i:), groups of 3
    assert pretokenize_as(s, "o200k") == ["DON'T", " pay", " ", "123", "456", "7"]     # contraction attached
    assert pretokenize_as("HTTPServer", "o200k") == ["HTTPServer"] and pretokenize_as("getHTTPServer", "o200k") == [
        "get", "HTTPServer"]


def test_bad_input():
    with pytest.raises(ValueError, match="scheme"):
        pretokenize_as("x", "gpt5")
    with pytest.raises(TypeError, match="str"):
        pretokenize_as(b"x", "gpt2")
