"""Chapter 29, RAG-Sequence and RAG-Token (llmbook/rag/rag_objectives.py).

Oracles: float64 brute force over passages and positions in plain Python (math.fsum, math.prod of
probabilities, no logs), on the book's tiny GPT conditioned on real retrieved passages; exhaustive
enumeration of all V^2 two-character answers (each likelihood is a distribution over answers); the
chain rule (posterior weights); Chebyshev's sum inequality for similarly ordered factors.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmbook.rag import pipeline
from llmbook.rag import rag_objectives as ro

INF = float("inf")


@pytest.fixture(scope="module")
def toy():
    """The notebook's toy: query q01, its top-4 MiniLM passages, the tiny GPT as generator."""
    from llmbook.lm.training import pretrained_tiny

    d = pipeline.book_data()
    model, tok = pretrained_tiny()
    qi = 0
    idx, log_p_z = ro.retriever_log_probs(pipeline.dense_scores(d)[qi:qi + 1], k=4, tau=0.05)
    contexts = [f"{d.passages[j].heading}: {d.passages[j].text}"[:44] for j in idx[0].tolist()]
    return model, tok, contexts, log_p_z


def _bf_sequence(p_z, a):
    """sum_z p_z prod_i a[z][i], in float64 Python arithmetic."""
    return math.fsum(p_z[z] * math.prod(a[z]) for z in range(len(p_z)))


def _bf_token(w, a):
    """prod_i sum_z w[z][i] a[z][i]."""
    return math.prod(math.fsum(w[z][i] * a[z][i] for z in range(len(a))) for i in range(len(a[0])))


@pytest.mark.equation("29.01", oracle="float64 brute force sum over passages of products of probabilities")
def test_rag_sequence_brute_force_on_tiny_gpt(toy):
    model, tok, contexts, log_p_z = toy
    lp = ro.generator_log_probs(model, tok, contexts, " the largest logit")
    p_z = log_p_z[0].double().exp().tolist()
    a = lp.exp().tolist()
    ours = ro.rag_sequence_log_likelihood(log_p_z.double(), lp[None]).item()
    assert ours == pytest.approx(math.log(_bf_sequence(p_z, a)), abs=1e-12)
    # raw retrieval scores give the same result as their log-softmax (RAG renormalises over the top k)
    raw = (log_p_z.double() + 3.7)
    assert ro.rag_sequence_log_likelihood(raw, lp[None]).item() == pytest.approx(ours, abs=1e-12)


@pytest.mark.equation("29.02", oracle="float64 brute force product over positions of mixtures")
def test_rag_token_brute_force_on_tiny_gpt(toy):
    model, tok, contexts, log_p_z = toy
    lp = ro.generator_log_probs(model, tok, contexts, " the largest logit")
    p_z = log_p_z[0].double().exp().tolist()
    a = lp.exp().tolist()
    N = lp.shape[1]
    w = [[p_z[z]] * N for z in range(len(p_z))]
    ours = ro.rag_token_log_likelihood(log_p_z.double(), lp[None]).item()
    assert ours == pytest.approx(math.log(_bf_token(w, a)), abs=1e-12)
    # per-position weights (B, k, N): random ones, against the same brute force
    g = torch.Generator().manual_seed(0)
    W = torch.softmax(torch.randn(1, len(p_z), N, generator=g, dtype=torch.float64), dim=1)
    ours_w = ro.rag_token_log_likelihood(W.log(), lp[None]).item()
    assert ours_w == pytest.approx(math.log(_bf_token(W[0].tolist(), a)), abs=1e-12)


@pytest.mark.equation("29.01", oracle="enumeration of all V^2 answers: the likelihood sums to 1")
@pytest.mark.equation("29.02", oracle="enumeration of all V^2 answers: the likelihood sums to 1")
def test_both_are_distributions_over_all_two_character_answers(toy):
    model, tok, contexts, log_p_z = toy
    V = tok.vocab_size
    T_max = model.config.max_seq_len
    known = set(tok.chars)
    first = torch.empty(len(contexts), V, dtype=torch.float64)  # log p(y1 | z)
    second = torch.empty(len(contexts), V, V, dtype=torch.float64)  # log p(y2 | z, y1)
    with torch.no_grad():
        for z, c in enumerate(contexts):
            ctx = torch.as_tensor(tok.encode("".join(ch for ch in c if ch in known)), dtype=torch.long)
            ctx = ctx[-(T_max - 1):]
            first[z] = torch.log_softmax(model(ctx[None])[0, -1].double(), -1)
            seqs = torch.cat([ctx.expand(V, -1), torch.arange(V)[:, None]], dim=1)
            second[z] = torch.log_softmax(model(seqs)[:, -1].double(), -1)
    # token_log_probs for all V^2 answers: (V*V, k, 2)
    y1 = torch.arange(V).repeat_interleave(V)
    y2 = torch.arange(V).repeat(V)
    tlp = torch.stack([first[:, y1].T, second[:, y1, y2].T], dim=-1)
    scores = log_p_z.double().expand(V * V, -1)
    seq = ro.rag_sequence_log_likelihood(scores, tlp).exp().sum().item()
    tok_ = ro.rag_token_log_likelihood(scores, tlp).exp().sum().item()
    assert seq == pytest.approx(1.0, abs=1e-10)
    assert tok_ == pytest.approx(1.0, abs=1e-10)
    # generator_log_probs reads the same numbers for one answer (its truncation and offsets)
    a, b = tok.encode("th").tolist()
    lp = ro.generator_log_probs(model, tok, contexts, "th")
    torch.testing.assert_close(lp, torch.stack([first[:, a], second[:, a, b]], dim=1), atol=1e-5, rtol=0)


