r"""Pre-tokenisation for byte-level BPE: GPT-2's regex, special tokens, streaming, and GPT-2's byte alphabet.

Before BPE counts pairs, the text is cut into *pre-tokens* so that no merge crosses a word boundary:
GPT-2's pattern (:data:`GPT2_PATTERN`) yields words with their leading space, numbers, runs of
punctuation and whitespace. Special tokens (``"<|endoftext|>"``) are cut out first and never
pre-tokenised (:class:`SpecialSplitter`), also when the text arrives in chunks of a stream.
:func:`gpt2_byte_to_unicode` is the printable stand-in GPT-2 and HuggingFace ``tokenizers`` use for
each byte in their vocabulary files (a space is ``"Ġ"``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence

from llmbook._checks import check_choice

__all__ = ["CL100K_PATTERN", "GPT2_PATTERN", "LLAMA3_PATTERN", "O200K_PATTERN", "PATTERNS", "SpecialSplitter",
           "check_specials", "chunks_of", "gpt2_byte_to_unicode", "pretokenize", "pretokenize_as", "to_bytes"]

#: GPT-2's pre-tokenisation pattern. It matches contractions, letters / numbers / other symbols with an
#: optional leading space, and whitespace (a run keeps its last space for the next word, ``\s+(?!\S)``).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Without the `regex` package (which `transformers` installs), the standard library's `re` lacks \p{..};
# this equivalent uses [^\W\d_] for letters and \d for numbers (it differs only for rare numerals such as '²').
_FALLBACK_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
try:
    import regex as _regex

    PRETOKEN = _regex.compile(GPT2_PATTERN)
except ImportError:  # pragma: no cover - regex ships with transformers
    PRETOKEN = re.compile(_FALLBACK_PATTERN)

#: GPT-4's pattern (tiktoken's ``cl100k_base``), with contractions in any case (a case-insensitive group),
#: a word may start with one non-letter (``[^\r\n\p{L}\p{N}]?\p{L}+``, so ``_name`` or ``.append`` stay whole),
#: numbers in groups of at most three digits (``\p{N}{1,3}``), punctuation keeps its trailing newlines,
#: newlines gather into their own pre-tokens (``\s*[\r\n]+``).
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
#: Llama 3's pattern (``pat_str`` of Meta's ``llama3/tokenizer.py``) is cl100k's, character for character.
LLAMA3_PATTERN = CL100K_PATTERN
#: GPT-4o's pattern (tiktoken's ``o200k_base``), where a word is an optional run of capitals then lower-case letters
#: (``camelCase`` is ``camel`` + ``Case``), contractions stay attached to their word, ``/`` joins punctuation.
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
#: The published pre-tokenisation patterns by name (tiktoken's ``openai_public.py``, Meta's ``llama3``).
PATTERNS = {"gpt2": GPT2_PATTERN, "cl100k": CL100K_PATTERN, "llama3": LLAMA3_PATTERN, "o200k": O200K_PATTERN}

CHUNK = 1 << 16  # characters a stream accumulates before it is cut into pre-tokens


def pretokenize(text: str) -> list[str]:
    """Cut ``text`` into GPT-2 pre-tokens (no special-token handling; see :class:`SpecialSplitter`).

    >>> pretokenize("Hello, world!  It's 2024.")
    ['Hello', ',', ' world', '!', ' ', ' It', "'s", ' 2024', '.']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return PRETOKEN.findall(text)


def pretokenize_as(text: str, scheme: str) -> list[str]:
    r"""Cut ``text`` with a published pre-tokenisation pattern: ``scheme`` is a key of :data:`PATTERNS`.

    The patterns need the ``regex`` package (``\p{L}``, possessive and scoped-flag syntax). The pieces always
    concatenate back to ``text``.

    >>> pretokenize_as("He'LL pay 12345 for x.append", "gpt2")
    ['He', "'", 'LL', ' pay', ' 12345', ' for', ' x', '.', 'append']
    >>> pretokenize_as("He'LL pay 12345 for x.append", "cl100k")
    ['He', "'LL", ' pay', ' ', '123', '45', ' for', ' x', '.append']
    """
    check_choice(scheme, "scheme", tuple(PATTERNS))
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _compiled(scheme).findall(text)


_COMPILED: dict = {}


def _compiled(scheme: str):
    if scheme not in _COMPILED:
        import regex  # the \p{..} classes and (?i:...) need it

        _COMPILED[scheme] = regex.compile(PATTERNS[scheme])
    return _COMPILED[scheme]


