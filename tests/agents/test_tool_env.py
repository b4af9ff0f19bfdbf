"""Tests of llmbook.agents.tool_env: the executor and exact checker against Python arithmetic and the table."""

import pytest

from llmbook.agents import tool_env as TE


def test_execute_and_check():
    for t in TE.make_tasks(30, seed=1):
        assert TE.check(t, t.tool, t.arg) == 1.0
        if t.tool != "lookup":
            a, b = map(int, t.arg.split(","))
            assert TE.execute(t.tool, t.arg) == str(a + b if t.tool == "add" else a * b)
        assert (t.tool, t.arg) in TE.candidate_calls(t)
        assert len(TE.candidate_calls(t)) == 15
    t = TE.Task("What is 3 plus 4?", "add", "3,4", "7")
    assert TE.check(t, "mul", "3,4") == 0.0 and TE.check(t, "lookup", "pi") == 0.0
    assert TE.execute("add", "pi").startswith("error")
    with pytest.raises(ValueError):
        TE.execute("sub", "1,2")


def test_tasks_reproducible_and_balanced():
    a, b = TE.make_tasks(12, seed=3), TE.make_tasks(12, seed=3)
    assert a == b and [t.tool for t in a].count("lookup") == 4


def test_observation_probs_sum_to_one():
    for eps in (0.0, 0.2, 1.0):
        d = TE.observation_probs("add", "3,4", eps)
        assert abs(sum(d.values()) - 1) < 1e-12
    assert TE.observation_probs("add", "3,4", 0.2)["7"] == pytest.approx(0.8)
