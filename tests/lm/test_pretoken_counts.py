"""Parallel pre-token counting (chapter 15's trainer): every cut is exact, and any number of workers counts the same.

Oracles: the serial splitter run on the whole text (the definition of the pieces), checked boundary by boundary
(the pieces of ``text[:i]`` then ``text[i:]`` must equal those of ``text``), and the merges of a one-process
training. Texts are random strings over an alphabet chosen to hit the hard cases: runs of spaces and newlines,
contractions, digits, multi-byte characters, undecodable bytes, and special tokens that overlap each other.
All comparisons are exact.
"""

import random
from collections import Counter

import pytest

from llmbook.data import corpus
from llmbook.lm import pretokenization
from llmbook.lm.bpe import train_bpe
from llmbook.lm.pretoken_counts import count_pretokens, split_points
from llmbook.lm.pretokenization import SpecialSplitter

SPECIALS = ["<|endoftext|>", "<|e", "x\ny"]  # "<|e" overlaps the first; "x\ny" straddles a safe newline
ALPHABET = ["x", "y", "ab", " ", "  ", "\n", "\n\n", " \n", "'s", "7", "é", "🙂", ".", "\t", "<|endoftext|>", "<|e",
            "\r\n"]


def pieces(text, specials):
    return [(p, s) for _, p, s in SpecialSplitter(specials).pieces(text)]


def random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@pytest.mark.parametrize("seed", range(40))
def test_every_boundary_is_exact(seed, monkeypatch):
    monkeypatch.setattr(pretokenization, "CHUNK", 16)  # many search windows per segment
    rng = random.Random(seed)
    text = random_text(rng, 400)
    whole = pieces(text, SPECIALS)
    points = split_points(text, 12, SPECIALS)
    assert points == sorted(set(points)) and all(0 < i < len(text) for i in points)
    for i in points:
        assert pieces(text[:i], SPECIALS) + pieces(text[i:], SPECIALS) == whole, (seed, i, text[max(i - 5, 0):i + 5])


def test_the_rule_matters():
    """The test above can fail: cutting at any other place changes the pieces of some text."""
    rng = random.Random(0)
    bad = 0
    for _ in range(20):
        text = random_text(rng, 200)
        whole = pieces(text, SPECIALS)
        bad += sum(pieces(text[:i], SPECIALS) + pieces(text[i:], SPECIALS) != whole for i in range(1, len(text)))
    assert bad > 1000


@pytest.mark.parametrize("workers", [2, 3])
def test_parallel_counts_equal_serial_for_text_and_file(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(pretokenization, "CHUNK", 64)  # a worker decodes its byte range in small reads
    rng = random.Random(workers)
    text = random_text(rng, 20_000)
    serial = count_pretokens(text, SPECIALS, workers=1)
    assert len(split_points(text, workers, SPECIALS)) == workers - 1  # the text really is cut
    assert count_pretokens(text, SPECIALS, workers=workers) == serial
    path = tmp_path / "c.txt"
    data = text.encode("utf-8") + b"\xff\xfe x\n" + text[:500].encode("utf-8")
    path.write_bytes(data)
    expected = count_pretokens(data.decode("utf-8", "surrogateescape"), SPECIALS, workers=1)
    assert len(split_points(path, workers, SPECIALS)) == workers - 1
    assert count_pretokens(path, SPECIALS, workers=workers) == expected
    assert sum(expected.values()) == sum(1 for p, s in pieces(data.decode("utf-8", "surrogateescape"), SPECIALS)
                                         if not s)


def test_parallel_training_learns_the_same_merges(tmp_path):
    text = "<|endoftext|>".join(corpus()[i:i + 5000] for i in range(0, 60_000, 5000))
    one = train_bpe(text, 200, ["<|endoftext|>"], workers=1)
    assert train_bpe(text, 200, ["<|endoftext|>"], workers=2).merges == one.merges
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    assert train_bpe(path, 200, ["<|endoftext|>"], workers=2).merges == one.merges


def test_a_text_without_exact_boundaries_stays_whole():
    text = "x" * 1000  # one pre-token: no special, no newline
    assert split_points(text, 4) == []
    assert count_pretokens(text, workers=4) == Counter({text: 1})


def test_bad_input():
    with pytest.raises(ValueError, match="workers"):
        count_pretokens("abc", workers=0)
    with pytest.raises(ValueError, match="n_segments"):
        split_points("abc", 0)
    with pytest.raises(TypeError, match="corpus"):
        split_points(123, 2)
    with pytest.raises(TypeError, match="str"):
        count_pretokens(b"abc")
