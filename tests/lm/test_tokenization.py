"""WordPiece scores (15.02) and the Unigram LM (15.03, 15.04) against independent oracles.

Oracles: the worked example of the HuggingFace LLM course (WordPiece scores 1/20 and 1/36), counts
recomputed from the expanded corpus with ``collections.Counter``, HuggingFace ``tokenizers``'
``WordPiece`` and ``Unigram`` models loaded with the same vocabulary (and log-probabilities), and
brute-force enumeration of every segmentation of short strings in float64 (``math.fsum``, ``math.log``).
Tolerances: segmentations and token strings are compared exactly; scores to 1e-12 (float64 sums).
"""

import itertools
import math
import random
from collections import Counter

import pytest

from llmbook.data import corpus
from llmbook.lm.bpe import pretokenize
from llmbook.lm.tokenization import (
    train_unigram,
    train_wordpiece,
    unigram_expected_counts,
    unigram_log_prob,
    unigram_marginal_log_prob,
    viterbi_segment,
    wordpiece_encode,
    wordpiece_scores,
)

COURSE = {"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5}


@pytest.fixture(scope="module")
def words():
    return Counter(w.strip() for w in pretokenize(corpus()[:40_000]) if w.strip().isalpha())


@pytest.mark.equation("15.02", oracle="HF LLM course worked example + Counter over the expanded corpus")
def test_wordpiece_scores_match_the_course_and_a_recount(words):
    s = wordpiece_scores(COURSE)
    assert s[("##g", "##s")] == pytest.approx(1 / 20, abs=1e-15)
    assert s[("##u", "##g")] == pytest.approx(1 / 36, abs=1e-15)
    assert max(s, key=s.get) == ("##g", "##s")
    # recount on the corpus expanded word by word (every occurrence kept)
    sample = dict(list(words.items())[:300])
    expanded = [w for w, c in sample.items() for _ in range(c)]
    units, pairs = Counter(), Counter()
    for w in expanded:
        seg = [w[0]] + ["##" + ch for ch in w[1:]]
        units.update(seg)
        pairs.update(zip(seg, seg[1:], strict=False))
    ours = wordpiece_scores(sample)
    assert set(ours) == set(pairs)
    for p, c in pairs.items():
        assert ours[p] == pytest.approx(c / (units[p[0]] * units[p[1]]), rel=1e-12)


def test_train_wordpiece_merges_the_best_score_and_encodes_like_huggingface(words):
    from tokenizers import Tokenizer, models

    sample = dict(words.most_common(400))
    vocab = train_wordpiece(sample, 150)
    assert len(vocab) == 150 and len(set(vocab)) == 150
    hf = Tokenizer(models.WordPiece({t: i for i, t in enumerate(["[UNK]", *vocab])}, unk_token="[UNK]"))
    for w in list(words)[:500] + ["xyzzy", "Qq"]:
        assert wordpiece_encode(w, set(vocab)) == hf.encode(w).tokens, w
    assert wordpiece_encode("a" * 101, set(vocab)) == ["[UNK]"]


def segmentations(x):
    """Every way to cut x into non-empty pieces (2^(len - 1) of them)."""
    for cuts in itertools.product([False, True], repeat=max(len(x) - 1, 0)):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append(x[start:i])
                start = i
        yield pieces + [x[start:]]


def random_vocab(rng, alphabet="abc", max_len=4):
    pieces = {"".join(p) for n in range(1, max_len + 1) for p in itertools.product(alphabet, repeat=n)}
    pieces = {p for p in pieces if len(p) == 1 or rng.random() < 0.5}  # every single character stays
    return {p: math.log(rng.uniform(0.001, 1.0)) for p in sorted(pieces)}


@pytest.mark.equation("15.03", oracle="float64 product of probabilities; brute-force sum over every segmentation")
def test_unigram_probabilities_match_enumeration():
    rng = random.Random(0)
    for _ in range(30):
        log_p = random_vocab(rng)
        x = "".join(rng.choice("abc") for _ in range(rng.randint(1, 9)))
        segs = [s for s in segmentations(x) if all(t in log_p for t in s)]
        for s in segs[:5]:
            assert unigram_log_prob(s, log_p) == pytest.approx(math.log(math.prod(math.exp(log_p[t]) for t in s)),
                                                               abs=1e-12)
        Z = math.fsum(math.prod(math.exp(log_p[t]) for t in s) for s in segs)
        assert unigram_marginal_log_prob(x, log_p) == pytest.approx(math.log(Z), abs=1e-12)
        expected, log_z = unigram_expected_counts(x, log_p)
        brute = Counter()
        for s in segs:
            w = math.prod(math.exp(log_p[t]) for t in s) / Z
            for t in s:
                brute[t] += w
        assert set(expected) <= set(brute) and log_z == pytest.approx(math.log(Z), abs=1e-12)
        for t, c in brute.items():
            assert expected.get(t, 0.0) == pytest.approx(c, abs=1e-12)
    assert unigram_marginal_log_prob("ad", {"a": -1.0}) == -math.inf


@pytest.mark.equation("15.04", oracle="brute-force argmax over every segmentation of short strings")
def test_viterbi_matches_brute_force():
    rng, unique = random.Random(1), 0
    for _ in range(60):
        log_p = random_vocab(rng)
        x = "".join(rng.choice("abc") for _ in range(rng.randint(1, 11)))
        pieces, score = viterbi_segment(x, log_p)
        scored = [(math.fsum(log_p[t] for t in s), s) for s in segmentations(x) if all(t in log_p for t in s)]
        top = max(sc for sc, _ in scored)
        argmax = [s for sc, s in scored if sc >= top - 1e-12]  # reorderings of the same pieces tie exactly
        assert pieces in argmax and "".join(pieces) == x
        assert score == pytest.approx(top, abs=1e-12)
        unique += len({tuple(sorted(s)) for s in argmax}) == 1 and len(argmax) == 1
    assert unique > 40  # most draws have a single best segmentation


@pytest.mark.equation("15.04", oracle="tokenizers.models.Unigram with the same vocabulary and log-probabilities")
def test_viterbi_matches_huggingface_unigram(words):
    from tokenizers import Tokenizer, models

    rng = random.Random(2)
    log_p = random_vocab(rng, "abcd", 5)
    hf = Tokenizer(models.Unigram([("<unk>", 0.0), *log_p.items()], unk_id=0, byte_fallback=False))
    for _ in range(300):
        x = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 30)))
        assert viterbi_segment(x, log_p)[0] == hf.encode(x).tokens
    # a vocabulary trained on the book's corpus, on real words
    trained = train_unigram(dict(words.most_common(500)), 200, seed_size=1000)
    hf = Tokenizer(models.Unigram([("<unk>", 0.0), *trained.items()], unk_id=0, byte_fallback=False))
    for w in list(words)[:400]:
        if all(ch in trained for ch in w):
            assert viterbi_segment(w, trained)[0] == hf.encode(w).tokens, w


