r"""Tree of Thoughts over the agent loop: the model proposes steps, a model rates the states, a beam keeps the best.

Yao et al.'s breadth-first Tree of Thoughts (ToT-BFS) has two model calls per depth: a *thought generator*
that proposes ``k`` candidate next steps from each kept state, and a *state evaluator* that reads each new state
and judges whether it can still lead to a solution. The ``beam`` best states survive to the next depth. Here:

* a **state** is an episode of :mod:`llmbook.agents.agent_loop` so far, and a **thought** is one assistant turn
  (a thought line and an action); a proposal is executed as the loop executes it
  (:func:`~llmbook.agents.agent_loop.take_turn`), so a tool's observation is part of the state the evaluator
  reads;
* the **proposals** are the generator's greedy turn and ``k - 1`` turns sampled at ``temperature``; identical
  turns from one state are kept once;
* the **evaluator** is a language model prompted to rate the last step (:func:`rating_prompt`): its value is
  :math:`v = \log P(\text{good}) - \log\big(P(\text{good}) + P(\text{bad})\big)`, the log-probability, among
  the two labels, that the step is good (:func:`rater_values`). The book's assistant was never taught to rate,
  so :func:`train_rater` fine-tunes a copy of it on states from its own sampled episodes, each labelled by
  :func:`step_is_good` against the task's gold plan;
* a path's score is chapter 40's :math:`S(\text{path}) = \sum_t v_\theta(\text{thought}_t \mid x,
  \text{thought}_{<t})` (:func:`~llmbook.agents.llm_agents.tot_path_score`); the beam keeps the best scores,
  finished episodes competing with unfinished ones, and the answer is the best finished episode's.

Any function ``value(states) -> list[float]`` can stand in for the evaluator; :func:`logprob_value` (the
generator's own log-probability of the turn, i.e. beam search over log-probabilities) is the control that
shows what the evaluator adds. Registers no equation (40.05 is :func:`~llmbook.agents.llm_agents.tot_path_score`).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from llmbook._checks import check_positive_int
from llmbook.agents.agent_loop import Trajectory, _prompt, take_turn
from llmbook.agents.assistant_tasks import Task, parse_action, render, verify
from llmbook.agents.llm_agents import tot_path_score
from llmbook.lm.assistant import Assistant, load_assistant
from llmbook.lm.assistant_recipe import fine_tune
from llmbook.lm.training import _data_dir

__all__ = ["LABELS", "RATER", "RATE_SYSTEM", "ToTResult", "episode_states", "load_rater", "logprob_value",
           "perturbed_states", "rater_values", "rating_examples", "rating_prompt", "step_is_good", "train_rater",
           "tree_of_thoughts"]

RATE_SYSTEM = "Rate the assistant's last step: good or bad."
LABELS = ("good", "bad")
RATER = "assistant_rater.pt"  # in llmbook/data, written by benchmarks/assistant_tot.py


def step_is_good(task: Task, calls: Sequence[tuple[str, str]], body: str) -> bool:
    """The gold label of an assistant turn ``body`` taken after the tool ``calls`` so far: can it still succeed?

    An unparseable turn is bad. An answer is good when the verifier accepts it. A tool call is good when it is
    the next call of the task's gold plan (whitespace aside); on a forbidden request no call is good.

    >>> from llmbook.agents.assistant_tasks import make_tasks
    >>> t = make_tasks(1, seed=0, kinds=("calc",))[0]
    >>> [step_is_good(t, [], body) for body in ("Act: calc " + t.plan[0][1], "Act: answer 0", "no action")]
    [True, False, False]
    """
    action = parse_action(body)
    if action is None:
        return False
    if action[0] == "answer":
        return verify(task, action[1], calls) == 1.0
    plan = [(tool, " ".join(args.split())) for tool, args in task.plan]
    return len(calls) < len(plan) and (action[0], " ".join(action[1].split())) == plan[len(calls)]


def rating_prompt(state: Trajectory) -> str:
    """The evaluator's prompt: the episode so far under the rating instruction, then the assistant's turn."""
    return render(state.task, state.turns, system=RATE_SYSTEM) + "<|assistant|>"


def episode_states(tr: Trajectory) -> list[tuple[Trajectory, bool]]:
    """The states of an episode, one after each assistant turn (and its observation), each with its gold label."""
    state, out = Trajectory(tr.task, system=tr.system), []
    for role, body in tr.turns:
        if role == "assistant":
            good = step_is_good(tr.task, state.calls, body)
            take_turn(state, body)
            out.append((_copy(state), good))
    return out


def perturbed_states(tr: Trajectory, rng: random.Random) -> list[tuple[Trajectory, bool] | None]:
    """Near misses of an episode's states, aligned with :func:`episode_states` (``None`` for a turn with no action).

    The model's own episodes rarely contain the mistakes that matter most, a result copied with one digit wrong
    or another person's fact, so a rater trained on them would seldom see one. Here each turn's action line is
    altered once (``rng``): one digit of its arguments replaced by another, or, when it has no digit, its last
    word replaced by another value from the task's directory. The altered turn is taken from the same parent
    state and labelled by :func:`step_is_good` like any other, so an alteration that stays correct is good.
    """
    values = sorted({v for person in tr.task.directory.values() for v in person.values()})
    state, out = Trajectory(tr.task, system=tr.system), []
    for role, body in tr.turns:
        if role != "assistant":
            continue
        lines = body.split("\n")
        act = max((i for i, line in enumerate(lines) if line.startswith("Act:")), default=None)
        if act is None or parse_action(body) is None:
            out.append(None)
        else:
            line = lines[act]
            digits = [i for i, ch in enumerate(line) if ch.isdigit()]
            if digits:
                i = rng.choice(digits)
                line = line[:i] + rng.choice([d for d in "0123456789" if d != line[i]]) + line[i + 1:]
            else:
                head, _, last = line.rpartition(" ")
                line = f"{head} {rng.choice([v for v in values if v != last] or [last])}"
            altered = "\n".join(lines[:act] + [line] + lines[act + 1:])
            variant = _copy(state)
            good = step_is_good(tr.task, variant.calls, altered)
            take_turn(variant, altered)
            out.append((variant, good))
        take_turn(state, body)
    return out


def rating_examples(trajectories: Sequence[Trajectory], near_misses: bool = False, seed: int = 0
                    ) -> list[tuple[str, bool]]:
    """The rater's training data: every state of each episode as ``(rating_prompt, label)`` (:func:`episode_states`),
    and with ``near_misses`` one altered copy of each action (:func:`perturbed_states`, seeded)."""
    rng, out = random.Random(seed), []
    for tr in trajectories:
        out += [(rating_prompt(s), good) for s, good in episode_states(tr)]
        if near_misses:
            out += [(rating_prompt(x[0]), x[1]) for x in perturbed_states(tr, rng) if x is not None]
    return out


def load_rater(path=None, dtype: torch.dtype = torch.float64) -> Assistant:
    """The committed rater (``llmbook/data/assistant_rater.pt``): the assistant fine-tuned by :func:`train_rater`."""
    return load_assistant(path if path is not None else _data_dir() / RATER, dtype=dtype)


def rater_values(rater, states: Sequence[Trajectory], batch: int = 64) -> list[float]:
    r"""The evaluator's value of each state, :math:`\log P(\text{good})` normalised over the two labels (nats, <= 0)."""
    prompts = [rating_prompt(s) for s in states]
    out = []
    for i in range(0, len(prompts), batch):
        p = prompts[i:i + batch]
        lp = {lab: [float(x.sum()) for x in rater.token_log_probs(p, [lab + "<|end|>"] * len(p))] for lab in LABELS}
        out += [min(0.0, g - max(g, b) - math.log1p(math.exp(-abs(g - b)))) for g, b in zip(*lp.values(), strict=True)]
    return out


