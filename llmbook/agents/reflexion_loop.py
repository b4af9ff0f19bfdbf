r"""Reflexion with a real generator: after a failed trial the model writes a lesson, and the next trial reads it.

Reflexion (Shinn et al., chapter 40's equation 40.09) keeps an episodic memory of verbal lessons,
:math:`M_{t+1} = M_t \cup \{\rho_t\}` with :math:`\rho_t = f_\theta(\text{trajectory}_t, \text{feedback}_t)`.
Here every part of that loop is real text:

1. trial 1 is a greedy episode of :func:`~llmbook.agents.agent_loop.run_agent`;
2. the feedback is binary, as in the paper's HotpotQA runs: the verifier says whether the answer was right, and
   only failed tasks get another trial;
3. the lesson :math:`\rho_t` is written by the model itself (:func:`write_reflections`): its failed transcript,
   then a user turn asking what to do differently, and the model's reply up to ``<|end|>``;
4. the next trial starts with the memory, every lesson so far, as a user turn before the model's first turn
   (``run_agent(..., prelude=...)``).

The control is the same loop with ``memory=False``: the same number of trials, sampled with the same seeds, but
no lessons in the context. What Reflexion adds over plain retrying is the difference between the two.
Registers no equation (40.09's union is :func:`llmbook.agents.agent_decisions.reflexion_update`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmbook._checks import check_positive_int
from llmbook.agents.agent_loop import Trajectory, _prompt, run_agent
from llmbook.agents.assistant_tasks import Task

__all__ = ["ASK", "MEMORY", "ReflexionRecord", "reflexion", "write_reflections"]

ASK = "That answer was wrong. In one line, what should you do differently?"
MEMORY = "Lessons from your earlier attempts: "


@dataclass
class ReflexionRecord:
    """One task's trials (:class:`~llmbook.agents.agent_loop.Trajectory`, in order) and the lessons between them."""

    task: Task
    trials: list[Trajectory] = field(default_factory=list)
    reflections: list[str] = field(default_factory=list)

    @property
    def solved(self) -> float:
        """1.0 if some trial earned the verifier's reward, else 0.0."""
        return float(any(tr.reward == 1.0 for tr in self.trials))


def write_reflections(generator, failed: Sequence[Trajectory], max_new_tokens: int = 24) -> list[str]:
    """The model's own lesson for each failed trajectory: greedy, one turn, after the user turn ``ASK``.

    The prompt is the trajectory's transcript with ``("user", ASK)`` appended, truncated from the oldest step as
    :func:`~llmbook.agents.agent_loop.run_agent` truncates, so that the reply fits the generator's window.

    >>> from llmbook.agents.assistant_tasks import make_tasks
    >>> class Echo:  # a stand-in generator that always writes the same line
    ...     def generate(self, prompts, max_new_tokens, stop, temperature, seed):
    ...         return [type("C", (), {"text": " Call the tool first. "})() for _ in prompts]
    >>> write_reflections(Echo(), [Trajectory(make_tasks(1, seed=1)[0])])
    ['Call the tool first.']
    """
    max_new_tokens = check_positive_int(max_new_tokens, "max_new_tokens")
    if not failed:
        return []
    window = getattr(generator, "context_window", None)
    prompts = []
    for tr in failed:
        probe = Trajectory(tr.task, turns=[*tr.turns, ("user", ASK)], system=tr.system)
        prompts.append(_prompt(generator, probe, "", True, None if window is None else window - max_new_tokens))
    outs = generator.generate(prompts, max_new_tokens=max_new_tokens, stop=("<|end|>",), temperature=0.0, seed=0)
    return [" ".join(o.text.split()) for o in outs]


def reflexion(generator, tasks: Sequence[Task], *, trials: int = 3, memory: bool = True, temperature: float = 0.7,
              seed: int = 0, reflect_tokens: int = 24, **loop) -> list[ReflexionRecord]:
    """Up to ``trials`` episodes per task, stopping at the first one the verifier accepts (module docstring).

    Trial 1 is greedy; trial ``j > 1`` samples at ``temperature`` with seed ``seed + 100 j`` for every open task,
    with (``memory=True``) or without the model's lessons in its context. ``loop`` goes to
    :func:`~llmbook.agents.agent_loop.run_agent` (``max_new_tokens``, ``max_steps``, ...). Returns one
    :class:`ReflexionRecord` per task.
    """
    trials = check_positive_int(trials, "trials")
    records = [ReflexionRecord(t) for t in tasks]
    for rec, tr in zip(records, run_agent(generator, tasks, seed=seed, **loop), strict=True):
        rec.trials.append(tr)
    for j in range(2, trials + 1):
        open_ = [rec for rec in records if not rec.solved]
        if not open_:
            break
        if memory:
            lessons = write_reflections(generator, [rec.trials[-1] for rec in open_], max_new_tokens=reflect_tokens)
            for rec, lesson in zip(open_, lessons, strict=True):
                rec.reflections.append(lesson)
        prelude = [[("user", MEMORY + " ".join(rec.reflections))] if memory else [] for rec in open_]
        again = run_agent(generator, [rec.task for rec in open_], temperature=temperature, seed=seed + 100 * j,
                          prelude=prelude, **loop)
        for rec, tr in zip(open_, again, strict=True):
            rec.trials.append(tr)
    return records
