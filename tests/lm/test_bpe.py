"""Byte-level BPE (15.01, claim C03) against independent oracles.

Oracles: a brute-force trainer written here (every pre-token occurrence of the corpus kept, all pair
counts recounted with ``collections.Counter`` before every merge), HuggingFace ``tokenizers``' BPE
trainer and BPE model with the byte-level pre-tokenizer (merges and encodings compared exactly, on
the merges before the first tied count, since the two break ties differently), and exact round trips.
Every comparison is exact (token ids and byte strings): there is no tolerance.
"""

import json
import random
import re
import tracemalloc
from collections import Counter

import pytest

from llmbook.data import corpus
from llmbook.lm import pretokenization
from llmbook.lm.bpe import BPETokenizer, pretokenize, train_bpe

EOT = "<|endoftext|>"


def brute_force_merges(text, n_merges, specials=(), follow=None, greatest=False):
    """Merges by a full recount of every pair before every merge; also the step of the first tied maximum.

    The pre-tokens are counted once (``Counter``) and every pair is recounted from the current segmentation
    of each of them at every step. With ``follow`` (a list of byte pairs) the recount checks that each of
    those merges is a most frequent pair, and follows it instead of choosing.
    """
    parts = re.split("|".join(map(re.escape, sorted(specials, key=len, reverse=True))), text) if specials else [text]
    words = Counter(w for part in parts for w in pretokenize(part))  # specials cut the text into parts
    segs = {w: [bytes([c]) for c in w.encode("utf-8")] for w in words}
    merges, first_tie = [], None
    for step in range(n_merges if follow is None else len(follow)):
        count = Counter()
        for w, f in words.items():
            for pair in zip(segs[w], segs[w][1:], strict=False):
                count[pair] += f
        if not count or max(count.values()) < 2:
            break
        best = max(count.values())
        tied = sorted(p for p, c in count.items() if c == best)
        if len(tied) > 1 and first_tie is None:
            first_tie = step
        if follow is None:
            a, b = tied[-1] if greatest else tied[0]  # greatest or smallest bytes among the most frequent
        else:
            (a, b) = follow[step]
            assert count[(a, b)] == best, f"step {step}: {(a, b)} has count {count[(a, b)]}, the maximum is {best}"
        merges.append((a, b))
        for w, seg in segs.items():
            out, i = [], 0
            while i < len(seg):
                if i + 1 < len(seg) and seg[i] == a and seg[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seg[i])
                    i += 1
            segs[w] = out
    return merges, first_tie


def merge_bytes(tok):
    return [(tok.vocab[a], tok.vocab[b]) for a, b in tok.merges]


@pytest.fixture(scope="module")
def text():
    return corpus()[:30_000]


@pytest.mark.equation("15.01", oracle="brute-force recount of every pair over every pre-token occurrence, per merge")
@pytest.mark.parametrize("method", ["incremental", "naive"])
def test_merges_match_brute_force_recount(text, method):
    tok = train_bpe(text, 150, method=method)
    ref, _ = brute_force_merges(text, 150)
    assert merge_bytes(tok) == ref
    assert tok.V == 256 + len(tok.merges) == 406  # C03: vocabulary = 256 + merges


@pytest.mark.equation("15.01", oracle="brute-force recount: training stops exactly when no pair occurs twice")
def test_training_stops_when_no_pair_repeats():
    small = "the cat sat on the mat; the cat ate."
    tok = train_bpe(small, 1000)
    ref, _ = brute_force_merges(small, 1000)
    assert merge_bytes(tok) == ref and 0 < len(tok.merges) < 20
    # after the last merge no adjacent pair of the training pre-tokens occurs twice
    count = Counter(p for w in pretokenize(small) for ids in [tok.encode(w)] for p in zip(ids, ids[1:], strict=False))
    assert max(count.values(), default=0) < 2


MIXED = ("Hello, world!  It's 2024: naïve café, 東京, emoji 🙂👍🏽 and 👩‍👩‍👧, e\u0301 (combining), tabs\tand\r\n"
         "newlines\n\n  indented  code_with_under_scores = x**2 + y_1; ½ ² ٣ \x00\x07 'll 're 'VE")


