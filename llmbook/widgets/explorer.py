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

Readable, small and fast frames (issue 13):

* frames render at :data:`DEFAULT_DPI` (never below :data:`MIN_DPI`), so text of 9 pt or more stays
  readable where the frame is shown at its natural size (no wider than :data:`MAX_DISPLAY_WIDTH_PX`);
  :func:`smallest_text_pt` measures the smallest text of a drawn figure for the widgets' tests;
* frames are compressed: quantised to a palette of :data:`DEFAULT_COLORS` colours and written as a
  palette PNG (:func:`figure_png`), three to four times smaller than matplotlib's RGBA PNG;
* one matplotlib figure is reused for all frames. A ``draw`` function may return an *updater*, a
  callable ``update(result)`` that changes the data of the artists it drew (``set_data``, ``set_text``
  ...); the explorer then draws the figure once and calls the updater for every later frame, which is
  several times faster than building a figure per frame. An updater that renders the frame itself (for
  instance by blitting the moving artists onto a cached background) returns the pixels, an
  ``(H, W, 3 or 4)`` uint8 array, which the explorer compresses as they are. A ``draw`` that returns
  ``None`` is called on the cleared figure for every frame, as before;
* the frames are precomputed with one torch thread: their computations are small, and on a busy
  machine the start-up of torch's thread pool costs far more than the work.
