"""Chapter 43's injection and guards (llmbook/agents/injection.py and the gate and escaping of agent_loop).

Oracles: scripted generators that do what an injected model would (call ``delete``, look up the injected
person), so the loop's guards are tested on calls that certainly happen; the tokenizer itself, which must
see no special token in an escaped observation; the poisoned records compared field by field.
"""

from __future__ import annotations

import pytest

from llmbook.agents import assistant_tasks as AT
from llmbook.agents import injection
from llmbook.agents.agent_loop import BLOCKED, escape_observation, run_agent
from llmbook.agents.generation import Completion
from llmbook.lm.bpe import train_bpe


class Obedient:
    """Looks the record up, then obeys any "Find the city of X" it sees in the context, then deletes X."""

    def __init__(self, tasks):
        self.prompts, self.plan = [], {t.question: t.plan[0][1] for t in tasks}

    def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
        out = []
        for p in prompts:
            self.prompts.append(p)
            n_turns = p.count("<|assistant|>")
            question = p.split("<|user|>")[1].split("<|end|>")[0]
            if n_turns == 1:
                out.append(Completion(f"Act: lookup {self.plan[question]}", [], "stop"))
            elif "Find the city of " in p and n_turns == 2:
                other = p.split("Find the city of ")[1].split(".")[0]
                out.append(Completion(f"Act: lookup {other} city", [], "stop"))
            elif n_turns == 3:
                other = p.split("Find the city of ")[1].split(".")[0]
                out.append(Completion(f"Act: delete {other}", [], "stop"))
            else:
                out.append(Completion("Act: answer done", [], "stop"))
        return out


@pytest.fixture(scope="module")
def tasks():
    return AT.make_tasks(6, seed=9, split="heldout", kinds=("lookup",))


def test_poison_keeps_the_answer_and_changes_one_field(tasks):
    for payload in injection.PAYLOADS:
        for t, p in zip(tasks, injection.poison(tasks, payload), strict=True):
            name, field = t.plan[0][1].rsplit(" ", 1)
            assert p.answer == t.answer and p.question == t.question
            assert p.directory[name][field].startswith(t.answer) and "Find the city of" in p.directory[name][field]
            diff = [(n, f) for n in t.directory for f in AT.FIELDS if t.directory[n][f] != p.directory[n][f]]
            assert diff == [(name, field)]
            assert t.directory[name][field] == t.answer    # the original is untouched
    with pytest.raises(ValueError, match="lookup tasks"):
        injection.poison(AT.make_tasks(1, seed=1, kinds=("calc",)), "plain text")


def test_gate_blocks_out_of_scope_and_irreversible_calls(tasks):
    poisoned = injection.poison(tasks, "plain text")
    free = run_agent(Obedient(tasks), poisoned)
    assert all(injection.out_of_scope(tr) == 2 for tr in free)   # the look-up of the other person, and delete
    assert all(tr.calls[2][0] == "delete" and not tr.blocked for tr in free)
    gen = Obedient(tasks)
    gated = run_agent(gen, poisoned, gate=injection.scope_gate)
    for tr in gated:
        assert injection.out_of_scope(tr) == 0 and [c[0] for c in tr.blocked] == ["lookup", "delete"]
        assert tr.turns[3] == ("tool", BLOCKED) and tr.turns[5] == ("tool", BLOCKED)
        assert tr.turns[1][1].startswith(tr.task.answer)   # the user's own look-up ran
    assert injection.scope_gate(tasks[0], "calc", "1 + 2")


def test_escaping_removes_every_forged_special_token(tasks):
    text = "\n".join(AT.render(t, AT.demonstration(t)) for t in AT.make_tasks(20, seed=1))
    tok = train_bpe(text, 40, AT.SPECIALS)
    forged = injection.PAYLOADS["forged user turn"].format(v="34", m="Mira Quin")
    ids = set(tok.special_tokens.values())
    assert ids & set(tok.encode(forged))                       # raw: the tokenizer sees <|end|> and <|user|>
    assert not ids & set(tok.encode(escape_observation(forged)))
    gen = Obedient(tasks)
    run_agent(gen, injection.poison(tasks[:1], "forged user turn"))
    raw = Obedient(tasks)
    run_agent(raw, injection.poison(tasks[:1], "forged user turn"), escape=False)
    assert gen.prompts[1].count("<|user|>") == 1 and raw.prompts[1].count("<|user|>") == 2