def check_specials(special_tokens) -> tuple[str, ...]:
    """``special_tokens`` as a tuple of distinct non-empty str (a lone str is an error, not its characters)."""
    if isinstance(special_tokens, str):
        raise TypeError("special_tokens must be a sequence of str, got a single str; wrap it in a list")
    out = tuple(special_tokens)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"special_tokens must be non-empty str, got {s!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"special_tokens must be distinct, got {list(out)}")
    return out


class SpecialSplitter:
    """Text -> (piece, is_special) pairs: specials cut out first (longest first), the rest pre-tokenised."""

    def __init__(self, specials: Sequence[str]):
        self.hold = max((len(s) for s in specials), default=1) - 1
        alternation = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        self.special = re.compile(alternation) if specials else None

    def pieces(self, text: str) -> Iterator[tuple[int, str, bool]]:
        """(start offset, piece, is_special) for every piece of ``text``, in order."""
        pos = 0
        for m in self.special.finditer(text) if self.special else ():
            for p in PRETOKEN.finditer(text, pos, m.start()):
                yield p.start(), p.group(), False
            yield m.start(), m.group(), True
            pos = m.end()
        for p in PRETOKEN.finditer(text, pos):
            yield p.start(), p.group(), False

    def stream(self, chunks: Iterable[str]) -> Iterator[tuple[str, bool]]:
        """The pieces of ``"".join(chunks)``, holding in memory only a buffer of about ``CHUNK`` characters.

        A piece is released once the text after it can no longer change it: the buffer is cut at a piece
        start at least ``hold + 3`` characters before its end (a partial special token, or a pre-token
        that peeks one character ahead, lies behind the cut), and never between two whitespace pieces
        (``\\s+(?!\\S)`` reads the whole whitespace run).
        """
        buf = ""
        for chunk in chunks:
            if not isinstance(chunk, str):
                raise TypeError(f"chunks must be str (open text files in text mode), got {type(chunk).__name__}")
            buf += chunk
            if len(buf) < CHUNK:
                continue
            pieces = list(self.pieces(buf))
            limit, cut = len(buf) - self.hold - 3, 0
            for k in range(len(pieces) - 1, 0, -1):
                start, piece, _ = pieces[k]
                if start <= limit and not (buf[start - 1].isspace() and piece.isspace()):
                    cut = k
                    break
            for _, piece, special in pieces[:cut]:
                yield piece, special
            buf = buf[pieces[cut][0]:] if cut else buf
        for _, piece, special in self.pieces(buf):
            yield piece, special


def to_bytes(piece: str) -> bytes:
    """The UTF-8 bytes of a piece; U+DC80..U+DCFF (Python's ``surrogateescape``) stand for raw bytes."""
    try:
        return piece.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:
        raise ValueError(f"text contains the lone surrogate U+{ord(piece[err.start]):04X}, which has no UTF-8 "
                         "encoding; pass the raw bytes to encode_bytes instead") from err


def chunks_of(corpus) -> tuple[Iterable[str], object]:
    """(an iterable of str, a file to close or None) for a text, a path or an iterable of str.

    A ``str`` is the text itself; a short one that names an existing file is rejected (a reader who meant the
    file would otherwise train on its name without a word).
    """
    if isinstance(corpus, str):
        if len(corpus) < 1024 and "\n" not in corpus and os.path.isfile(corpus):
            raise ValueError(f"corpus is the text itself, and {corpus!r} names a file: pass pathlib.Path({corpus!r}) "
                             "to train on the file's contents")
        return (corpus,), None
    if isinstance(corpus, os.PathLike):
        f = open(corpus, encoding="utf-8", errors="surrogateescape", newline="")  # noqa: SIM115
        return iter(lambda: f.read(CHUNK), ""), f
    if isinstance(corpus, bytes):
        raise TypeError("corpus must be a str, a path or an iterable of str, got bytes; decode it first")
    if isinstance(corpus, Iterable):
        return corpus, None
    raise TypeError(f"corpus must be a str, a path (pathlib.Path) or an iterable of str, got {type(corpus).__name__}")


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte: printable Latin-1 bytes stand for themselves, the other 68
    (controls, space, ...) map in order to U+0100, U+0101, ... (so a space is ``"Ġ"``, a newline ``"Ċ"``).

    >>> m = gpt2_byte_to_unicode()
    >>> m[ord("a")], m[ord(" ")], m[ord("\\n")], len(set(m.values()))
    ('a', 'Ġ', 'Ċ', 256)
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out
