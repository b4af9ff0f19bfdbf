"""Tests of llmbook.rag.graph_context: the message-passing layer and the book's graphs.

Oracles: an explicit per-node loop in float64 (Python sums over each node's neighbours, numpy for the
matrix-vector products, ``math.exp`` for GAT's softmax); pair counting by Python sets for the
co-occurrence graph; per-query personalised PageRank for the batched re-ranker. Tolerance 1e-12.
"""

import math
import re

import numpy as np
import pytest
import torch

from llmbook.rag import graph_context as gc
from llmbook.rag.graph import personalized_pagerank


def loop_aggregate(h, A, Ws, Wn, alpha, act):
    """h_v' = act(Ws h_v + sum over u with A[v, u] > 0 of alpha[v, u] Wn h_u), one node at a time."""
    N = len(h)
    out = []
    for v in range(N):
        nbrs = [u for u in range(N) if A[v][u] > 0]
        if alpha is None:
            deg = sum(A[v][u] for u in nbrs)
            weights = {u: A[v][u] / deg for u in nbrs}
        else:
            weights = {u: alpha[v][u] for u in nbrs}
        z = Ws @ h[v] + sum((weights[u] * (Wn @ h[u]) for u in nbrs), np.zeros(Ws.shape[0]))
        out.append({"relu": np.maximum(z, 0), "tanh": np.tanh(z), "identity": z}[act])
    return np.array(out)


def loop_attention(h, A, W, a, slope):
    N, D = len(h), W.shape[0]
    z = h @ W.T
    out = np.zeros((N, N))
    for v in range(N):
        nbrs = [u for u in range(N) if A[v][u] > 0]
        e = {}
        for u in nbrs:
            s = a[:D] @ z[v] + a[D:] @ z[u]
            e[u] = s if s > 0 else slope * s
        norm = sum(math.exp(x) for x in e.values())
        for u in nbrs:
            out[v, u] = math.exp(e[u]) / norm
    return out


def random_case(seed, N=7, D_in=5, D_out=4):
    rng = np.random.default_rng(seed)
    A = (rng.random((N, N)) < 0.4) * rng.uniform(0.2, 2.0, (N, N))
    A[N - 1] = 0.0  # an isolated receiver
    return (rng.normal(size=(N, D_in)), A, rng.normal(size=(D_out, D_in)), rng.normal(size=(D_out, D_in)),
            rng.normal(size=(N, N)), rng.normal(size=2 * D_out))


# ----------------------------------------------------------------------------------------------- 31.06


@pytest.mark.equation("31.06", oracle="explicit per-node loop over neighbours in float64 (numpy)")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("act", ["relu", "tanh", "identity"])
@pytest.mark.parametrize("weights", ["mean", "given", "gat"])
def test_aggregate_matches_a_per_node_loop(seed, act, weights):
    h, A, Ws, Wn, alpha, a = random_case(seed)
    if weights == "gat":
        alpha = gc.attention_weights(torch.tensor(h), torch.tensor(A), torch.tensor(Wn), torch.tensor(a)).numpy()
        np.testing.assert_allclose(alpha, loop_attention(h, A, Wn, a, 0.2), rtol=0, atol=1e-12)
    al = None if weights == "mean" else alpha
    want = loop_aggregate(h, A, Ws, Wn, al, act)
    got = gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn),
                       None if al is None else torch.tensor(al), activation=act)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


def test_aggregate_batch_lowp_and_errors():
    h, A, Ws, Wn, alpha, _ = random_case(9)
    H = torch.tensor(np.stack([h, -h]))
    out = gc.aggregate(H, torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn))
    for b in range(2):
        np.testing.assert_allclose(out[b].numpy(), loop_aggregate(H[b].numpy(), A, Ws, Wn, None, "relu"), atol=1e-12)
    half = gc.aggregate(*(torch.tensor(x).half() for x in (h, A, Ws, Wn)))
    assert half.dtype == torch.float16
    with pytest.raises(ValueError, match="activation"):
        gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn), activation="gelu")
    with pytest.raises(ValueError, match="non-negative"):
        gc.aggregate(torch.tensor(h), -torch.tensor(A), torch.tensor(Ws), torch.tensor(Wn))
    with pytest.raises(ValueError, match="D_in"):
        gc.aggregate(torch.tensor(h), torch.tensor(A), torch.tensor(Ws[:, :2]), torch.tensor(Wn))


