"""Tests of llmbook.agents.tree_of_thoughts: gold labels, the search against brute force, and the evaluator."""

import math
import random

import pytest

from llmbook.agents import assistant_tasks as AT
from llmbook.agents.agent_loop import Trajectory, run_agent, take_turn
from llmbook.agents.generation import Completion
from llmbook.agents.tree_of_thoughts import (
    LABELS,
    episode_states,
    logprob_value,
    perturbed_states,
    rater_values,
    rating_examples,
    rating_prompt,
    step_is_good,
    train_rater,
    tree_of_thoughts,
)
from llmbook.lm.assistant import Assistant
from tests.lm.test_assistant import check_trains_a_copy, tiny_assistant_model


class Menu:
    """A scripted generator: at depth d (assistant turns so far) greedy gives ``greedy[d]``, sampling ``samples[d]``."""

    def __init__(self, greedy, samples):
        self.greedy, self.samples, self.calls = greedy, samples, []

    def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
        self.calls.append((len(prompts), temperature, seed))
        out = []
        for j, p in enumerate(prompts):
            d = p.count("<|assistant|>") - 1
            menu = [self.greedy[d]] if temperature == 0 else self.samples[d]
            out.append(Completion(menu[j % len(menu)](p), [], "stop"))
        return out


def _last_result(prompt):
    return prompt.rsplit("Result: ", 1)[1].split("<|end|>")[0]


@pytest.fixture
def calc_task():
    return AT.make_tasks(1, seed=3, kinds=("calc",))[0]


def _menu(task):
    gold = task.plan[0][1]
    greedy = [lambda p: "Thought: calc.\nAct: calc 1 + 1", lambda p: f"Act: answer {_last_result(p)}"]
    samples = [[lambda p: f"Act: calc {gold}", lambda p: "Act: answer 7", lambda p: "no action here"],
               [lambda p: "Act: answer 0", lambda p: f"Act: answer {_last_result(p)}x", lambda p: "Act: answer 1"]]
    return Menu(greedy, samples)


def oracle(states):
    """A perfect evaluator: v = 0 for a good last step, -5 for a bad one (gold labels)."""
    out = []
    for s in states:
        replay = Trajectory(s.task)
        for role, body in s.turns:
            if role == "assistant":
                good = step_is_good(s.task, replay.calls, body)
                take_turn(replay, body)
        out.append(0.0 if good else -5.0)
    return out


def test_gold_labels_on_demonstrations_and_corruptions():
    tasks = AT.make_tasks(25, seed=11)
    ex = rating_examples([Trajectory(t, turns=AT.demonstration(t)) for t in tasks])
    assert len(ex) == sum(r == "assistant" for t in tasks for r, _ in AT.demonstration(t))
    assert all(good for _, good in ex) and all(p.endswith("<|assistant|>") for p, _ in ex)
    for t in tasks:
        calls = []
        if t.kind == "refuse":
            assert not step_is_good(t, [], "Act: lookup " + next(iter(t.directory)) + " age")
            continue
        if t.plan:
            tool, args = t.plan[0]
            assert step_is_good(t, calls, f"Act: {tool}  {args} ")  # whitespace does not matter
            assert not step_is_good(t, calls, f"Act: {tool} {args} 1")
        assert not step_is_good(t, list(t.plan), f"Act: answer {t.answer}0")
        assert step_is_good(t, list(t.plan), f"Act: answer {t.answer}")


def test_perturbed_steps_are_near_misses_with_gold_labels():
    tasks = AT.make_tasks(30, seed=12)
    gold = [Trajectory(t, turns=AT.demonstration(t)) for t in tasks]
    for tr in gold:
        states, near = episode_states(tr), perturbed_states(tr, random.Random(1))
        assert len(near) == len(states) and all(x is not None for x in near)  # every gold turn has an action
        for (s, good), (v, near_good) in zip(states, near, strict=True):
            a, b = (next(body for role, body in reversed(x.turns) if role == "assistant") for x in (s, v))
            assert good and a != b and a.split("Act:")[0] == b.split("Act:")[0]  # only the action line changed
            # a gold step with one digit or one word changed is no longer the gold step: every near miss is bad
            assert not near_good
    ex = rating_examples(gold, near_misses=True, seed=3)
    assert len(ex) == 2 * len(rating_examples(gold)) and sum(g for _, g in ex) == len(ex) // 2
    assert ex == rating_examples(gold, near_misses=True, seed=3) != rating_examples(gold, near_misses=True, seed=4)