def _tie_free_corpus(seed=0, n_words=150):
    """Random lowercase words with random counts: large, distinct counts make tied maxima rare."""
    rng = random.Random(seed)
    words = {"".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 9))) for _ in range(n_words)}
    occurrences = [w for w in sorted(words) for _ in range(rng.randint(1, 400))]
    rng.shuffle(occurrences)
    return " " + " ".join(occurrences)


def _hf_byte_level(merges=None, vocab=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE() if merges is None else models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _unicode_maps():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    return (lambda b: "".join(b2u[x] for x in b)), {v: k for k, v in b2u.items()}


@pytest.mark.equation("15.01", oracle="tokenizers.trainers.BpeTrainer (byte-level, GPT-2 regex) on a tie-free corpus")
def test_merges_match_huggingface_trainer():
    """Identical merges up to the first tied count; after it, every HF merge is still a most frequent pair."""
    from tokenizers import pre_tokenizers, trainers

    text = _tie_free_corpus()
    n = 300
    ref, first_tie = brute_force_merges(text, n)
    assert first_tie == 80  # this seed's corpus: the first tied maximum comes at merge 80
    hf = _hf_byte_level()
    trainer = trainers.BpeTrainer(vocab_size=256 + n, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=2)
    hf.train_from_iterator([text], trainer)
    _, u2b = _unicode_maps()
    hf_merges = [tuple(bytes(u2b[c] for c in part) for part in (m if isinstance(m, list) else m.split(" ")))
                 for m in json.loads(hf.to_str())["model"]["merges"]]
    ours = train_bpe(text, n)
    assert len(hf_merges) == len(ours.merges) == n
    assert merge_bytes(ours)[:first_tie] == hf_merges[:first_tie] == ref[:first_tie]
    assert merge_bytes(ours) == ref
    brute_force_merges(text, n, follow=hf_merges)  # HF's choices after a tie are most frequent pairs too
    hf_small = _hf_byte_level()  # trained to the tie: the same merges, so the same tokens on any text
    hf_small.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=256 + first_tie, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    small = train_bpe(text, first_tie)
    sample = text[:2000] + MIXED
    assert [small.vocab[t] for t in small.encode(sample)] == [bytes(u2b[c] for c in t)
                                                             for t in hf_small.encode(sample).tokens]


@pytest.mark.equation("15.01", oracle="tokenizers.models.BPE loaded with the same merges: identical encodings")
def test_encode_matches_huggingface_bpe_model(text):
    tok = train_bpe(text, 300, [EOT])
    to_u, _ = _unicode_maps()  # transformers' own bytes_to_unicode
    vocab, merges = tok.to_huggingface()
    assert vocab == {to_u(tok.vocab[i]): i for i in range(256 + len(tok.merges))}
    assert merges == [(to_u(tok.vocab[a]), to_u(tok.vocab[b])) for a, b in tok.merges]
    hf = _hf_byte_level(merges, vocab)
    for sample in (MIXED, corpus()[50_000:58_000]):
        assert tok.encode(sample) == hf.encode(sample).ids
        assert tok.decode(tok.encode(sample)) == hf.decode(hf.encode(sample).ids) == sample


def test_pretokenize_matches_huggingface_byte_level_and_fallback():
    from tokenizers import pre_tokenizers

    _, u2b = _unicode_maps()
    hf = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).pre_tokenize_str(MIXED)
    ours = pretokenize(MIXED)
    assert [p.encode() for p in ours] == [bytes(u2b[c] for c in piece) for piece, _ in hf]
    # the standard-library fallback agrees except on numerals outside Nd (½ ², letters to re)
    plain = MIXED.replace("½ ²", "")
    assert re.findall(pretokenization._FALLBACK_PATTERN, plain) == pretokenize(plain)


