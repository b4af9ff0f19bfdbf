r"""Counting pre-tokens for BPE training, on one core or several.

BPE training begins by cutting the corpus into pre-tokens and counting each distinct one
(:func:`count_pretokens`). On a few megabytes this is a third of the training time, and it parallelises
perfectly: cut the corpus into segments, count each segment in its own process, add the counters.

The cut must not change a single pre-token. A boundary :math:`i` is *exact* when the pieces of
``text[:i]`` followed by the pieces of ``text[i:]`` are the pieces of ``text``; :func:`split_points` takes
only boundaries that are exact by construction:

* the start or the end of a special token (``"<|endoftext|>"``), which the splitter cuts out before
  pre-tokenising anyway;
* a newline between two printable ASCII characters (``"x\ny"`` is cut after the ``"\n"``): no GPT-2
  pre-token contains a newline and a non-space, and the whitespace rule ``\s+(?!\S)`` reads the lone
  newline the same way whether a ``"y"`` or the end of the text follows it.

Neither kind is taken where an occurrence of a special token straddles it. Boundaries are searched from
equal-sized targets, so the segments are about equally long; a corpus with no exact boundary stays whole.
The same rule works on the UTF-8 bytes of a file (an ASCII byte never occurs inside a multi-byte
character), so a worker reads only its own byte range.

>>> text = "one two\nthree<|endoftext|>four\nfive"
>>> split_points(text, 3, ["<|endoftext|>"])  # targets 11 and 23: the special's start (13) and end (26)
[13, 26]
>>> split_points(text, 4, ["<|endoftext|>"])  # targets 8, 17 and 26: a safe newline at 8
[8, 26]
>>> count_pretokens(text, ["<|endoftext|>"], workers=1) == count_pretokens(text, ["<|endoftext|>"], workers=2)
True
"""

from __future__ import annotations

import codecs
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from llmbook._checks import check_int
from llmbook.lm import pretokenization
from llmbook.lm.pretokenization import SpecialSplitter, check_specials, chunks_of

__all__ = ["count_pretokens", "split_points"]

PARALLEL_MIN_CHARS = 1_000_000  # below this, ``workers=None`` counts in this process (a pool costs ~0.1 s)
_SAFE_NEWLINE = {str: re.compile("(?<=[\x21-\x7e]\n)(?=[\x21-\x7e])"),
                 bytes: re.compile(b"(?<=[\x21-\x7e]\n)(?=[\x21-\x7e])")}


def _occurrences(window, specials, lo: int) -> list[tuple[int, int]]:
    """Every (start, end) of every special token in ``window`` (overlapping ones included), offset by ``lo``."""
    spans = []
    for s in specials:
        k = window.find(s)
        while k >= 0:
            spans.append((lo + k, lo + k + len(s)))
            k = window.find(s, k + 1)
    return spans


def _boundary_from(read, size: int, target: int, specials, stop: int) -> int | None:
    """The first exact boundary in ``[target, stop)``, or None. ``read(lo, hi)`` returns that slice."""
    L = max((len(s) for s in specials), default=1)
    pattern = _SAFE_NEWLINE[bytes if isinstance(read(0, 0), bytes) else str]
    pos, step = target, max(pretokenization.CHUNK, 4 * L)
    while pos < stop:
        lo, hi = max(pos - L, 0), min(pos + step + L, size)
        window = read(lo, hi)
        spans = _occurrences(window, specials, lo)
        candidates = sorted({i for span in spans for i in span} | {lo + m.start() for m in pattern.finditer(window)})
        limit = stop if hi == size else min(stop, hi - L)  # past hi - L a straddling special may be cut off
        for i in candidates:
            if pos <= i < limit and i > 0 and not any(a < i < b for a, b in spans):
                return i
        if hi == size:
            return None
        pos = hi - L
    return None


