"""The book's one plotting style, and the set-up every chapter notebook runs first."""

from __future__ import annotations

import logging
import random

STYLE = {
    "figure.figsize": (6.4, 3.4),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "savefig.bbox": "tight",
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": None,  # filled in apply_style
    "font.size": 10,
    "axes.titlesize": 11,
    "legend.frameon": False,
    "image.cmap": "viridis",
    "svg.hashsalt": "llmbook",
}
# A colour-blind-safe palette (Okabe & Ito), used in this order by every figure.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]


def apply_style() -> None:
    """Set matplotlib's rcParams to the book's style (idempotent)."""
    import matplotlib as mpl
    from cycler import cycler

    style = dict(STYLE)
    style["axes.prop_cycle"] = cycler(color=PALETTE)
    mpl.rcParams.update(style)


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch so that a notebook gives the same outputs on every run."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup_notebook(seed: int = 0) -> None:
    """What a chapter's first cell runs: seeds, one torch thread, 4-significant-digit printing, the plot style."""
    import numpy as np
    import torch

    seed_everything(seed)
    # One thread: the book's tensors are small, the test run gives each notebook one core, and a fixed
    # reduction order makes the printed numbers the same on machines with different core counts.
    torch.set_num_threads(1)
    torch.set_printoptions(precision=4, sci_mode=False)
    np.set_printoptions(precision=4, suppress=True)
    apply_style()
    # transformers imports bitsandbytes when it is installed, and on CPUs with AVX512-BF16 bitsandbytes logs
    # a warning about an optional GPU-kernel package to stderr at import; it concerns nothing the book runs.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:  # in a kernel: PNG figures, no timing or address in the output
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.run_line_magic("config", "InlineBackend.figure_formats = ['png']")
    except ImportError:  # pragma: no cover
        pass


def show_source(obj, *, start: str | None = None, end: str | None = None):
    """The source of ``obj`` from the installed package, as a highlighted code block in a notebook.

    Generated from the code itself, so the page cannot drift from the implementation. ``start`` and
    ``end`` cut it to the lines from the first one containing ``start`` to the first later one containing
    ``end`` (inclusive), to show an inner loop rather than a whole function.

    >>> print(show_source(seed_everything, start="random.seed", end="np.random").data)
        random.seed(seed)
        np.random.seed(seed)
    """
    import inspect

    obj = getattr(obj, "fn", obj)  # a @triton.jit kernel wraps the Python function it compiles
    lines = inspect.getsource(obj).splitlines()
    if start is not None:
        first = next((i for i, line in enumerate(lines) if start in line), None)
        if first is None:
            raise ValueError(f"no line of {getattr(obj, '__qualname__', obj)!r} contains {start!r}")
        lines = lines[first:]
    if end is not None:
        last = next((i for i, line in enumerate(lines) if end in line), None)
        if last is None:
            raise ValueError(f"no line of {getattr(obj, '__qualname__', obj)!r} after {start!r} contains {end!r}")
        lines = lines[:last + 1]
    from IPython.display import Code

    return Code("\n".join(lines), language="python")