def test_attention_rows_are_distributions_over_neighbours():
    h, A, _, Wn, _, a = random_case(3)
    al = gc.attention_weights(torch.tensor(h), torch.tensor(A), torch.tensor(Wn), torch.tensor(a))
    has = (A > 0).any(1)
    np.testing.assert_allclose(al.sum(-1).numpy()[has], 1.0, atol=1e-12)
    assert (al.numpy()[~has] == 0).all() and (al.numpy()[A == 0] == 0).all()


# ----------------------------------------------------------------------------------------------- the book's graphs


def normalise(text):
    """Lower case, possessive 's dropped, hyphens and underscores as spaces (the oracle's own substitutions)."""
    return re.sub(r"[-_\u2010\u2011\u2013]", " ", re.sub(r"['\u2019]s\b", "", text.lower()))


def regex_entities(text, entities):
    """Oracle for gc.match_entities, written with ``re``: the text is normalised by substitutions, cut into runs
    at punctuation and stopwords by ``re.split``, and each run scanned by one alternation of the entities with
    the longest (most words) first, which ``re`` tries in order at each position, left to right."""
    from llmbook.rag.sparse import STOPWORDS

    text = normalise(text)
    runs = re.split(r"[^\w\s']|'|\b(?:" + "|".join(sorted(STOPWORDS)) + r")\b", text)
    if not entities:
        return []
    alt = "|".join(re.escape(e).replace(r"\ ", r"\s+") for e in sorted(entities, key=lambda e: (-len(e.split()), e)))
    pattern = re.compile(r"(?<!\w)(?:" + alt + r")(?!\w)")
    return [" ".join(m.split()) for run in runs for m in pattern.findall(" ".join(run.split()))]


def test_entity_runs_normalise_case_hyphens_and_possessives():
    for variant in ("cross-entropy", "Cross Entropy", "CROSS-ENTROPY", "cross_entropy", "cross - entropy",
                    "cross\u2013entropy"):
        assert gc.entity_runs(variant) == [("cross", "entropy")]
        found = gc.match_entities(f"the {variant} of a model", {"cross entropy", "cross", "entropy"})
        assert found == ["cross entropy"]
    # punctuation and stopwords end a run: no name spans "monte. carlo" or "monte and carlo"
    assert gc.entity_runs("Monte. Carlo, monte and carlo; the KV-cache's size") == [
        ("monte",), ("carlo",), ("monte",), ("carlo",), ("kv", "cache", "size")]
    assert gc.match_entities("monte and carlo", {"monte carlo"}) == []
    with pytest.raises(TypeError, match="text must be a str"):
        gc.match_entities(["kv", "cache"], {"kv cache"})
    with pytest.raises(TypeError, match="entities must be"):
        gc.match_entities("kv cache", {("kv", "cache")})


def test_a_phrase_inside_a_longer_name_is_matched_once():
    names = {"kv cache", "paged kv cache", "cache", "cross entropy", "cross entropy loss", "entropy", "loss"}
    assert gc.match_entities("A paged KV cache", names) == ["paged kv cache"]
    assert gc.match_entities("the KV-cache grows", names) == ["kv cache"]
    assert gc.match_entities("cross-entropy loss, then the entropy and the loss", names) == [
        "cross entropy loss", "entropy", "loss"]
    assert gc.match_entities("cross-entropy is a loss", names) == ["cross entropy", "loss"]


def test_match_entities_equals_a_regex_oracle_on_random_texts():
    rng = np.random.default_rng(0)
    words = ["kv", "cache", "λ", "return", "paged", "cross", "entropy", "loss", "monte", "carlo", "tree", "search",
             "fine", "tuning"]
    glue = [" ", " ", " ", "-", "_", " - ", "\u2013", " \u2014 ", ", ", ". ", " the ", " of ", "'s ", "\n", " (", ") "]
    for _ in range(300):
        n = int(rng.integers(1, 15))
        text = ""
        for w in rng.choice(words, n):
            w = w.upper() if rng.random() < 0.2 else w.capitalize() if rng.random() < 0.2 else w
            text += w + str(rng.choice(glue))
        ents = {" ".join(rng.choice(words, int(rng.integers(1, 5)))) for _ in range(int(rng.integers(0, 12)))}
        assert gc.match_entities(text, ents) == regex_entities(text, ents), (text, ents)


