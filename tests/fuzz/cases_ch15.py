"""Fuzz cases of chapter 15 (tokenisation and word vectors); imported at the end of ``cases.py``.

The tokenizers take text and dictionaries, which the generic mutations leave alone: for them the fuzz
suite checks the valid call and the bad scalars (``n_merges``, ``method``); their string handling is
tested in ``tests/lm/test_bpe.py`` and ``tests/lm/test_tokenization.py``.
"""

from __future__ import annotations

import math

from .cases import NONNEG, NONNEG_INT, POS, POS_INT, add
from .harness import Choice

BP, TK, WV = "llmbook.lm.bpe:", "llmbook.lm.tokenization:", "llmbook.lm.word_vectors:"
_LOG_P = {"a": math.log(0.3), "b": math.log(0.2), "c": math.log(0.1), "ab": math.log(0.15), "bc": math.log(0.25)}

add(BP + "train_bpe", lambda m: dict(corpus="low lower lowest newer wider " * m.s.T + "<|endoftext|>",
                                     n_merges=m.s.V, special_tokens=["<|endoftext|>"]),
    scalars=dict(n_merges=NONNEG_INT, method=Choice()))
add(TK + "wordpiece_scores", lambda m: dict(word_counts={"hug": 10, "pug": 5, "pun": 12, "bun": 4, "hugs": 5}))
add(TK + "unigram_log_prob", lambda m: dict(pieces=["ab", "c", "a"], log_p=_LOG_P))
add(TK + "viterbi_segment", lambda m: dict(x="abcab" * m.s.T, log_p=_LOG_P))

add(WV + "sgns_loss", lambda m: dict(v_w=m.f(m.s.B, m.s.D), v_c=m.f(m.s.B, m.s.D), v_n=m.f(m.s.B, m.s.K, m.s.D)),
    scalars=dict(reduction=Choice()))
add(WV + "cbow_log_probs", lambda m: dict(v_context=m.f(m.s.B, 4, m.s.D), W=m.f(m.s.V, m.s.D)))
add(WV + "glove_loss", lambda m: dict(W=m.f(m.s.V, m.s.D), W_tilde=m.f(m.s.V, m.s.D), b=m.f(m.s.V),
                                      b_tilde=m.f(m.s.V), X=m.pos(m.s.V, m.s.V) * 50),
    scalars=dict(x_max=POS, alpha=NONNEG, reduction=Choice()))
add(WV + "subword_vector", lambda m: dict(word="hello", Z=m.f(m.s.V, m.s.D), n_min=3, n_max=5),
    scalars=dict(n_min=POS_INT, n_max=POS_INT, reduce=Choice()))
