"""The explorer mechanism: live and static views built from one computation."""

import ipywidgets as w
import pytest

from llmbook.widgets.explorer import Explorer, Param


def _draw(result, fig):
    fig.gca().bar([0], [result])


def _explorer():
    return Explorer(lambda a, b: a * (2 if b == "double" else 1), _draw,
                    [Param("a", [1, 2, 3], default=2), Param("b", ["single", "double"])])


def test_param_validation():
    with pytest.raises(ValueError, match="identifier"):
        Param("not a name", [1])
    with pytest.raises(ValueError, match="at least one value"):
        Param("a", [])
    with pytest.raises(ValueError, match="is not one of its values"):
        Param("a", [1, 2], default=5)
    with pytest.raises(ValueError, match="distinct"):
        Explorer(lambda a: a, _draw, [Param("a", [1]), Param("a", [2])])
    with pytest.raises(ValueError, match="mode"):
        _explorer().show(mode="sometimes")


def test_static_view_links_sliders_to_nested_stacks_with_one_frame_per_point():
    ex = _explorer()
    box = ex.static()
    controls, outer = box.children
    slider_a, toggle_b = controls.children
    assert isinstance(outer, w.Stack) and len(outer.children) == 3
    assert all(isinstance(s, w.Stack) and len(s.children) == 2 for s in outer.children)
    assert outer.selected_index == 1 == slider_a.index  # default a = 2
    # every Stack is jslinked to its control: a Link model pairs (control, "index") with (stack, "selected_index")
    linked = {(id(link.source[0]), id(link.target[0])) for link in box.links}
    assert all(link.source[1] == "index" and link.target[1] == "selected_index" for link in box.links)
    assert (id(slider_a), id(outer)) in linked
    for inner in outer.children:
        assert (id(toggle_b), id(inner)) in linked
    # frames differ where the computation differs: a=1,double (2) vs a=2,single (2) are equal pictures
    frames = ex.frames()
    assert len(frames) == 6
    assert frames[(0, 1)] == frames[(1, 0)]
    assert frames[(0, 0)] != frames[(2, 1)]
    # equal frames share one Image model (the page stores the picture once)
    assert outer.children[0].children[1] is outer.children[1].children[0]
    assert outer.children[0].children[0] is not outer.children[2].children[1]


def test_live_view_recomputes_when_a_control_changes():
    ex = _explorer()
    box = ex.live()
    controls, image = box.children
    slider_a, drop_b = controls.children
    before = image.value
    slider_a.value = 3
    assert image.value != before
    assert image.value == ex.png(a=3, b="single")
    drop_b.value = "double"
    assert image.value == ex.png(a=3, b="double")


def test_show_falls_back_to_live_on_colab(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "google.colab", object())
    box = _explorer().show()
    assert isinstance(box.children[1], w.Image)  # live view: an Image, not a Stack


# ---------------------------------------------------------------- issue 13: readable, small, fast frames
def _line_draw(result, fig):
    """A draw that returns an updater: the line's data and the title change in place."""
    ax = fig.subplots()
    (line,) = ax.plot([0, 1, 2], [0, result, 2 * result])
    ax.set(xlim=(0, 2), ylim=(0, 6))
    title = ax.set_title(f"slope {result}", fontsize=10)
    fig.tight_layout()

    def update(r):
        line.set_ydata([0, r, 2 * r])
        title.set_text(f"slope {r}")

    return update


def _decode(png):
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_frames_default_to_100_dpi_and_never_go_below():
    from llmbook.widgets.explorer import DEFAULT_DPI, MIN_DPI

    assert DEFAULT_DPI >= 100 and MIN_DPI >= 100
    assert _explorer().dpi == DEFAULT_DPI
    low = Explorer(lambda a: a, _draw, [Param("a", [1])], figsize=(2, 1), dpi=64)
    assert low.dpi == MIN_DPI
    width, height = _decode(low.png()).shape[1::-1]
    assert width > 2 * MIN_DPI * 0.8  # about 2 inches at MIN_DPI (cropped by the tight bounding box)


def test_compressed_frames_are_palette_pngs_much_smaller_than_rgba_and_look_the_same():
    import numpy as np

    ex = Explorer(lambda a: a, _line_draw, [Param("a", [1, 2])], figsize=(4, 2.5))
    full = Explorer(lambda a: a, _line_draw, [Param("a", [1, 2])], figsize=(4, 2.5), colors=None)
    small, big = ex.png(a=2), full.png(a=2)
    assert small[25] == 3 and big[25] == 6  # IHDR colour type: 3 = palette, 6 = RGBA
    assert len(small) < 0.6 * len(big)
    a, b = _decode(small).astype(int), _decode(big).astype(int)
    assert a.shape == b.shape
    # quantisation moves no pixel far: mean error below 2 of 255 per channel, worst pixel below 64
    assert np.abs(a - b).mean() < 2 and np.abs(a - b).max() < 64
    with pytest.raises(ValueError, match="colors must be an int in"):
        Explorer(lambda a: a, _draw, [Param("a", [1])], colors=1)


def test_an_updater_renders_the_same_frame_as_a_fresh_drawing():
    params = [Param("a", [1, 2, 3])]
    ex = Explorer(lambda a: a, _line_draw, params, figsize=(4, 2.5))
    frames = ex.frames()
    assert ex._update is not None  # the figure was drawn once, then updated
    for i, a in enumerate([1, 2, 3]):
        fresh = Explorer(lambda a: a, _line_draw, params, figsize=(4, 2.5)).png(a=a)
        assert frames[(i,)] == fresh
    assert frames[(0,)] != frames[(1,)]


def test_smallest_text_pt_measures_the_smallest_visible_text():
    from matplotlib.figure import Figure

    from llmbook.widgets.explorer import smallest_text_pt

    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_title("title", fontsize=12)
    ax.tick_params(labelsize=10)
    assert smallest_text_pt(fig) == 10
    ax.set_xlabel("x", fontsize=7)
    assert smallest_text_pt(fig) == 7

    def labelled(result, fig):
        ax = fig.subplots()
        ax.plot([0, 1], [0, result])
        ax.set_title("t", fontsize=11)
        ax.tick_params(labelsize=9.5)

    assert Explorer(lambda a: a, labelled, [Param("a", [1])]).smallest_text_pt() == 9.5