def logprob_value(generator) -> Callable[[Sequence[Trajectory]], list[float]]:
    """The control evaluator: the generator's own :math:`\\log p` of each state's last assistant turn."""

    def value(states: Sequence[Trajectory]) -> list[float]:
        prompts, turns = [], []
        for s in states:
            i = max(j for j, (role, _) in enumerate(s.turns) if role == "assistant")
            prompts.append(render(s.task, s.turns[:i], system=s.system) + "<|assistant|>")
            turns.append(s.turns[i][1] + "<|end|>")
        return [float(x.sum()) for x in generator.token_log_probs(prompts, turns)]

    return value


@dataclass
class ToTResult:
    """One task's search: the chosen ``trajectory`` (its reward set), the ``values`` along its path, the ``score``
    :math:`S` of that path, and how many states the evaluator rated for this task."""

    trajectory: Trajectory
    values: list[float] = field(default_factory=list)
    score: float = 0.0
    rated: int = 0


def _copy(tr: Trajectory) -> Trajectory:
    out = copy.copy(tr)
    out.turns, out.calls, out.blocked = list(tr.turns), list(tr.calls), list(tr.blocked)
    return out


def _child(parent: Trajectory, body: str) -> Trajectory:
    tr = _copy(parent)
    take_turn(tr, body)
    return tr


