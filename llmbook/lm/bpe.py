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
every merge instead, for the benchmark. Ties in the count go, by default, to the pair whose bytes
``(a, b)`` compare smallest (``tie_break="smallest"``); ``tie_break="greatest"`` gives them to the
lexicographically greatest pair, the convention of several course implementations. Ties are frequent on
a small corpus (they decide about a third of the merges), so two trainers agree only under one rule.
Training stops after ``n_merges`` merges (or at ``vocab_size``) or when no pair occurs twice.

Token ids: ``0..255`` are the bytes, ``256 + i`` is the ``i``-th merge, and the special tokens
(e.g. ``"<|endoftext|>"``) follow, so ``V = 256 + len(merges) + len(special_tokens)``; with
``special_first=True`` the special tokens take ids ``0..S-1`` and everything else moves up by ``S``.
Special tokens are cut out of the text before pre-tokenisation: they are never split, never merged with
their neighbours, and never learned from.

Tokenizers trained elsewhere load too: :meth:`BPETokenizer.from_vocab` takes a ``dict[int, bytes]``
vocabulary with merges as byte pairs (any id layout), and :meth:`BPETokenizer.from_files` reads GPT-2's
``vocab.json`` and ``merges.txt`` (the files :meth:`BPETokenizer.to_files` writes, the inverse of
:meth:`BPETokenizer.to_huggingface`).

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
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from llmbook._checks import check_choice, check_int, check_nonnegative_int
from llmbook.lm.pretoken_counts import count_pretokens
from llmbook.lm.pretokenization import (
    GPT2_PATTERN,
    SpecialSplitter,
    check_specials,
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


class _Greater(bytes):
    """Bytes that sort in reverse, so a min-heap pops the lexicographically greatest pair first."""

    def __lt__(self, other):
        return bytes.__gt__(self, other)


def _merge_loop(words: list[tuple[int, ...]], freq: list[int], n_merges: int, vocab: list[bytes],
                tie_break: str = "smallest"):
    """Incremental BPE: pair counts over unique words, updated only where a merge changes a word."""
    key = (lambda t: vocab[t]) if tie_break == "smallest" else (lambda t: _Greater(vocab[t]))
    count: dict[tuple[int, int], int] = defaultdict(int)  # count(a, b), weighted by word frequency
    where: dict[tuple[int, int], set[int]] = defaultdict(set)  # the words that contain (a, b)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:], strict=False):
            count[pair] += freq[i]
            where[pair].add(i)
    heap = [(-c, key(a), key(b), (a, b)) for (a, b), c in count.items()]  # max count, then the tie rule
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
                heapq.heappush(heap, (-count[pair], key(pair[0]), key(pair[1]), pair))
            else:
                del count[pair]
    return merges


def _merge_loop_naive(words: list[tuple[int, ...]], freq: list[int], n_merges: int, vocab: list[bytes],
                      tie_break: str = "smallest"):
    """The textbook loop: recount every pair of every word before each merge (the benchmark's baseline)."""
    merges: list[tuple[int, int]] = []
    while len(merges) < n_merges:
        count: Counter = Counter()
        for w, f in zip(words, freq, strict=True):
            for pair in zip(w, w[1:], strict=False):
                count[pair] += f
        if not count:
            break
        if tie_break == "smallest":
            (a, b), c = min(count.items(), key=lambda kv: (-kv[1], vocab[kv[0][0]], vocab[kv[0][1]]))
        else:
            (a, b), c = max(count.items(), key=lambda kv: (kv[1], vocab[kv[0][0]], vocab[kv[0][1]]))
        if c < 2:
            break
        merges.append((a, b))
        vocab.append(vocab[a] + vocab[b])
        words = [merge_pair(w, a, b, len(vocab) - 1) for w in words]
    return merges


@implements("15.01")
def train_bpe(corpus=None, n_merges: int | None = None, special_tokens: Sequence[str] = (), *,
              vocab_size: int | None = None, input_path: str | os.PathLike | None = None,
              tie_break: str = "smallest", special_first: bool = False, method: str = "incremental",
              workers: int | None = None):
    r"""Train a byte-level BPE tokenizer: ``n_merges`` times, merge :math:`\arg\max_{(a,b)} \mathrm{count}(a,b)`.

    ``corpus`` is the training text, a ``str`` (the text itself: a file name given as a ``str`` is an error, not
    trained on), a path (``pathlib.Path``, read as UTF-8 in chunks, undecodable bytes kept through
    ``surrogateescape``) or an iterable of ``str`` chunks (an open text file). ``n_merges`` is
    the most merges to learn (training stops earlier when no pair occurs twice). ``special_tokens`` are strings
    such as ``"<|endoftext|>"``, cut out of the corpus before counting and given the ids after the merges.
    ``method`` is ``"incremental"`` (counts updated per merge) or ``"naive"`` (a full recount per merge); both
    learn the same merges. Returns a :class:`BPETokenizer` with ``V = 256 + len(merges) + len(special_tokens)``.

    Keyword forms: ``vocab_size`` instead of ``n_merges`` (``n_merges = vocab_size - 256 - len(special_tokens)``;
    give one of the two); ``input_path`` (a ``str`` or a path) instead of ``corpus`` to train on a file;
    ``tie_break`` ``"smallest"`` (default) or ``"greatest"`` (see the module's docstring); ``special_first``
    puts the special tokens at ids ``0..S-1``; ``workers`` processes count the pre-tokens
    (:func:`~llmbook.lm.pretoken_counts.count_pretokens`: ``None`` uses every core on a text of a million
    characters or more; the merges do not depend on it).

    >>> tok = train_bpe("aaabdaaabac", n_merges=10)  # Wikipedia's example: aa -> Z, ab -> Y, ZY -> X, then no repeats
    >>> [tok.vocab[t] for t in range(256, tok.V)]
    [b'aa', b'ab', b'aaab']
    """
    check_choice(method, "method", ("incremental", "naive"))
    check_choice(tie_break, "tie_break", ("smallest", "greatest"))
    specials = check_specials(special_tokens)
    if (n_merges is None) == (vocab_size is None):
        raise TypeError(f"give exactly one of n_merges and vocab_size, got n_merges={n_merges!r}, "
                        f"vocab_size={vocab_size!r}")
    if vocab_size is not None:
        n_merges = check_int(vocab_size, "vocab_size", low=256 + len(specials),
                             what=f"an int >= 256 + {len(specials)} special tokens") - 256 - len(specials)
    n_merges = check_nonnegative_int(n_merges, "n_merges")
    if (corpus is None) == (input_path is None):
        raise TypeError("give exactly one of corpus (the text, a path or an iterable of str) and input_path")
    if input_path is not None:
        if not isinstance(input_path, (str, os.PathLike)):
            raise TypeError(f"input_path must be a str or a path, got {type(input_path).__name__}")
        corpus = os.fspath(input_path)
        if not os.path.isfile(corpus):
            raise ValueError(f"input_path {corpus!r} is not a file")
        corpus = Path(corpus)
    counts = count_pretokens(corpus, specials, workers=workers)
    words = [tuple(to_bytes(p)) for p in counts]
    freq = list(counts.values())
    vocab = [bytes([i]) for i in range(256)]
    loop = _merge_loop if method == "incremental" else _merge_loop_naive
    merges = loop(words, freq, n_merges, vocab, tie_break)
    S = len(specials) if special_first else 0  # the loop numbered bytes 0..255; shift past the specials
    return BPETokenizer([(a + S, b + S) for a, b in merges], specials, special_first=special_first)


class BPETokenizer:
    """A byte-level BPE tokenizer: ``merges[i] = (a, b)`` makes token ``256 + i``; special tokens follow.

    ``encode`` applies the merges to each pre-token in training order (lowest rank first), which
    reproduces the segmentation training arrived at. ``vocab[t]`` is the byte string of token ``t``.
    ``merges`` are pairs of this tokenizer's ids; with ``special_first`` the special tokens are ids
    ``0..S-1``, the bytes ``S..S+255`` and merge ``i`` makes ``S + 256 + i``. Other layouts (GPT-2's,
    or any ``dict[int, bytes]``) load through :meth:`from_vocab` and :meth:`from_files`.
    """

    def __init__(self, merges: Sequence[tuple[int, int]], special_tokens: Sequence[str] = (), *,
                 special_first: bool = False):
        if not isinstance(special_first, bool):
            raise TypeError(f"special_first must be a bool, got {special_first!r}")
        specials = check_specials(special_tokens)
        S = len(specials) if special_first else 0
        vocab: list[bytes] = [s.encode("utf-8") for s in specials] if special_first else []
        vocab += [bytes([i]) for i in range(256)]
        merges = [tuple(m) for m in merges]
        for i, m in enumerate(merges):
            if len(m) != 2:
                raise ValueError(f"merges[{i}] must be a pair of token ids, got {m!r}")
            a = check_int(m[0], f"merges[{i}][0]", low=S, high=S + 255 + i)
            b = check_int(m[1], f"merges[{i}][1]", low=S, high=S + 255 + i)
            vocab.append(vocab[a] + vocab[b])
        ids = range(S + 256, S + 256 + len(merges))
        special_ids = range(S) if special_first else range(len(vocab), len(vocab) + len(specials))
        if not special_first:
            vocab += [s.encode("utf-8") for s in specials]
        self._setup(vocab, merges, list(ids), dict(zip(specials, special_ids, strict=True)),
                    list(range(S, S + 256)))
        self.special_first = special_first

    def _setup(self, vocab: list[bytes], merges: list[tuple[int, int]], merged: list[int],
               special_tokens: dict[str, int], byte_ids: list[int]) -> None:
        """The state every constructor fills: ids -> bytes, the merges (id pairs, in rank order), the id each
        merge makes, the special tokens' ids and the id of each single byte."""
        self.vocab, self.merges, self._merged = vocab, merges, merged
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.special_tokens, self._byte_ids = special_tokens, byte_ids
        self.special_first = bool(special_tokens) and min(special_tokens.values()) == 0
        self._splitter = SpecialSplitter(list(special_tokens))
        self._splitters: dict[frozenset, SpecialSplitter] = {}  # one per allowed subset, for encode
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_vocab(cls, vocab: Mapping[int, bytes], merges: Sequence[tuple[bytes, bytes]],
                   special_tokens: Sequence[str] = ()) -> BPETokenizer:
        """A tokenizer from a vocabulary ``{id: bytes}`` (ids ``0..V-1``, any order of tokens) and merges given as
        byte pairs in rank order, the form most BPE trainers return.

        Every single byte must be in the vocabulary, and each merge's two parts and their concatenation too. A
        special token whose bytes are in the vocabulary keeps that id; the others are appended.

        >>> tok = BPETokenizer.from_vocab({i: bytes([i]) for i in range(256)} | {256: b"ab"}, [(b"a", b"b")])
        >>> tok.encode("abc")
        [256, 99]
        """
        if not isinstance(vocab, Mapping):
            raise TypeError(f"vocab must be a dict {{id: bytes}}, got {type(vocab).__name__}")
        V = len(vocab)
        if sorted(vocab) != list(range(V)):
            raise ValueError(f"vocab's ids must be 0..{V - 1} (each once), got {sorted(vocab)[:5]}...")
        table = [vocab[i] for i in range(V)]
        for i, t in enumerate(table):
            if not isinstance(t, (bytes, bytearray)):
                raise TypeError(f"vocab[{i}] must be bytes, got {type(t).__name__}")
        specials = check_specials(special_tokens)
        inverse: dict[bytes, int] = {}
        for i, t in enumerate(table):
            inverse.setdefault(bytes(t), i)
        missing = [b for b in range(256) if bytes([b]) not in inverse]
        if missing:
            raise ValueError(f"vocab must hold every single byte; missing {len(missing)}, e.g. {bytes(missing[:3])!r}")
        ids, made = [], []
        for k, m in enumerate(merges):
            if len(m) != 2 or not all(isinstance(x, (bytes, bytearray)) for x in m):
                raise TypeError(f"merges[{k}] must be a pair of bytes, got {m!r}")
            parts = (bytes(m[0]), bytes(m[1]), bytes(m[0]) + bytes(m[1]))
            absent = [x for x in parts if x not in inverse]
            if absent:
                raise ValueError(f"merges[{k}] = {m!r}: {absent[0]!r} is not in the vocabulary")
            ids.append((inverse[parts[0]], inverse[parts[1]]))
            made.append(inverse[parts[2]])
        special_ids = {}
        for sp in specials:
            b = sp.encode("utf-8")
            if b not in inverse:
                inverse[b] = len(table)
                table.append(b)
            special_ids[sp] = inverse[b]
        tok = cls.__new__(cls)
        tok._setup(table, ids, made, special_ids, [inverse[bytes([b])] for b in range(256)])
        return tok

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                   special_tokens: Sequence[str] = ()) -> BPETokenizer:
        """Load GPT-2's format: ``vocab.json`` (``{token: id}`` in GPT-2's byte alphabet) and ``merges.txt`` (one
        ``"a b"`` pair per line in rank order; a ``#version`` first line is skipped). The inverse of
        :meth:`to_files` (and of :meth:`to_huggingface`); GPT-2's own files load as they are."""
        u2b = {u: b for b, u in gpt2_byte_to_unicode().items()}

        def to_bytes_(token: str) -> bytes:
            try:
                return bytes(u2b[c] for c in token)
            except KeyError as err:  # a special token written as itself, e.g. "<|endoftext|>", is all printable
                raise ValueError(f"{vocab_path}: token {token!r} has a character outside GPT-2's byte "
                                 "alphabet") from err

        with open(vocab_path, encoding="utf-8") as f:
            table = json.load(f)
        vocab = {check_int(i, f"the id of {t!r}", low=0): to_bytes_(t) for t, i in table.items()}
        merges = []
        with open(merges_path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                line = line.rstrip("\n")
                if not line or (n == 0 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{merges_path}, line {n + 1}: expected two tokens separated by a space, "
                                     f"got {line!r}")
                merges.append((to_bytes_(parts[0]), to_bytes_(parts[1])))
        return cls.from_vocab(vocab, merges, special_tokens)

    @property
    def V(self) -> int:
        """Vocabulary size, 256 bytes + merges + special tokens."""
        return len(self.vocab)

    def _encode_piece(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            word = tuple(self._byte_ids[b] for b in to_bytes(piece))
            while len(word) > 1:
                rank, pair = min((self.ranks.get(p, len(self.ranks)), p) for p in zip(word, word[1:], strict=False))
                if rank == len(self.ranks):
                    break  # no mergeable pair left
                word = merge_pair(word, *pair, self._merged[rank])
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

    def _special_set(self, value, name: str) -> frozenset:
        if value == "all":
            return frozenset(self.special_tokens)
        if isinstance(value, str):
            raise TypeError(f"{name} must be 'all' or a collection of special-token strings, got the str {value!r}")
        out = frozenset(value)
        unknown = sorted(out - set(self.special_tokens))
        if unknown:
            raise ValueError(f"{name} names {unknown}, which are not special tokens of this tokenizer "
                             f"({sorted(self.special_tokens)})")
        return out

    def encode(self, text: str, *, allowed_special="all", disallowed_special="all") -> list[int]:
        """Token ids of ``text``, with tiktoken's policy for special-token strings that appear in it.

        ``allowed_special`` (``"all"`` or a set of special tokens) become their single ids. A special token in
        ``disallowed_special`` (``"all"``: every special token not allowed) makes ``encode`` raise
        ``ValueError``: user text that contains ``"<|endoftext|>"`` must not silently end a document or
        forge a chat turn. A special token in neither set is encoded as ordinary text (bytes and merges).
        The defaults keep the book's earlier behaviour (every special token allowed); tiktoken's own default
        is ``allowed_special=set()``, under which any special-token string in the text raises.

        >>> tok = BPETokenizer([], ["<|endoftext|>"])
        >>> tok.encode("a<|endoftext|>"), len(tok.encode("a<|endoftext|>", allowed_special=(), disallowed_special=()))
        ([97, 256], 14)
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__} (use encode_bytes for bytes)")
        allowed = self._special_set(allowed_special, "allowed_special")
        disallowed = (frozenset(self.special_tokens) - allowed if disallowed_special == "all"
                      else self._special_set(disallowed_special, "disallowed_special"))
        for sp in sorted(disallowed, key=lambda s: (-len(s), s)):
            if sp in text:
                raise ValueError(f"text contains the special token {sp!r}, which is disallowed: pass "
                                 f"allowed_special={{{sp!r}}} to encode it as one token, or remove it from "
                                 "disallowed_special (e.g. disallowed_special=()) to encode it as plain text")
        if allowed == frozenset(self.special_tokens):
            splitter = self._splitter
        else:
            splitter = self._splitters.get(allowed)
            if splitter is None:
                splitter = self._splitters[allowed] = SpecialSplitter(sorted(allowed))
        return list(self._ids((p, s) for _, p, s in splitter.pieces(text)))

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
        (special tokens are added to it separately, with ``add_special_tokens``). The ids are this tokenizer's.
        """
        b2u = gpt2_byte_to_unicode()
        special = set(self.special_tokens.values())
        text = {i: "".join(b2u[b] for b in v) for i, v in enumerate(self.vocab) if i not in special}
        return {t: i for i, t in text.items()}, [(text[a], text[b]) for a, b in self.merges]

    def to_files(self, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
        """Write GPT-2's ``vocab.json`` and ``merges.txt`` (special tokens included in the vocabulary, as GPT-2
        does); :meth:`from_files` with the same special tokens reads them back to an identical tokenizer."""
        vocab, merges = self.to_huggingface()
        vocab |= {s: i for s, i in self.special_tokens.items()}
        with open(vocab_path, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(vocab.items(), key=lambda kv: kv[1])), f, ensure_ascii=False)
        with open(merges_path, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))

    def save(self, path: str | os.PathLike) -> None:
        """Write the merges, special tokens and the vocabulary (hex bytes, for reading) as JSON."""
        state = {"format": "llmbook-bpe", "version": 1, "pattern": GPT2_PATTERN,
                 "merges": [list(m) for m in self.merges], "special_tokens": self.special_tokens,
                 "special_first": self.special_first,
                 "vocab": {str(i): v.hex() for i, v in enumerate(self.vocab)}}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=0)

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        """Read a file written by :meth:`save`; the vocabulary stored there must match the merges."""
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("format") != "llmbook-bpe":
            raise ValueError(f"{path} is not a tokenizer saved by BPETokenizer.save")
        if state.get("pattern", GPT2_PATTERN) != GPT2_PATTERN:
            raise ValueError(f"{path} was saved with another pre-tokenisation pattern, which this tokenizer does "
                             f"not apply: {state['pattern']!r}")
        specials = sorted(state["special_tokens"], key=state["special_tokens"].get)
        tok = cls([tuple(m) for m in state["merges"]], specials, special_first=state.get("special_first", False))
        if {str(i): v.hex() for i, v in enumerate(tok.vocab)} != state["vocab"]:
            raise ValueError(f"{path}: the stored vocabulary does not match its merges")
        return tok