def test_more_merges_give_shorter_sequences(text):
    """C03: the encoded length of held-out text is non-increasing in the number of merges."""
    held_out = corpus()[100_000:110_000]
    full = train_bpe(text, 400)
    lengths = []
    for n in (0, 25, 50, 100, 200, 400):
        tok = train_bpe(text, n)
        assert tok.merges == full.merges[:n]  # the merge list of a shorter run is a prefix
        lengths.append(len(tok.encode(held_out)))
    assert lengths[0] == len(held_out.encode()) and all(a >= b for a, b in zip(lengths, lengths[1:], strict=False))
    assert lengths[-1] < 0.5 * lengths[0]


def _random_text(rng, n):
    pools = [" ", "  ", "\n", "\t", "\r\n", "a", "Z", "é", "ß", "東", "🙂", "👍🏽", "\u0301", "\u200d", "'s", "'ll",
             "1", "9", "½", "!", "__", "<|", "|>", EOT, "<|end|>", "\x00", "\ud83d" if False else "x"]
    return "".join(rng.choice(pools) for _ in range(n))


def test_round_trip_any_utf8(text):
    """C03: decode(encode(s)) == s for emoji, combining marks, every script; bytes round-trip exactly."""
    tok = train_bpe(text, 200, [EOT])
    rng = random.Random(0)
    for _ in range(200):
        s = _random_text(rng, rng.randint(0, 40))
        assert tok.decode(tok.encode(s)) == s
    for _ in range(50):
        s = "".join(chr(rng.choice([rng.randint(0, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])) for _ in range(30))
        assert tok.decode(tok.encode(s)) == s
        raw = bytes(rng.randint(0, 255) for _ in range(40))  # malformed UTF-8, mostly
        assert tok.decode_bytes(tok.encode_bytes(raw)) == raw
    assert tok.encode("") == [] and tok.decode([]) == ""
    # a lone surrogate has no UTF-8 encoding: a clear error; surrogateescape code points stand for raw bytes
    with pytest.raises(ValueError, match="lone surrogate U\\+D800"):
        tok.encode("ok \ud800")
    assert tok.decode_bytes(tok.encode("a\udcff")) == b"a\xff"
    # a cut multi-byte character decodes with U+FFFD under the default errors="replace"
    assert tok.decode(tok.encode("🙂")[:1] if len(tok.encode("🙂")) > 1 else [0xF0]) == "\ufffd"


def test_special_tokens_are_never_split_or_merged():
    body = "the end of a story." + EOT + "<|end|>" + " next story begins."
    txt = body * 30
    tok = train_bpe(txt, 200, [EOT, "<|end|>"])
    assert tok.special_tokens == {EOT: 256 + len(tok.merges), "<|end|>": 257 + len(tok.merges)}
    assert tok.V == 256 + len(tok.merges) + 2
    learned = [tok.vocab[256 + i] for i in range(len(tok.merges))]
    assert not any(b"<|" in v or b"|>" in v for v in learned)  # nothing learned from inside a special
    ids = tok.encode("x" + EOT + "<|end|>" + EOT + "y")
    assert ids[1:4] == [tok.special_tokens[EOT], tok.special_tokens["<|end|>"], tok.special_tokens[EOT]]
    assert tok.decode(ids) == "x" + EOT + "<|end|>" + EOT + "y"
    # the same corpus without declaring them: BPE learns merges from their characters
    plain = train_bpe(txt, 200)
    assert any(b"<|" in plain.vocab[256 + i] for i in range(len(plain.merges)))
    # merges match the brute force with the specials cut out
    assert merge_bytes(tok) == brute_force_merges(txt, 200, [EOT, "<|end|>"])[0]


def test_encode_iterable_equals_encode_for_any_chunking(text):
    tok = train_bpe(text, 200, [EOT, "<|end|>"])
    rng = random.Random(1)
    old = pretokenization.CHUNK
    pretokenization.CHUNK = 8  # release pieces often, so every chunk boundary case is exercised
    try:
        for trial in range(300):
            s = _random_text(rng, rng.randint(0, 60)) if trial % 3 else text[rng.randint(0, 20000):][:300]
            cuts = sorted(rng.randint(0, len(s)) for _ in range(rng.randint(0, 12)))
            chunks = [s[i:j] for i, j in zip([0, *cuts], [*cuts, len(s)], strict=False)]
            assert list(tok.encode_iterable(chunks)) == tok.encode(s), (s, chunks)
    finally:
        pretokenization.CHUNK = old


def test_encode_iterable_streams_a_file_in_constant_memory(tmp_path, text, monkeypatch):
    """Peak traced memory does not grow with the file (three times larger) and stays a small fraction of it."""
    tok = train_bpe(text, 200, [EOT])
    monkeypatch.setattr(pretokenization, "CHUNK", 4096)
    block = corpus()[:20_000]
    n_block = len(tok.encode(block)) + 1
    peaks = []
    for reps in (10, 30):
        path = tmp_path / f"big{reps}.txt"
        path.write_text((block + EOT) * reps, encoding="utf-8")
        tracemalloc.start()  # the piece cache is already warm (n_block above): only the stream's own memory counts
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in tok.encode_iterable(f))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        assert n == reps * n_block
    size = path.stat().st_size
    # reading the whole file would hold 600 kB of text alone; the stream holds a 4 kB buffer and its pieces
    assert size > 600_000 and peaks[1] < size / 2 and peaks[1] < 1.25 * peaks[0] + 20_000, (peaks, size)