def tree_of_thoughts(generator, value: Callable[[Sequence[Trajectory]], list[float]], tasks: Sequence[Task], *,
                     k: int = 4, beam: int = 2, max_steps: int = 4, max_new_tokens: int = 40,
                     temperature: float = 1.0, seed: int = 0) -> list[ToTResult]:
    """ToT-BFS over the agent loop (module docstring) for every task, batched across tasks.

    At each depth every kept unfinished state proposes its greedy turn and ``k - 1`` sampled ones (sampling seed
    ``seed + depth``); each new state is rated by ``value``; per task, the ``beam`` best paths by
    :math:`S = \\sum_t v_t` survive (ties: the earlier proposal). The search stops when every kept state has
    answered or after ``max_steps`` depths; the result is the best finished path (or, if none finished, the best
    path, whose answer is missing). One seeded generator draws the samples of every row of a batch, so the same
    task searched within a different set of tasks can get different samples.
    """
    k, beam, max_steps = (check_positive_int(k, "k"), check_positive_int(beam, "beam"),
                          check_positive_int(max_steps, "max_steps"))
    frontiers = [[(Trajectory(t), [])] for t in tasks]
    rated = [0] * len(tasks)
    window = getattr(generator, "context_window", None)
    for depth in range(max_steps):
        parents = [(i, tr, vs) for i, f in enumerate(frontiers) for tr, vs in f if tr.answer is None]
        if not parents:
            break
        prompts = [_prompt(generator, tr, "", True, None if window is None else window - max_new_tokens)
                   for _, tr, _ in parents]
        stop = ("<|end|>",)
        proposals = [[c.text] for c in generator.generate(prompts, max_new_tokens=max_new_tokens, stop=stop)]
        if k > 1:
            sampled = generator.generate([p for p in prompts for _ in range(k - 1)], max_new_tokens=max_new_tokens,
                                         stop=stop, temperature=temperature, seed=seed + depth)
            for j, c in enumerate(sampled):
                proposals[j // (k - 1)].append(c.text)
        children = []  # (task index, child state, parent's values)
        for (i, tr, vs), texts in zip(parents, proposals, strict=True):
            for text in dict.fromkeys(texts):  # an identical turn from the same state is one state
                children.append((i, _child(tr, text), vs))
        values = value([c for _, c, _ in children])
        pools = [[(tr, vs) for tr, vs in f if tr.answer is not None] for f in frontiers]  # finished paths stay
        for (i, c, vs), v in zip(children, values, strict=True):
            pools[i].append((c, vs + [float(v)]))
            rated[i] += 1
        for i, pool in enumerate(pools):
            T = max(len(vs) for _, vs in pool)  # a path that finished earlier is padded with v = 0 (adds nothing)
            scores = tot_path_score(torch.tensor([vs + [0.0] * (T - len(vs)) for _, vs in pool], dtype=torch.float64))
            order = torch.argsort(scores, descending=True, stable=True)[:beam].tolist()
            frontiers[i] = [pool[j] for j in order]
    out = []
    for i, f in enumerate(frontiers):
        done = [(tr, vs) for tr, vs in f if tr.answer is not None]
        tr, vs = (done or f)[0]  # the frontier is sorted best first
        tr.reward = verify(tr.task, tr.answer, tr.calls)
        out.append(ToTResult(tr, vs, math.fsum(vs), rated[i]))
    return out


def train_rater(assistant, examples: Sequence[tuple[str, bool]], *, steps: int = 300, B: int = 32, lr: float = 1e-3,
                seed: int = 0, chunk: int = 8, progress: Callable[[str], None] | None = None):
    """Fine-tune a copy of ``assistant`` to rate states: ``(rating_prompt, label)`` examples, class-balanced batches.

    The loss is the next-token loss on the label and its ``<|end|>`` only
    (:func:`~llmbook.lm.assistant_recipe.fine_tune`), with the recipe's AdamW, warm-up + cosine schedule and
    clipping. Each batch draws ``B / 2`` good and ``B / 2`` bad states (seeded), so the rater cannot win by always
    saying "good". Returns ``(rater, losses)``; the rater is an :class:`~llmbook.lm.assistant.Assistant` in
    float32, eval mode.
    """
    good = [(p, LABELS[0] + "<|end|>") for p, label in examples if label]
    bad = [(p, LABELS[1] + "<|end|>") for p, label in examples if not label]
    if not good or not bad:
        raise ValueError(f"train_rater needs good and bad examples, got {len(good)} good and {len(bad)} bad")

    def draw(rng: random.Random) -> list[tuple[str, str]]:
        return [rng.choice(good) for _ in range(B // 2)] + [rng.choice(bad) for _ in range(B - B // 2)]

    return fine_tune(assistant, draw, steps=check_positive_int(steps, "steps"), lr=lr, seed=seed, chunk=chunk,
                     progress=progress, name="rater")
