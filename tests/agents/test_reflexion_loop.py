"""Tests of llmbook.agents.reflexion_loop (and run_agent's prelude) with a generator that reads its prompt."""

import pytest

from llmbook.agents import assistant_tasks as AT
from llmbook.agents.agent_loop import Trajectory, run_agent
from llmbook.agents.generation import Completion
from llmbook.agents.reflexion_loop import ASK, MEMORY, ReflexionRecord, reflexion, write_reflections
from tests.agents.test_agent_loop import Scripted


class Reader(Scripted):
    """A stand-in model: answers wrongly unless a lesson naming the gold answer is in its context.

    Asked for a lesson (the prompt ends with the ASK turn), it writes ``use <gold answer>`` on its ``k``-th
    lesson for a task, and ``try again`` before that, so that lessons must accumulate for a task to be solved.
    Its window and token count are :class:`Scripted`'s; it reads its prompts instead of following a script.
    """

    def __init__(self, lessons_needed=1, window=None):
        super().__init__({}, window=window)
        self.lessons_needed, self.asked = lessons_needed, {}

    def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
        out = []
        for p in prompts:
            self.prompts.append(p)
            task = next(t for t in TASKS if f"<|user|>{t.user}<|end|>" in p)
            if p.endswith(f"<|user|>{ASK}<|end|><|assistant|>"):
                n = self.asked[task.question] = self.asked.get(task.question, 0) + 1
                out.append(Completion(f" use {task.answer} " if n >= self.lessons_needed else " try again", [], "stop"))
            elif f"use {task.answer}" in p:
                out.append(Completion(f"Act: answer {task.answer}", [], "stop"))
            else:
                out.append(Completion("Act: answer wrong", [], "stop"))
        return out


TASKS = AT.make_tasks(6, seed=11, kinds=("lookup", "notes", "calc"))


def test_lessons_are_written_read_and_accumulated():
    gen = Reader(lessons_needed=2)
    recs = reflexion(gen, TASKS, trials=3, memory=True)
    assert all(isinstance(r, ReflexionRecord) and r.solved == 1.0 for r in recs)
    for r in recs:
        assert [tr.reward for tr in r.trials] == [0.0, 0.0, 1.0]  # the second lesson names the answer
        assert r.reflections == ["try again", f"use {r.task.answer}"]
        first_turn = r.trials[2].turns[0]
        assert first_turn == ("user", MEMORY + f"try again use {r.task.answer}")  # both lessons, oldest first
        assert r.trials[2].steps == 1  # the memory is no step of the episode


def test_without_memory_the_same_trials_stay_unsolved_and_nothing_is_written():
    gen = Reader(lessons_needed=1)
    recs = reflexion(gen, TASKS, trials=3, memory=False)
    assert [r.solved for r in recs] == [0.0] * len(TASKS)
    assert all(len(r.trials) == 3 and r.reflections == [] for r in recs)
    assert not any(p.endswith(f"{ASK}<|end|><|assistant|>") for p in gen.prompts)
    assert not any(MEMORY in p for p in gen.prompts)


def test_solved_tasks_get_no_further_trial():
    gen = Reader(lessons_needed=1)
    recs = reflexion(gen, TASKS, trials=5, memory=True)
    assert all(len(r.trials) == 2 and len(r.reflections) == 1 for r in recs)
    assert len(reflexion(gen, TASKS, trials=1)[0].trials) == 1
    with pytest.raises(ValueError, match="trials"):
        reflexion(gen, TASKS, trials=0)


def test_write_reflections_prompt_and_truncation():
    tr = run_agent(Reader(), TASKS[:1])[0]
    tr.turns = [("assistant", "Act: lookup x"), ("tool", "one two three " * 10)] * 3 + tr.turns
    gen = Reader(window=len(tr.text().split()) - 5)  # too long by a few words: the oldest steps go
    assert write_reflections(gen, [tr], max_new_tokens=4) == [f"use {TASKS[0].answer}"]  # spaces normalised
    prompt = gen.prompts[-1]
    assert prompt.endswith(f"<|user|>{ASK}<|end|><|assistant|>") and "earlier steps omitted" in prompt
    assert gen.count_tokens(prompt) <= gen.context_window - 4
    assert write_reflections(gen, []) == []


def test_run_agent_prelude_opens_the_transcript_and_is_checked():
    gen = Reader()
    trajs = run_agent(gen, TASKS[:2], prelude=[[("user", "hello")], []])
    assert trajs[0].turns[0] == ("user", "hello") and trajs[1].turns[0][0] == "assistant"
    assert "<|user|>hello<|end|><|assistant|>" in gen.prompts[0]
    with pytest.raises(ValueError, match="prelude has 1 entries for 2 tasks"):
        run_agent(gen, TASKS[:2], prelude=[[]])
    assert isinstance(trajs[0], Trajectory)