def test_train_from_file_and_iterable(tmp_path, text):
    path = tmp_path / "corpus.txt"
    path.write_bytes(text.encode() + b"\xff\xfe broken bytes\n")
    from_file = train_bpe(path, 100)
    from_str = train_bpe(text + "\udcff\udcfe broken bytes\n", 100)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        from_lines = train_bpe(f, 100)
    assert from_file.merges == from_str.merges == from_lines.merges


def test_train_from_file_with_special_tokens(tmp_path, text, monkeypatch):
    """Documents separated by <|endoftext|> in a file, read in small chunks so that a special token straddles
    a chunk boundary: the same merges as the brute force on the text with the specials cut out, none of them
    learned from a special token's characters."""
    monkeypatch.setattr(pretokenization, "CHUNK", 97)
    docs = [text[i:i + 1500] for i in range(0, 15_000, 1500)]
    path = tmp_path / "docs.txt"
    path.write_text(EOT.join(docs), encoding="utf-8")
    tok = train_bpe(path, 120, [EOT])
    assert merge_bytes(tok) == brute_force_merges(EOT.join(docs), 120, [EOT])[0]
    assert not any(b"<|" in v or b"|>" in v or b"endoftext" in v for v in tok.vocab[256:tok.special_tokens[EOT]])
    assert tok.encode(docs[0][-20:] + EOT + docs[1][:20]).count(tok.special_tokens[EOT]) == 1
    with pytest.raises(ValueError, match="pathlib.Path"):
        train_bpe(str(path), 10)  # a file name as a str is not silently trained on


