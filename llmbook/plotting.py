"""The book's one plotting style, and the set-up every chapter notebook runs first."""

from __future__ import annotations

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
    """What a chapter's first cell runs: seeds, 4-significant-digit printing, the plot style."""
    import numpy as np
    import torch

    seed_everything(seed)
    torch.set_printoptions(precision=4, sci_mode=False)
    np.set_printoptions(precision=4, suppress=True)
    apply_style()
    try:  # in a kernel: PNG figures, no timing or address in the output
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.run_line_magic("config", "InlineBackend.figure_formats = ['png']")
    except ImportError:  # pragma: no cover
        pass