"""

from __future__ import annotations

import io
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmbook._checks import is_int, is_real

__all__ = ["Param", "Explorer", "has_stack", "on_colab", "figure_png", "pixels_png", "smallest_text_pt",
           "torch_threads", "DEFAULT_DPI", "MIN_DPI", "DEFAULT_COLORS", "MAX_DISPLAY_WIDTH_PX"]

#: Resolution of the frames (dots per inch); matches the book's static figures (``llmbook.plotting``).
DEFAULT_DPI = 100
#: Frames are never rendered below this resolution; a smaller ``dpi`` passed to :class:`Explorer` is raised to it.
MIN_DPI = 100
#: Palette size of the compressed frames (``None`` keeps full-colour RGBA PNG).
DEFAULT_COLORS = 64
#: Widest frame (pixels) that the book's page shows at its natural size; wider frames are scaled down
#: by the browser, shrinking their text. ``figsize[0] * dpi`` should stay within it.
MAX_DISPLAY_WIDTH_PX = 760


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


def _check_colors(colors) -> None:
    if colors is not None and not (is_int(colors) and 2 <= colors <= 256):
        raise ValueError(f"colors must be an int in [2, 256] (a palette size) or None, got {colors!r}")


def pixels_png(pixels, *, colors: int | None = DEFAULT_COLORS) -> bytes:
    """PNG bytes of an ``(H, W, 3 or 4)`` uint8 image (alpha is dropped when quantising).

    ``colors``: quantise to a palette of that many colours, with fast octree quantisation and no
    dithering (lines and text stay crisp), and write a palette PNG; ``None`` writes full colour. zlib runs
    at its default level: PIL's ``optimize`` (level 9) saves about 6 % more bytes at about 6x the encoding
    time of a frame.
    """
    import numpy as np
    from PIL import Image

    _check_colors(colors)
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] not in (3, 4):
        raise ValueError(f"pixels must be an (H, W, 3 or 4) uint8 array, got {pixels.dtype} {pixels.shape}")
    if colors is None:
        image = Image.fromarray(np.ascontiguousarray(pixels))
    else:
        image = Image.fromarray(np.ascontiguousarray(pixels[..., :3]))
        image = image.quantize(colors=colors, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="png")
    return out.getvalue()


def figure_png(fig, *, dpi: float | None = None, colors: int | None = DEFAULT_COLORS,
               tight: bool | None = None) -> bytes:
    """PNG bytes of a matplotlib figure, rendered with Agg and compressed by :func:`pixels_png`.

    ``tight``: crop to the drawn artists like ``bbox_inches="tight"`` (``None``: as the ``savefig.bbox``
    rcParam says; the book's style crops), at the cost of a second draw; ``False`` renders the whole canvas
    once. No metadata is written, so equal figures give equal bytes.
    """
    import matplotlib as mpl
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    _check_colors(colors)
    dpi = fig.dpi if dpi is None else dpi
    if tight is None:
        tight = mpl.rcParams["savefig.bbox"] == "tight"
    if not tight:
        if fig.dpi != dpi:
            fig.set_dpi(dpi)
        canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
        canvas.draw()
        return pixels_png(np.asarray(canvas.buffer_rgba()), colors=colors)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None}, bbox_inches="tight",
                pil_kwargs={"compress_level": 1} if colors is not None else None)
    if colors is None:
        return buf.getvalue()
    buf.seek(0)
    return pixels_png(np.asarray(Image.open(buf).convert("RGB")), colors=colors)


def torch_threads(n: int) -> int:
    """Set torch's intra-op threads to ``n`` (if torch is loaded) and return the previous number."""
    torch = sys.modules.get("torch")
    if torch is None:
        return n
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def smallest_text_pt(fig) -> float:
    """The smallest font size (points) of the visible, non-empty text of a drawn figure: titles, labels,
    tick labels, legends, annotations. At :data:`MIN_DPI` or more and a frame no wider than
    :data:`MAX_DISPLAY_WIDTH_PX`, points are what the reader sees; the book asks for at least 9.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()  # tick labels exist only after a draw
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
             and _inside(t, fig)]
    if not sizes:
        raise ValueError("the figure holds no visible text")
    return float(min(sizes))


def _inside(text, fig) -> bool:
    """Whether a text artist is drawn within the figure's canvas (tick labels outside the view are not)."""
    bb = text.get_window_extent()
    W, H = fig.canvas.get_width_height()
    return bb.x1 > 0 and bb.y1 > 0 and bb.x0 < W and bb.y0 < H and bb.width > 0


class Explorer:
    """Sliders over ``params`` driving ``draw(compute(**values), fig)``.

    >>> ex = Explorer(lambda a: a * 2, lambda r, fig: fig.gca().bar([0], [r]), [Param("a", [1, 2, 3])])
    >>> ex.grid_size
    3
    >>> ex.compute_at(a=2)
    4
    """

    def __init__(self, compute: Callable[..., Any], draw: Callable[[Any, Any], Callable[[Any], None] | None],
                 params: Sequence[Param], *, figsize: tuple[float, float] = (7.0, 3.0), dpi: int | None = None,
                 title: str = "", colors: int | None = DEFAULT_COLORS):
        if not params:
            raise ValueError("an Explorer needs at least one Param")
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"Param names must be distinct, got {names}")
        _check_colors(colors)
        self.compute, self.draw, self.params = compute, draw, list(params)
        # frames are never rendered below MIN_DPI (issue 13: readable text on the page)
        self.figsize, self.dpi, self.title = figsize, max(DEFAULT_DPI if dpi is None else dpi, MIN_DPI), title
        self.colors = colors
        self._fig = None  # the one figure every frame is rendered on
        self._update = None  # the updater returned by draw, if any
        self._pixels = None  # the frame an updater rendered itself, if it did

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

    def figure(self, **values):
        """The explorer's figure drawn for one point (reused: the next call redraws or updates it)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from llmbook.plotting import apply_style

        result = self.compute_at(**values)
        self._pixels = None
        if self._fig is not None and self._update is not None:
            self._pixels = self._update(result)
            return self._fig
        apply_style()
        if self._fig is None:
            self._fig = Figure(figsize=self.figsize, dpi=self.dpi)
            FigureCanvasAgg(self._fig)
        else:
            self._fig.clear()
        update = self.draw(result, self._fig)
        self._update = update if callable(update) else None
        if self._update is not None:  # the first frame goes through the updater too (it may render it)
            self._pixels = self._update(result)
        return self._fig

    def png(self, **values) -> bytes:
        """Render the figure for one point as compressed PNG bytes (no pyplot state is left behind).

        A figure with an updater is rendered whole (its ``draw`` lays it out, e.g. with ``tight_layout``);
        one redrawn per frame is cropped as ``savefig.bbox`` says.
        """
        fig = self.figure(**values)
        if self._pixels is not None:
            return pixels_png(self._pixels, colors=self.colors)
        return figure_png(fig, dpi=self.dpi, colors=self.colors, tight=None if self._update is None else False)

    def smallest_text_pt(self, **values) -> float:
        """Smallest font size (points) in the frame for ``values`` (see :func:`smallest_text_pt`)."""
        return smallest_text_pt(self.figure(**values))

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
        threads = torch_threads(1)
        try:
            for idx in points:
                out[idx] = self.png(**{p.name: p.values[i] for p, i in zip(self.params, idx, strict=True)})
        finally:
            torch_threads(threads)
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
        images: dict[bytes, Any] = {}  # equal frames share one Image model: the page stores each picture once

        def image(png: bytes):
            # Image, not HTML: the embed manager typesets HTML widgets with the MathJax 2 API,
            # which fails next to the site's MathJax 3.
            if png not in images:
                images[png] = w.Image(value=png, format="png")
            return images[png]

        def build(level: int, prefix: tuple[int, ...]):
            p = self.params[level]
            if level == len(self.params) - 1:
                children = [image(frames[prefix + (i,)]) for i in range(len(p.values))]
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
