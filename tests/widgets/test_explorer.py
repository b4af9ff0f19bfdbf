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