def test_save_load_round_trip(tmp_path, text):
    tok = train_bpe(text, 120, [EOT])
    tok.save(tmp_path / "tok.json")
    back = BPETokenizer.load(tmp_path / "tok.json")
    assert back.merges == tok.merges and back.vocab == tok.vocab and back.special_tokens == tok.special_tokens
    assert back.encode(MIXED + EOT) == tok.encode(MIXED + EOT)
    state = json.loads((tmp_path / "tok.json").read_text())
    state["vocab"]["300"] = "00"
    (tmp_path / "bad.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="does not match"):
        BPETokenizer.load(tmp_path / "bad.json")


def test_bad_input_is_rejected(text):
    with pytest.raises(TypeError, match="n_merges"):
        train_bpe(text, 2.5)
    with pytest.raises(ValueError, match="n_merges"):
        train_bpe(text, -1)
    with pytest.raises(TypeError, match="bytes"):
        train_bpe(b"abc", 3)
    with pytest.raises(TypeError, match="single str"):
        train_bpe(text, 3, EOT)
    with pytest.raises(ValueError, match="method"):
        train_bpe(text, 3, method="fast")
    with pytest.raises(TypeError, match="chunks must be str"):
        list(train_bpe(text, 3).encode_iterable([b"abc"]))
    with pytest.raises(ValueError, match=r"merges\[0\]\[0\]"):
        BPETokenizer([(256, 1)])
    tok = train_bpe(text, 3)
    with pytest.raises(ValueError, match="token id"):
        tok.decode([tok.V])
    with pytest.raises(TypeError, match="encode_bytes"):
        tok.encode(b"abc")


def test_try_it_numbers():
    """The numbers of chapter 15's Try-it solutions 1 and 2 (the notebook's 1000-merge tokenizer)."""
    from tests.try_it import assert_states

    text = corpus()
    tok = train_bpe(text[:int(0.9 * len(text))], 1000, [EOT])
    counts = [len(tok.encode(w)) for w in (" return", " Return", " RETURN")]
    assert counts == [1, 4, 7]
    assert [tok.vocab[t] for t in tok.encode(" Return")] == [b" ", b"R", b"et", b"urn"]
    emoji = tok.encode("🙂")
    assert len(emoji) == 4 and tok.decode(emoji[:1]) == "\ufffd" and tok.vocab[emoji[0]] == b"\xf0"
    assert_states("15-tokenization.ipynb", ["1, 4 and 7 tokens", "` return` | `␣` `R` `et` `urn`", "4 tokens",
                                            "`0xF0`", "`�` (U+FFFD)"])


# ---------------------------------------------------------------- loading and training options (issue 28)


@pytest.mark.parametrize("method", ["incremental", "naive"])
def test_tie_break_greatest_matches_brute_force(text, method):
    n = 150
    tok = train_bpe(text, n, tie_break="greatest", method=method)
    ref, first_tie = brute_force_merges(text, n, greatest=True)
    assert merge_bytes(tok) == ref
    smallest = merge_bytes(train_bpe(text, n))
    assert smallest[:first_tie] == ref[:first_tie] and smallest != ref  # the rule matters from the first tie


def test_vocab_size_and_input_path_forms(tmp_path, text):
    tok = train_bpe(text, vocab_size=256 + 100 + 1, special_tokens=[EOT])
    assert tok.V == 357 and tok.merges == train_bpe(text, 100, [EOT]).merges
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    assert train_bpe(input_path=str(path), n_merges=60).merges == train_bpe(path, 60).merges
    with pytest.raises(TypeError, match="exactly one of n_merges and vocab_size"):
        train_bpe(text, 10, vocab_size=300)
    with pytest.raises(TypeError, match="exactly one of n_merges and vocab_size"):
        train_bpe(text)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(text, vocab_size=256, special_tokens=[EOT])  # no room for the special token
    with pytest.raises(TypeError, match="exactly one of corpus"):
        train_bpe(text, 10, input_path=path)
    with pytest.raises(ValueError, match="not a file"):
        train_bpe(input_path=str(tmp_path / "missing.txt"), n_merges=5)


def test_special_tokens_first(tmp_path, text):
    specials = [EOT, "<|end|>"]
    last = train_bpe(text, 120, specials)
    first = train_bpe(text, 120, specials, special_first=True)
    assert first.special_tokens == {EOT: 0, "<|end|>": 1} and first.V == last.V
    assert first.vocab[2:] == last.vocab[:-2]  # the same tokens, moved up by S = 2
    sample = MIXED + EOT + text[:500] + "<|end|>"
    remap = {i: i + 2 for i in range(last.V - 2)} | {last.special_tokens[s]: first.special_tokens[s] for s in specials}
    assert first.encode(sample) == [remap[t] for t in last.encode(sample)]
    assert first.decode(first.encode(sample)) == sample
    first.save(tmp_path / "tok.json")
    again = BPETokenizer.load(str(tmp_path / "tok.json"))  # a str path works too
    assert again.special_first and again.encode(sample) == first.encode(sample)


def test_from_vocab_with_any_id_layout(text):
    tok = train_bpe(text, 200, [EOT])
    rng = random.Random(0)
    order = list(range(tok.V))
    rng.shuffle(order)  # token t gets id order[t]: bytes are no longer ids 0..255
    vocab = {order[t]: tok.vocab[t] for t in range(tok.V)}
    merges = [(tok.vocab[a], tok.vocab[b]) for a, b in tok.merges]
    other = BPETokenizer.from_vocab(vocab, merges, [EOT])
    sample = MIXED + EOT + text[:3000]
    assert other.encode(sample) == [order[t] for t in tok.encode(sample)]
    assert other.decode(other.encode(sample)) == sample
    assert other.special_tokens == {EOT: order[tok.special_tokens[EOT]]}
    with pytest.raises(ValueError, match="not in the vocabulary"):
        BPETokenizer.from_vocab(vocab, merges + [(b"zq", b"xj")])
    with pytest.raises(ValueError, match="every single byte"):
        BPETokenizer.from_vocab({i: bytes([i]) for i in range(200)}, [])
    with pytest.raises(ValueError, match="ids must be"):
        BPETokenizer.from_vocab({1: b"a"}, [])


def test_from_files_is_the_inverse_of_to_files_and_loads_into_huggingface(tmp_path, text):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = train_bpe(text, 300, [EOT])
    vocab_path, merges_path = tmp_path / "vocab.json", tmp_path / "merges.txt"
    tok.to_files(vocab_path, merges_path)
    again = BPETokenizer.from_files(str(vocab_path), str(merges_path), [EOT])
    assert again.vocab == tok.vocab and again.merges == tok.merges and again.special_tokens == tok.special_tokens
    # independent reader: Hugging Face's BPE model built from the very same two files
    hf = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for sample in (MIXED, corpus()[50_000:56_000]):
        assert again.encode(sample) == hf.encode(sample).ids


def test_load_rejects_another_pretokenisation_pattern(tmp_path, text):
    tok = train_bpe(text, 20)
    path = tmp_path / "tok.json"
    tok.save(path)
    state = json.loads(path.read_text())
    state["pattern"] = r"\S+|\s+"
    path.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="pre-tokenisation pattern"):
        BPETokenizer.load(path)