def test_train_unigram_gives_a_normalised_vocabulary(words):
    sample = dict(words.most_common(500))
    log_p = train_unigram(sample, 200, seed_size=1000)
    assert len(log_p) == 200
    assert {ch for w in sample for ch in w} <= set(log_p)  # every character stays: every word has a segmentation
    assert math.fsum(math.exp(v) for v in log_p.values()) == pytest.approx(1.0, abs=1e-9)
    # the trained pieces explain the corpus better than single characters with their own frequencies
    chars = Counter()
    for w, c in sample.items():
        for ch in w:
            chars[ch] += c
    n = sum(chars.values())
    char_lp = {ch: math.log(c / n) for ch, c in chars.items()}
    ll = math.fsum(c * unigram_marginal_log_prob(w, log_p) for w, c in sample.items())
    ll_chars = math.fsum(c * unigram_marginal_log_prob(w, char_lp) for w, c in sample.items())
    assert ll > ll_chars


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="nothing covers 'ab'"):
        viterbi_segment("abc", {"a": -1.0, "c": -1.0})
    with pytest.raises(ValueError, match="log_p"):
        viterbi_segment("a", {"a": 0.5})
    with pytest.raises(TypeError, match="log_p"):
        viterbi_segment("a", {})
    with pytest.raises(TypeError, match="x must be a str"):
        viterbi_segment(["a"], {"a": -1.0})
    with pytest.raises(ValueError, match="not in the vocabulary"):
        unigram_log_prob(["a", "z"], {"a": -1.0})
    with pytest.raises(TypeError, match="single str"):
        unigram_log_prob("a", {"a": -1.0})
    with pytest.raises(ValueError, match="word_counts"):
        wordpiece_scores({"a": 0})
    with pytest.raises(TypeError, match="word_counts"):
        wordpiece_scores(["a"])
    with pytest.raises(ValueError, match="vocab_size"):
        train_unigram({"ab": 2}, 0)
    assert viterbi_segment("", {"a": -1.0}) == ([], 0.0)


def test_try_it_numbers():
    """The segmentations of chapter 15's Try-it solution 3 (unigram vocabularies of 300 and 150 pieces)."""
    from tests.try_it import assert_states

    text = corpus()
    counts = Counter(w.strip() for w in pretokenize(text[:int(0.9 * len(text))]) if w.strip().isalpha())
    seg = {}
    for V in (300, 150):
        log_p = train_unigram(dict(counts.most_common(800)), V, seed_size=1500)
        seg[V] = {w: " ".join(viterbi_segment(w, log_p)[0]) for w in ("statement", "identifiers", "generator")}
    assert seg[300] == {"statement": "statement", "identifiers": "i d ent ifie r s", "generator": "g en e rator"}
    assert seg[150] == {"statement": "statement", "identifiers": "i d ent if i er s", "generator": "g e n er a t or"}
    assert_states("15-tokenization.ipynb", ["`statement` stays one piece", "`i d ent ifie r s` (300 pieces) to "
                                            "`i d ent if i er s`", "`g en e rator` to\n   `g e n er a t or`"])
