"""Tests of llmbook.agents.memory_agent, chapter 42's agent over the book (it registers no equation).

Oracles: hand-computed accuracies on a 2x3 example; for the agent on the book, counts taken directly from the
label matrix (the agent without memory), and the qualitative statements the chapter's prose makes, with margins
of whole questions so that a corpus snapshot moving a question or two does not flip them.
"""

import pytest
import torch

from llmbook.agents import memory_agent as AG
from llmbook.rag.corpus import load_queries

Q = len(load_queries())  # the labelled questions of Part II


def test_citation_accuracy_by_hand():
    pi = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    labels = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    assert AG.citation_accuracy(pi, labels) == {"greedy": 0.5, "expected": pytest.approx((0.3 + 0.6) / 2)}
    # grouped: items 0 and 1 share a group, so citing item 0 counts in row 0
    assert AG.citation_accuracy(pi, labels, groups=torch.tensor([0, 0, 1]))["greedy"] == 1.0
    with pytest.raises(ValueError, match="same"):
        AG.citation_accuracy(pi, labels[:, :2])


def test_the_agent_without_memory_is_right_only_about_its_prior_chapter():
    d, _, ch = AG._book()
    j = AG.prior_passage()
    assert ch[j] == torch.bincount(ch).argmax() and (j == 0 or ch[j - 1] != ch[j])  # first of the longest chapter
    none = AG.book_agent(memory="none")
    rel = d.labels > 0
    assert none["size"] == 0
    assert none["passage"] == pytest.approx(rel[:, j].double().mean().item(), abs=1e-6)
    assert none["chapter"] == pytest.approx((rel & (ch == ch[j])).any(-1).double().mean().item(), abs=1e-6)


def test_book_agent_statements_of_the_chapter():
    """The notebook's 42.05 table and curve, as the prose describes them (no number from the snapshot)."""
    none, full = AG.book_agent(memory="none"), AG.book_agent(memory="all")
    write, decay = AG.book_agent(memory="write"), AG.book_agent(memory="decay")
    assert none["passage"] < 0.1 < 0.6 < full["passage"] and full["chapter"] > 0.9
    # the write rule stores clearly fewer passages, within a few questions of the full memory on both measures
    assert write["size"] < 0.9 * full["size"]
    assert abs(write["passage"] - full["passage"]) <= 4 / Q + 1e-9
    assert abs(write["chapter"] - full["chapter"]) <= 4 / Q + 1e-9
    # a half-life of 50 steps forgets many answers; a long one keeps what the write rule keeps
    assert decay["size"] < write["size"] and decay["passage"] < write["passage"] - 0.2
    short, long_ = AG.book_agent(memory="decay", half_life_steps=10), AG.book_agent(memory="decay",
                                                                                   half_life_steps=400)
    # a half-life of 10 steps: fewer than one question in ten right, on the passage or the chapter
    assert short["chapter"] < 0.1 and short["passage"] < 0.1 and write["chapter"] > 0.85
    assert (long_["passage"], long_["chapter"]) == (write["passage"], write["chapter"])
    assert long_["size"] <= write["size"]
    # a half-life of 100 steps (forgotten after 200, the longest delay): chapters kept, many exact passages lost
    # (book_agent rounds its rates to 6 decimals, hence the 1e-6)
    mid = AG.book_agent(memory="decay", half_life_steps=100)
    assert mid["chapter"] >= write["chapter"] - 3 / Q - 1e-6 and mid["passage"] < write["passage"] - 3 / Q
    with pytest.raises(ValueError, match="memory must be one of"):
        AG.book_agent(memory="everything")
    with pytest.raises(ValueError, match="half_life_steps"):
        AG.book_agent(memory="decay", half_life_steps=0.0)


def test_try_it_a_stricter_write_rule_stores_less_and_costs_questions():
    w3, w5 = AG.book_agent(memory="write", tau_n=0.3), AG.book_agent(memory="write", tau_n=0.5)
    assert w5["size"] < 0.5 * w3["size"]
    assert w5["passage"] < w3["passage"] - 5 / Q and w5["chapter"] < w3["chapter"] - 5 / Q
