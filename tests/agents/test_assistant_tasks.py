"""Tests of llmbook.agents.assistant_tasks: tools against Python's arithmetic, the split's hygiene, the verifier."""

import re

import pytest

from llmbook.agents import assistant_tasks as AT
from llmbook.lm.assistant_recipe import RecipeConfig, heldout_tasks, training_tasks


def test_no_heldout_prompt_in_training_data():
    cfg = RecipeConfig()
    train = {t.user for t in training_tasks(cfg)}
    held = heldout_tasks(cfg)
    assert len(train) > 8000 and len(held) == cfg.heldout
    assert not {t.user for t in held} & train
    # no held-out question can come from a training or RL template: each template as a regex whose slots
    # accept exactly what the generator fills in (numbers, an operation word, a name, a field)
    slots = {"a": r"\d+", "b": r"\d+", "k": r"\d+", "w": "(?:plus|minus|times)", "n": r"[A-Z][a-z]+ [A-Z][a-z]+",
             "f": "(?:city|age|job)"}

    def pattern(template):
        return re.compile("^" + re.sub(r"\\\{(\w)\\\}", lambda m: slots[m.group(1)], re.escape(template)) + "$")

    patterns = [pattern(x) for v in AT._TEMPLATES.values() for x in v["train"] + v["rl"]]
    assert not [t.question for t in held if any(p.match(t.question) for p in patterns)]
    # the check can fail: each held-out template matches its own questions
    for kind, v in AT._TEMPLATES.items():
        own = [pattern(x) for x in v["heldout"]]
        assert all(any(p.match(t.question) for p in own) for t in held if t.kind == kind)


def test_tools_against_python():
    for t in AT.make_tasks(200, seed=4):
        for tool, args in t.plan:
            obs = AT.execute(t, tool, args)
            if tool == "calc":
                a, op, b = args.split()
                assert obs == str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
            else:
                *name, f = args.split()
                assert obs == t.directory[" ".join(name)][f]
    t = AT.make_tasks(1, seed=0, kinds=("lookup",))[0]
    for tool, args in [("calc", "3 +"), ("calc", "a + 2"), ("lookup", ""), ("lookup", "Nobody Here age"),
                       ("search", "x")]:
        assert AT.execute(t, tool, args).startswith("error")


def test_demonstration_reaches_gold_answer_and_verifier():
    for t in AT.make_tasks(100, seed=2) + AT.make_tasks(50, seed=3, split="heldout"):
        turns = AT.demonstration(t, react=t.seed % 2 == 0)
        final = AT.parse_action(turns[-1][1])
        assert final[0] == "answer" and AT.verify(t, final[1]) == 1.0
        assert AT.verify(t, final[1] + "0") == 0.0 and AT.verify(t, None) == 0.0
        calls = [AT.parse_action(b) for r, b in turns if r == "assistant"][:-1]
        assert calls == list(t.plan)
    refuse = AT.make_tasks(1, seed=0, kinds=("refuse",))[0]
    assert AT.verify(refuse, AT.REFUSAL) == 1.0 and AT.verify(refuse, AT.REFUSAL, [("lookup", "x age")]) == 0.0


def test_facts_are_random_per_episode():
    a = AT.make_tasks(400, seed=11, kinds=("lookup",))
    answers = {}
    for t in a:  # the same person gets different facts in different episodes
        n = next(iter(t.directory))
        answers.setdefault(n, set()).add(t.directory[n]["city"])
    assert max(len(v) for v in answers.values()) > 1


def test_parse_and_render():
    assert AT.parse_action("Act: answer I cannot help with that.") == ("answer", "I cannot help with that.")
    assert AT.parse_action("Act:") is None and AT.parse_action("") is None
    t = AT.make_tasks(1, seed=1, kinds=("notes",))[0]
    assert "Notes:" in AT.render(t) and "Notes:" not in AT.closed_book(t)
    assert AT.render(t, [("tool", "12")]).endswith("<|tool|>Result: 12<|end|>")
    with pytest.raises(ValueError, match="split"):
        AT.make_tasks(2, split="test")
    with pytest.raises(ValueError, match="kind"):
        AT.make_tasks(2, kinds=("poem",))


def test_grounded_thoughts_change_only_the_thoughts_and_quote_what_the_action_needs():
    for t in AT.make_tasks(40, seed=11):
        plain, grounded = AT.demonstration(t), AT.demonstration(t, grounded=True)
        assert [r for r, _ in plain] == [r for r, _ in grounded]
        acts = [body.splitlines()[-1] for _, body in plain]
        assert acts == [body.splitlines()[-1] for _, body in grounded]  # the same actions and observations
        thoughts = [body.splitlines()[0] for r, body in grounded if r == "assistant"]
        n = next(iter(t.directory))
        if t.kind == "notes":  # the thought is the note about the person asked about, word for word
            note = next(s.strip() + "." for s in t.notes.split(".") if s.strip().startswith(n))
            assert thoughts[0] == f"Thought: The notes say {note}" and f" {t.answer}" in note
        if t.kind == "chain":  # the second thought holds the calculator's arguments as the call writes them
            assert f"Now {t.plan[1][1]} on" in thoughts[1]
        if t.kind in ("calc", "lookup"):
            assert t.answer not in thoughts[-1]
