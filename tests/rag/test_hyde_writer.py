"""Tests of llmbook.rag.hyde_writer: the writer's data, the held-out split, the ranks and the retrieval runs."""

import random
import re

import numpy as np
import pytest
import torch
from sklearn.metrics.pairwise import cosine_similarity

from llmbook.agents import assistant_tasks as AT
from llmbook.agents.generation import Completion
from llmbook.lm.assistant import Assistant
from llmbook.lm.assistant_recipe import fine_tune
from llmbook.lm.training import _data_dir
from llmbook.rag import hyde_writer as hw
from llmbook.rag.rag_generation import knowledge_base
from tests.lm.test_assistant import check_trains_a_copy, tiny_assistant_model

_VERB = {"city": " lives in ", "age": " years old.", "job": " works as a "}


def _template_of(question: str, name: str, field_: str) -> str:
    return re.sub(rf"\b{field_}\b", "{f}", question.replace(name, "{n}"))


def _question_of(prompt: str) -> str:
    return re.search(r"<\|user\|>(.*)<\|end\|><\|assistant\|>$", prompt).group(1)


def test_writer_examples_are_notes_about_the_asked_field_from_training_templates():
    train = {t for k in ("lookup", "notes") for t in AT._TEMPLATES[k]["train"]}
    for prompt, note in hw.writer_examples(60, seed=4):
        name, field_ = " ".join(note.split()[:2]), next(f for f, v in _VERB.items() if v in note)
        assert note.endswith("<|end|>") and note.startswith(name)
        assert _template_of(_question_of(prompt), name, field_) in train
    # the values are random: over many examples about cities, every city of the world turns up
    cities = {y.split(" lives in ")[1][:-8] for _, y in hw.writer_examples(600, seed=5) if " lives in " in y}
    assert cities == set(AT._CITIES)


def test_heldout_questions_share_no_template_or_string_with_the_writer_data():
    facts = knowledge_base(30, seed=8)
    qs = hw.heldout_questions(facts, 90, seed=8)
    assert len({g for _, g in qs}) == 90  # distinct facts
    assert [facts[g].field for _, g in qs] == [AT.FIELDS[j % 3] for j in range(90)]
    heldout = {t for k in ("lookup", "notes") for t in AT._TEMPLATES[k]["heldout"]}
    for q, g in qs:
        assert _template_of(q, facts[g].name, facts[g].field) in heldout
    seen = {_question_of(p) for p, _ in hw.writer_examples(3000, seed=0)}
    assert not seen & {q for q, _ in qs}
    with pytest.raises(ValueError, match="at most the number of facts"):
        hw.heldout_questions(facts, 91)
    with pytest.raises(ValueError, match="one field"):
        AT.fact_question("Pim Dovik", "city", random.Random(0), kinds=("calc",))


def test_gold_ranks_against_numpy_stable_sort():
    rng = np.random.default_rng(0)
    S = torch.from_numpy(rng.integers(0, 4, size=(50, 12)).astype(np.float64))  # many ties
    gold = rng.integers(0, 12, size=50).tolist()
    ref = [int(np.flatnonzero(np.argsort(-S[q].numpy(), kind="stable") == g)[0]) + 1 for q, g in enumerate(gold)]
    assert hw.gold_ranks(S, gold).tolist() == ref
    with pytest.raises(ValueError, match="Q = len"):
        hw.gold_ranks(S, gold[:3])


class Notes:
    """A scripted writer: greedy writes one fixed note per question, a sample writes note ``m`` of its draws."""

    def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
        return [Completion(f"Note {j} about {'greedy' if temperature == 0 else 'sample'}.", [], "stop")
                for j, _ in enumerate(prompts)]


def _embed(texts):
    """Unit vectors fixed per text (a seeded hash), a stand-in for MiniLM."""
    out = []
    for t in texts:
        v = np.random.default_rng(abs(hash(t)) % 2**32).normal(size=16)
        out.append(v / np.linalg.norm(v))
    return torch.tensor(np.array(out))


def test_retrieval_runs_bm25_is_additive_and_dense_is_cosine_of_the_mean():
    facts = knowledge_base(10, seed=1)
    qs = hw.heldout_questions(facts, 12, seed=1)
    questions = [q for q, _ in qs]
    docs = hw.write_documents(Notes(), questions, n_samples=3)
    assert [len(d) for d in docs] == [4] * 12 and docs[0][0] == "Note 0 about greedy."
    runs = hw.retrieval_runs(facts, questions, docs, embed=_embed)
    # BM25 sums over the query's terms with repetition, so the scores of q + h are those of q plus those of h
    torch.testing.assert_close(runs["BM25 q + h"], runs["BM25 q"] + runs["BM25 h"], rtol=0, atol=1e-9)
    G = _embed([f.sentence for f in facts]).numpy()
    Q = _embed(questions).numpy()
    H = _embed([x for d in docs for x in d]).numpy().reshape(12, 4, -1)
    torch.testing.assert_close(runs["dense q"], torch.tensor(cosine_similarity(Q, G)), rtol=0, atol=1e-12)
    mean_qhM = (Q + H[:, 1:].sum(1)) / 4
    torch.testing.assert_close(runs["dense q + h x M"], torch.tensor(cosine_similarity(mean_qhM, G)), rtol=0,
                               atol=1e-12)
    assert "dense h" not in hw.retrieval_runs(facts, questions, docs)  # no encoder, no dense runs
    with pytest.raises(ValueError, match="greedy note and at least"):
        hw.retrieval_runs(facts, questions, [d[:1] for d in docs])


def test_form_notes_state_the_asked_field_of_the_asked_person():
    facts = knowledge_base(5, seed=2)
    gold = list(range(15))
    for g, note in zip(gold, hw.form_notes(facts, gold, seed=3), strict=True):
        assert note.startswith(facts[g].name + " ") and _VERB[facts[g].field] in note


@pytest.fixture(scope="module")
def small():
    examples = hw.writer_examples(40, seed=1)
    model, tok = tiny_assistant_model([p + y for p, y in examples])
    return Assistant(model.eval(), tok), examples


def test_train_writer_learns_and_leaves_the_assistant_alone(small):
    a, examples = small
    check_trains_a_copy(hw.train_writer, a, examples, steps=80, B=8, lr=1e-2)
    with pytest.raises(ValueError, match="at least one"):
        hw.train_writer(a, [], steps=1)
    with pytest.raises(ValueError, match="empty batch"):
        fine_tune(a, lambda rng: [], steps=1)


@pytest.mark.skipif(not (_data_dir() / hw.WRITER).is_file(), reason="the committed writer is not in the package")
def test_committed_writer_copies_the_name_and_the_field_of_held_out_questions():
    facts = knowledge_base(4, seed=11)
    qs = hw.heldout_questions(facts, 12, seed=11)
    docs = hw.write_documents(hw.load_writer(), [q for q, _ in qs])
    ok = [d[0].startswith(facts[g].name + " ") and _VERB[facts[g].field] in d[0]
          for d, (_, g) in zip(docs, qs, strict=True)]
    assert sum(ok) >= 10, docs  # could fail: a writer that garbles names or fields
