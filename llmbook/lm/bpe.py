r"""Byte-level BPE: training with incremental pair counts, and a tokenizer a reader can use.

Byte-pair encoding (Sennrich et al., 2016; byte-level as in GPT-2) starts from the 256 byte values
and repeatedly merges the most frequent adjacent pair into a new token:

.. math::

    (a^*, b^*) = \operatorname*{argmax}_{(a, b)} \mathrm{count}(a, b)

The counts run over the *pre-tokens* of the corpus (pieces cut by
:data:`~llmbook.lm.pretokenization.GPT2_PATTERN`: words with their leading space, numbers, punctuation
runs, whitespace), so a merge never crosses a word boundary.
Every unique pre-token is stored once with its count, and a merge updates only the counts of the
pairs in the words that contain it (:func:`train_bpe`); ``method="naive"`` recounts every pair at
every merge instead, for the benchmark. Ties in the count go to the pair whose bytes ``(a, b)``
compare smallest. Training stops after ``n_merges`` merges or when no pair occurs twice.

Token ids: ``0..255`` are the bytes, ``256 + i`` is the ``i``-th merge, and the special tokens
(e.g. ``"<|endoftext|>"``) follow, so ``V = 256 + len(merges) + len(special_tokens)``. Special
tokens are cut out of the text before pre-tokenisation: they are never split, never merged with
their neighbours, and never learned from.

Text in, text out: :meth:`BPETokenizer.encode` takes a ``str`` and encodes it as UTF-8, so
:meth:`~BPETokenizer.decode` returns exactly the input for every string that *has* a UTF-8 encoding
(emoji, combining marks, any script). A ``str`` with a lone surrogate (``"\ud800"``, which no UTF-8
byte sequence represents) is rejected with ``ValueError``, except the code points ``U+DC80..U+DCFF``
that Python's ``surrogateescape`` uses for undecodable bytes: those encode as the raw byte they stand
for. Arbitrary bytes, malformed UTF-8 included, go through :meth:`~BPETokenizer.encode_bytes` and
:meth:`~BPETokenizer.decode_bytes`, which round-trip any ``bytes`` exactly.

>>> tok = train_bpe("low low low lower lowest", n_merges=3)
>>> [tok.vocab[t] for t in tok.encode(" lowest")]
[b' low', b'e', b's', b't']
>>> tok.decode(tok.encode("naïve 🙂")) == "naïve 🙂", tok.V
(True, 259)
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence

from llmbook._checks import check_choice, check_int, check_nonnegative_int
from llmbook.lm.pretokenization import (
    GPT2_PATTERN,
    SpecialSplitter,
    check_specials,
    chunks_of,
    gpt2_byte_to_unicode,
    pretokenize,  # noqa: F401 - re-exported: bpe.pretokenize is the pre-tokeniser the trainer uses
    to_bytes,
)
from llmbook.registry import implements

__all__ = ["BPETokenizer", "merge_pair", "train_bpe"]  # GPT2_PATTERN and pretokenize live in pretokenization


def merge_pair(word: tuple[int, ...], a: int, b: int, new: int) -> tuple[int, ...]:
    """Replace each non-overlapping occurrence of ``(a, b)`` in ``word``, left to right, by ``new``.

    >>> merge_pair((1, 1, 1, 2), 1, 1, 9)
    (9, 1, 2)
    """
    out, i, n = [], 0, len(word)
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _merge_loop(words: list[tuple[int, ...]], freq: list[int], n_merges: int, vocab: list[bytes]):
    """Incremental BPE: pair counts over unique words, updated only where a merge changes a word."""
    count: dict[tuple[int, int], int] = defaultdict(int)  # count(a, b), weighted by word frequency
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # the words that contain (a, b)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:], strict=False):
            count[pair] += freq[i]
            where[pair].add(i)
    heap = [(-c, vocab[a], vocab[b], (a, b)) for (a, b), c in count.items()]  # max count, then smallest bytes
    heapq.heapify(heap)
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges and heap:
        neg, _, _, (a, b) = heapq.heappop(heap)
        if count.get((a, b), 0) != -neg:
            continue  # a stale entry: this pair's count has changed since it was pushed
        if -neg < 2:
            break  # no pair occurs twice: nothing left worth a token
        new = len(vocab)
        merges.append((a, b))
        vocab.append(vocab[a] + vocab[b])
        changed = set()
        for i in where.pop((a, b)):
            old, f = words[i], freq[i]
            merged = merge_pair(old, a, b, new)
            for pair in zip(old, old[1:], strict=False):  # remove the word's old pairs ...
                count[pair] -= f
                changed.add(pair)
            for pair in zip(merged, merged[1:], strict=False):  # ... and add its new ones
                count[pair] += f
                where[pair].add(i)
                changed.add(pair)
            words[i] = merged
        for pair in changed:
            if count[pair] > 0:
                heapq.heappush(heap, (-count[pair], vocab[pair[0]], vocab[pair[1]], pair))
            else:
                del count[pair]
    return merges


def _merge_loop_naive(words: list[tuple[int, ...]], freq: list[int], n_merges: int, vocab: list[bytes]):
    """The textbook loop: recount every pair of every word before each merge (the benchmark's baseline)."""
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges:
        count: Counter = Counter()
        for w, f in zip(words, freq, strict=True):
            for pair in zip(w, w[1:], strict=False):
                count[pair] += f
        if not count:
            break
        (a, b), c = min(count.items(), key=lambda kv: (-kv[1], vocab[kv[0][0]], vocab[kv[0][1]]))
        if c < 2:
            break
        merges.append((a, b))
        vocab.append(vocab[a] + vocab[b])
        words = [merge_pair(w, a, b, len(vocab) - 1) for w in words]
    return merges


@implements("15.01")
def train_bpe(corpus, n_merges: int, special_tokens: Sequence[str] = (), *, method: str = "incremental"):
    r"""Train a byte-level BPE tokenizer: ``n_merges`` times, merge :math:`\arg\max_{(a,b)} \mathrm{count}(a,b)`.

    ``corpus`` is the training text, a ``str`` (the text itself: a file name given as a ``str`` is an error, not
    trained on), a path (``pathlib.Path``, read as UTF-8 in chunks, undecodable bytes kept through
    ``surrogateescape``) or an iterable of ``str`` chunks (an open text file). ``n_merges`` is
    the most merges to learn (training stops earlier when no pair occurs twice). ``special_tokens`` are strings
    such as ``"<|endoftext|>"``, cut out of the corpus before counting and given the ids after the merges.
    ``method`` is ``"incremental"`` (counts updated per merge) or ``"naive"`` (a full recount per merge); both
    learn the same merges. Returns a :class:`BPETokenizer` with ``V = 256 + len(merges) + len(special_tokens)``.

    >>> tok = train_bpe("aaabdaaabac", n_merges=10)  # Wikipedia's example: aa -> Z, ab -> Y, ZY -> X, then no repeats
    >>> [tok.vocab[t] for t in range(256, tok.V)]
    [b'aa', b'ab', b'aaab']
    """
    n_merges = check_nonnegative_int(n_merges, "n_merges")
    check_choice(method, "method", ("incremental", "naive"))
    specials = check_specials(special_tokens)
    chunks, f = chunks_of(corpus)
    try:
        counts = Counter(piece for piece, special in SpecialSplitter(specials).stream(chunks) if not special)
    finally:
        if f is not None:
            f.close()
    words = [tuple(to_bytes(p)) for p in counts]
    freq = list(counts.values())
    vocab = [bytes([i]) for i in range(256)]
    loop = _merge_loop if method == "incremental" else _merge_loop_naive
    return BPETokenizer(loop(words, freq, n_merges, vocab), specials)


class BPETokenizer:
    """A byte-level BPE tokenizer: ``merges[i] = (a, b)`` makes token ``256 + i``; special tokens follow.

    ``encode`` applies the merges to each pre-token in training order (lowest rank first), which
    reproduces the segmentation training arrived at. ``vocab[t]`` is the byte string of token ``t``.
    """

    def __init__(self, merges: Sequence[tuple[int, int]], special_tokens: Sequence[str] = ()):
        self.merges = [tuple(m) for m in merges]
        self.vocab: list[bytes] = [bytes([i]) for i in range(256)]
        for i, m in enumerate(self.merges):
            if len(m) != 2:
                raise ValueError(f"merges[{i}] must be a pair of token ids, got {m!r}")
            a = check_int(m[0], f"merges[{i}][0]", low=0, high=255 + i)
            b = check_int(m[1], f"merges[{i}][1]", low=0, high=255 + i)
            self.vocab.append(self.vocab[a] + self.vocab[b])
        self.ranks = {m: i for i, m in enumerate(self.merges)}
        specials = check_specials(special_tokens)
        self.special_tokens = {s: len(self.vocab) + i for i, s in enumerate(specials)}
        self.vocab += [s.encode("utf-8") for s in specials]
        self._splitter = SpecialSplitter(specials)
        self._cache: dict[str, list[int]] = {}

    @property
    def V(self) -> int:
        """Vocabulary size, 256 bytes + merges + special tokens."""
        return len(self.vocab)

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            word = tuple(to_bytes(piece))
            while len(word) > 1:
                rank, pair = min((self.ranks.get(p, len(self.ranks)), p) for p in zip(word, word[1:], strict=False))
                if rank == len(self.ranks):
                    break  # no mergeable pair left
                word = merge_pair(word, *pair, 256 + rank)
            ids = list(word)
            if len(self._cache) >= 1 << 16:  # bounded, so a long stream runs in constant memory
                self._cache.clear()
            self._cache[piece] = ids
        return ids

    def _ids(self, pieces: Iterable[tuple[str, bool]]) -> Iterator[int]:
        for piece, special in pieces:
            if special:
                yield self.special_tokens[piece]
            else:
                yield from self._encode_piece(piece)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens in it become their single ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__} (use encode_bytes for bytes)")
        return list(self._ids((p, s) for _, p, s in self._splitter.pieces(text)))

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes (malformed UTF-8 included); ``decode_bytes`` gives them back exactly."""
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        return self.encode(bytes(data).decode("utf-8", "surrogateescape"))

    def encode_iterable(self, chunks: Iterable[str]) -> Iterator[int]:
        """Lazily yield the ids of ``"".join(chunks)`` (e.g. an open text file) in constant memory.

        The ids are exactly those of ``encode`` on the whole text, however the chunks cut it.
        """
        return self._ids(self._splitter.stream(chunks))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes the ids stand for."""
        out = []
        for t in ids:
            out.append(self.vocab[check_int(t, "token id", low=0, high=self.V - 1)])
        return b"".join(out)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """The text of ``ids``; bytes that are not valid UTF-8 (a cut multi-byte character) follow ``errors``."""
        check_choice(errors, "errors", ("replace", "strict", "surrogateescape", "ignore"))
        return self.decode_bytes(ids).decode("utf-8", errors)

    def to_huggingface(self) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """``(vocab, merges)`` in GPT-2's byte-level alphabet, for ``tokenizers.models.BPE(vocab, merges)``.

        With ``pre_tokenizers.ByteLevel(add_prefix_space=False)`` the HF tokenizer encodes like this one
        (special tokens are added to it separately, with ``add_special_tokens``).
        """
        b2u = gpt2_byte_to_unicode()
        text = ["".join(b2u[b] for b in v) for v in self.vocab[:256 + len(self.merges)]]
        return {t: i for i, t in enumerate(text)}, [(text[a], text[b]) for a, b in self.merges]

    def save(self, path) -> None:
        """Write the merges, special tokens and the vocabulary (hex bytes, for reading) as JSON."""
        state = {"format": "llmbook-bpe", "version": 1, "pattern": GPT2_PATTERN,
                 "merges": [list(m) for m in self.merges], "special_tokens": self.special_tokens,
                 "vocab": {str(i): v.hex() for i, v in enumerate(self.vocab)}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=0)

    @classmethod
    def load(cls, path) -> BPETokenizer:
        """Read a file written by :meth:`save`; the vocabulary stored there must match the merges."""
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != "llmbook-bpe":
            raise ValueError(f"{path} is not a tokenizer saved by BPETokenizer.save")
        specials = sorted(state["special_tokens"], key=state["special_tokens"].get)
        tok = cls([tuple(m) for m in state["merges"]], specials)
        if {str(i): v.hex() for i, v in enumerate(tok.vocab)} != state["vocab"]:
            raise ValueError(f"{path}: the stored vocabulary does not match its merges")
        return tok
