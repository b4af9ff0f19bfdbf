"""Chapter 29's RAG with the book's assistant (llmbook/rag/rag_generation.py).

Oracles: brute-force RAG-Token decoding with a full forward pass per step and passage (no KV cache) and the
mixture in Python floats; RAG-Sequence's argmax recomputed from ``Assistant.score`` (one-sequence forward
passes, a different code path from the batched scorer) and ``math.log(sum(exp))``; identities (one passage
is plain greedy decoding; a passage with weight 0 is ignored); the knowledge base's sentences.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmbook.lm.assistant import load_assistant
from llmbook.rag import rag_generation as rg


@pytest.fixture(scope="module")
def setup():
    a = load_assistant()
    facts = rg.knowledge_base(20, seed=3)
    qs = rg.questions(facts, 6, seed=3)
    tasks = [t for t, _ in qs]
    idx, S = rg.retrieve(tasks, facts, 3)
    return a, facts, qs, tasks, [[facts[j].sentence for j in ix] for ix in idx], idx, S


def test_knowledge_base_and_questions():
    facts = rg.knowledge_base(30, seed=1)
    assert len(facts) == 90 and len({f.name for f in facts}) == 30
    assert [f.field for f in facts[:3]] == ["city", "age", "job"]
    qs = rg.questions(facts, 12, seed=1)
    assert len({i for _, i in qs}) == 12                            # distinct facts
    assert [facts[i].field for _, i in qs[:3]] == ["city", "age", "job"]
    for t, i in qs:
        assert facts[i].name in t.question and t.answer == facts[i].value and t.notes == ""
    assert rg.knowledge_base(30, seed=1) == facts


def test_retrieve_orders_by_score_then_position(setup):
    _, facts, qs, tasks, _, idx, S = setup
    assert (S[:, :-1] >= S[:, 1:]).all()
    for (_, gold), ix in zip(qs, idx, strict=True):
        assert ix[0] == gold   # field name and full name: the question's own fact wins
    # a query matching two facts equally: the earlier one first
    two = [rg.Fact("Ab Cd", "city", "Tarsk"), rg.Fact("Ab Cd", "city", "Velm")]
    ix, s = rg.retrieve([rg.Task("notes", "What is the city of Ab Cd?", "x")], two, 2)
    assert ix == [[0, 1]] and float(s[0, 0]) == float(s[0, 1])
    with pytest.raises(ValueError, match="at most the number of facts"):
        rg.retrieve(tasks, two, 3)


def _brute_rag_token(a, task, passages, log_p_z, max_new):
    """Greedy mixture decoding with a fresh full forward pass for every passage at every step."""
    end = a.tok.special_tokens["<|end|>"]
    prefixes = [a.tok.encode(rg.answer_prompt(task, [p])) for p in passages]
    out = []
    for _ in range(max_new):
        with torch.no_grad():
            probs = [torch.softmax(a.model(torch.tensor([x + out]))[0, -1].double(), -1) for x in prefixes]
        w = [math.exp(float(v)) for v in log_p_z]
        mix = sum(wi * p for wi, p in zip(w, probs, strict=True))
        t = int(mix.argmax())
        if t == end:
            break
        out.append(t)
    return a.tok.decode(out).strip()


def test_rag_token_against_uncached_brute_force(setup):
    a, _, _, tasks, ctx, _, S = setup
    for lpz in (torch.log_softmax(S, 1), torch.zeros_like(S)):   # the retriever's weights, and uniform
        got = rg.rag_token_decode(a, tasks, ctx, lpz)
        assert got == [_brute_rag_token(a, t, c, w, 8) for t, c, w in zip(tasks, ctx, lpz, strict=True)]


def test_one_passage_or_a_zero_weight_is_plain_greedy(setup):
    a, _, _, tasks, ctx, _, _ = setup
    greedy = rg.answer(a, tasks, [c[:1] for c in ctx])
    assert rg.rag_token_decode(a, tasks, [c[:1] for c in ctx], torch.zeros(len(tasks), 1)) == greedy
    w = torch.tensor([[0.0, -torch.inf, -torch.inf]] * len(tasks))
    assert rg.rag_token_decode(a, tasks, ctx, w) == greedy
    assert rg.rag_sequence_decode(a, tasks, ctx, w) == greedy
    with pytest.raises(ValueError, match="log_p_z"):
        rg.rag_token_decode(a, tasks, ctx, torch.zeros(len(tasks), 2))


def test_rag_sequence_thorough_against_scores(setup):
    a, _, _, tasks, ctx, _, S = setup
    lpz = torch.zeros_like(S)   # uniform weights: the generator's likelihoods decide
    got = rg.rag_sequence_decode(a, tasks, ctx, lpz, thorough=True)
    for q, (t, c) in enumerate(zip(tasks, ctx, strict=True)):
        cands = list(dict.fromkeys(rg.answer(a, [t] * len(c), [[p] for p in c])))
        marg = [math.log(sum(math.exp(a.score([rg.answer_prompt(t, [p])], [f" {y}<|end|>"])[0]) for p in c) / len(c))
                for y in cands]
        assert got[q] == cands[max(range(len(cands)), key=lambda i: (marg[i], -i))]
    # fast decoding: a candidate counts only under the passages whose greedy answer it is
    w = torch.log_softmax(S, 1)
    fast = rg.rag_sequence_decode(a, tasks, ctx, w, thorough=False)
    for q, (t, c) in enumerate(zip(tasks, ctx, strict=True)):
        outs = a.generate([rg.answer_prompt(t, [p]) for p in c], max_new_tokens=8)
        ys = [o.text.strip() for o in outs]
        marg = {y: math.log(sum(math.exp(float(w[q, z]) + sum(outs[z].logprobs)) for z in range(len(c)) if ys[z] == y))
                for y in ys}
        assert fast[q] == max(dict.fromkeys(ys), key=lambda y: marg[y])


def test_supported_and_prompts(setup):
    _, facts, qs, tasks, ctx, _, _ = setup
    t, i = qs[0]
    assert rg.supported(facts[i], facts[i].value, ctx[0])
    assert not rg.supported(facts[i], facts[i].value + "x", ctx[0])
    assert "Notes:" not in rg.answer_prompt(t, []) and rg.answer_prompt(t, []).endswith("<|assistant|>Act: answer")
    assert rg.answer_prompt(t, ctx[0]).count(facts[i].name) >= 2
