"""One mechanism for every widget of the book: live in a kernel, still interactive on the static site.

A widget is three parts (see the design notes):

* a pure **computation** ``compute(**params) -> result`` that is tested like any implementation;
* a **draw** function ``draw(result, fig)`` that paints the result onto a matplotlib figure;
* an :class:`Explorer` that turns the two into ipywidgets:

  - :meth:`Explorer.live` recomputes for any slider value (Jupyter, Colab);
  - :meth:`Explorer.static` precomputes one PNG per point of the slider grid and puts them into
    nested ``ipywidgets.Stack`` containers whose ``selected_index`` is ``jslink``-ed to the sliders.
    The links run in the browser, so the page keeps responding with no kernel once myst-nb has
    embedded the widget state;
  - :meth:`Explorer.show` picks ``static`` where ``Stack`` exists (ipywidgets 8) and falls back to
    ``live`` on Colab (ipywidgets 7, no ``Stack``).
"""

from __future__ import annotations

import io
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmbook._checks import is_int, is_real

__all__ = ["Param", "Explorer", "has_stack", "on_colab"]


@dataclass
class Param:
    """One slider: a name (the keyword passed to ``compute``), its grid of values and a label.

    ``values`` is the grid the static explorer precomputes. The live explorer uses a continuous
    slider over ``[min, max]`` (with ``step``) for numbers and a dropdown for anything else.
    ``default`` is a value from ``values`` (the first one if omitted).
    """

    name: str
    values: Sequence[Any]
    label: str | None = None
    default: Any = None
    step: float | None = None
    fmt: Callable[[Any], str] = field(default=lambda v: f"{v:g}" if isinstance(v, float) else str(v))

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"Param name {self.name!r} must be a Python identifier (it becomes a keyword argument)")
        self.values = list(self.values)
        if not self.values:
            raise ValueError(f"Param {self.name!r} needs at least one value")
        if self.default is None:
            self.default = self.values[0]
        if self.default not in self.values:
            raise ValueError(f"default {self.default!r} of Param {self.name!r} is not one of its values {self.values}")
        self.label = self.label or self.name

    @property
    def numeric(self) -> bool:
        return all(is_real(v) for v in self.values)

    @property
    def integer(self) -> bool:
        return all(is_int(v) for v in self.values)


def on_colab() -> bool:
    return "google.colab" in sys.modules


def has_stack() -> bool:
    """``ipywidgets.Stack`` (ipywidgets >= 8) is what the kernel-free explorer needs."""
    try:
        import ipywidgets as w
    except ImportError:  # pragma: no cover - ipywidgets is a reader dependency
        return False
    return hasattr(w, "Stack")