def test_special_token_policy_follows_tiktoken(text):
    """``allowed_special`` / ``disallowed_special``: allowed -> one id, disallowed -> ValueError, neither -> plain text.

    The oracle for "plain text" is a tokenizer with the same merges and *no* special tokens, and HuggingFace's
    BPE model loaded with those merges (it knows no special token either); the allowed case is assembled by hand
    from the pieces between the special tokens.
    """
    tok = train_bpe(text, 200, [EOT, "<|pad|>"])
    plain = BPETokenizer(tok.merges)
    hf = _hf_byte_level(*reversed(tok.to_huggingface()))
    doc = "one<|pad|>two" + EOT + "three <|endoftext|"
    with pytest.raises(ValueError, match="disallowed"):
        tok.encode(doc, allowed_special=set())               # tiktoken's default: any special string raises
    with pytest.raises(ValueError, match="<\\|pad\\|>"):
        tok.encode(doc, allowed_special={EOT})                # <|pad|> is disallowed ("all" = all not allowed)
    as_text = tok.encode(doc, allowed_special=set(), disallowed_special=())
    assert as_text == plain.encode(doc) == hf.encode(doc).ids
    mixed = tok.encode(doc, allowed_special={EOT}, disallowed_special=())
    assert mixed == plain.encode("one<|pad|>two") + [tok.special_tokens[EOT]] + plain.encode("three <|endoftext|")
    full = tok.encode(doc)                                    # the default: every special token allowed
    assert full == (plain.encode("one") + [tok.special_tokens["<|pad|>"]] + plain.encode("two")
                    + [tok.special_tokens[EOT]] + plain.encode("three <|endoftext|"))
    with pytest.raises(ValueError, match="disallowed"):
        tok.encode(doc, allowed_special={"<|pad|>"}, disallowed_special={EOT})
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode(doc, allowed_special={"<|bos|>"})
    with pytest.raises(TypeError, match="allowed_special"):
        tok.encode(doc, allowed_special=EOT)