def split_points(corpus: str | bytes | os.PathLike, n_segments: int, special_tokens: Sequence[str] = ()) -> list[int]:
    """Up to ``n_segments - 1`` exact boundaries, increasing, near ``k * size / n_segments``.

    ``corpus`` is a ``str`` (offsets in characters), ``bytes`` or a path (offsets in bytes of the file).
    """
    n_segments = check_int(n_segments, "n_segments", low=1, what="an int >= 1")
    specials = check_specials(special_tokens)
    if isinstance(corpus, os.PathLike):
        size = os.path.getsize(corpus)
        f = open(corpus, "rb")  # noqa: SIM115 - closed below

        def read(lo, hi):
            f.seek(lo)
            return f.read(hi - lo)
        specials = tuple(s.encode("utf-8", "surrogateescape") for s in specials)
    elif isinstance(corpus, (str, bytes)):
        f, size = None, len(corpus)

        def read(lo, hi):
            return corpus[lo:hi]
        if isinstance(corpus, bytes):
            specials = tuple(s.encode("utf-8", "surrogateescape") for s in specials)
    else:
        raise TypeError(f"corpus must be a str, bytes or a path, got {type(corpus).__name__}")
    try:
        points: list[int] = []
        for k in range(1, n_segments):
            start = max(k * size // n_segments, points[-1] + 1 if points else 1)
            stop = (k + 1) * size // n_segments
            i = _boundary_from(read, size, start, specials, stop)
            if i is not None:
                points.append(i)
        return points
    finally:
        if f is not None:
            f.close()


def _count(text: str, specials: tuple[str, ...]) -> Counter:
    return Counter(piece for _, piece, special in SpecialSplitter(specials).pieces(text) if not special)


def _count_file_range(path: str, lo: int, hi: int, specials: tuple[str, ...]) -> Counter:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    with open(path, "rb") as f:
        f.seek(lo)

        def chunks():
            left = hi - lo
            while left > 0:
                block = f.read(min(pretokenization.CHUNK, left))
                if not block:
                    break
                left -= len(block)
                yield decoder.decode(block)
            yield decoder.decode(b"", final=True)
        return Counter(piece for piece, special in SpecialSplitter(specials).stream(chunks()) if not special)


def _pool(workers: int):
    # fork: no re-import of the caller's script (an unguarded script would start again under spawn)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return multiprocessing.get_context(method).Pool(workers)


def default_workers() -> int:
    """The cores this process may use (``os.sched_getaffinity`` where it exists), at most 8."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, 8))


def count_pretokens(corpus, special_tokens: Sequence[str] = (), *, workers: int | None = None) -> Counter:
    """``Counter`` of the GPT-2 pre-tokens of ``corpus``, special tokens cut out and not counted.

    ``corpus`` is the text (``str``), a path to a UTF-8 file (undecodable bytes kept via ``surrogateescape``)
    or an iterable of ``str`` chunks. ``workers`` processes count the segments between :func:`split_points`
    (``None``: every available core for a text or file of at least a million characters or bytes, else one;
    an iterable of chunks is always counted in this process, as it streams). The counts do not depend on
    ``workers``.

    >>> count_pretokens("the cat<|endoftext|> the cat", ["<|endoftext|>"])
    Counter({' cat': 2, 'the': 1, ' the': 1})
    """
    specials = check_specials(special_tokens)
    if workers is not None:
        workers = check_int(workers, "workers", low=1, what="an int >= 1 (or None)")
    chunks, f = chunks_of(corpus)  # validates corpus; a path is opened for the serial stream
    if f is not None:
        f.close()
    if isinstance(corpus, os.PathLike):
        size = os.path.getsize(corpus)
    elif isinstance(corpus, str):
        size = len(corpus)
    else:  # an iterable of str: stream it here
        return Counter(piece for piece, special in SpecialSplitter(specials).stream(chunks) if not special)
    if workers is None:
        workers = default_workers() if size >= PARALLEL_MIN_CHARS else 1
    edges = [0, *split_points(corpus, workers, specials), size] if workers > 1 else [0, size]
    if isinstance(corpus, os.PathLike):
        jobs = [(os.fspath(Path(corpus)), lo, hi, specials) for lo, hi in zip(edges, edges[1:], strict=False)]
        target = _count_file_range
    else:
        jobs = [(corpus[lo:hi], specials) for lo, hi in zip(edges, edges[1:], strict=False)]
        target = _count
    if len(jobs) == 1:
        return target(*jobs[0])
    with _pool(len(jobs)) as pool:
        parts = pool.starmap(target, jobs)
    total = Counter()
    for part in parts:
        total.update(part)
    return total
