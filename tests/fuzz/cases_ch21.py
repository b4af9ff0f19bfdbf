"""Fuzz cases of chapter 21 (sparse retrieval): ``llmbook.rag.sparse`` and ``llmbook.rag.language_models``.

The scorers take analysed term lists, not tensors: ``B`` queries and ``N`` documents (``N`` read from
the size symbol ``T``; ``N = 0`` is rejected with a ValueError). Their outputs are float64 whatever the
case dtype (counts are exact), so the low-precision comparison does not apply to them.
"""

from __future__ import annotations

from .cases import NONNEG, PROB, Choice, add

SP = "llmbook.rag.sparse:"
TERMS = "term lists in, float64 out: no tensor input whose dtype could vary"


def _terms(m):
    g = m.gen()
    words = [f"t{i}" for i in range(7)]

    def draw(L):
        import torch

        return [words[int(i)] for i in torch.randint(0, len(words), (L,), generator=g)]

    return dict(query_terms=[draw(1 + i % 3) for i in range(m.s.B)], doc_terms=[draw(1 + i % 5) for i in range(m.s.T)])


add(SP + "term_stats", _terms, lowp_skip=TERMS)
add(SP + "idf", lambda m: dict(df=m.ids(m.s.B, m.s.T, high=6) , N=6, kind="rsj"),
    scalars=dict(kind=Choice()), lowp_int_reason="df is a count; the idf is float64 in every dtype",
    real_ok=("df",))
add(SP + "bm25_scores", lambda m: dict(**_terms(m), k1=1.2, b=0.75, variant="okapi", delta=1.0,
                                       idf_kind="lucene", epsilon=0.25),
    scalars=dict(k1=NONNEG, b=PROB, variant=Choice(), delta=NONNEG, idf_kind=Choice(), epsilon=NONNEG),
    lowp_skip=TERMS)
add(SP + "log_tf", lambda m: dict(counts=m.ids(m.s.B, m.s.T, high=9)), real_ok=("counts",),
    lowp_int_reason="counts are exact in every dtype; the output is float64")
add(SP + "tfidf_scores", lambda m: dict(**_terms(m), sublinear_tf=True, idf_kind="sklearn", normalize=True),
    scalars=dict(idf_kind=Choice()), lowp_skip=TERMS)


def _fields(m):
    t = _terms(m)
    return dict(query_terms=t["query_terms"], fields=[[d[:1] for d in t["doc_terms"]], t["doc_terms"]])


add(SP + "bm25f_scores", lambda m: dict(**_fields(m), k1=1.2, weights=[2.0, 1.0], b=0.75, idf_kind="lucene"),
    scalars=dict(k1=NONNEG, idf_kind=Choice()), lowp_skip=TERMS)

LMS = "llmbook.rag.language_models:"


def _smooth(m):
    c = m.ids(m.s.B, m.s.T, high=5)
    import torch

    L = c.to(torch.float64).sum(1) + 1
    pC = torch.full((m.s.T,), 1.0 / max(m.s.T, 1))
    return dict(counts=c, doc_len=L, p_C=pC)


add(LMS + "dirichlet_smoothing", lambda m: dict(**_smooth(m), mu=10.0), scalars=dict(mu=NONNEG),
    real_ok=("counts",), lowp_skip="counts, lengths and probabilities are upcast to float64")
add(LMS + "jelinek_mercer_smoothing", lambda m: dict(**_smooth(m), lam=0.2), scalars=dict(lam=PROB),
    real_ok=("counts",), lowp_skip="counts, lengths and probabilities are upcast to float64")
add(LMS + "query_likelihood_scores", lambda m: dict(**_terms(m), smoothing="dirichlet", mu=20.0, lam=0.1),
    scalars=dict(smoothing=Choice(), mu=NONNEG, lam=PROB), lowp_skip=TERMS)
add(LMS + "probability_ranking", lambda m: dict(p_rel=m.probs(m.s.B, m.s.T)),
    lowp_int_reason="ties among fp16/bf16-rounded probabilities may order differently than in float64")
add(LMS + "bim_scores", lambda m: dict(**_terms(m), relevant=None), lowp_skip=TERMS)