def test_index_terms_are_whole_names_in_the_document_frequency_band():
    from llmbook.rag.corpus import passage_text
    from llmbook.rag.pipeline import book_data
    from llmbook.registry import catalogue

    d = book_data()
    terms = gc.index_terms()
    texts = [passage_text(p) for p in d.passages]
    found = [set(regex_entities(t, terms)) for t in texts]
    df = {t: sum(t in f for f in found) for t in terms}
    assert all(3 <= n <= 0.05 * len(texts) for n in df.values())
    # each term is a word of an equation name, or a phrase of 2-4 words of a name or a named heading
    names = [" ".join(re.findall(r"[^\W_]+", normalise(e.name))) for e in catalogue().values()]
    headings = [" ".join(re.findall(r"[^\W_]+", normalise(p.heading))) for p in d.passages
                if re.search(r"^\d+\. |\(\d+\.\d+\)$", p.heading.strip())]
    for t in (t for t in terms if " " in t):
        pattern = r"(?<!\w)" + re.escape(t).replace(r"\ ", " ") + r"(?!\w)"
        assert any(re.search(pattern, x) for x in names + headings), t
    # a single word is a whole name, or a word of an equation name that the book mostly writes capitalised
    whole = {" ".join(w for w in x.split() if not w.isdigit()) for x in names + headings}
    for t in (t for t in terms if " " not in t):
        if t in whole:
            continue
        assert any(t in x.split() for x in names), t
        hits = [m.group() for x in texts for m in re.finditer(r"(?<![^\W_])" + re.escape(t) + r"(?![^\W_])", x, re.I)]
        assert 2 * sum(h != h.lower() for h in hits) >= len(hits), t
    # the brief's examples are single entities, and their words are no longer nodes that link each other
    for name in ("cross entropy", "monte carlo", "fine tuning", "kv cache"):
        assert name in terms
    assert not {"monte", "carlo"} <= set(terms)


def test_entity_graph_counts_pairs_of_terms_sharing_a_passage():
    from llmbook.rag.corpus import passage_text
    from llmbook.rag.pipeline import book_data

    eg = gc.entity_graph()
    T = len(eg.terms)
    assert eg.A.shape == (T, T) and torch.equal(eg.A, eg.A.T) and (eg.A.diagonal() == 0).all()
    sets = [set(regex_entities(passage_text(p), eg.terms)) for p in book_data().passages]
    rng = np.random.default_rng(0)
    heavy = torch.nonzero(eg.A > 2)[:10].tolist()  # pairs that do share passages, and random ones
    for s, t in rng.integers(0, T, (20, 2)).tolist() + heavy:
        if s != t:
            want = sum(eg.terms[s] in x and eg.terms[t] in x for x in sets)
            assert eg.A[s, t].item() == want


def test_graph_rerank_is_per_query_ppr_seeded_by_reciprocal_rank():
    rng = np.random.default_rng(0)
    N = 12
    W = rng.random((N, N)) * (rng.random((N, N)) < 0.3)
    W = torch.tensor(W + W.T)
    scores = torch.tensor(rng.normal(size=(3, N)))
    got = gc.graph_rerank(scores, W, k=3, alpha=0.4)
    for b in range(3):
        v = torch.zeros(N, dtype=torch.float64)
        for r, j in enumerate(np.argsort(-scores[b].numpy())[:3].tolist()):
            v[j] = 1.0 / (r + 1)
        np.testing.assert_allclose(got[b].numpy(), personalized_pagerank(W, v, 0.4).numpy(), atol=1e-12)


def test_entity_graph_exclude_leaves_out_a_chapters_passages():
    from llmbook.rag.pipeline import book_data

    d = book_data()
    eg, eg_without = gc.entity_graph(d), gc.entity_graph(d, exclude=(1,))
    n1 = sum(p.chapter == 1 for p in d.passages)
    assert eg_without.X.shape[0] == len(d.passages) - n1 and (eg_without.A.sum(0) > 0).all()
    # the same graph by hand: drop chapter 1's rows, then the terms that share no remaining passage with another
    rows = [n for n, p in enumerate(d.passages) if p.chapter != 1]
    cols = [j for j in range(len(eg.terms))
            if any(eg.X[n, j] and eg.X[n].sum() > 1 for n in rows)]
    Xk = eg.X[rows][:, cols]
    assert eg_without.terms == tuple(eg.terms[j] for j in cols)
    assert torch.equal(eg_without.A, Xk.T @ Xk - torch.diag((Xk.T @ Xk).diagonal()))