def test_search_finds_the_brute_force_best_path(calc_task):
    greedy = run_agent(_menu(calc_task), [calc_task])[0]
    assert greedy.reward == 0.0  # the greedy turn calls the calculator with the wrong numbers
    # every path of the menu's tree, depth <= 2, scored by the oracle's S = sum of v
    best = None
    for first in [_menu(calc_task).greedy[0]] + _menu(calc_task).samples[0]:
        s1 = Trajectory(calc_task)
        take_turn(s1, first(""))
        v1 = oracle([s1])[0]
        seconds = [None] if s1.answer is not None else [_menu(calc_task).greedy[1]] + _menu(calc_task).samples[1]
        for second in seconds:
            s2 = s1
            score = v1
            if second is not None:
                s2 = Trajectory(calc_task, turns=list(s1.turns), calls=list(s1.calls), steps=s1.steps)
                take_turn(s2, second(AT.render(calc_task, s1.turns)))
                score += oracle([s2])[0]
            if s2.answer is not None and (best is None or score > best[0]):
                best = (score, s2.turns)
    res = tree_of_thoughts(_menu(calc_task), oracle, [calc_task], k=4, beam=50, max_steps=2)[0]
    assert res.trajectory.turns == best[1] and res.score == best[0] == 0.0
    assert res.trajectory.reward == 1.0 and res.trajectory.answer == calc_task.answer
    assert res.values == [0.0, 0.0] and res.rated == 4 + 3 * 4  # 4 first turns; 3 unfinished (one a format error) x 4
    narrow = tree_of_thoughts(_menu(calc_task), oracle, [calc_task], k=4, beam=1, max_steps=2)[0]
    assert narrow.trajectory.reward == 1.0 and narrow.rated == 4 + 4  # beam 1 expands only the best state


def test_one_proposal_and_a_flat_value_is_the_greedy_loop():
    tasks = AT.make_tasks(10, seed=8)
    scripts = {t.user: [b for r, b in AT.demonstration(t) if r == "assistant"] for t in tasks}

    class Gold:
        def generate(self, prompts, max_new_tokens=64, stop=(), temperature=0.0, seed=0):
            assert temperature == 0.0
            return [Completion(scripts[p.split("<|user|>")[1].split("<|end|>")[0]][p.count("<|assistant|>") - 1],
                               [], "stop") for p in prompts]

    res = tree_of_thoughts(Gold(), lambda states: [0.0] * len(states), tasks, k=1, beam=3)
    ref = run_agent(Gold(), tasks)
    assert [r.trajectory.turns for r in res] == [tr.turns for tr in ref]
    assert [r.trajectory.reward for r in res] == [1.0] * 10


def test_seeds_and_validation(calc_task):
    menu = _menu(calc_task)
    tree_of_thoughts(menu, oracle, [calc_task], k=3, beam=2, max_steps=2, seed=40)
    assert [c for c in menu.calls if c[1] > 0] == [(2, 1.0, 40), (4, 1.0, 41)]  # k - 1 samples per kept state
    for bad in ({"k": 0}, {"beam": 0}, {"max_steps": 0}):
        with pytest.raises(ValueError):
            tree_of_thoughts(menu, oracle, [calc_task], **bad)


@pytest.fixture(scope="module")
def small():
    model, tok = tiny_assistant_model([AT.render(t, AT.demonstration(t)) for t in AT.make_tasks(60, seed=1)])
    return Assistant(model.eval(), tok)


def test_rater_value_is_the_label_log_probability(small):
    states = []
    for t in AT.make_tasks(6, seed=2):
        s = Trajectory(t)
        take_turn(s, [b for r, b in AT.demonstration(t) if r == "assistant"][0])
        states.append(s)
    v = rater_values(small, states, batch=4)
    for s, vi in zip(states, v, strict=True):  # the unbatched, per-row path of Assistant.score as the reference
        g, b = (small.score([rating_prompt(s)], [lab + "<|end|>"])[0] for lab in LABELS)
        assert math.isclose(vi, g - math.log(math.exp(g) + math.exp(b)), abs_tol=1e-10) and vi < 0
    lv = logprob_value(small)(states)
    for s, x in zip(states, lv, strict=True):
        prompt = AT.render(s.task, s.turns[:-2] if s.turns[-1][0] == "tool" else s.turns[:-1]) + "<|assistant|>"
        turn = next(b for r, b in reversed(s.turns) if r == "assistant")
        assert math.isclose(x, small.score([prompt], [turn + "<|end|>"])[0], abs_tol=1e-10)


def test_train_rater_learns_and_leaves_the_assistant_alone(small):
    tasks = AT.make_tasks(20, seed=6, kinds=("calc",))
    good = rating_examples([Trajectory(t, turns=AT.demonstration(t)) for t in tasks])
    bad = rating_examples([Trajectory(t, turns=[("assistant", "no action")]) for t in tasks])
    rater, _ = check_trains_a_copy(train_rater, small, good + bad, steps=40, B=8, lr=3e-3)
    new = AT.make_tasks(4, seed=9, kinds=("calc",))
    v = rater_values(rater, [Trajectory(t, turns=AT.demonstration(t)) for t in new])
    w = rater_values(rater, [Trajectory(t, turns=[("assistant", "no action")]) for t in new])
    assert min(v) > max(w)  # it separates the two kinds of state it was taught
    with pytest.raises(ValueError, match="good and bad"):
        train_rater(small, good, steps=1)
