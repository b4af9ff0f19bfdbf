"""The text of a chapter notebook, for the tests that compute every number its prose and Try-it solutions state."""

import json
from pathlib import Path

BOOK = Path(__file__).resolve().parents[1] / "book"


def markdown_text(notebook: str) -> str | None:
    """All markdown cells of ``book/<notebook>``, joined (None outside a source checkout)."""
    path = BOOK / notebook
    if not path.exists():
        return None
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def assert_states(notebook: str, stated: list[str], section: str = "try_it", *, after: str | None = None) -> None:
    """Fail unless ``book/<notebook>`` states every string of ``stated``; skipped without a source checkout.

    The text searched runs from the heading ``after`` to the end: by default the Try-it section
    ("## Try it"); ``section="all"`` searches every markdown cell.
    """
    text = markdown_text(notebook)
    if text is None:
        return
    start = after if after is not None else ("## Try it" if section == "try_it" else None)
    if start is not None:
        assert start in text, f"book/{notebook} has no {start!r}"
        text = text[text.index(start):]
    missing = [s for s in stated if s not in text]
    assert not missing, f"book/{notebook} (from {start or 'the top'!r}) does not state {missing}"
