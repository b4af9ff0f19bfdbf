r"""RAGAS-style metrics of a RAG answer, computed from judgements (chapter 29).

RAGAS (Es et al.) scores a retrieval-augmented answer without reference answers by asking an LLM
judge small yes/no questions and counting. The counting is what this module implements; the judgements
are its input, ``0``/``1`` tensors (int or float; ``bool`` is refused, as in chapter 26: pass ``.long()``):

* **context precision** (29.03, :func:`context_precision`): the share of the top :math:`k` retrieved
  contexts judged relevant, in rank order; RAGAS's own variant weights by rank (``weighted=True``);
* **context recall** (29.04, :func:`context_recall`): the share of the ground-truth facts that the
  retrieved contexts cover;
* **faithfulness** (29.05, :func:`faithfulness`): the share of the answer's claims supported by the
  context;
* **answer relevance** (29.06, :func:`answer_relevance`): the mean cosine between the query and
  questions regenerated from the answer;
* **attribution precision** (29.07, :func:`attribution_precision`): the share of cited claims that their
  citation supports.

Ragged sets (answers with different numbers of claims) use a ``mask`` ``(B, C)`` of the slots that
exist. A query with nothing to count (no claims, no facts, no citations) scores 0, chapter 26's
convention for a query without relevant documents. Per-query values are float64 ``(B,)``.

:func:`load_answers` reads the book's small hand-labelled set (``llmbook/data/rag_answers.json``):
answers to eight of the labelled queries, split into claims with their human support judgements,
citations and regenerated questions. :func:`proxy_judge` is the offline stand-in for the LLM judge: a
claim counts as supported when its MiniLM cosine with some sentence of the context reaches a threshold.

>>> faithfulness(torch.tensor([[1, 1, 0, 0]]), mask=torch.tensor([[1, 1, 1, 0]]))   # 2 of 3 claims
tensor([0.6667], dtype=torch.float64)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from llmbook._checks import as_tensor, check_dim, check_finite, check_positive_int, check_real, check_same_shape
from llmbook._precision import upcast_half
from llmbook.rag import metrics
from llmbook.registry import implements

__all__ = ["AnswerItem", "Claim", "answer_relevance", "attribution_precision", "context_precision",
           "context_recall", "faithfulness", "judge_texts", "load_answers", "proxy_judge", "split_sentences"]


def _judged(x, name: str) -> Tensor:
    """A (B, C) or (C,) tensor of 0/1 judgements as float64; bool and other values are refused."""
    t = as_tensor(x, name, floating=False)
    if t.dtype == torch.bool:
        raise TypeError(f"{name} must hold 0/1 as int or float, got bool; pass {name}.long()")
    if t.is_complex():
        raise TypeError(f"{name} must be a real tensor, got {t.dtype}")
    check_dim(t, name, "(B, C) or (C,)", min_dim=1, max_dim=2)
    t = t.double()
    if t.numel() and not ((t == 0) | (t == 1)).all():
        bad = t[(t != 0) & (t != 1)][0].item()
        raise ValueError(f"{name} must hold judgements 0 or 1, got {bad:g}")
    return t


def _share(judged, mask, name: str) -> Tensor:
    """Sum of the judgements over the slots of ``mask``, divided by the number of slots; 0 for none."""
    j = _judged(judged, name)
    m = torch.ones_like(j) if mask is None else _judged(mask, "mask")
    check_same_shape(j, m, name, "mask")
    one = j.ndim == 1
    j, m = (j[None], m[None]) if one else (j, m)
    n = m.sum(-1)
    out = torch.where(n > 0, (j * m).sum(-1) / n.clamp_min(1.0), torch.zeros_like(n))
    return out[0] if one else out


@implements("29.03")
def context_precision(verdicts, k: int | None = None, weighted: bool = False) -> Tensor:
    r"""Context precision: :math:`\mathrm{CP}@k=\frac1k\sum_{i=1}^{k}\mathbf 1[c_i\text{ is relevant}]`.

    ``verdicts`` ``(B, K)`` (or ``(K,)``): the judged relevance (0/1) of the retrieved contexts
    :math:`c_1, \dots, c_K` in rank order; ``k`` defaults to :math:`K` (a ``k`` beyond :math:`K` counts
    the empty slots as misses). This is chapter 26's :math:`P@k` (:func:`llmbook.rag.metrics.precision_at_k`)
    on the judged contexts, computed by that function. ``weighted=True`` gives RAGAS's rank-aware variant
    :math:`\sum_{i\le k}P@i\,v_i\,/\sum_{i\le k}v_i`, which is chapter 26's average precision of the list
    cut at :math:`k` (the relevant contexts beyond :math:`k` do not count). Returns ``(B,)`` float64.

    >>> v = torch.tensor([1, 0, 1, 0])
    >>> context_precision(v, k=4).item(), round(context_precision(v, k=4, weighted=True).item(), 4)
    (0.5, 0.8333)
    """
    v = _judged(verdicts, "verdicts")
    K = v.shape[-1]
    k = K if k is None else check_positive_int(k, "k")
    if not isinstance(weighted, bool):
        raise TypeError(f"weighted must be a bool, got {type(weighted).__name__}")
    if K == 0:
        raise ValueError("verdicts must judge at least one retrieved context (K >= 1)")
    rank_scores = -torch.arange(1, K + 1, dtype=torch.float64).expand_as(v)  # the given order
    if weighted:
        return metrics.average_precision(rank_scores[..., :k], v[..., :k])
    return metrics.precision_at_k(rank_scores, v, k)


@implements("29.04")
def context_recall(covered, mask=None) -> Tensor:
    r"""Context recall: :math:`\mathrm{CR}=|\{\text{covered facts}\}|\,/\,|\{\text{ground-truth facts}\}|`.

    ``covered`` ``(B, F)``: 1 where ground-truth fact :math:`f` of query :math:`b` (a statement of the
    reference answer, or a relevant passage) is attributable to the retrieved contexts; ``mask``
    ``(B, F)`` marks the facts that exist (default all). When the facts are the relevant passages and
    "covered" means "retrieved in the top :math:`k`", this is chapter 26's recall@k. Returns ``(B,)``.

    >>> context_recall(torch.tensor([[1, 0, 1, 1]]))
    tensor([0.7500], dtype=torch.float64)
    """
    return _share(covered, mask, "covered")


@implements("29.05")
def faithfulness(supported, mask=None) -> Tensor:
    r"""Faithfulness: :math:`F=|\{\text{claims supported by the context}\}|\,/\,|\{\text{claims in the answer}\}|`.

    ``supported`` ``(B, C)``: 1 where claim :math:`c` of answer :math:`b` can be inferred from the context
    the answer was given; ``mask`` ``(B, C)`` the claims that exist. Returns ``(B,)``; an answer without
    claims scores 0.

    >>> faithfulness(torch.tensor([1, 1, 0]))
    tensor(0.6667, dtype=torch.float64)
    """
    return _share(supported, mask, "supported")


@implements("29.06")
def answer_relevance(e_q, e_gen, mask=None) -> Tensor:
    r"""Answer relevance: :math:`\mathrm{AR}=\frac1m\sum_{i=1}^{m}\cos(e_q, e_{q_i'})`.

    ``e_q`` ``(B, D)``: the query embeddings; ``e_gen`` ``(B, m, D)``: the embeddings of :math:`m`
    questions regenerated from each answer (RAGAS asks an LLM to write them; an answer that drifts from
    the query gives questions that drift too); ``mask`` ``(B, m)`` the questions that exist. Vectors need
    not be unit length (a zero vector has cosine 0). Returns ``(B,)`` float64 in :math:`[-1, 1]`.

    >>> answer_relevance(torch.tensor([[1.0, 0.0]]), torch.tensor([[[2.0, 0.0], [0.0, 3.0]]]))
    tensor([0.5000], dtype=torch.float64)
    """
    e_q, e_gen = as_tensor(e_q, "e_q"), as_tensor(e_gen, "e_gen")
    check_dim(e_q, "e_q", "(B, D)", min_dim=2, max_dim=2)
    check_dim(e_gen, "e_gen", "(B, m, D)", min_dim=3, max_dim=3)
    if e_gen.shape[0] != e_q.shape[0] or e_gen.shape[2] != e_q.shape[1]:
        raise ValueError(f"e_gen (B, m, D) = {tuple(e_gen.shape)} must match e_q (B, D) = {tuple(e_q.shape)}")
    if e_q.shape[1] == 0:
        raise ValueError("the embedding size D must be >= 1 (a cosine needs a vector), got D = 0")
    check_finite(e_q, "e_q")
    check_finite(e_gen, "e_gen")

    def unit(x):
        x = upcast_half(x).double()
        x = x / x.abs().amax(-1, keepdim=True).clamp_min(1e-300)  # rescale first: no overflow in the norm
        return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-300)

    cos = (unit(e_gen) * unit(e_q).unsqueeze(1)).sum(-1)  # (B, m)
    m = torch.ones_like(cos) if mask is None else _judged(mask, "mask")
    check_same_shape(cos, m, "cosines (B, m)", "mask")
    n = m.sum(-1)
    return torch.where(n > 0, (cos * m).sum(-1) / n.clamp_min(1.0), torch.zeros_like(n))


@implements("29.07")
def attribution_precision(cited, supported_by_citation) -> Tensor:
    r"""Attribution precision: :math:`|\{\text{cited claims supported}\}|\,/\,|\{\text{cited claims}\}|`.

    ``cited`` ``(B, C)``: 1 where claim :math:`c` carries a citation; ``supported_by_citation`` ``(B, C)``:
    1 where the cited passage supports the claim (ignored for uncited claims). A correct claim with a
    wrong citation lowers this metric and not faithfulness. Returns ``(B,)``; 0 without citations.

    >>> attribution_precision(torch.tensor([1, 1, 0]), torch.tensor([1, 0, 1]))
    tensor(0.5000, dtype=torch.float64)
    """
    ok = _judged(supported_by_citation, "supported_by_citation")
    return _share(ok, cited, "supported_by_citation")


# --------------------------------------------------------------------------- the labelled set and the proxy judge


@dataclass(frozen=True)
class Claim:
    """One claim of an answer with its human judgement."""

    #: The claim as a sentence.
    text: str
    #: Passage ids that support it (empty when unsupported).
    support: tuple[str, ...]
    #: The passage the answer cites for it ('' when uncited).
    cite: str

    @property
    def supported(self) -> bool:
        """Whether some passage of the context supports the claim."""
        return bool(self.support)

    @property
    def citation_ok(self) -> bool:
        """Whether the cited passage is among the supporting ones."""
        return bool(self.cite) and self.cite in self.support


@dataclass(frozen=True)
class AnswerItem:
    """An answer to one labelled query: its context passages, claims and regenerated questions."""

    #: Query id in the book's labelled set (llmbook/data/rag_queries.tsv).
    query: str
    #: Ids of the passages the answer was written from.
    context: tuple[str, ...]
    #: The answer, split into claims.
    claims: tuple[Claim, ...]
    #: Questions regenerated from the answer (hand-written stand-ins for an LLM).
    questions: tuple[str, ...]

    @property
    def answer(self) -> str:
        """The answer text, its claims joined."""
        return " ".join(c.text for c in self.claims)


def load_answers(path: str | Path | None = None) -> list[AnswerItem]:
    """The book's hand-labelled answers (``llmbook/data/rag_answers.json`` unless ``path`` is given).

    >>> items = load_answers()
    >>> len(items), sum(len(it.claims) for it in items) > 2 * len(items)
    (8, True)
    """
    text = (Path(path).read_text(encoding="utf-8") if path is not None
            else resources.files("llmbook.data").joinpath("rag_answers.json").read_text(encoding="utf-8"))
    out = []
    for it in json.loads(text)["items"]:
        claims = tuple(Claim(c["text"], tuple(c["support"]), c["cite"]) for c in it["claims"])
        out.append(AnswerItem(it["query"], tuple(it["context"]), claims, tuple(it["questions"])))
    return out


def split_sentences(text: str) -> list[str]:
    """Sentences of a passage: split after ``.``, ``!`` or ``?`` followed by white space, blanks collapsed.

    Display equations stay inside the sentence around them; pieces shorter than 20 characters are dropped.

    >>> split_sentences("A ReLU zeroes half its input. He et al. double the variance!  Short. x")
    ['A ReLU zeroes half its input.', 'He et al. double the variance!']
    """
    flat = re.sub(r"\s+", " ", text).strip()
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z$(])", flat)
    return [p for p in parts if len(p) >= 20]


def judge_texts(items: list[AnswerItem], passages) -> list[str]:
    """Every text the proxy judge and answer relevance embed for ``items``: context and cited sentences,
    claims and regenerated questions, in order and deduplicated (registered in ``encoder_texts.txt``).

    ``passages`` maps passage ids to :class:`llmbook.rag.corpus.Passage` (or is a sequence of them).
    """
    by_id = passages if isinstance(passages, dict) else {p.id: p for p in passages}
    texts: list[str] = []
    for it in items:
        for pid in dict.fromkeys(list(it.context) + [c.cite for c in it.claims if c.cite]):
            texts += split_sentences(by_id[pid].text)
        texts += [c.text for c in it.claims] + list(it.questions)
    return list(dict.fromkeys(texts))


def proxy_judge(claim_emb, sentence_emb, threshold: float) -> tuple[Tensor, Tensor]:
    r"""Offline stand-in for RAGAS's LLM judge: supported when :math:`\max_s\cos(e_{claim}, e_s)\ge` ``threshold``.

    ``claim_emb`` ``(C, D)``, ``sentence_emb`` ``(S, D)`` (the context's sentences); returns the 0/1
    verdicts ``(C,)`` as int64 and the maximal cosines ``(C,)`` float64.
    """
    a, b = as_tensor(claim_emb, "claim_emb"), as_tensor(sentence_emb, "sentence_emb")
    check_dim(a, "claim_emb", "(C, D)", min_dim=2, max_dim=2)
    check_dim(b, "sentence_emb", "(S, D)", min_dim=2, max_dim=2)
    if b.shape[0] == 0:
        raise ValueError("sentence_emb must hold at least one sentence of the context (S >= 1)")
    threshold = check_real(threshold, "threshold")
    a = torch.nn.functional.normalize(a.double(), dim=-1)
    b = torch.nn.functional.normalize(b.double(), dim=-1)
    best = (a @ b.T).amax(-1)
    return (best >= threshold).long(), best
