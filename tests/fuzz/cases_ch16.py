"""Fuzz cases of chapter 16 (evaluation metrics).

The text metrics take Python strings, not tensors: their factories build ``B`` sentences of ``T``
words from a seeded draw (so the degenerate sizes B = 0, 1 and T = 0, 1 reach them: no segment, an
empty sentence), and only their scalar options are mutated. BERTScore, pass@k and MAUVE take tensors.
"""

from __future__ import annotations

from .cases import NONNEG, NONNEG_INT, POS, POS_INT, PROB, Choice, Int, add

TM = "llmbook.lm.text_metrics:"
UM = "llmbook.lm.unigram_metrics:"
EV = "llmbook.lm.eval_metrics:"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", ".", ",", "The", "3.50"]


def _sentences(m, n: int) -> list[str]:
    """n sentences of T words drawn with the case's generator."""
    import torch

    ids = torch.randint(0, len(WORDS), (n, m.s.T), generator=m.g)
    return [" ".join(WORDS[i] for i in row) for row in ids.tolist()]


def _corpus(m):
    hyps = _sentences(m, m.s.B)
    return dict(hypotheses=hyps, references=[_sentences(m, 2) for _ in hyps])


add(TM + "brevity_penalty", lambda m: dict(c=9, r=10), scalars=dict(c=NONNEG_INT, r=NONNEG_INT))
add(TM + "bleu", lambda m: dict(**_corpus(m), smooth="exp"),
    scalars=dict(N=POS_INT, smooth=Choice(), smooth_value=NONNEG, tokenize=Choice()))
add(TM + "rouge_n", lambda m: dict(candidate=_sentences(m, 1)[0], references=_sentences(m, m.s.B)),
    scalars=dict(n=POS_INT, tokenize=Choice()))
add(TM + "rouge_l", lambda m: dict(candidate=_sentences(m, 1)[0], references=_sentences(m, m.s.B)),
    scalars=dict(beta=NONNEG, tokenize=Choice()))
add(UM + "meteor", lambda m: dict(hypothesis=_sentences(m, 1)[0], references=_sentences(m, m.s.B)),
    scalars=dict(alpha=PROB, beta=NONNEG, gamma=PROB))
for _f in ("exact_match", "token_f1"):
    add(UM + _f, lambda m: dict(prediction=_sentences(m, 1)[0], ground_truths=_sentences(m, m.s.B)))

add(EV + "bertscore", lambda m: dict(x_hat=m.f(m.s.B, m.s.T, m.s.D), x=m.f(m.s.B, m.s.T + 1, m.s.D)))
add(EV + "pass_at_k", lambda m: dict(n=10, c=m.ids(m.s.B, high=11), k=3),
    scalars=dict(n=Int(lo=1), k=Int(lo=1)))
add(EV + "mauve", lambda m: dict(p=m.probs(m.s.V), q=m.probs(m.s.V)), scalars=dict(c=POS, num_lambdas=POS_INT))
