"""Sparse retrieval: term statistics, TF-IDF and the BM25 family over bags of words (chapter 21).

:func:`analyze` is the one text analyser of Part II: every sparse retriever of the book (and the
pipeline of :mod:`llmbook.rag.pipeline`) turns text into terms with it.
"""

from __future__ import annotations

import re

__all__ = ["STOPWORDS", "analyze"]

#: A short English stopword list (function words only; domain words such as "attention" stay).
STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both
but by can could did do does doing down during each few for from further had has have having he her here hers
herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which
while who whom why will with would you your yours yourself yourselves
""".split())

_TOKEN = re.compile(r"[a-z0-9]+")


def analyze(text: str) -> list[str]:
    r"""Terms of ``text``: lower-cased runs of letters and digits, stopwords removed, order kept.

    LaTeX commands become words (``\frac`` -> ``frac``), so an equation's symbols are searchable.

    >>> analyze("Why does RoPE rotate the query?  $\\frac{q}{2}$")
    ['rope', 'rotate', 'query', 'frac', 'q', '2']
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]
