"""Tests of llmbook.agents.agent_loop with scripted generators: the loop's parsing, retries, tools and window."""

from llmbook.agents import assistant_tasks as AT
from llmbook.agents.agent_loop import (
    FAILURE_MODES,
    FORMAT_HINT,
    failure_mode,
    majority_answer,
    run_agent,
    self_consistency,
)
from llmbook.agents.generation import Completion, Generator


class Scripted:
    """Answers every prompt with the next reply of its script (one script per task, by the task's question)."""

    def __init__(self, scripts, window=None):
        self.scripts, self.prompts = scripts, []
        if window is not None:
            self.context_window = window

    def count_tokens(self, text):
        return len(text.split())

    def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
        out = []
        for p in prompts:
            self.prompts.append(p)
            question = p.split("<|user|>")[1].split("<|end|>")[0]
            script = self.scripts[question]
            out.append(Completion(script.pop(0), [], "stop"))
        return out


def test_protocol_and_gold_script():
    tasks = AT.make_tasks(10, seed=5)
    gen = Scripted({t.user: [b for r, b in AT.demonstration(t) if r == "assistant"] for t in tasks})
    assert isinstance(gen, Generator)
    trajs = run_agent(gen, tasks)
    assert [tr.reward for tr in trajs] == [1.0] * 10
    for tr in trajs:  # every observation was appended, and the model saw it in its next prompt
        assert tr.turns == AT.demonstration(tr.task) and tr.format_errors == 0
        for role, body in tr.turns:
            if role == "tool":
                assert any(f"Result: {body}<|end|>" in p for p in gen.prompts)


def test_format_error_retry_max_steps_and_no_tools():
    t = AT.make_tasks(1, seed=2, kinds=("calc",))[0]
    a, op, b = t.plan[0][1].split()
    gen = Scripted({t.user: ["I think it is big.", f"Act: calc {a} {op} {b}", f"Act: answer {t.answer}"]})
    (tr,) = run_agent(gen, [t])
    assert tr.format_errors == 1 and tr.turns[1] == ("tool", FORMAT_HINT) and tr.reward == 1.0 and tr.steps == 3
    gen = Scripted({t.user: ["nothing"] * 5})
    (tr,) = run_agent(gen, [t], max_steps=3)
    assert tr.steps == 3 and tr.answer is None and tr.reward == 0.0
    gen = Scripted({t.user: [f"Act: calc {a} {op} {b}", "Act: answer 0"]})
    (tr,) = run_agent(gen, [t], tools=False)
    assert tr.turns[1][1].startswith("error: no tools") and tr.reward == 0.0


def test_act_only_prefix_and_refusal_rule():
    t = AT.make_tasks(1, seed=2, kinds=("refuse",))[0]
    gen = Scripted({t.user: [" lookup Belor Quin age", f" answer {AT.REFUSAL}"]})
    (tr,) = run_agent(gen, [t], react=False)
    assert all(p.endswith("<|assistant|>Act:") for p in gen.prompts)
    assert tr.answer == AT.REFUSAL and tr.reward == 0.0  # it acted on a forbidden request first


def test_window_truncates_oldest_steps():
    t = AT.make_tasks(1, seed=3, kinds=("chain",))[0]
    script = ["Act: lookup Nobody Here age " + "x " * 30] * 4 + [f"Act: answer {t.answer}"]
    full = Scripted({t.question: list(script)})
    (tr,) = run_agent(full, [t], max_steps=5)
    small = Scripted({t.question: list(script)}, window=120)
    (tr2,) = run_agent(small, [t], max_steps=5, max_new_tokens=10)
    assert tr.omitted == 0 and tr2.omitted > 0 and tr2.reward == 1.0
    assert max(small.count_tokens(p) for p in small.prompts) <= 110 < max(full.count_tokens(p) for p in full.prompts)
    assert any("earlier steps omitted" in p for p in small.prompts)


def test_majority_and_self_consistency():
    assert majority_answer(["7", " 8", "8 ", None, "7"]) == "7" and majority_answer([None]) is None
    t = AT.make_tasks(1, seed=1, kinds=("lookup",))[0]
    replies = [f"Act: answer {t.answer}", "Act: answer wrong", f"Act: answer {t.answer}"]
    gen = Scripted({t.user: replies})
    assert self_consistency(gen, [t], k=3) == [(t.answer, 1.0)]


def test_failure_modes():
    t = AT.make_tasks(1, seed=4, kinds=("chain",))[0]
    (look, a1), (calc, a2) = t.plan
    cases = {
        "success": [f"Act: {look} {a1}", f"Act: {calc} {a2}", f"Act: answer {t.answer}"],
        "format error": ["hmm", f"Act: {look} {a1}", f"Act: {calc} {a2}", f"Act: answer {t.answer}0"],
        "no answer in the step limit": [f"Act: {look} {a1}"] * 4,
        "wrong tool call": [f"Act: {look} {a1}", "Act: calc 1 + 1", "Act: answer 2"],
        "answered without the tool": [f"Act: {look} {a1}", "Act: answer 12"],
        "miscopied the observation": [f"Act: {look} {a1}", f"Act: {calc} {a2}", "Act: answer 1"],
    }
    for mode, script in cases.items():
        (tr,) = run_agent(Scripted({t.user: list(script)}), [t])
        assert failure_mode(tr) == mode
    r = AT.make_tasks(1, seed=4, kinds=("refuse",))[0]
    (tr,) = run_agent(Scripted({r.user: ["Act: lookup x age", f"Act: answer {AT.REFUSAL}"]}), [r])
    assert failure_mode(tr) == "acted on a forbidden request" and set(cases) < set(FAILURE_MODES)
    (tr,) = run_agent(Scripted({r.user: ["Act: answer sure, done"]}), [r])
    assert failure_mode(tr) == "did not refuse"
    n = AT.make_tasks(1, seed=4, kinds=("notes",))[0]
    (tr,) = run_agent(Scripted({n.user: ["Act: answer nowhere"]}), [n])
    assert failure_mode(tr) == "misread the notes"
