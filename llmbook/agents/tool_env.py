r"""A small tool-use environment written for the book: arithmetic and look-up questions, three tools, an exact checker.

Each :class:`Task` is a question such as ``"What is 3 plus 4?"`` or ``"What is the value of pi?"``. The agent
answers with one tool call ``tool(arg)``: ``add("3,4")``, ``mul("3,4")`` or ``lookup("pi")``. :func:`execute`
runs the call deterministically (a malformed argument gives an ``"error: ..."`` observation);
:func:`check` is the exact checker: reward 1 iff the call's result equals the task's answer. A *flaky* version
(:func:`observation_probs`) returns ``"error: timeout"`` with probability ``eps``, which makes the environment
stochastic, as ReAct's trajectory probability (40.04) needs. Registers no equation.

>>> execute("add", "3,4"), execute("mul", "3,4"), execute("lookup", "pi"), execute("add", "pi")
('7', '12', '3.14159', 'error: add needs two integers a,b')
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["LOOKUP", "TOOLS", "Task", "candidate_calls", "check", "execute", "make_tasks", "observation_probs",
           "prompt"]

TOOLS = ("add", "mul", "lookup")
LOOKUP = {"pi": "3.14159", "e": "2.71828", "tau": "6.28318", "phi": "1.61803"}
_NAME = {"pi": "pi", "e": "e", "tau": "tau", "phi": "the golden ratio phi"}


@dataclass(frozen=True)
class Task:
    """One question with its gold tool, gold argument and the answer the checker accepts."""

    question: str
    tool: str
    arg: str
    answer: str


def execute(tool: str, arg: str) -> str:
    """Run ``tool(arg)`` and return the observation string (deterministic)."""
    if tool not in TOOLS:
        raise ValueError(f"tool must be one of {TOOLS}, got {tool!r}")
    if not isinstance(arg, str):
        raise TypeError(f"arg must be a str, got {type(arg).__name__}")
    if tool == "lookup":
        return LOOKUP.get(arg, f"error: no entry {arg!r}")
    parts = arg.split(",")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        return f"error: {tool} needs two integers a,b"
    a, b = (int(p) for p in parts)
    return str(a + b if tool == "add" else a * b)


def check(task: Task, tool: str, arg: str) -> float:
    """Exact checker: 1.0 iff ``execute(tool, arg)`` equals the task's answer, else 0.0."""
    return float(execute(tool, arg) == task.answer)


def make_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks, a third of each tool, operands in 2..9; reproducible from ``seed``."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        tool = TOOLS[i % 3]
        if tool == "lookup":
            key = rng.choice(sorted(LOOKUP))
            tasks.append(Task(f"What is the value of {_NAME[key]}?", tool, key, LOOKUP[key]))
        else:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            word = "plus" if tool == "add" else "times"
            tasks.append(Task(f"What is {a} {word} {b}?", tool, f"{a},{b}", execute(tool, f"{a},{b}")))
    return tasks


def prompt(task: Task) -> str:
    """The context the agent sees: the question and an answer line that awaits a tool call."""
    return f"Q: {task.question}\nA: "


def candidate_calls(task: Task) -> list[tuple[str, str]]:
    """Every call the agent may emit: each tool with the question's number pair or a look-up key (15 calls)."""
    nums = [w for w in task.question.rstrip("?").split() if w.isdigit()]
    args = [",".join(nums)] if len(nums) == 2 else ["1,1"]
    return [(t, a) for t in TOOLS for a in args + sorted(LOOKUP)]


def observation_probs(tool: str, arg: str, eps: float) -> dict[str, float]:
    """The flaky environment's observation distribution: the result w.p. ``1 - eps``, a timeout w.p. ``eps``."""
    if not 0 <= eps <= 1:
        raise ValueError(f"eps must lie in [0, 1], got {eps}")
    out = execute(tool, arg)
    if eps == 0:
        return {out: 1.0}
    return {out: 1 - eps, "error: timeout": eps}