def _random_probs(seed, B=5, k=4, N=6):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(B, k, N, 7, generator=g, dtype=torch.float64) * 2, -1)[..., 0]
    return torch.randn(B, k, generator=g, dtype=torch.float64), lp


def test_agree_when_k_is_one_or_the_generator_ignores_z():
    scores, lp = _random_probs(1)
    one_s = ro.rag_sequence_log_likelihood(scores[:, :1], lp[:, :1])
    one_t = ro.rag_token_log_likelihood(scores[:, :1], lp[:, :1])
    torch.testing.assert_close(one_s, lp[:, 0].sum(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(one_t, lp[:, 0].sum(-1), atol=1e-12, rtol=0)
    same = lp[:, :1].expand_as(lp)  # every passage gives the same token probabilities
    torch.testing.assert_close(ro.rag_sequence_log_likelihood(scores, same), same[:, 0].sum(-1), atol=1e-12, rtol=0)
    torch.testing.assert_close(ro.rag_token_log_likelihood(scores, same), same[:, 0].sum(-1), atol=1e-12, rtol=0)


def test_posterior_weights_turn_rag_token_into_rag_sequence():
    for seed in range(5):
        scores, lp = _random_probs(seed)
        post = ro.sequence_posterior(scores, lp)
        torch.testing.assert_close(post.exp().sum(1), torch.ones(5, 6, dtype=torch.float64), atol=1e-12, rtol=0)
        torch.testing.assert_close(ro.rag_token_log_likelihood(post, lp), ro.rag_sequence_log_likelihood(scores, lp),
                                   atol=1e-12, rtol=0)


def test_chebyshev_orders_the_two_for_similarly_ordered_passages():
    """Same order of passages at every position: Seq >= Token; two positions ordered oppositely: Seq <= Token."""
    for seed in range(20):
        scores, lp = _random_probs(seed)
        co = lp.sort(dim=1).values  # every position ranks the passages the same way
        assert (ro.rag_sequence_log_likelihood(scores, co) >= ro.rag_token_log_likelihood(scores, co) - 1e-12).all()
        two = lp[..., :2].clone()
        two[..., 0] = two[..., 0].sort(dim=1).values
        two[..., 1] = two[..., 1].sort(dim=1, descending=True).values
        assert (ro.rag_sequence_log_likelihood(scores, two) <= ro.rag_token_log_likelihood(scores, two) + 1e-12).all()


def test_neither_dominates_in_general():
    scores = torch.zeros(2, 2, dtype=torch.float64)
    lp = torch.log(torch.tensor([[[0.9, 0.9], [0.1, 0.1]],     # one passage explains everything
                                 [[0.9, 0.01], [0.01, 0.9]]], dtype=torch.float64))  # each explains one token
    diff = ro.rag_sequence_log_likelihood(scores, lp) - ro.rag_token_log_likelihood(scores, lp)
    assert diff[0] > 0 and diff[1] < 0


def test_extremes_stay_finite():
    scores, lp = _random_probs(3)
    big = scores * 1e30
    out = ro.rag_sequence_log_likelihood(big, lp)
    torch.testing.assert_close(out, lp.gather(1, big.argmax(1)[:, None, None].expand(-1, 1, 6))[:, 0].sum(-1),
                               atol=1e-12, rtol=0)
    dropped = scores.clone()
    dropped[:, 0] = -INF  # a passage with weight 0 is the same as leaving it out
    torch.testing.assert_close(ro.rag_token_log_likelihood(dropped, lp),
                               ro.rag_token_log_likelihood(scores[:, 1:], lp[:, 1:]), atol=1e-12, rtol=0)
    zero = lp.clone()
    zero[:, :, 0] = -INF  # the answer's first token impossible under every passage
    assert (ro.rag_sequence_log_likelihood(scores, zero) == -INF).all()
    assert not ro.sequence_posterior(scores, zero).isnan().any()


def test_errors():
    scores, lp = _random_probs(0)
    with pytest.raises(ValueError, match="<= 0"):
        ro.rag_sequence_log_likelihood(scores, lp + 1)
    with pytest.raises(ValueError, match="shape"):
        ro.rag_token_log_likelihood(scores[:, :2], lp)
    with pytest.raises(ValueError, match="-inf"):
        ro.rag_sequence_log_likelihood(torch.full_like(scores, -INF), lp)
    with pytest.raises(ValueError, match="tau"):
        ro.retriever_log_probs(scores, k=2, tau=0.0)


def test_retriever_log_probs_against_softmax():
    S = pipeline.dense_scores()[:3]
    idx, lp = ro.retriever_log_probs(S, k=5, tau=0.05)
    top = S.topk(5, dim=1)
    assert torch.equal(idx, top.indices)
    torch.testing.assert_close(lp, torch.nn.functional.log_softmax(top.values / 0.05, dim=1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("tau", [1.0, 0.05])
def test_retriever_gradient_is_posterior_minus_prior_over_tau_by_autograd(tau):
    """Oracle: autograd through RAG-Sequence's log-likelihood with p_eta = softmax(s / tau), in float64."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(4, 5, generator=g, dtype=torch.float64)
    s[1, 2] = -torch.inf  # a passage with weight 0 gets no gradient
    lp = torch.log(torch.rand(4, 5, 7, generator=g, dtype=torch.float64))
    x = s.clone().requires_grad_(True)
    ro.rag_sequence_log_likelihood(x / tau, lp).sum().backward()
    ours = ro.retriever_gradient(s, lp, tau=tau)
    ref = torch.nan_to_num(x.grad, nan=0.0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours.sum(1), torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-12)
    assert ours[1, 2] == 0
    with pytest.raises(ValueError, match="tau"):
        ro.retriever_gradient(s, lp, tau=0.0)