class Explorer:
    """Sliders over ``params`` driving ``draw(compute(**values), fig)``.

    >>> ex = Explorer(lambda a: a * 2, lambda r, fig: fig.gca().bar([0], [r]), [Param("a", [1, 2, 3])])
    >>> ex.grid_size
    3
    >>> ex.compute_at(a=2)
    4
    """

    def __init__(self, compute: Callable[..., Any], draw: Callable[[Any, Any], None], params: Sequence[Param],
                 *, figsize: tuple[float, float] = (7.0, 3.0), dpi: int = 64, title: str = ""):
        if not params:
            raise ValueError("an Explorer needs at least one Param")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"Param names must be distinct, got {names}")
        self.compute, self.draw, self.params = compute, draw, list(params)
        self.figsize, self.dpi, self.title = figsize, dpi, title

    @property
    def grid_size(self) -> int:
        n = 1
        for p in self.params:
            n *= len(p.values)
        return n

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def compute_at(self, **values) -> Any:
        kw = self.defaults() | values
        return self.compute(**kw)

    def png(self, **values) -> bytes:
        """Render the figure for one point as PNG bytes (no pyplot state is left behind)."""
        from matplotlib.figure import Figure

        from llmbook.plotting import apply_style

        apply_style()
        fig = Figure(figsize=self.figsize, dpi=self.dpi)
        self.draw(self.compute_at(**values), fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=self.dpi, metadata={"Software": None})
        return buf.getvalue()

    # ------------------------------------------------------------------ live
    def live(self):
        """Sliders that recompute on every change (needs a running kernel)."""
        import ipywidgets as w

        controls = []
        for p in self.params:
            if p.numeric and len(p.values) > 1:
                lo, hi = min(p.values), max(p.values)
                if p.integer:
                    c = w.IntSlider(value=p.default, min=lo, max=hi, step=int(p.step or 1), description=p.label)
                else:
                    c = w.FloatSlider(value=p.default, min=lo, max=hi, step=p.step or (hi - lo) / 100,
                                      description=p.label, readout_format=".3g")
            else:
                c = w.Dropdown(options=[(p.fmt(v), v) for v in p.values], value=p.default, description=p.label)
            controls.append(c)
        image = w.Image(format="png", value=self.png())

        def update(_change=None):
            image.value = self.png(**{p.name: c.value for p, c in zip(self.params, controls, strict=True)})

        for c in controls:
            c.observe(update, names="value")
        return w.VBox([w.HBox(controls, layout=w.Layout(flex_flow="row wrap")), image])

    # ------------------------------------------------------------------ static
    def frames(self, progress: bool = False) -> dict[tuple[int, ...], bytes]:
        """PNG bytes for every point of the grid, keyed by the tuple of value indices."""
        points = list(itertools.product(*[range(len(p.values)) for p in self.params]))
        if progress:  # plain tqdm on stderr: the site drops stderr, nbval never sees it
            from tqdm import tqdm

            points = tqdm(points, desc=f"precomputing {self.title or 'frames'}", leave=False, file=sys.stderr)
        out = {}
        for idx in points:
            out[idx] = self.png(**{p.name: p.values[i] for p, i in zip(self.params, idx, strict=True)})
        return out

    def static(self, progress: bool = False):
        """Precomputed frames in nested Stacks, ``jslink``-ed to the sliders: works without a kernel."""
        import ipywidgets as w

        if not has_stack():
            raise RuntimeError("the static explorer needs ipywidgets >= 8 (ipywidgets.Stack); use live() instead")
        frames = self.frames(progress=progress)
        controls = []
        for p in self.params:
            options = [(p.fmt(v), i) for i, v in enumerate(p.values)]
            index = p.values.index(p.default)
            if p.numeric:
                c = w.SelectionSlider(options=options, value=index, description=p.label, continuous_update=True)
            else:
                c = w.ToggleButtons(options=options, value=index, description=p.label)
            controls.append(c)

        links = []

        def build(level: int, prefix: tuple[int, ...]):
            p = self.params[level]
            if level == len(self.params) - 1:
                # Image, not HTML: the embed manager typesets HTML widgets with the MathJax 2 API,
                # which fails next to the site's MathJax 3.
                children = [w.Image(value=frames[prefix + (i,)], format="png") for i in range(len(p.values))]
            else:
                children = [build(level + 1, prefix + (i,)) for i in range(len(p.values))]
            stack = w.Stack(children, selected_index=p.values.index(p.default))
            links.append(w.jslink((controls[level], "index"), (stack, "selected_index")))
            return stack

        view = build(0, ())
        box = w.VBox([w.VBox(controls), view])
        box.links = links  # the browser-side links, kept for inspection (tests)
        return box

    def show(self, mode: str = "auto", progress: bool = False):
        """The explorer for this environment: ``static`` where possible, ``live`` on Colab / ipywidgets 7."""
        if mode not in ("auto", "live", "static"):
            raise ValueError(f"mode must be 'auto', 'live' or 'static', got {mode!r}")
        if mode == "auto":
            mode = "live" if on_colab() or not has_stack() else "static"
        return self.live() if mode == "live" else self.static(progress=progress)
