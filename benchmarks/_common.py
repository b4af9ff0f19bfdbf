"""What every CPU benchmark script shares: the timer, the machine record and the result files.

Scripts run as ``python benchmarks/<name>.py``, so this folder is on ``sys.path`` and they import it
as ``_common``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def median_time(fn: Callable[[], object], repeats: int, *, warmup: bool = True) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls of ``fn`` (after one untimed warm-up call), and its last result."""
    if warmup:
        fn()
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def machine(**extra) -> dict:
    """The machine a result was measured on (processor, core count, Python) plus ``extra`` fields."""
    return {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), **extra}


def save(result: dict, out: Path, plot: Callable[[dict, Path], None] | None = None) -> None:
    """Write ``<benchmark>.json`` and, given ``plot``, its figure ``<benchmark>.png`` into ``out``, and say so."""
    name = result["benchmark"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if plot is not None:
        plot(result, out / f"{name}.png")
    print(f"wrote {out / f'{name}.json'}" + (f" and {name}.png" if plot is not None else ""))


class Progress:
    """A deterministic run and its progress messages: each printed with the seconds since the run started.

    Creating it sets torch to 2 threads and deterministic algorithms, the set-up under which the assistant's
    benchmarks write the same weights on every rerun. ``minutes()`` is the run's length so far, rounded.
    """

    def __init__(self, threads: int = 2):
        import torch

        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True)
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.0f} s] {msg}", flush=True)

    def minutes(self) -> float:
        return round((time.perf_counter() - self.t0) / 60, 1)
